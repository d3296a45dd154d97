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
