"""Aggregation weights: how much each accepted update counts in the round's weighted mean.

The weighted mean is ``sum_k w_k x_k / sum_k w_k``, folded reply by reply (:class:`WeightedMean`), so every rule
gives one update's weight from that update alone, whatever arrives before or after it; the same seed then gives
the same model in simulation and over gRPC, whatever the arrival order.

=========  =========================================================================================================
rule       weight ``w_k`` of client k's update
=========  =========================================================================================================
examples   ``n_k``, the client's training examples (FedAvg, McMahan et al. 2017). The default.
uniform    ``1``.
metric     a metric the client reports with its update (``FitRes.metrics``, e.g. ``train_loss``, or a validation
           loss or accuracy its task reports), through the transform below.
server     the server's own evaluation of the update on its held-out validation data (``"loss"`` or a metric of
           the evaluation, e.g. ``"accuracy"``), through the transform below.
=========  =========================================================================================================

Transforms of a quality value ``v`` (:class:`QualityWeights`):

- ``softmax`` (for a loss, lower is better): ``w_k = exp(-v_k / T)``. This is the softmax over ``-v / T`` of the
  round's clients: its denominator ``sum_j exp(-v_j / T)`` is common to all and cancels in the weighted mean, so
  each weight is known as its reply arrives. ``T`` (temperature) > 0: small T trusts the best clients most; large T
  tends to uniform. Each weight is taken on its own, with no shift by the round's best value (which is known only
  once every reply is in), so the exponent must stay within float64's range with room for the sum: a value with
  ``|v| / T > 300`` is not usable (below), never clamped, since clamping would give every such value one weight
  and, once all of a round's values are beyond it, turn the softmax into a uniform mean. So T must be at least
  ``|v| / 300`` for the values expected (0.0077 for losses of 2.3): a round whose losses all lie beyond it fails,
  naming that bound, rather than weighting its clients otherwise than asked.
- ``proportional`` (for an accuracy, higher is better): ``w_k = v_k``, for ``v_k >= 0``.

With ``times_examples`` the quality weight is multiplied by ``n_k`` (quality and data amount together).

Fallback: an update whose value is missing, not a finite number, beyond ``300 T`` in size under ``softmax`` (a
diverged client's loss), or negative under ``proportional`` (a client that reports nothing; a server evaluation that
failed or saw 0 examples) takes the weight of ``fallback``, a value
assumed in its place (e.g. a loss of 10, an accuracy of 0: no say in the mean); with no fallback (the default)
such an update is rejected (:class:`~fedcore.errors.UpdateRejected`, a failure of the round that names the
client), so a client cannot gain weight by staying silent. A weight of 0 is allowed; a round whose weights all
are 0 fails as any round whose weights sum to 0 (:class:`~fedcore.errors.AggregationError`) and is retried.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from fedcore.errors import ConfigError, UpdateRejected
from fedcore.messages import bound_text
from fedcore.task import DeclaredMetrics, EvalResult

WEIGHT_RULES = ("examples", "uniform", "metric", "server")
"""The names of the weighting rules (``Strategy.weighting``)."""

WeightRule = Literal["examples", "uniform", "metric", "server"]
Transform = Literal["softmax", "proportional"]

_MAX_EXPONENT = 300.0

UpdateEvaluation = Callable[[], EvalResult]
"""The server's evaluation of one update on its validation data, run when called (rule ``server``)."""


def example_count_weight(num_examples: int) -> float:
    """``float(num_examples)``, the FedAvg weight.

    Raises:
        UpdateRejected: the count is beyond the float range (the update cannot be weighted).
    """
    try:
        return float(num_examples)
    except OverflowError:
        raise UpdateRejected(
            f"the example count (an integer of {int(num_examples).bit_length()} bits) is beyond the float range"
        ) from None


def softmax_weight(value: float, temperature: float) -> float:
    """``exp(-value / temperature)``: a loss's softmax weight (see the module docstring), a positive finite float64.

    Raises:
        UpdateRejected: ``|value| / temperature`` is above 300 (the weight would leave the range in which a round's
            weights and their weighted sum stay apart and finite), or ``value`` is not finite; the message gives the
            smallest temperature that takes the value.
    """
    if _beyond_softmax(value, temperature):
        raise UpdateRejected(_beyond_softmax_reason(value, temperature))
    return math.exp(-value / temperature)


def _beyond_softmax(value: float, temperature: float) -> bool:
    """Whether ``exp(-value / temperature)`` is out of the range softmax weights take (or ``value`` is NaN)."""
    return not abs(value) / temperature <= _MAX_EXPONENT


def _beyond_softmax_reason(value: float, temperature: float) -> str:
    """Why softmax weights at ``temperature`` cannot take ``value``, and the temperature that would."""
    return (
        f"{value:.6g} is beyond what softmax weights at temperature {temperature:g} take (|value| at most "
        f"{_MAX_EXPONENT:g} x the temperature, so that each weight stays a finite float64); raise strategy."
        f"weight_temperature (--weight-temperature) to at least {abs(value) / _MAX_EXPONENT:.3g}"
    )


def _number(value: object) -> float | None:
    """``value`` as a float when it is an int or a float (not a bool), else None."""
    return None if isinstance(value, bool) or not isinstance(value, int | float) else float(value)


@dataclass(frozen=True, kw_only=True)
class QualityWeights:
    """How a quality value becomes a weight (rules ``metric`` and ``server``; see the module docstring).

    Attributes:
        metric: the value's name: a metric the client reports (rule ``metric``; e.g. ``"train_loss"``), or
            ``"loss"`` or a metric of the server's evaluation (rule ``server``; e.g. ``"accuracy"``).
        transform: ``"softmax"`` (``exp(-v / T)``, for losses) or ``"proportional"`` (``v``, for accuracies).
        temperature: ``T`` of ``softmax``, finite and > 0.
        fallback: the value assumed for an update whose value is missing or unusable; None: such an update is
            rejected.
        times_examples: multiply the quality weight by the client's example count.

    Raises:
        ConfigError: an empty metric name, an unknown transform, a temperature or fallback out of range.
    """

    metric: str = "train_loss"
    transform: Transform = "softmax"
    temperature: float = 1.0
    fallback: float | None = None
    times_examples: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.metric, str) or not self.metric:
            raise ConfigError("the weighting metric must be a metric name, e.g. 'train_loss' or 'accuracy'")
        if self.transform not in ("softmax", "proportional"):
            raise ConfigError(f"weight transform must be 'softmax' or 'proportional', got {self.transform!r}")
        if not 0 < self.temperature < math.inf:
            raise ConfigError(f"the weighting temperature must be a finite number > 0, got {self.temperature}")
        if self.fallback is not None and self._usable(self.fallback) is None:
            raise ConfigError(
                f"the weighting fallback must be a finite number (>= 0 for 'proportional'; under 'softmax' at most "
                f"{_MAX_EXPONENT:g} x the temperature {self.temperature:g} in size), got {self.fallback}"
            )

    def _too_far(self, value: object) -> float | None:
        """``value`` as a float when it is a finite number that ``softmax`` cannot weight at this temperature, else
        None."""
        v = _number(value)
        if self.transform != "softmax" or v is None or not math.isfinite(v):
            return None
        return v if _beyond_softmax(v, self.temperature) else None

    def _usable(self, value: object) -> float | None:
        v = _number(value)
        if v is None or not math.isfinite(v) or (self.transform == "proportional" and v < 0):
            return None
        return None if self._too_far(v) is not None else v

    def weight_of(
        self, value: object, num_examples: int, *, source: str, reported: Mapping[str, object] | None = None
    ) -> float:
        """The weight of an update whose quality value is ``value`` (any object: what a client or an evaluation
        reported), from a client with ``num_examples`` examples; ``source`` says where the value came from and
        ``reported`` (optional) what the source reported instead, both for the rejection's message.

        Raises:
            UpdateRejected: the value is unusable and there is no fallback; the example count is beyond the float
                range (``times_examples``).
        """
        v = self._usable(value)
        if v is None:
            if self.fallback is None:
                if (far := self._too_far(value)) is not None:  # a sound value, a temperature too low for it
                    raise UpdateRejected(
                        f"{source}'s {self.metric!r} {_beyond_softmax_reason(far, self.temperature)}, or above the "
                        f"largest |value| the clients report / {_MAX_EXPONENT:g}; or set strategy.weight_fallback "
                        "(--weight-fallback) to a value within that range to take such updates"
                    )
                got = f"got {bound_text(repr(value), 40)}"
                if value is None and reported is not None:
                    names = ", ".join(bound_text(str(k), 40) for k in sorted(map(str, reported))[:20]) or "none"
                    got = f"it reported: {names}; choose one with --weight-metric"
                raise UpdateRejected(
                    f"{source} gave no usable {self.metric!r} for quality weighting "
                    f"({got}); set strategy.weight_fallback (--weight-fallback) to take such updates"
                )
            v = self.fallback
        weight = softmax_weight(v, self.temperature) if self.transform == "softmax" else v
        return weight * example_count_weight(num_examples) if self.times_examples else weight


RUNNER_FIT_METRICS = ("fit_seconds",)
"""Fit metrics the client side adds to every update whatever the task (:mod:`client.runner`)."""


def weight_metric_names(
    rule: WeightRule, declared: DeclaredMetrics, *, report_validation: bool, extra: tuple[str, ...] = ()
) -> tuple[str, ...]:
    """The quality values rule ``rule`` can read from a task that reports ``declared``: for ``metric`` the task's
    fit metrics, :data:`RUNNER_FIT_METRICS`, ``extra`` (e.g. a simulation's ``simulated_seconds``) and, with
    ``report_validation``, ``val_loss`` and ``val_<name>`` of its evaluation metrics; for ``server`` ``loss`` and
    the evaluation metrics; nothing for the other rules."""
    if rule == "metric":
        validation = ("val_loss", *(f"val_{n}" for n in declared.evaluate)) if report_validation else ()
        return tuple(dict.fromkeys((*declared.fit, *RUNNER_FIT_METRICS, *extra, *validation)))
    if rule == "server":
        return ("loss", *declared.evaluate)
    return ()


def check_weight_metric(
    rule: WeightRule,
    metric: str,
    declared: DeclaredMetrics | None,
    *,
    report_validation: bool,
    extra: tuple[str, ...] = (),
    exclude: tuple[str, ...] = (),
) -> None:
    """Refuse, before the first round, a weighting metric the task cannot report (rules ``metric`` and ``server``;
    the others read no metric). A task that declares no metric names (``declared`` None) is not checked: its
    updates say in the first round (:meth:`QualityWeights.weight_of` names what they reported instead).
    ``exclude`` names reported values the caller does not allow (a simulation's wall-clock ``fit_seconds``): they
    are left out of the list the refusal gives.

    Raises:
        ConfigError: ``metric`` is not one of :func:`weight_metric_names`; the message lists them.
    """
    if declared is None or rule not in ("metric", "server"):
        return
    reported = weight_metric_names(rule, declared, report_validation=report_validation, extra=extra)
    names = [name for name in reported if name not in exclude]
    if metric in names:
        return
    hint = ""
    if rule == "metric" and not report_validation and declared.evaluate:
        validation = ", ".join(("val_loss", *(f"val_{n}" for n in declared.evaluate)))
        hint = f" ({validation} with train.report_validation = true, --report-validation)"
    source = "the clients report with their updates" if rule == "metric" else "the server's evaluation gives"
    raise ConfigError(
        f"strategy.weight_metric (--weight-metric) {metric!r} is not a value {source}; weighting {rule!r} can use: "
        f"{', '.join(names)}{hint}"
    )


def update_weight(
    rule: WeightRule,
    quality: QualityWeights,
    num_examples: int,
    metrics: Mapping[str, object],
    evaluate: UpdateEvaluation | None = None,
) -> float:
    """The aggregation weight of one update under ``rule`` (see the module docstring).

    Args:
        rule: examples, uniform, metric or server.
        quality: the transform and fallback of the ``metric`` and ``server`` rules.
        num_examples: the client's training examples (already checked to be an int >= 0).
        metrics: the metrics the client reported with the update.
        evaluate: rule ``server``: runs the server's evaluation of this update. If it raises, the value is missing
            (the fallback applies; the error is part of the rejection's message otherwise).

    Raises:
        UpdateRejected: see :meth:`QualityWeights.weight_of`.
        ConfigError: rule ``server`` without an evaluation.
    """
    if rule == "uniform":
        return 1.0
    if rule == "examples":
        return example_count_weight(num_examples)
    if rule == "metric":
        reported = metrics if isinstance(metrics, Mapping) else {}
        return quality.weight_of(reported.get(quality.metric), num_examples, source="the client", reported=reported)
    if evaluate is None:
        raise ConfigError("weighting 'server' needs the server's evaluation of each update on its validation data")
    try:
        result = evaluate()
        found: object = result.loss if quality.metric == "loss" else result.metrics.get(quality.metric)
        evaluated: Mapping[str, object] | None = {"loss": result.loss, **result.metrics}
        if result.num_examples <= 0:
            found, evaluated = None, None
    except Exception as exc:  # an evaluation that fails costs the update its value, never the round
        if quality.fallback is None:
            raise UpdateRejected(
                f"the server's evaluation of the update failed ({type(exc).__name__}: {bound_text(str(exc), 200)}); "
                "set a weighting fallback value to take such updates"
            ) from exc
        found, evaluated = None, None
    return quality.weight_of(found, num_examples, source="the server's evaluation of the update", reported=evaluated)
