"""SCAFFOLD (Karimireddy et al. 2020, "SCAFFOLD: Stochastic Controlled Averaging for Federated Learning"), assembled
from fedcore's parts: a tensor group, a client mod, client state and the server optimizer. The round loop knows
nothing of it.

Algorithm 1 of the paper, with option II for the client control variate. Per round, with global model x, server
control variate c, and for each sampled client i of the S sampled, of N, its control variate c_i:

- client (:class:`ScaffoldMod`): from y = x, take K local steps ``y <- y - eta_l (g_i(y) + c - c_i)``; then
  ``c_i+ = c_i - c + (x - y) / (K eta_l)`` (option II); send ``delta y = y - x`` (as the model y) and
  ``delta c_i = c_i+ - c_i`` (the ``control`` group); keep ``c_i+`` in the client's state.
- server: ``x <- x + eta_g mean(delta y)`` (:class:`~fedcore.server_opt.ServerSGD` with ``lr = eta_g``, the
  model's mean taken with the strategy's weighting) and ``c <- c + |S| / N mean(delta c_i)``
  (:class:`ControlRule`).

Where fedcore follows the paper and where it chooses:

- the correction ``c - c_i`` is added to each trainable parameter's gradient just before every optimizer step
  of the task's own training (a pre-hook on ``torch.optim`` optimizer steps), so any task that trains with a
  ``torch.optim`` optimizer in the client's process gets it; K is the number of those steps. The correction is
  constant during a round, as in the paper. With momentum or weight decay the local optimizer is no longer the
  paper's plain SGD; option II's estimate then uses the same formula.
- c_i starts at zero; the server's c starts at zero. Both cover the model's trainable parameters only (buffers
  such as BatchNorm statistics are averaged like in FedAvg).
- |S| is the number of accepted replies (a client that failed contributes no ``delta c_i``), N the number of
  clients available when the round started (in simulation: every client).
- a client's c_i+ is stored (durably) before its reply is sent, with the c_i it came from and the round; a round
  that is run again (the server restarted from its checkpoint and lost the round's replies) starts again from
  that c_i, so a repeated round counts once and a restarted deployment gives the uninterrupted run's numbers.
  If the server rejects a reply, the client keeps c_i+ while c does not count its delta, which the paper (which
  has no failures) leaves open.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from fedcore.aggregation import Aggregator, MeanAggregator, NormBoundAggregator
from fedcore.aggregation.weights import WeightRule
from fedcore.errors import ClientTaskError, ConfigError, PayloadError
from fedcore.messages import FitIns, FitRes, ModSpec, bounded_repr
from fedcore.mods import CallNext, ModContext, StateEntry, in_process
from fedcore.server_opt import ServerSGD
from fedcore.stephooks import CORRECTION_ORDER, step_pre_handler
from fedcore.strategy import SamplingConfig, Strategy
from fedcore.task import FitConfig
from fedcore.tensors import NamedArrays, check_spec, spec_of

CONTROL = "control"
"""The tensor group of the control variates: c in the instruction, delta c_i in the reply, c_i in client state."""


@dataclass(frozen=True)
class ControlRule:
    """The server side of the ``control`` group: ``c <- c + |S| / N * mean(delta c_i)`` (Algorithm 1, line 17).

    Attributes:
        aggregator: combines the replies' delta c_i (default: the streaming mean, every client weight 1, as the
            paper's uniform mean). :func:`scaffold` gives it the model's robust rule when the model has one: a
            Byzantine client's delta c_i reaches every client's gradients through c, so averaging it plainly would
            undo the model's protection.
    """

    aggregator: Aggregator = field(default_factory=MeanAggregator)

    def init(self, parameters: NamedArrays, *, trainable: frozenset[str] | None) -> NamedArrays:
        """c = 0 for every trainable parameter (every floating tensor when ``trainable`` is None), in its dtype."""
        names = [n for n, a in parameters.items() if (n in trainable if trainable is not None else a.dtype.kind == "f")]
        if not names:
            raise ConfigError("SCAFFOLD needs a model with trainable floating parameters; this one has none")
        return {n: np.zeros(parameters[n].shape, dtype=parameters[n].dtype) for n in names}

    def weight(self, num_examples: int) -> float:
        """1: the paper averages the delta c_i of the sampled clients uniformly."""
        return 1.0

    def update(self, state: NamedArrays, combined: NamedArrays, *, accepted: int, available: int) -> NamedArrays:
        """``c + accepted / available * combined``, computed in float64 and stored in c's dtypes.

        Raises:
            ConfigError: ``available`` < ``accepted`` or < 1.
        """
        if available < max(accepted, 1):
            raise ConfigError(f"{accepted} accepted of {available} available clients: N must be >= |S| >= 0")
        fraction = accepted / available
        return {
            n: (np.asarray(c, dtype=np.float64) + fraction * np.asarray(combined[n], dtype=np.float64)).astype(c.dtype)
            for n, c in state.items()
        }


@dataclass(frozen=True)
class ScaffoldMod:
    """The client side of SCAFFOLD, a client mod (``ModSpec("scaffold")``, no parameters): corrects every local
    gradient by ``c - c_i``, then computes ``c_i+`` (option II), keeps it in the client's state and returns
    ``delta c_i`` as the reply's ``control`` group. See the module docstring.

    Raises (from the call):
        ClientTaskError: training does not run in this process (a parallel plan), the client keeps no state, or
            the task took no optimizer step.
        PayloadError: the instruction carries no ``control`` group, or one that does not fit the model's trainable
            parameters.
    """

    def __call__(self, instruction: FitIns, context: ModContext, call_next: CallNext) -> FitRes:
        """Run ``call_next`` with the gradient correction in place; see the class docstring."""

        model, state = in_process(instruction, context, mod="SCAFFOLD", state_for="its control variate")
        c = instruction.groups.get(CONTROL)
        if c is None:
            raise PayloadError(
                "SCAFFOLD: the instruction carries no 'control' group",
                round=instruction.round,
                client_id=context.client_id,
            )
        trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
        unknown = sorted(set(c) - set(trainable))
        if unknown:
            raise PayloadError(
                f"SCAFFOLD: the control group names {bounded_repr(unknown[:5])}, not trainable parameters of the model",
                round=instruction.round,
                client_id=context.client_id,
            )
        c_i = _control_before(state, instruction.round, c)
        check_spec(c_i, spec_of(c), round=instruction.round, client_id=context.client_id)
        corrections = {id(trainable[n]): torch.from_numpy(np.asarray(c[n]) - np.asarray(c_i[n])) for n in c}
        steps = 0

        def correct(optimizer: torch.optim.Optimizer) -> None:
            nonlocal steps
            touched = False
            for group in optimizer.param_groups:
                for p in group["params"]:
                    correction = corrections.get(id(p))
                    if correction is None:
                        continue
                    touched = True
                    if correction.device != p.device or correction.dtype != p.dtype:  # moved once, then reused
                        correction = corrections[id(p)] = correction.to(device=p.device, dtype=p.dtype)
                    if p.grad is None:
                        p.grad = correction.clone()
                    else:
                        p.grad.add_(correction)
            steps += touched

        # not a torch hook of its own: clients in threads of one process would add and remove it while others step
        with step_pre_handler((trainable[n] for n in c), correct, CORRECTION_ORDER):
            reply = call_next(instruction)
        if steps == 0:
            raise ClientTaskError(
                "SCAFFOLD: the task took no torch.optim optimizer step on the model's parameters (K = 0)",
                round=instruction.round,
                client_id=context.client_id,
            )
        scale = 1.0 / (steps * instruction.config.lr)
        new_c_i: NamedArrays = {}
        delta: NamedArrays = {}
        for n, c_n in c.items():
            x, y = np.asarray(instruction.parameters[n]), np.asarray(reply.parameters[n])
            updated = (np.asarray(c_i[n]) - np.asarray(c_n) + (x - y) * np.asarray(scale, dtype=x.dtype)).astype(
                x.dtype
            )
            new_c_i[n] = updated
            delta[n] = updated - np.asarray(c_i[n])
        state.put(
            {
                CONTROL: new_c_i,
                _BEFORE: c_i,
                _ROUND: {"round": np.array(instruction.round, dtype=np.int64)},
            }
        )
        return replace(reply, groups={**reply.groups, CONTROL: delta})


_BEFORE = "control-before"
"""Client state group: c_i as it was before the round recorded in :data:`_ROUND`."""
_ROUND = "control-round"
"""Client state group: the round whose c_i+ the ``control`` group holds (one int64 scalar ``round``)."""


def _control_before(state: StateEntry, rnd: int, c: NamedArrays) -> NamedArrays:
    """The client's c_i to start round ``rnd`` from: zeros the first time (or when the model changed), else the
    stored c_i, except when the stored one was computed in round ``rnd`` itself (the round is run again, e.g. after
    a server restart lost its replies): then the c_i from before that round, so a repeated round counts once."""
    stored, before, tag = state.get(CONTROL), state.get(_BEFORE), state.get(_ROUND)
    names = set(c)
    if stored is None or set(stored) != names:
        return {n: np.zeros_like(a) for n, a in c.items()}
    if tag is not None and "round" in tag and int(tag["round"]) == rnd and before is not None and set(before) == names:
        return before
    return stored


def control_aggregator(model_rule: Aggregator) -> Aggregator:
    """How SCAFFOLD combines the control variates' delta c_i when ``model_rule`` combines the models: the plain
    mean (the paper's) for the mean, else the same robust rule with the same Byzantine budget.

    Raises:
        ConfigError: ``model_rule`` is norm bounding: its bound is on the model's change, and a control variate
            (of a gradient's scale) would reach every client unbounded.
    """
    if isinstance(model_rule, NormBoundAggregator):
        raise ConfigError(
            "SCAFFOLD with norm bounding: the bound limits each client's change of the model, but its control "
            "variate (delta c_i, of a gradient's scale) would reach every client unbounded; use aggregator = "
            "'median', 'trimmed_mean', 'krum' or 'multi_krum', which also combine the control variates"
        )
    return MeanAggregator() if isinstance(model_rule, MeanAggregator) else model_rule


def scaffold(
    *,
    fit: FitConfig,
    sampling: SamplingConfig,
    server_lr: float = 1.0,
    weighting: WeightRule = "uniform",
    aggregator: Aggregator | None = None,
    evaluate_batch_size: int = 256,
) -> Strategy:
    """The SCAFFOLD strategy: ``ServerSGD(lr=server_lr)`` (eta_g) on the model, the ``control`` group with its
    :class:`ControlRule`, and the ``scaffold`` client mod.

    Args:
        fit: local training settings (``fit.lr`` is eta_l, also used in option II's ``1 / (K eta_l)``).
        sampling: whom to select each round.
        server_lr: eta_g, > 0 (1 in most of the paper's experiments).
        weighting: how the models are averaged: ``"uniform"`` as in the paper, ``"examples"`` as FedAvg (or a
            quality rule of :mod:`fedcore.aggregation.weights`).
        aggregator: how the models are combined (default: the streaming mean). A robust rule (median, trimmed
            mean, Krum) also combines the control variates' delta c_i, with the same Byzantine budget: an attacker's
            delta c_i is added to every honest client's gradients through c (an unbounded c_i of sd 10 took a
            median-protected run from 0.72 to 0.13 accuracy).
        evaluate_batch_size: as in :class:`~fedcore.strategy.Strategy`.

    Raises:
        ConfigError: ``server_lr`` is not > 0, ``fit.mu`` > 0 (SCAFFOLD's correction replaces FedProx's term), or
            the aggregator is norm bounding (its bound is on the model's change; a control variate has a scale of
            its own, so it would be left unbounded).
    """
    if not (isinstance(server_lr, int | float) and math.isfinite(server_lr) and server_lr > 0):
        raise ConfigError(f"SCAFFOLD's server_lr (eta_g) must be a finite number > 0, got {server_lr!r}")
    if fit.mu > 0:
        raise ConfigError("SCAFFOLD with FedProx's proximal term (train.mu > 0) is not an algorithm; set mu = 0")
    model_rule = aggregator if aggregator is not None else MeanAggregator()
    control = ControlRule(aggregator=control_aggregator(model_rule))
    return Strategy(
        name="scaffold",
        fit=fit,
        sampling=sampling,
        weighting=weighting,
        server_optimizer=ServerSGD(lr=server_lr),
        evaluate_batch_size=evaluate_batch_size,
        groups={CONTROL: control},
        mods=(ModSpec("scaffold"),),
        aggregator=model_rule,
    )
