"""The client mod chain: the strategy's mods, in order, around the task's training (DESIGN.md, "Client mods").

A fit instruction names its mods (:class:`~fedcore.messages.ModSpec`); :func:`run_chain` builds each from the
registry (:mod:`fedcore.mods`: an unknown name or bad parameters is a :class:`~fedcore.errors.ConfigError`, which
the daemon reports to the server as the client's failure) and calls them Flower-style: the first mod declared is
the outermost, each gets ``call_next`` to run the rest, and the last one's ``call_next`` is the task's training::

    mods (m1, m2):   m1(ins, ctx, ins -> m2(ins, ctx, ins -> train(ins)))

A mod that does not call ``call_next`` trains nothing; one that calls it twice trains twice: both are the mod's
choice. The chain is built afresh per instruction (mods are small values; their state lives in the client's state
store, not in the mod).
"""

from __future__ import annotations

from collections.abc import Sequence

from fedcore.errors import ClientTaskError, ConfigError
from fedcore.messages import FitIns, FitRes, ModSpec
from fedcore.mods import CallNext, Mod, ModContext, check_mods

__all__ = ["ModContext", "chain", "run_chain"]


def chain(mods: Sequence[Mod], context: ModContext, train: CallNext) -> CallNext:
    """``train`` wrapped by ``mods`` (the first one outermost), as one ``instruction -> reply`` function."""
    call: CallNext = train
    for mod in reversed(mods):
        call = _link(mod, context, call)
    return call


def _link(mod: Mod, context: ModContext, call_next: CallNext) -> CallNext:
    def call(instruction: FitIns) -> FitRes:
        reply = mod(instruction, context, call_next)
        if not isinstance(reply, FitRes):
            raise ClientTaskError(
                f"client mod {type(mod).__name__} returned {type(reply).__name__}, not a FitRes",
                round=instruction.round,
                client_id=context.client_id,
                stage="fit",
            )
        return reply

    return call


def run_chain(instruction: FitIns, context: ModContext, train: CallNext) -> FitRes:
    """Run ``instruction`` through the mods it declares, with ``train`` at the end of the chain.

    Raises:
        ConfigError: a declared mod is unknown or refuses its parameters (nothing has run).
        whatever a mod or ``train`` raises.
    """
    specs: tuple[ModSpec, ...] = instruction.mods
    try:
        mods = check_mods(specs)
    except ConfigError as exc:
        raise ConfigError(exc.message, round=instruction.round, client_id=context.client_id, stage="fit") from None
    return chain(mods, context, train)(instruction)
