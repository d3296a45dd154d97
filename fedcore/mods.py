"""Client mods: what a mod is, and the registry both ends check the strategy's declarations against.

A *mod* wraps a client's handling of a fit instruction, Flower-style::

    reply = mod(instruction, context, call_next)

where ``call_next(instruction) -> FitRes`` runs the rest of the chain and, at its end, the task's training. A mod
may change the instruction on the way in, act during training (SCAFFOLD adds its gradient correction through
optimizer hooks), change the reply on the way out (clip, add noise, compress, mask, add a tensor group), and keep
per-client state in ``context.state``. The chain itself runs in :mod:`client.mods`.

The strategy declares its mods as :class:`~fedcore.messages.ModSpec` (name + parameters); the fit instruction
carries them, so a daemon knows which to run. Names resolve through :data:`registry`, a map from a name to the
mod class; the class's constructor takes the parameters as keyword arguments and validates them. The server
checks the declarations when the round is configured (:func:`check_mods`) and the client again when it receives
them: an unknown name or a bad parameter is a :class:`~fedcore.errors.ConfigError` on both ends.

This module is in ``fedcore`` (not ``client``) because the server checks the same declarations and must not
import the client package.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from fedcore.errors import ClientTaskError, ConfigError
from fedcore.messages import FitIns, FitRes, ModSpec, bound_text, bounded_repr
from fedcore.stages import ClientStageMachine
from fedcore.tensors import NamedArrays

MAX_MODS = 16
"""The most mods one fit instruction declares."""


class StateEntry(Protocol):
    """One client's persistent state: named groups of tensors (:class:`client.state.ClientState` implements it)."""

    @property
    def client_id(self) -> str:
        """The client the state belongs to."""
        ...

    def get(self, group: str) -> NamedArrays | None:
        """The tensors of ``group``, or None if the client has none yet (loaded on first use)."""
        ...

    def put(self, groups: Mapping[str, NamedArrays]) -> None:
        """Replace the given groups (keeping the others) and store the client's state durably, in one atomic
        write, before returning."""
        ...


class StageMachines(Protocol):
    """Where a mod finds the client's round protocol state (:class:`client.stages.ClientStages` implements it)."""

    def machine(self, round: int, client_id: str, protocol: str) -> ClientStageMachine | None:
        """The live state machine of ``client_id`` for ``protocol`` in ``round``, or None."""
        ...


@dataclass(frozen=True, kw_only=True, eq=False)
class ModContext:
    """What a mod may use besides the instruction.

    Attributes:
        client_id: the client the instruction is for.
        model: the model the task trains in this process (holding the global model once training starts), or
            None when training runs elsewhere (a parallel plan's worker processes).
        state: the client's persistent state, or None when the client keeps none (a daemon without a state
            directory).
        stages: the client's round protocol state machines (a mod that acts for a protocol, e.g. SecAgg+'s
            masking, finds the round's machine there), or None when the client answers no protocol.
    """

    client_id: str
    model: torch.nn.Module | None
    state: StateEntry | None
    stages: StageMachines | None = None


def in_process(
    instruction: FitIns, context: ModContext, *, mod: str, state_for: str
) -> tuple[torch.nn.Module, StateEntry]:
    """The model and the client state a mod that acts during training needs, or a clear refusal.

    Args:
        mod: the mod's name for the message (e.g. ``"DP-SGD"``).
        state_for: what the mod keeps in the client's state (e.g. ``"its privacy accounting"``).

    Raises:
        ClientTaskError: training runs in other processes (a parallel plan), or the client keeps no state.
    """
    if context.model is None:
        raise ClientTaskError(
            f"{mod}: local training runs in other processes (a parallel plan); {mod} needs it in this one",
            round=instruction.round,
            client_id=context.client_id,
        )
    if context.state is None:
        raise ClientTaskError(
            f"{mod}: this client keeps no state for {state_for}; give the daemon a state directory",
            round=instruction.round,
            client_id=context.client_id,
        )
    return context.model, context.state


CallNext = Callable[[FitIns], FitRes]
"""The rest of the chain: ``call_next(instruction) -> reply``."""


class Mod(Protocol):
    """A client mod (see the module docstring)."""

    def __call__(self, instruction: FitIns, context: ModContext, call_next: CallNext) -> FitRes:
        """Handle ``instruction``, calling ``call_next`` once to train, and return the reply."""
        ...


_BUILTIN: dict[str, str] = {
    "scaffold": "fedcore.algorithms.scaffold:ScaffoldMod",
    "dp-clip": "privacy.dp.distributed:ClipAndNoiseMod",
    "dp-sgd": "privacy.dp.sgd:DPSGDMod",
    "secagg": "privacy.secagg.rounds:SecAggMod",
    "compress": "fedcore.compression:CompressionMod",
}
"""Built-in mods, imported on first use: ``name -> "module:class"``."""

registry: dict[str, Callable[..., Mod]] = {}
"""Registered mods, ``name -> class`` (built-ins are added on first lookup; :func:`register` adds others)."""


def register(name: str, factory: Callable[..., Mod]) -> None:
    """Register ``factory`` (a mod class, called with the declared parameters as keyword arguments) as ``name``.

    Both the server and the clients must register it (e.g. in the task module both import).

    Raises:
        ConfigError: ``name`` is taken by another mod.
    """
    known = registry.get(name)
    if known is not None and known is not factory:
        raise ConfigError(
            f"a client mod named {bounded_repr(name)} is already registered ({known!r}); pick another name"
        )
    registry[name] = factory


def lookup(name: str) -> Callable[..., Mod]:
    """The mod class registered as ``name``.

    Raises:
        ConfigError: no mod of that name (the known names are listed).
    """
    if name not in registry and isinstance(name, str) and name in _BUILTIN:
        module, _, attr = _BUILTIN[name].partition(":")
        registry.setdefault(name, getattr(importlib.import_module(module), attr))
    factory = registry.get(name) if isinstance(name, str) else None
    if factory is None:
        known = sorted({*registry, *_BUILTIN})
        raise ConfigError(f"unknown client mod {bounded_repr(name)}; known mods: {', '.join(known)}")
    return factory


def build_mod(spec: ModSpec) -> Mod:
    """The mod ``spec`` declares, built with its parameters.

    Raises:
        ConfigError: unknown name, or parameters the mod refuses (unknown, missing, wrong type or out of range).
    """
    factory = lookup(spec.name)
    name = bounded_repr(spec.name, 40)
    if not isinstance(spec.params, Mapping) or not all(isinstance(k, str) for k in spec.params):
        raise ConfigError(f"the parameters of client mod {name} must be a mapping of names to values")
    for key, value in spec.params.items():
        if not isinstance(value, bool | int | float | str):
            raise ConfigError(
                f"parameter {bounded_repr(key, 40)} of client mod {name} is a {type(value).__name__}; "
                "mod parameters are bool, int, float or str"
            )
    try:
        return factory(**spec.params)
    except ConfigError as exc:
        raise ConfigError(f"client mod {name}: {bound_text(exc.message, 300)}") from None
    except TypeError as exc:  # an unknown or missing keyword
        raise ConfigError(f"client mod {name} refuses its parameters: {bound_text(str(exc), 300)}") from None


def check_mods(specs: tuple[ModSpec, ...]) -> list[Mod]:
    """Build every mod of ``specs`` (in order), refusing what cannot run.

    Raises:
        ConfigError: more than :data:`MAX_MODS`, a declaration that is not a :class:`ModSpec`, a name declared twice,
            or what :func:`build_mod` refuses.
    """
    if len(specs) > MAX_MODS:
        raise ConfigError(f"{len(specs)} client mods declared; at most {MAX_MODS}")
    names = [spec.name if isinstance(spec, ModSpec) else None for spec in specs]
    if None in names:
        raise ConfigError("client mods are declared as ModSpec(name, params)")
    if len(set(names)) != len(names):
        twice = sorted({bounded_repr(n, 40) for n in names if names.count(n) > 1})
        raise ConfigError(f"a client mod is declared twice: {', '.join(twice)}; declare each once")
    return [build_mod(spec) for spec in specs]


@runtime_checkable
class ServerInverse(Protocol):
    """A mod whose change of the reply the server undoes before aggregating it (update compression,
    :class:`fedcore.compression.CompressionMod`): the mod's class has a ``decode`` method."""

    def decode(self, reply: FitRes, *, reference: Mapping[str, np.ndarray], round: int) -> FitRes:
        """``reply`` with its parameters back in the spec of ``reference`` (the global model the client trained
        from), after checking everything the client sent.

        Raises:
            PayloadError, UpdateRejected: the reply is not this mod's encoding of an update of the model.
        """
        ...


def server_inverses(specs: tuple[ModSpec, ...]) -> tuple[ServerInverse, ...]:
    """The server-side inverses among the mods ``specs`` declares, outermost first (the order to apply them in: the
    outermost mod changed the reply last).

    Raises:
        ConfigError: what :func:`check_mods` refuses.
    """
    return tuple(mod for mod in check_mods(specs) if isinstance(mod, ServerInverse))


def decode_reply(
    inverses: tuple[ServerInverse, ...], reply: FitRes, *, reference: Mapping[str, np.ndarray], round: int
) -> FitRes:
    """``reply`` as the round's aggregator takes it: each inverse of :func:`server_inverses` applied in turn (none:
    the reply as it is).

    Raises:
        PayloadError, UpdateRejected: what an inverse refuses (the update is rejected; nothing of it was used).
    """
    for inverse in inverses:
        reply = inverse.decode(reply, reference=reference, round=round)
    return reply
