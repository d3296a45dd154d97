"""load_task_factory's messages: a module that is not found says how to make it importable; a module that is found
but fails to import says what it raised (not a PYTHONPATH hint that would send the user the wrong way)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from fedcore.errors import ConfigError
from fedcore.task import load_task_factory


def test_a_module_that_is_not_found_is_named_with_how_to_make_it_importable() -> None:
    with pytest.raises(ConfigError) as caught:
        load_task_factory("no_such_task_module_xyz:make_task")
    message = str(caught.value)
    assert "cannot import task module 'no_such_task_module_xyz'" in message
    assert "PYTHONPATH" in message and "pip install" in message and "each client daemon" in message


def test_a_module_whose_own_import_fails_says_what_it_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "broken_task_module_xyz.py").write_text("import not_installed_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with pytest.raises(ConfigError) as caught:
            load_task_factory("broken_task_module_xyz:make_task")
    finally:
        sys.modules.pop("broken_task_module_xyz", None)
    message = str(caught.value)
    assert "cannot import task module 'broken_task_module_xyz': importing it raised" in message
    assert "not_installed_dependency_xyz" in message
    assert "PYTHONPATH" not in message


def test_a_found_module_gives_its_factory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "good_task_module_xyz.py").write_text("def make_task(ctx):\n    return ctx\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        factory = load_task_factory("good_task_module_xyz:make_task")
    finally:
        sys.modules.pop("good_task_module_xyz", None)
    assert factory("context") == "context"  # type: ignore[arg-type]  # deliberate: the factory echoes any value


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("def make_task(ctx):\n    return 1 +\n", "a syntax error in {path}, line 2: invalid syntax"),
        ("X = 1\nraise RuntimeError('no data here')\n", "its code raised RuntimeError at {path}, line 2: no data here"),
        ("open('/nonexistent-xyz/data.csv')\n", "its code raised FileNotFoundError at {path}, line 1: [Errno 2]"),
        ("import sys\nsys.exit(3)\n", "it called sys.exit(3)"),
    ],
)
def test_a_module_whose_own_code_fails_at_import_is_one_clear_line_on_every_command(
    source: str, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A syntax error, an exception or sys.exit in the task module's own code at import: before, everything but an
    ImportError or OSError crashed the server, the daemon and simulate with a traceback and exit code 1 (which a
    daemon's systemd unit restarts forever); sys.exit ended the process with the module's code. Now each command
    exits 2 with one line that says what and where, and writes nothing."""
    from fedcore.cli import main

    path = tmp_path / "failing_task_module_xyz.py"
    path.write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    expected = message.format(path=path)
    with pytest.raises(ConfigError) as caught:
        load_task_factory("failing_task_module_xyz:make_task")
    assert f"cannot import task module 'failing_task_module_xyz': {expected}" in str(caught.value)
    task = ["--task", "failing_task_module_xyz:make_task"]
    commands = [
        ["server", "start", "--insecure", "--address", "127.0.0.1:0", "--state-dir", str(tmp_path / "server")],
        ["client", "start", "--insecure", "--server", "127.0.0.1:1", "--client-id", "c0", "--state-dir",
         str(tmp_path / "client")],
        ["simulate", "--rounds", "1", "--out", str(tmp_path / "run")],
    ]  # fmt: skip
    for command in commands:
        sys.modules.pop("failing_task_module_xyz", None)
        assert main([*command, *task]) == 2, command
        err = capsys.readouterr().err
        assert err.startswith("fedcore: error: cannot import task module") and expected in err, err
        assert err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "__pycache__") == [path.name]
