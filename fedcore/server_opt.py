"""Server optimizers: how the global model moves given the clients' average (FedOpt, Reddi et al. 2021).

A server optimizer is a value with two pure functions (STYLE.md §2, composition, no inheritance):

- ``init(params) -> state``: the optimizer state as named arrays (``"m/<name>"``, ``"v/<name>"``), so it
  checkpoints with the model through the same safetensors codec;
- ``step(params, average, state) -> (new_params, new_state)``: never mutates its inputs (``average`` only when the
  caller gives it up with ``reuse_average=True``, as the round loop does).

With ``Δ = average − params`` the *pseudo-gradient* of "Adaptive Federated Optimization" (Reddi et al.,
ICLR 2021, Algorithm 2), :class:`ServerSGD` gives FedAvg / FedAvgM and :class:`ServerAdaptive` gives
FedAdagrad, FedAdam and FedYogi.

Trainable parameters and buffers: only trainable parameters go through the optimizer. Every other tensor
(BatchNorm ``running_mean``/``running_var``/``num_batches_tracked``, any buffer or frozen parameter) takes the
clients' (example-weighted) average as it is and has no state: stepping running statistics with Adam's
normalized step drives ``running_var`` negative and the model's outputs to NaN. ``init`` and ``step`` take
``trainable``, the names of the trainable parameters (:func:`fedcore.task.trainable_names`: the model's
``named_parameters()`` with ``requires_grad``); ``None`` means every floating tensor is trainable (a model
without named parameters, e.g. the unnamed arrays of a Flower ``NumPyClient``, as flwr's FedOpt strategies
do). Integer tensors are never stepped.

Numerics: updates are computed in float64 and cast back to each parameter's dtype; the state has the
dtype of its parameter. 0-d parameters give 0-d arrays (never numpy scalars), in the parameters and the state.
Memory: the float64 work is done block by block, so a step allocates its outputs (new parameters, new state) and
a few float64 blocks; with ``reuse_average`` the new parameters take the average's memory. Parameters and state
mapped read-only from a file (``np.memmap`` mode "r": a checkpoint, :func:`server.state.map_round_state`) have
each block's pages dropped from the resident set once read (they stay in the file), so the old state is never
resident whole beside the new one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np

from fedcore.aggregation.blocks import drop_read, file_mapping
from fedcore.errors import ConfigError, PayloadError
from fedcore.tensors import NamedArrays

__all__ = ["ServerAdaptive", "ServerOptimizer", "ServerSGD", "stepped"]


class ServerOptimizer(Protocol):
    """Moves the global model from ``params`` towards the clients' ``average``; I/O-free and pure.

    ``trainable``: the names of the tensors the optimizer steps (the model's trainable parameters); every other
    tensor takes ``average``. None: every floating tensor.
    """

    def init(self, params: NamedArrays, *, trainable: frozenset[str] | None = None) -> NamedArrays:
        """Return the initial optimizer state for ``params`` (empty when the optimizer is stateless)."""
        ...

    def step(
        self,
        params: NamedArrays,
        average: NamedArrays,
        state: NamedArrays,
        *,
        trainable: frozenset[str] | None = None,
        reuse_average: bool = False,
    ) -> tuple[NamedArrays, NamedArrays]:
        """Return ``(new_params, new_state)`` from the current params, the clients' average and the state.

        ``reuse_average``: the caller gives ``average`` up, and the new parameters may be written into its arrays
        (no model-sized allocation for them); otherwise ``average`` is not mutated. ``params`` and ``state`` never
        are (a round that fails after the step keeps the model it had).
        """
        ...


def _is_float(a: np.ndarray) -> bool:
    return a.dtype.kind == "f"


def stepped(name: str, a: np.ndarray, trainable: frozenset[str] | None) -> bool:
    """Whether a server optimizer steps tensor ``name`` (else it takes the average): a floating tensor that is
    trainable (every floating tensor when ``trainable`` is None)."""
    return _is_float(a) and (trainable is None or name in trainable)


def check_finite_number(
    name: str, value: float, *, low: float, high: float | None = None, low_open: bool = False
) -> None:
    """Raise :class:`ConfigError` naming ``name`` unless ``value`` is a finite number ``>= low`` (``> low`` with
    ``low_open``) and ``< high`` when given."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high
    if not ok:
        lo = f"{'>' if low_open else '>='} {low}"
        hi = f" and < {high}" if high is not None else ""
        raise ConfigError(f"{name} must be a finite number {lo}{hi}, got {value!r}")


_BLOCK = 1 << 18
"""Elements per block of a server step (2 MiB of float64 per temporary): the float64 work never makes a temporary of
a tensor's size, so a step's memory is its outputs (and the state it keeps), not several float64 copies of the
model. Every operation of a rule is element-wise, so the blocks give the same values as one pass."""

Rule = Callable[[np.ndarray, np.ndarray, dict[str, np.ndarray]], tuple[np.ndarray, dict[str, np.ndarray]]]
"""``rule(x64, delta64, moments64) -> (new_x64, new_moments64)`` on one block of one tensor: the parameters and
``Δ = average − x`` in float64, and the block of each state entry of the tensor (key: its prefix, e.g. ``"v"``) in
float64; returns the new parameters and the new state entries of the block."""


def _apply(
    params: NamedArrays,
    average: NamedArrays,
    state: NamedArrays,
    keys: tuple[str, ...],
    trainable: frozenset[str] | None,
    rule: Rule,
    reuse_average: bool = False,
) -> tuple[NamedArrays, NamedArrays]:
    """The loop every server optimizer shares: tensors that are not :func:`stepped` take the average; each stepped
    tensor ``x`` gets ``rule(x, Δ = average − x, its state)`` computed in float64 block by block (:data:`_BLOCK`
    elements), and the new parameters and state (``keys``: its state prefixes, e.g. ``("m", "v")``) are written
    in ``x``'s dtype into arrays of ``x``'s shape (0-d stays 0-d). ``params`` and ``state`` are not mutated;
    ``average`` neither, unless ``reuse_average``: then the new parameters are written into ``average``'s arrays
    where they fit (same dtype, contiguous, writable), which the caller gives up.

    Raises:
        PayloadError: ``average`` names other tensors than ``params``, or ``state`` lacks a stepped tensor's entry.
    """
    _check_keys(params, average)
    missing = [
        f"{k}/{n}" for n, x in params.items() if stepped(n, x, trainable) for k in keys if f"{k}/{n}" not in state
    ]
    if missing:
        raise PayloadError(
            f"the server optimizer state lacks {len(missing)} entries (e.g. {missing[0]!r}); it was made for "
            "another strategy or model: resume with the strategy that wrote it, or start a new state directory"
        )
    new_params: NamedArrays = {}
    new_state: NamedArrays = {}
    for name, x in params.items():
        avg = np.asarray(average[name])
        reusable = reuse_average and _writable_like(avg, x)
        if not stepped(name, x, trainable):
            new_params[name] = avg if reusable else np.array(avg, dtype=x.dtype, copy=True)
            continue
        out = avg if reusable else np.empty(x.shape, x.dtype)
        moments = {key: np.empty(x.shape, x.dtype) for key in keys}
        flat_x, flat_avg, flat_out = x.reshape(-1), avg.reshape(-1), out.reshape(-1)
        flat_in = {key: np.asarray(state[f"{key}/{name}"]).reshape(-1) for key in keys}
        flat_moments = {key: m.reshape(-1) for key, m in moments.items()}
        # inputs mapped read-only from a file (a simulation's state between rounds, a deployment's checkpoint)
        # leave the resident set block by block once read: the old state never sits whole beside the new one
        sources = [(state[f"{key}/{name}"], flat_in[key]) for key in keys] + [(x, flat_x)]
        mapped = [(handle, flat) for array, flat in sources if (handle := file_mapping(array, flat)) is not None]
        for i in range(0, max(flat_x.size, 1), _BLOCK):
            part = slice(i, i + _BLOCK)
            x64 = flat_x[part].astype(np.float64)
            delta = flat_avg[part].astype(np.float64) - x64  # read before ``out`` (maybe ``avg``) is written
            new_x, new_moments = rule(x64, delta, {key: a[part].astype(np.float64) for key, a in flat_in.items()})
            flat_out[part] = new_x
            for key, value in new_moments.items():
                flat_moments[key][part] = value
            for handle, flat in mapped:
                drop_read(handle, flat, i, min(i + _BLOCK, flat.size))
        new_params[name] = out
        new_state.update({f"{key}/{name}": m for key, m in moments.items()})
    return new_params, new_state


def _writable_like(avg: np.ndarray, x: np.ndarray) -> bool:
    """Whether ``avg`` can take ``x``'s new values in place: same dtype and shape, C-contiguous, writable."""
    return avg.dtype == x.dtype and avg.shape == x.shape and avg.flags.c_contiguous and avg.flags.writeable


def _check_keys(params: NamedArrays, average: NamedArrays) -> None:
    if set(params) != set(average):
        raise PayloadError(
            f"average has tensors {sorted(set(average) ^ set(params))[:5]} that differ from the params; "
            "the strategy must aggregate the same model"
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerSGD:
    """Server SGD with optional momentum: FedAvg (lr=1, momentum=0) and FedAvgM.

    With ``Δ = average − x``: ``v ← momentum · v + Δ``; ``x ← x + lr · v`` (FedAvgM, Hsu, Qi and Brown 2019,
    "Measuring the Effects of Non-Identical Data Distribution for Federated Visual Classification";
    ServerOpt = SGD in Reddi et al. 2021). With ``lr=1, momentum=0`` the step returns exactly ``average``
    (copies, bit-exact, no ``x + (avg − x)`` rounding) and the state is empty.
    """

    lr: float = 1.0
    """Server learning rate η, > 0."""
    momentum: float = 0.0
    """Server momentum β in [0, 1); 0 disables momentum (no state kept)."""

    def __post_init__(self) -> None:
        check_finite_number("ServerSGD.lr", self.lr, low=0.0, low_open=True)
        check_finite_number("ServerSGD.momentum", self.momentum, low=0.0, high=1.0)

    @property
    def _is_fedavg(self) -> bool:
        return self.lr == 1.0 and self.momentum == 0.0

    def init(self, params: NamedArrays, *, trainable: frozenset[str] | None = None) -> NamedArrays:
        """State: ``"v/<name>"`` zeros for each stepped tensor (see :func:`stepped`) when momentum > 0, else empty."""
        if self.momentum == 0.0:
            return {}
        return {f"v/{n}": np.zeros(a.shape, a.dtype) for n, a in params.items() if stepped(n, a, trainable)}

    def step(
        self,
        params: NamedArrays,
        average: NamedArrays,
        state: NamedArrays,
        *,
        trainable: frozenset[str] | None = None,
        reuse_average: bool = False,
    ) -> tuple[NamedArrays, NamedArrays]:
        """One server step; see the class docstring. ``params`` and ``state`` are not mutated; ``average`` neither
        unless ``reuse_average`` (then FedAvg returns its arrays themselves, and FedAvgM writes into them).

        Raises:
            PayloadError: ``average`` names other tensors than ``params``; ``state`` lacks a momentum buffer.
        """
        if self._is_fedavg:
            _check_keys(params, average)
            if reuse_average:
                return {n: np.asarray(average[n]) for n in params}, {}
            return {n: np.array(average[n], copy=True) for n in params}, {}

        def rule(
            x64: np.ndarray, delta: np.ndarray, moments: dict[str, np.ndarray]
        ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
            if self.momentum > 0.0:
                v = self.momentum * moments["v"] + delta
                return x64 + self.lr * v, {"v": v}
            return x64 + self.lr * delta, {}

        keys = ("v",) if self.momentum > 0.0 else ()
        return _apply(params, average, state, keys, trainable, rule, reuse_average)


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerAdaptive:
    """FedAdagrad, FedAdam and FedYogi: Reddi et al. 2021, "Adaptive Federated Optimization", Algorithm 2.

    With ``Δ = average − x`` (element-wise)::

        m ← β1 · m + (1 − β1) · Δ
        v ← v + Δ²                              (adagrad)
        v ← β2 · v + (1 − β2) · Δ²              (adam)
        v ← v − (1 − β2) · Δ² · sign(v − Δ²)    (yogi)
        x ← x + η · m / (√v + τ)

    Where we follow the paper: ``m`` starts at 0 and ``v`` at ``τ²`` (the paper's ``v_{−1} ≥ τ²``), and there
    is no bias correction. Where flwr 1.x differs (``flwr/server/strategy/fedadam.py``, ``fedyogi.py``,
    ``fedadagrad.py``): flwr starts ``v`` at 0, not ``τ²``; flwr's FedAdam also applies Adam's bias
    correction, scaling η by ``√(1 − β2^(t+1)) / (1 − β1^(t+1))`` in server round ``t`` (FedYogi and
    FedAdagrad do not); flwr's FedAdagrad keeps ``m`` with β1 = 0 (so ``m = Δ``) whereas here β1 applies to
    all three kinds; and flwr's defaults differ (FedAdam η=0.1, τ=1e-9; FedYogi η=0.01, τ=1e-3). The
    update rule itself (m, v, x lines above) is the same.

    Computed in float64; ``m`` and ``v`` are stored with their parameter's dtype.
    """

    kind: Literal["adagrad", "adam", "yogi"]
    """Which second-moment rule."""
    lr: float = 0.01
    """Server learning rate η, > 0."""
    beta1: float = 0.9
    """First-moment decay β1 in [0, 1)."""
    beta2: float = 0.99
    """Second-moment decay β2 in [0, 1) (unused by adagrad)."""
    tau: float = 1e-3
    """Adaptivity τ > 0: keeps √v + τ away from 0 and sets v's initial value τ²."""

    def __post_init__(self) -> None:
        if self.kind not in ("adagrad", "adam", "yogi"):
            raise ConfigError(f"ServerAdaptive.kind must be 'adagrad', 'adam' or 'yogi', got {self.kind!r}")
        check_finite_number("ServerAdaptive.lr", self.lr, low=0.0, low_open=True)
        check_finite_number("ServerAdaptive.beta1", self.beta1, low=0.0, high=1.0)
        check_finite_number("ServerAdaptive.beta2", self.beta2, low=0.0, high=1.0)
        check_finite_number("ServerAdaptive.tau", self.tau, low=0.0, low_open=True)

    def init(self, params: NamedArrays, *, trainable: frozenset[str] | None = None) -> NamedArrays:
        """State ``"m/<name>"`` = 0 and ``"v/<name>"`` = τ² for each stepped tensor (see :func:`stepped`), in its
        dtype."""
        state: NamedArrays = {}
        for name, x in params.items():
            if stepped(name, x, trainable):
                state[f"m/{name}"] = np.zeros(x.shape, x.dtype)
                state[f"v/{name}"] = np.full(x.shape, self.tau**2, x.dtype)
        return state

    def step(
        self,
        params: NamedArrays,
        average: NamedArrays,
        state: NamedArrays,
        *,
        trainable: frozenset[str] | None = None,
        reuse_average: bool = False,
    ) -> tuple[NamedArrays, NamedArrays]:
        """One server step; see the class docstring. ``params`` and ``state`` are not mutated; ``average`` neither
        unless ``reuse_average`` (then the new parameters are written into its arrays).

        Raises:
            PayloadError: ``average`` names other tensors than ``params``; ``state`` lacks a stepped tensor's moments.
        """

        def rule(
            x64: np.ndarray, delta: np.ndarray, moments: dict[str, np.ndarray]
        ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
            m = self.beta1 * moments["m"] + (1.0 - self.beta1) * delta
            v = moments["v"]
            d2 = delta * delta
            if self.kind == "adagrad":
                v = v + d2
            elif self.kind == "adam":
                v = self.beta2 * v + (1.0 - self.beta2) * d2
            else:
                v = v - (1.0 - self.beta2) * d2 * np.sign(v - d2)
            return x64 + self.lr * m / (np.sqrt(v) + self.tau), {"m": m, "v": v}

        return _apply(params, average, state, ("m", "v"), trainable, rule, reuse_average)
