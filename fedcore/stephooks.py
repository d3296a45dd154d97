"""Optimizer step pre-handlers that clients training in threads of one process add and remove safely.

A client mod that changes each optimizer step (DP-SGD privatizing the gradients, SCAFFOLD adding its correction)
needs a hook on the task's optimizer, which it does not hold: only torch's global step pre-hooks reach it. But
torch iterates its global hooks without a lock (an ``OrderedDict``), so a client that registers or removes one
while a client in another thread of the same process steps makes that step raise ``RuntimeError: OrderedDict
mutated during iteration``: daemons run as threads, a Flower app's clients, a thread pool's. This module registers
one global hook, once, at import, and keeps the handlers in its own table under a lock: a handler applies to the
optimizers that step the parameters it was added for, and is added and removed without touching torch's hooks.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

StepHandler = Callable[[torch.optim.Optimizer], None]
"""Called with the optimizer before each of its steps (its parameters' ``grad`` may be changed in place)."""

PRIVACY_ORDER = 0
"""The order of DP-SGD's handler: it privatizes the loss's gradients before anything is added to them."""
CORRECTION_ORDER = 10
"""The order of handlers that add a term to the (privatized) gradients, such as SCAFFOLD's correction."""

_handlers: dict[int, list[tuple[int, int, StepHandler]]] = {}  # id of a parameter -> (order, sequence, handler)
_lock = threading.Lock()
_sequence = itertools.count()


def _dispatch(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
    """The one global step pre-hook: runs the handlers added for ``optimizer``'s parameters, each once per step, by
    their order and then the order they were added in."""
    if not _handlers:  # no mod active in this process: the common case costs one read
        return
    with _lock:
        found = {
            id(entry[2]): entry
            for group in optimizer.param_groups
            for p in group["params"]
            for entry in _handlers.get(id(p), ())
        }
    for _, _, handler in sorted(found.values(), key=lambda entry: entry[:2]):
        handler(optimizer)


register_optimizer_step_pre_hook(_dispatch)


@contextmanager
def step_pre_handler(params: Iterable[torch.Tensor], handler: StepHandler, order: int) -> Iterator[None]:
    """Run ``handler`` before each step of any optimizer that holds one of ``params``, while the context is open.

    Args:
        params: the parameters the handler is for (by identity: the model's own tensors).
        handler: see :data:`StepHandler`; it runs in the stepping thread, outside this module's lock.
        order: handlers of lower order run first (:data:`PRIVACY_ORDER`, :data:`CORRECTION_ORDER`); handlers of one
            order run in the order they were added.
    """
    entry = (order, next(_sequence), handler)
    keys = list(dict.fromkeys(id(p) for p in params))
    with _lock:
        for key in keys:
            _handlers.setdefault(key, []).append(entry)
    try:
        yield
    finally:
        with _lock:
            for key in keys:
                remaining = [e for e in _handlers.get(key, ()) if e is not entry]
                if remaining:
                    _handlers[key] = remaining
                else:
                    _handlers.pop(key, None)
