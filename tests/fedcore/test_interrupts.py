"""Ctrl-C around cleanup: held back by deferred_interrupts, only the first raising under first_interrupt_only."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedcore.interrupts import deferred_interrupts, first_interrupt_only


def _ctrl_c() -> None:
    """A Ctrl-C to this process; its Python handler runs before this returns (the next bytecode of the main thread)."""
    os.kill(os.getpid(), signal.SIGINT)


@pytest.fixture(autouse=True)
def default_handler() -> Iterator[None]:
    """Each test starts with Python's default SIGINT handler and gets it back (pytest's own, whatever it is)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_ctrl_c_in_the_block_is_raised_once_it_ends() -> None:
    done = []
    with pytest.raises(KeyboardInterrupt), deferred_interrupts():
        _ctrl_c()
        _ctrl_c()
        done.append("cleanup")
    assert done == ["cleanup"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_ctrl_c_in_the_block_is_dropped_on_the_way_out_of_another() -> None:
    """In the cleanup of a first KeyboardInterrupt, a second one would only replace it: the block ends, the first
    one goes on."""
    done = []
    with pytest.raises(KeyboardInterrupt) as raised:
        try:
            raise KeyboardInterrupt("first")
        finally:
            with deferred_interrupts():
                _ctrl_c()
                done.append("cleanup")
    assert done == ["cleanup"] and str(raised.value) == "first"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_nested_blocks_hand_a_ctrl_c_outwards() -> None:
    done = []
    with pytest.raises(KeyboardInterrupt), deferred_interrupts():
        with deferred_interrupts():
            _ctrl_c()
        done.append("outer cleanup")
    assert done == ["outer cleanup"]


def test_outside_the_main_thread_and_with_sigint_ignored_nothing_changes() -> None:
    seen = []

    def other() -> None:
        with deferred_interrupts():
            seen.append(signal.getsignal(signal.SIGINT))

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert seen == [signal.default_int_handler]
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with deferred_interrupts():
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        _ctrl_c()
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_only_the_first_ctrl_c_raises_and_sigint_stays_ignored_after_one() -> None:
    done = []
    with first_interrupt_only():
        try:
            _ctrl_c()
            done.append("not reached")
        except KeyboardInterrupt:
            _ctrl_c()  # while the first one's cleanup runs: ignored
            _ctrl_c()
            done.append("cleanup")
    assert done == ["cleanup"]
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # the program exits: its interpreter's exit too


def test_without_a_ctrl_c_the_default_handler_comes_back() -> None:
    with first_interrupt_only():
        assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_ctrl_c_held_by_a_cleanup_block_is_the_first_one() -> None:
    """The first Ctrl-C may come while a cleanup block runs (a pool closing at a run's normal end): it is raised
    when that block ends, and later ones are ignored."""
    done = []
    with first_interrupt_only():
        with pytest.raises(KeyboardInterrupt), deferred_interrupts():
            _ctrl_c()
            done.append("cleanup")
        _ctrl_c()
        done.append("after")
    assert done == ["cleanup", "after"]


def _console(tmp_path: Path, patches: str) -> subprocess.CompletedProcess[str]:
    """``fedcore simulate`` (a 1-round digits run) through the console script's entry, after ``patches``."""
    args = ["simulate", "--dataset", "digits", "--clients", "4", "--rounds", "1", "--no-plot", "--no-progress",
            "--out", str(tmp_path / "run")]  # fmt: skip
    script = f"import sys\nsys.argv = ['fedcore', *{args!r}]\n{patches}\nfrom fedcore.cli import console_main\n"
    script += "sys.exit(console_main())\n"
    return subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as a terminal starts it
    )


def test_a_ctrl_c_while_the_console_script_builds_its_parser_is_one_line(tmp_path: Path) -> None:
    """Ctrl-C while the parser is built (it imports torch and grpc, the first second or two of every command):
    "fedcore: interrupted", exit status 130, as later; before, a KeyboardInterrupt traceback through the imports."""
    patches = (
        "import os, signal, time\n"
        "import fedcore.cli as cli\n"
        "build = cli.build_parser\n"
        "def interrupted():\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(5)\n"
        "    return build()\n"
        "cli.build_parser = interrupted\n"
    )
    done = _console(tmp_path, patches)
    assert (done.returncode, done.stderr) == (130, "fedcore: interrupted\n")
    assert not (tmp_path / "run").exists()


def test_a_ctrl_c_after_the_run_finished_does_not_undo_its_success(tmp_path: Path) -> None:
    """Ctrl-C while the interpreter exits after a finished run (sent from an exit hook that sleeps, as torch's and
    Ray's do their work): ignored, so the run ends with exit status 0 and no traceback; before, "Exception ignored
    in atexit callback ... KeyboardInterrupt" and the status of a process killed by SIGINT."""
    patches = (
        "import atexit, os, signal, time\n"
        "def exit_hook():\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(0.5)\n"
        "atexit.register(exit_hook)\n"
    )
    done = _console(tmp_path, patches)
    assert done.returncode == 0 and "final test accuracy" in done.stdout
    assert "KeyboardInterrupt" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert (tmp_path / "run" / "model.safetensors").is_file()
