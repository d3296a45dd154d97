"""Server optimizers: how the global model moves given the clients' average (FedOpt, Reddi et al. 2021).

A server optimizer is a value with two pure functions (STYLE.md §2, composition, no inheritance):

- ``init(params) -> state``: the optimizer state as named arrays (``"m/<name>"``, ``"v/<name>"``), so it
  checkpoints with the model through the same safetensors codec;
- ``step(params, average, state) -> (new_params, new_state)``: never mutates its inputs.

With ``Δ = average − params`` the *pseudo-gradient* of "Adaptive Federated Optimization" (Reddi et al.,
ICLR 2021, Algorithm 2), :class:`ServerSGD` gives FedAvg / FedAvgM and :class:`ServerAdaptive` gives
FedAdagrad, FedAdam and FedYogi.

Numerics: updates are computed in float64 and cast back to each parameter's dtype; the state has the
dtype of its parameter. Only floating tensors are optimized; integer buffers (e.g. BatchNorm
``num_batches_tracked``) take the clients' average directly and have no state.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np

from fedcore.errors import ConfigError, PayloadError
from fedcore.tensors import NamedArrays

__all__ = ["ServerAdaptive", "ServerOptimizer", "ServerSGD"]


class ServerOptimizer(Protocol):
    """Moves the global model from ``params`` towards the clients' ``average``; I/O-free and pure."""

    def init(self, params: NamedArrays) -> NamedArrays:
        """Return the initial optimizer state for ``params`` (empty when the optimizer is stateless)."""
        ...

    def step(self, params: NamedArrays, average: NamedArrays, state: NamedArrays) -> tuple[NamedArrays, NamedArrays]:
        """Return ``(new_params, new_state)`` from the current params, the clients' average and the state."""
        ...


def _is_float(a: np.ndarray) -> bool:
    return a.dtype.kind == "f"


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
    rule: Callable[[str, np.ndarray, np.ndarray], tuple[np.ndarray, dict[str, np.ndarray]]],
) -> tuple[NamedArrays, NamedArrays]:
    """The loop every server optimizer shares: integer tensors take the average; each floating tensor ``x`` gets
    ``rule(name, x, Δ = average − x)`` computed in float64, and the new parameters and state are cast back to
    ``x``'s dtype. Inputs are not mutated.

    Raises:
        PayloadError: ``average`` names other tensors than ``params``.
    """
    _check_keys(params, average)
    new_params: NamedArrays = {}
    new_state: NamedArrays = {}
    for name, x in params.items():
        avg = average[name]
        if not _is_float(x):
            new_params[name] = np.array(avg, dtype=x.dtype, copy=True)
            continue
        x64 = x.astype(np.float64)
        new_x, state = rule(name, x64, avg.astype(np.float64) - x64)
        new_params[name] = new_x.astype(x.dtype)
        new_state.update({key: value.astype(x.dtype) for key, value in state.items()})
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

    def init(self, params: NamedArrays) -> NamedArrays:
        """State: ``"v/<name>"`` zeros for each floating tensor when momentum > 0, else empty."""
        if self.momentum == 0.0:
            return {}
        return {f"v/{n}": np.zeros_like(a) for n, a in params.items() if _is_float(a)}

    def step(self, params: NamedArrays, average: NamedArrays, state: NamedArrays) -> tuple[NamedArrays, NamedArrays]:
        """One server step; see the class docstring. Inputs are not mutated."""
        if self._is_fedavg:
            _check_keys(params, average)
            return {n: np.array(average[n], copy=True) for n in params}, {}

        def rule(name: str, x64: np.ndarray, delta: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
            if self.momentum > 0.0:
                v = self.momentum * state[f"v/{name}"].astype(np.float64) + delta
                return x64 + self.lr * v, {f"v/{name}": v}
            return x64 + self.lr * delta, {}

        return _apply(params, average, rule)


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

    def init(self, params: NamedArrays) -> NamedArrays:
        """State ``"m/<name>"`` = 0 and ``"v/<name>"`` = τ² for each floating tensor, in its dtype."""
        state: NamedArrays = {}
        for name, x in params.items():
            if _is_float(x):
                state[f"m/{name}"] = np.zeros_like(x)
                state[f"v/{name}"] = np.full_like(x, self.tau**2)
        return state

    def step(self, params: NamedArrays, average: NamedArrays, state: NamedArrays) -> tuple[NamedArrays, NamedArrays]:
        """One server step; see the class docstring. Inputs are not mutated."""

        def rule(name: str, x64: np.ndarray, delta: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
            m = self.beta1 * state[f"m/{name}"].astype(np.float64) + (1.0 - self.beta1) * delta
            v = state[f"v/{name}"].astype(np.float64)
            d2 = delta * delta
            if self.kind == "adagrad":
                v = v + d2
            elif self.kind == "adam":
                v = self.beta2 * v + (1.0 - self.beta2) * d2
            else:
                v = v - (1.0 - self.beta2) * d2 * np.sign(v - d2)
            return x64 + self.lr * m / (np.sqrt(v) + self.tau), {f"m/{name}": m, f"v/{name}": v}

        return _apply(params, average, rule)
