"""Sample-level DP-SGD on each client through Opacus (Abadi et al. 2016, "Deep Learning with Differential
Privacy"): the ``dp-sgd`` client mod.

While the task trains (its own loop, with any ``torch.optim`` optimizer, in the client's process), Opacus'
``GradSampleModule`` hooks compute per-example gradients of the model, and before every optimizer step an Opacus
``DPOptimizer`` around the task's optimizer clips each example's gradient to ``max_grad_norm``, sums, adds
``N(0, (noise_multiplier * max_grad_norm)^2)`` and divides by the batch size (``pre_step``); the task's optimizer
then steps with that gradient. The noise comes from a generator seeded from the OS (:func:`os_seeded_generator`),
not from the round's seed, which the server knows, and through Opacus' ``secure_mode`` (each value the sum of four
Gaussian draws halved, Opacus' defence against the floating-point attacks of arXiv:2107.10138 and
arXiv:2112.05307). The task must average its loss over the batch (``reduction="mean"``, the default of
torch's losses).

Accounting: Opacus' RDP accountant, one entry ``(noise_multiplier, q = batch_size / num_examples, steps)`` per
round, with ``steps`` the optimizer steps that really ran in the round (epochs x batches, or fewer with
``max_steps``), counted by the hook. The client keeps its history in its state (group ``dp-sgd``), one entry per
round number, so the epsilon covers every round it trained in, and a round it trains again (the server restarted
from the checkpoint before that round, or retried the round's attempt) replaces that round's entry instead of
adding one: epsilon after a restart equals an uninterrupted run's. This treats the earlier run's update as not
released, which holds when the server discarded it (a crashed server loses the round's updates with its memory
and empties its spill directory at start; a failed attempt's accumulator is dropped); against a server that kept
it, both runs count. It reports ``sgd_epsilon`` (at ``delta``) with its training metrics (the history column
``train_sgd_epsilon`` is the largest over the round's clients, :data:`fedcore.aggregation.metrics.MAXIMUM_METRICS`;
each client's own value is its reply's). fedcore's loop draws
shuffled batches of fixed size, which the accountant treats as Poisson sampling at rate q, as Opacus does for its
own non-Poisson loaders.

Models Opacus cannot handle (BatchNorm, which mixes the examples of a batch) are refused with the validator's
findings; :func:`make_private_model` converts one with Opacus' ``ModuleValidator.fix`` (BatchNorm -> GroupNorm)
and says what changed. The server and every client must build the same converted model, so it belongs in the
task's ``build_model``.
"""

from __future__ import annotations

import logging
import math
import os
import warnings
from dataclasses import dataclass, replace

import numpy as np
import torch
from opacus import GradSampleModule
from opacus.accountants import RDPAccountant
from opacus.optimizers import DPOptimizer
from opacus.validators import ModuleValidator

from fedcore.errors import ClientTaskError, ConfigError
from fedcore.messages import FitIns, FitRes, bound_text
from fedcore.mods import CallNext, ModContext, in_process
from fedcore.stephooks import PRIVACY_ORDER, step_pre_handler

log = logging.getLogger("fedcore.privacy")

MOD_NAME = "dp-sgd"
"""The client mod's registered name."""
STATE_GROUP = "dp-sgd"
"""Client state group: the accountant's history, arrays ``round``, ``noise_multiplier``, ``sample_rate``,
``steps`` (one entry per round)."""


def model_problems(model: torch.nn.Module) -> list[str]:
    """What Opacus' ``ModuleValidator`` finds that DP-SGD cannot train (empty when the model is fine)."""
    return [str(e) for e in ModuleValidator.validate(model, strict=False)]


def make_private_model(model: torch.nn.Module) -> tuple[torch.nn.Module, list[str]]:
    """``model`` converted by Opacus' ``ModuleValidator.fix`` (BatchNorm -> GroupNorm, ...) and the list of what
    changed (``"name: Before -> After"``), which is also logged. Call it in the task's ``build_model`` so the
    server and every client build the same model.

    Raises:
        ConfigError: the model still has modules Opacus cannot handle after the conversion.
    """
    before = {name: type(m).__name__ for name, m in model.named_modules()}
    fixed = ModuleValidator.fix(model)
    after = {name: type(m).__name__ for name, m in fixed.named_modules()}
    changes = [
        f"{name or '(model)'}: {before[name]} -> {kind}" for name, kind in after.items() if before.get(name) != kind
    ]
    for change in changes:
        log.warning("DP-SGD: converted %s", change)
    left = model_problems(fixed)
    if left:
        raise ConfigError(f"DP-SGD cannot train this model even after conversion: {bound_text('; '.join(left), 500)}")
    return fixed, changes


def os_seeded_generator(device: torch.device) -> torch.Generator:
    """A torch generator on ``device`` seeded with 64 bits from the operating system (``os.urandom``), for DP-SGD's
    noise.

    The noise must not follow from anything the server knows: the round's seed (which keys the client's shuffling
    and torch's default generator, :func:`fedcore.training.train_supervised`) is chosen and sent by the server, so
    noise drawn from the default generator could be recomputed and subtracted by the party the noise protects the
    data from. DP-SGD runs are therefore not bit-reproducible (the rest of a run stays seeded).
    """
    return torch.Generator(device=device).manual_seed(int.from_bytes(os.urandom(8), "little"))


def sgd_epsilon(history: list[tuple[float, float, int]], delta: float) -> float:
    """Opacus' RDP epsilon at ``delta`` for ``history`` entries ``(noise_multiplier, sample_rate, steps)``."""
    if not history:
        return 0.0
    accountant = RDPAccountant()
    accountant.history = list(history)
    return float(accountant.get_epsilon(delta))


@dataclass(frozen=True, kw_only=True)
class DPSGDMod:
    """The ``dp-sgd`` client mod (see the module docstring).

    Attributes:
        noise_multiplier: sigma > 0, the noise over the per-example clipping norm.
        max_grad_norm: C > 0, the per-example gradient clipping norm.
        delta: the delta of the reported epsilon, in (0, 1).

    Raises:
        ConfigError: a parameter out of range (on the server when configured, on the client when received).
    """

    noise_multiplier: float
    max_grad_norm: float
    delta: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("noise_multiplier", "max_grad_norm"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not (math.isfinite(value) and value > 0)
            ):
                raise ConfigError(f"{name} must be a finite number > 0, got {value!r}")
        if isinstance(self.delta, bool) or not isinstance(self.delta, int | float) or not 0 < self.delta < 1:
            raise ConfigError(f"delta must be in (0, 1), got {self.delta!r}")

    def __call__(self, instruction: FitIns, context: ModContext, call_next: CallNext) -> FitRes:
        """Train through ``call_next`` with per-example clipping and noise; report ``sgd_epsilon``."""

        def fail(message: str) -> ClientTaskError:
            return ClientTaskError(f"DP-SGD: {message}", round=instruction.round, client_id=context.client_id)

        model, state = in_process(instruction, context, mod="DP-SGD", state_for="its privacy accounting")
        problems = model_problems(model)
        if problems:
            raise fail(
                f"Opacus cannot train this model: {bound_text('; '.join(problems), 400)}. Convert it in the task's "
                "build_model with privacy.dp.sgd.make_private_model (BatchNorm becomes GroupNorm)"
            )
        batch_size = instruction.config.batch_size
        params = [p for p in model.parameters() if p.requires_grad]
        optimizers: dict[int, DPOptimizer] = {}
        steps = 0

        def privatize(optimizer: torch.optim.Optimizer) -> None:
            nonlocal steps
            dp = optimizers.get(id(optimizer))
            if dp is None:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # Opacus warns that secure_mode is off
                    dp = optimizers[id(optimizer)] = DPOptimizer(
                        optimizer,
                        noise_multiplier=self.noise_multiplier,
                        max_grad_norm=self.max_grad_norm,
                        expected_batch_size=batch_size,
                        generator=os_seeded_generator(next(iter(model.parameters())).device),
                        secure_mode=True,
                    )
            dp.pre_step()
            for p in dp.params:  # consumed: the task's zero_grad does not clear Opacus' per-example gradients
                p.grad_sample = None
                p.summed_grad = None
            steps += 1

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. "full backward hook will not fire" for modules without params
            hooked = GradSampleModule(model, batch_first=True, loss_reduction="mean", strict=True)
        try:
            with step_pre_handler(params, privatize, PRIVACY_ORDER), warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Full backward hook is firing")  # a first layer's input
                reply = call_next(instruction)  # needs no gradient: Opacus' hooks say so
        finally:
            hooked._close()  # removes the hooks and the per-example gradients; the model is the task's again
        if steps == 0:
            raise fail("the task took no torch.optim optimizer step on the model's parameters")
        history = [h for h in _history(state.get(STATE_GROUP)) if h[0] != instruction.round]  # a re-run replaces
        history.append(
            (instruction.round, self.noise_multiplier, min(1.0, batch_size / max(reply.num_examples, 1)), steps)
        )
        state.put(
            {
                STATE_GROUP: {
                    "round": np.array([h[0] for h in history], np.int64),
                    "noise_multiplier": np.array([h[1] for h in history], np.float64),
                    "sample_rate": np.array([h[2] for h in history], np.float64),
                    "steps": np.array([h[3] for h in history], np.int64),
                }
            }
        )
        spent = sgd_epsilon([h[1:] for h in history], self.delta)
        return replace(reply, metrics={**reply.metrics, "sgd_epsilon": spent})


def _history(stored: dict[str, np.ndarray] | None) -> list[tuple[int, float, float, int]]:
    """``(round, noise_multiplier, sample_rate, steps)`` entries from the client state (round -1: a state written
    before rounds were kept, never replaced)."""
    if not stored or not {"noise_multiplier", "sample_rate", "steps"} <= set(stored):
        return []
    z, q, s = stored["noise_multiplier"], stored["sample_rate"], stored["steps"]
    rounds = stored["round"] if "round" in stored and len(stored["round"]) == len(z) else np.full(len(z), -1)
    return [(int(r), float(a), float(b), int(c)) for r, a, b, c in zip(rounds, z, q, s, strict=False)]
