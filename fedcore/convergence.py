"""Convergence tracking: how far each round moved the model, when a run reached its target accuracy, and the rules
that stop a run early.

Pure functions and one I/O-free tracker over history rows (the mappings of
:meth:`server.round_loop.RoundRecord.as_row`, the rows a server stores), so one piece of code judges a run while it
goes and rebuilds its verdict from the stored history when a server resumes.

The stop rules (early stopping as in Prechelt, "Early stopping — but when?", 1998: patience over evaluations):

- **target accuracy**: stop after the first evaluated round whose accuracy is at least the target;
- **plateau**: stop after ``patience`` evaluated rounds in a row that did not raise the best accuracy so far by more
  than ``min_delta``.

The accuracy of a round is its central test accuracy (``test_accuracy``), else its clients' evaluation
(``federated_accuracy``); a round with neither (not evaluated) does not count for either rule.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from fedcore.errors import ConfigError
from fedcore.kernels import FUSED_DTYPES, squared_distance
from fedcore.server_opt import stepped
from fedcore.task import declared_metrics
from fedcore.tensors import NamedArrays

ACCURACY_COLUMNS = ("test_accuracy", "federated_accuracy")
"""The history columns a round's accuracy is read from, first present first."""

STOP_RULES = ("target_accuracy", "plateau")
"""The names of the stop rules, as recorded (history column ``stopped_<rule>`` = 1 on the round the run stopped)."""

STOP_COLUMN_PREFIX = "stopped_"

_BLOCK = 1 << 20  # elements per block of the update norm: no model-sized temporary


def update_norm(new: NamedArrays, old: NamedArrays, trainable: frozenset[str] | None = None) -> float:
    """The L2 norm of the global model's update ``new - old`` over the tensors the server optimizer steps.

    Args:
        new, old: the global model after and before a round (same names, shapes and dtypes).
        trainable: the names of the trainable parameters (:class:`server.round_loop.ServerState`); None: every
            floating tensor. Buffers (e.g. BatchNorm running statistics) and integer tensors are left out.

    Returns:
        ``sqrt(sum((new - old)**2))`` in float64 over those tensors, computed block by block (1 Mi elements), so
        no temporary of the model's size is made; 0.0 when no tensor is stepped.
    """
    return _stepped_norm(new, old, trainable)


def parameter_norm(parameters: NamedArrays, trainable: frozenset[str] | None = None) -> float:
    """The L2 norm of a global model itself over the tensors the server optimizer steps: :func:`update_norm`
    from the zero model (float64, block by block; inf when the squares overflow)."""
    return _stepped_norm(parameters, None, trainable)


def _stepped_norm(new: NamedArrays, old: NamedArrays | None, trainable: frozenset[str] | None) -> float:
    """``sqrt(sum((new - old)**2))`` over the stepped tensors, block by block; ``old`` None: the zero model."""
    total = 0.0
    for name, after in new.items():
        if not stepped(name, after, trainable):
            continue
        a = after.reshape(-1)
        b = old[name].reshape(-1) if old is not None else np.zeros(0, a.dtype)
        fused = b.size and a.dtype in FUSED_DTYPES and b.dtype == a.dtype
        for i in range(0, a.size, _BLOCK):
            x, y = a[i : i + _BLOCK], b[i : i + _BLOCK]
            if fused:
                total += squared_distance(x, y)
            else:
                d = x.astype(np.float64) - (y.astype(np.float64) if b.size else 0.0)
                with np.errstate(over="ignore"):  # an overflow is an infinite norm
                    total += float(np.dot(d, d))
    return math.sqrt(total)


def row_accuracy(row: Mapping[str, object]) -> float | None:
    """The accuracy a history row reports (see :data:`ACCURACY_COLUMNS`), or None when it has no finite one."""
    for column in ACCURACY_COLUMNS:
        value = row.get(column)
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    return None


@dataclass(frozen=True, kw_only=True)
class StopRules:
    """When a run stops before its last round.

    Attributes:
        target_accuracy: stop after the first evaluated round whose accuracy reaches this value, in (0, 1]; None:
            no target (the rounds and seconds to reach it are then not reported either).
        patience: stop after this many evaluated rounds in a row without a gain of more than ``min_delta`` over the
            best accuracy so far, >= 1; None: no plateau rule.
        min_delta: the smallest gain in accuracy that counts as one, >= 0.

    Raises:
        ConfigError: a value out of range.
    """

    target_accuracy: float | None = None
    patience: int | None = None
    min_delta: float = 0.0

    def __post_init__(self) -> None:
        if self.target_accuracy is not None and not 0 < self.target_accuracy <= 1:
            raise ConfigError(f"target_accuracy must be in (0, 1] or unset, got {self.target_accuracy}")
        if self.patience is not None and (
            isinstance(self.patience, bool) or not isinstance(self.patience, int) or self.patience < 1
        ):
            raise ConfigError(
                f"patience (evaluated rounds without a gain) must be an integer >= 1, got {self.patience}"
            )
        if not 0 <= self.min_delta < 1:
            raise ConfigError(f"min_delta must be in [0, 1), got {self.min_delta}")

    def check_measurable(self, *, evaluated: bool, remedy: str) -> None:
        """Refuse rules that could never fire: a target or a patience in a run that evaluates nothing (no round
        would have an accuracy, so the run would go to its last round as if neither were set).

        Args:
            evaluated: whether any round gets an accuracy (central evaluation, or federated evaluation).
            remedy: how to turn an evaluation on, for the message (the caller's own option names).

        Raises:
            ConfigError: ``target_accuracy`` or ``patience`` set and ``evaluated`` false.
        """
        if not evaluated:
            self._refuse("but this run evaluates none, so {they} would never stop it", remedy)

    def _refuse(self, why: str, remedy: str) -> None:
        """Raise the :class:`ConfigError` of rules that could never fire, if any is set: ``why`` (with ``{they}``
        for the rules' pronoun) and ``remedy``."""
        rules = [
            name for name, value in (("target_accuracy", self.target_accuracy), ("patience", self.patience)) if value
        ]
        if rules:
            named, they = " and ".join(rules), "they" if len(rules) > 1 else "it"
            raise ConfigError(
                f"{named} {'read' if len(rules) > 1 else 'reads'} each evaluated round's accuracy, "
                f"{why.replace('{they}', they)}; {remedy}, or leave {named} unset"
            )

    def check_accuracy_reported(self, evaluate_metrics: tuple[str, ...] | None, *, task: str, remedy: str) -> None:
        """Refuse rules that could never fire because the run's only evaluation, the server's task's, declares that
        it reports no ``accuracy`` (a regression task's ``eval_metric_names = ("mae",)``): no round would have an
        accuracy (:data:`ACCURACY_COLUMNS`), so the run would go to its last round as if neither rule were set.

        Args:
            evaluate_metrics: the metric names the evaluating task declares (:attr:`fedcore.task.DeclaredMetrics.
                evaluate`); None: it declares none, and is not checked (its evaluations say in the run).
            task: the task's name, for the message.
            remedy: how else the run could get an accuracy (the caller's own option names), for the message.

        Raises:
            ConfigError: ``target_accuracy`` or ``patience`` set and ``"accuracy"`` not in ``evaluate_metrics``.
        """
        if evaluate_metrics is not None and "accuracy" not in evaluate_metrics:
            self._refuse(
                f"but the task {task} declares that its evaluate reports {list(evaluate_metrics)} (eval_metric_names), "
                "no 'accuracy', so {they} would never stop the run",
                f"report 'accuracy' from evaluate (and declare it), {remedy}",
            )

    def check_task_reports_accuracy(self, task: object, *, name: str) -> None:
        """:meth:`check_accuracy_reported` for ``task``, the server's task when it is the run's only evaluation
        (a simulation's and a server's start check): its declared evaluate metrics (:func:`fedcore.task.
        declared_metrics`), ``name`` for the message, and letting the clients evaluate as the other remedy.

        Raises:
            ConfigError: as :meth:`check_accuracy_reported`.
        """
        declared = declared_metrics(task)
        self.check_accuracy_reported(
            declared.evaluate if declared is not None else None,
            task=f"{name} ({type(task).__name__})",
            remedy="let the clients evaluate (--fraction-evaluate) if theirs does",
        )


@dataclass(frozen=True)
class Stop:
    """Why and when a run stopped early.

    Attributes:
        rule: ``"target_accuracy"`` or ``"plateau"``.
        round: the last round run.
        detail: what the rule saw, in words.
    """

    rule: str
    round: int
    detail: str = ""


class Convergence:
    """The running verdict of :class:`StopRules` over a run's history rows, fed one row at a time.

    Attributes:
        reached: ``(round, seconds)`` of the first row whose accuracy reached the target: the round and the wall
            time of the run up to it (the ``seconds`` of every row seen, round 0's evaluation included), or None.
        stop: the stop, once a rule fired (or a row recorded one, see :meth:`observe`); None while the run goes on.
        best: the best accuracy seen (None before the first evaluated row).
        stale: evaluated rows in a row since the best accuracy last rose by more than ``min_delta``.
        seconds: the sum of the ``seconds`` of the rows seen.
    """

    def __init__(self, rules: StopRules) -> None:
        self.rules = rules
        self.reached: tuple[int, float] | None = None
        self.stop: Stop | None = None
        self.best: float | None = None
        self.stale = 0
        self.seconds = 0.0

    @classmethod
    def replay(cls, rules: StopRules, rows: Iterable[Mapping[str, object]]) -> Convergence:
        """A tracker that has observed ``rows`` (e.g. a resumed server's stored history), in order."""
        tracker = cls(rules)
        for row in rows:
            tracker.observe(row)
        return tracker

    def observe(self, row: Mapping[str, object]) -> Stop | None:
        """Take the next history row; return the stop it causes (the first one only), else None.

        A row that records a stop itself (a ``stopped_<rule>`` column set, see :func:`stop_columns`) is that stop,
        whatever the rules are now: a stop once made is final (a resumed server does not run past it).
        """
        rnd = row.get("round")
        rnd = int(rnd) if isinstance(rnd, int | float) and not isinstance(rnd, bool) else 0
        seconds = row.get("seconds")
        if isinstance(seconds, int | float) and math.isfinite(seconds):
            self.seconds += float(seconds)
        accuracy = row_accuracy(row)
        recorded = next((r for r in STOP_RULES if row.get(STOP_COLUMN_PREFIX + r) == 1), None)  # not NaN, not empty
        if accuracy is not None:
            target = self.rules.target_accuracy
            if target is not None and self.reached is None and accuracy >= target:
                self.reached = (rnd, self.seconds)
            if self.best is None or accuracy > self.best + self.rules.min_delta:
                self.best, self.stale = accuracy, 0
            else:
                self.stale += 1
        if self.stop is not None:
            return None
        if recorded is not None:
            self.stop = Stop(recorded, rnd, "recorded in the history")
        elif accuracy is None:
            return None
        elif self.rules.target_accuracy is not None and accuracy >= self.rules.target_accuracy:
            self.stop = Stop(
                "target_accuracy", rnd, f"accuracy {accuracy:.4f} reached the target {self.rules.target_accuracy}"
            )
        elif self.rules.patience is not None and self.stale >= self.rules.patience:
            self.stop = Stop(
                "plateau",
                rnd,
                f"{self.stale} evaluated round(s) without a gain of more than {self.rules.min_delta} over the best "
                f"accuracy {self.best:.4f}",
            )
        return self.stop

    def summary(self, last_round: int) -> str:
        """One line for the console: rounds and seconds to the target (or that it was not reached by
        ``last_round``), and the stop if there was one."""
        parts = []
        if self.rules.target_accuracy is not None:
            if self.reached is None:
                parts.append(f"target accuracy {self.rules.target_accuracy} not reached in {last_round} round(s)")
            else:
                parts.append(
                    f"target accuracy {self.rules.target_accuracy} reached at round {self.reached[0]} after "
                    f"{self.reached[1]:.1f} s"
                )
        if self.stop is not None:
            parts.append(f"stopped early after round {self.stop.round} ({self.stop.rule}: {self.stop.detail})")
        return "; ".join(parts)


def stop_columns(stop: Stop | None) -> dict[str, int]:
    """The history columns that record ``stop`` on its round's row: ``{"stopped_<rule>": 1}`` (empty for None)."""
    return {} if stop is None else {STOP_COLUMN_PREFIX + stop.rule: 1}
