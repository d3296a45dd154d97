"""Server optimizers: how the global model moves given the clients' average (FedOpt, Reddi et al. 2021).

A server optimizer is a value with two pure functions (STYLE.md §2, composition, no inheritance):

- ``init(params) -> state``: the optimizer state as named arrays (``"m/<name>"``, ``"v/<name>"``), so it
  checkpoints with the model through the same safetensors codec;
- ``step(params, average, state) -> (new_params, new_state)``: never mutates its inputs.

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
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np

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
    ) -> tuple[NamedArrays, NamedArrays]:
        """Return ``(new_params, new_state)`` from the current params, the clients' average and the state."""
        ...


def _is_float(a: np.ndarray) -> bool:
    return a.dtype.kind == "f"


def stepped(name: str, a: np.ndarray, trainable: frozenset[str] | None) -> bool:
    """Whether a server optimizer steps tensor ``name`` (else it takes the average): a floating tensor that is
    trainable (every floating tensor when ``trainable`` is None)."""
    return _is_float(a) and (trainable is None or name in trainable)


def _check_finite_number(
    name: str, value: float, *, low: float, high: float | None = None, low_open: bool = False
) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high
    if not ok:
        lo = f"{'>' if low_open else '>='} {low}"
        hi = f" and < {high}" if high is not None else ""
        raise ConfigError(f"{name} must be a finite number {lo}{hi}, got {value!r}")


def _apply(
    params: NamedArrays,
    average: NamedArrays,
    state: NamedArrays,
    keys: tuple[str, ...],
    trainable: frozenset[str] | None,
    rule: Callable[[str, np.ndarray, np.ndarray], tuple[np.ndarray, dict[str, np.ndarray]]],
) -> tuple[NamedArrays, NamedArrays]:
    """The loop every server optimizer shares: tensors that are not :func:`stepped` take the average; each stepped
    tensor ``x`` gets ``rule(name, x, Δ = average − x)`` computed in float64, and the new parameters and state
    (``keys``: its state prefixes, e.g. ``("m", "v")``) are cast back to ``x``'s dtype as arrays (0-d stays
    0-d). Inputs are not mutated.

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
        avg = average[name]
        if not stepped(name, x, trainable):
            new_params[name] = np.array(avg, dtype=x.dtype, copy=True)
            continue
        x64 = np.asarray(x, dtype=np.float64)
        new_x, moments = rule(name, x64, np.asarray(avg, dtype=np.float64) - x64)
        new_params[name] = np.asarray(new_x, dtype=x.dtype).reshape(x.shape)
        new_state.update({key: np.asarray(value, dtype=x.dtype).reshape(x.shape) for key, value in moments.items()})
    return new_params, new_state


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
        _check_finite_number("ServerSGD.lr", self.lr, low=0.0, low_open=True)
        _check_finite_number("ServerSGD.momentum", self.momentum, low=0.0, high=1.0)

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
    ) -> tuple[NamedArrays, NamedArrays]:
        """One server step; see the class docstring. Inputs are not mutated.

        Raises:
            PayloadError: ``average`` names other tensors than ``params``; ``state`` lacks a momentum buffer.
        """
        if self._is_fedavg:
            _check_keys(params, average)
            return {n: np.array(average[n], copy=True) for n in params}, {}

        def rule(name: str, x64: np.ndarray, delta: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
            if self.momentum > 0.0:
                v = self.momentum * np.asarray(state[f"v/{name}"], dtype=np.float64) + delta
                return x64 + self.lr * v, {f"v/{name}": v}
            return x64 + self.lr * delta, {}

        keys = ("v",) if self.momentum > 0.0 else ()
        return _apply(params, average, state, keys, trainable, rule)


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
        _check_finite_number("ServerAdaptive.lr", self.lr, low=0.0, low_open=True)
        _check_finite_number("ServerAdaptive.beta1", self.beta1, low=0.0, high=1.0)
        _check_finite_number("ServerAdaptive.beta2", self.beta2, low=0.0, high=1.0)
        _check_finite_number("ServerAdaptive.tau", self.tau, low=0.0, low_open=True)

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
    ) -> tuple[NamedArrays, NamedArrays]:
        """One server step; see the class docstring. Inputs are not mutated.

        Raises:
            PayloadError: ``average`` names other tensors than ``params``; ``state`` lacks a stepped tensor's moments.
        """

        def rule(name: str, x64: np.ndarray, delta: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
            m = self.beta1 * np.asarray(state[f"m/{name}"], dtype=np.float64) + (1.0 - self.beta1) * delta
            v = np.asarray(state[f"v/{name}"], dtype=np.float64)
            d2 = delta * delta
            if self.kind == "adagrad":
                v = v + d2
            elif self.kind == "adam":
                v = self.beta2 * v + (1.0 - self.beta2) * d2
            else:
                v = v - (1.0 - self.beta2) * d2 * np.sign(v - d2)
            return x64 + self.lr * m / (np.sqrt(v) + self.tau), {f"m/{name}": m, f"v/{name}": v}

        return _apply(params, average, state, ("m", "v"), trainable, rule)
