"""Ctrl-C (SIGINT) around cleanup that must finish.

A terminal's Ctrl-C raises :class:`KeyboardInterrupt` wherever the main thread happens to be. A user who presses
it two or three times in quick succession interrupts the cleanup the first one started: a process pool's workers
and shared-memory directory, Ray's processes (``ray.shutdown`` stopped half-way left ``ray::DashboardAgent`` and
``ray::RuntimeEnvAgent`` running), or Ray's own ``atexit`` shutdown (a ``KeyboardInterrupt`` traceback). Two tools:

- :func:`deferred_interrupts` holds Ctrl-C back while a block of cleanup runs (the pools' ``close``, the
  simulation harness's way out), for any caller: a library user with Python's default handler included;
- :func:`first_interrupt_only` makes the first Ctrl-C raise as usual and every later one do nothing, for a
  command-line program from its start to its exit (``fedcore simulate``): the cleanup the first one started, and
  the interpreter's exit after it, then run to their end, with the same message and exit status as one Ctrl-C.

Both act in the main thread only (Python runs signal handlers there) and leave a handler the program installed
itself alone where they would replace it. A cleanup that hangs can still be ended by SIGQUIT (Ctrl-\\) or SIGKILL.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[None]:
    """While the block runs, Ctrl-C (SIGINT) is held back instead of raising :class:`KeyboardInterrupt`, so that
    the block (cleanup that must finish) is never left half-way.

    At the block's end the previous handler is put back, and a Ctrl-C that came meanwhile is handed to it (Python's
    default handler raises KeyboardInterrupt then), unless an exception is already on its way out: the block
    raised, or it runs in an ``except`` or ``finally`` clause of one (typically the first Ctrl-C's
    KeyboardInterrupt, whose cleanup this is). The program is stopping anyway then, and another KeyboardInterrupt
    would only replace the first one's exception. Nested blocks hand a held Ctrl-C outwards.

    Only in the main thread (elsewhere it does nothing: Python runs signal handlers in the main thread only), and
    only where SIGINT has a Python handler: where it is ignored nothing comes, and where it has its default action
    (no Python handler) it ends the process as before.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):
        yield
        return
    held: list[FrameType | None] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        held.append(frame)

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held and sys.exc_info()[1] is None:  # the block ended normally, and no exception is being handled
            previous(signal.SIGINT, held[0])


@contextlib.contextmanager
def first_interrupt_only() -> Iterator[None]:
    """While the block runs, the first Ctrl-C (SIGINT) raises :class:`KeyboardInterrupt` as usual, and every later
    one is ignored: the cleanup the first one started runs to its end, however many follow.

    After a Ctrl-C, SIGINT stays ignored when the block ends: this is for a program's main function, whose process
    exits right after it, and another Ctrl-C would only interrupt the interpreter's exit (``atexit`` hooks, such as
    Ray's own shutdown, whose interrupted ``time.sleep`` printed a KeyboardInterrupt traceback). Without a Ctrl-C
    the previous handler is put back.

    Only in the main thread and where SIGINT has Python's default handler (:func:`signal.default_int_handler`);
    elsewhere the block runs with SIGINT as it is.
    """
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    interrupted = False

    def handler(signum: int, frame: FrameType | None) -> None:
        nonlocal interrupted
        if not interrupted:
            interrupted = True
            signal.default_int_handler(signum, frame)  # raises KeyboardInterrupt, as without this handler

    signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN if interrupted else signal.default_int_handler)
