"""The files a simulation writes: the same bytes for the same seed, one history schema, the recipe as run."""

from __future__ import annotations

import csv
import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from fedcore.config import from_mapping
from fedcore.payload import check_digest
from fedcore.supervised import SupervisedTask
from fedcore.task import TaskContext
from server.state import HISTORY_COLUMNS, history_columns, load_checkpoint
from simulations.config import SimulationConfig, load_recipe
from simulations.harness import RUN_LOCK, run_simulation

TINY = "tests.simulations.test_harness:tiny_task"  # a user's own task: a linear model on a fixed problem


def _simulate(out: Path, *extra: str) -> dict[str, bytes]:
    """Run 3 rounds of the tiny task with federated evaluation on; return the bytes of each file written."""
    overrides = [
        f"task.factory='{TINY}'",
        "task.options.data_seed='3'",
        "data.num_clients=4",
        "sampling.min_fit_clients=2",
        "sampling.fraction_fit=0.5",
        "sampling.fraction_evaluate=1.0",
        "strategy.name='fedadam'",
        "strategy.server_lr=0.05",
        "train.lr=0.5",
        "rounds=3",
        "evaluate_every=1",
        "output.progress=false",
        "output.plot=false",
        f"output.dir={str(out)!r}",
        *extra,
    ]
    run_simulation(load_recipe(None, overrides), echo=lambda _: None)
    return _files(out)


def _files(out: Path) -> dict[str, bytes]:
    """The bytes of each file in ``out`` (not in its directories: state/, the checkpoints)."""
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}


def _without_seconds(text: bytes) -> list[list[str]]:
    rows = list(csv.reader(text.decode().splitlines()))
    drop = rows[0].index("seconds")
    return [row[:drop] + row[drop + 1 :] for row in rows]


def test_two_same_seed_simulations_write_the_same_bytes(tmp_path: Path) -> None:
    out = tmp_path / "run"
    first = _simulate(out)
    second = _simulate(out)  # the same output directory: config.json records it
    assert sorted(first) == [RUN_LOCK, "config.json", "history.csv", "model.safetensors"]
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["state"]  # the checkpoints
    assert first["model.safetensors"] == second["model.safetensors"]
    assert first["config.json"] == second["config.json"]
    # history.csv: every byte but the wall-time column
    assert _without_seconds(first["history.csv"]) == _without_seconds(second["history.csv"])
    assert check_digest(out / "model.safetensors") is True
    assert load_checkpoint(str(out / "model.safetensors")).round == 3
    other = _simulate(tmp_path / "other", "seed=1")
    assert other["model.safetensors"] != first["model.safetensors"]


@pytest.fixture(scope="module")
def one_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("run")
    _simulate(out)
    return out


def test_the_simulation_history_has_the_one_schema_with_federated_evaluation(one_run: Path) -> None:
    frame = pd.read_csv(one_run / "history.csv")
    columns = list(frame.columns)
    assert columns[: len(HISTORY_COLUMNS)] == list(HISTORY_COLUMNS) and columns[-1] == "seconds"
    assert "federated_accuracy" in columns and columns == history_columns([dict.fromkeys(columns)])
    assert list(frame["round"]) == [0, 1, 2, 3]
    assert list(frame["clients"]) == [0, 2, 2, 2] and frame["clients"].dtype == np.int64
    assert frame["failures"].dtype == np.int64
    assert np.isnan(frame["federated_loss"].iloc[0])  # round 0 evaluates the initial model centrally only
    assert frame["federated_loss"].iloc[1:].notna().all() and frame["federated_accuracy"].iloc[1:].between(0, 1).all()
    assert frame["test_accuracy"].notna().all()


def test_config_json_records_a_custom_task_not_the_builtin_dataset(one_run: Path) -> None:
    recorded = json.loads((one_run / "config.json").read_text())
    assert recorded["task"] == {"factory": TINY, "options": {"data_seed": "3"}, "server_evaluation": True}
    assert recorded["data"] == {"num_clients": 4}  # data_dir unset: left out, as to_mapping does
    assert "model" not in recorded
    assert recorded["strategy"]["name"] == "fedadam" and recorded["sampling"]["fraction_evaluate"] == 1.0
    # the record loads back as the recipe that ran
    again = from_mapping(SimulationConfig, recorded)
    assert again.task.factory == TINY and again.data.num_clients == 4 and again.strategy.name == "fedadam"


def test_a_runs_config_json_given_as_the_recipe_runs_it_again(one_run: Path, tmp_path: Path) -> None:
    from fedcore.cli import main

    again = tmp_path / "again"
    assert main(["simulate", "--recipe", str(one_run / "config.json"), "--out", str(again)]) == 0
    assert (again / "model.safetensors").read_bytes() == (one_run / "model.safetensors").read_bytes()
    assert _without_seconds((again / "history.csv").read_bytes()) == _without_seconds(
        (one_run / "history.csv").read_bytes()
    )
    recorded, rerun = (json.loads((d / "config.json").read_text()) for d in (one_run, again))
    assert recorded.pop("output")["dir"] == str(one_run) and rerun.pop("output")["dir"] == str(again)
    assert rerun == recorded


def test_a_json_recipe_that_is_not_an_object_of_tables_is_refused(tmp_path: Path) -> None:
    from fedcore.errors import ConfigError

    for text, reason in (("[1, 2]", "holds a JSON list, not an object of tables"), ("{seed: 1}", "not valid JSON")):
        (tmp_path / "config.json").write_text(text)
        with pytest.raises(ConfigError, match=reason):
            load_recipe(tmp_path / "config.json")


def test_config_json_of_the_demo_task_keeps_the_dataset_and_model(tmp_path: Path) -> None:
    from simulations.config import DEMO_TASK
    from simulations.harness import recipe_record

    config = load_recipe(None, ["data.dataset='digits'", "model.name='2nn'"])
    recorded = recipe_record(config)
    assert recorded["task"]["factory"] == DEMO_TASK
    assert recorded["data"]["dataset"] == "digits" and recorded["model"] == {"name": "2nn"}


def test_a_simulation_and_a_server_never_share_a_directory(tmp_path: Path) -> None:
    from fedcore.errors import ConfigError, StateError
    from server.state import StateStore

    out = tmp_path / "sim"
    written = _simulate(out)
    # a server given the simulation's output as --state-dir would overwrite its history.csv: refused, untouched
    with pytest.raises(StateError, match=r"not a server state directory \(no state\.db\) but holds history\.csv, "
                       r"config\.json, model\.safetensors.*new or empty directory"):  # fmt: skip
        StateStore(out)
    assert _files(out) == written
    # and a simulation given a server's state directory as output.dir
    StateStore(tmp_path / "server").close()
    with pytest.raises(ConfigError, match=r"is a server's state directory \(it holds state\.db\)"):
        _simulate(tmp_path / "server")
    assert not (tmp_path / "server" / "config.json").exists()


def test_a_run_refuses_a_directory_holding_files_no_simulation_wrote(tmp_path: Path) -> None:
    """A run replaces config.json, the results and state/ and client-state/ of an earlier run in its output.dir:
    where those names hold a user's own files (no simulation's config.json beside them, or an unknown file in
    state/), it refuses before touching anything, naming them."""
    from fedcore.errors import ConfigError

    out = tmp_path / "project"
    (out / "state").mkdir(parents=True)
    (out / "state" / "notes.txt").write_text("precious")
    (out / "client-state").mkdir()
    (out / "client-state" / "x").write_text("keep")
    (out / "config.json").write_text('{"mine": 1}')
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    refusal = r"holds 'client-state', 'config\.json', 'state', which no fedcore simulation wrote"
    with pytest.raises(ConfigError, match=refusal):
        _simulate(out)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != RUN_LOCK} == before
    # a simulation's own directory is replaced by the next run, unless a file of another's sits in its state/
    written = _simulate(tmp_path / "sim")
    assert _simulate(tmp_path / "sim").keys() == written.keys()
    (tmp_path / "sim" / "state" / "notes.txt").write_text("mine")
    with pytest.raises(
        ConfigError,
        match=r"holds 'state/notes\.txt', which no fedcore simulation wrote there "
        r"\(a simulation's state/ holds only its checkpoint store\).*move them out of it",
    ):
        _simulate(tmp_path / "sim")
    assert (tmp_path / "sim" / "state" / "notes.txt").read_text() == "mine"


def unbuildable_task(ctx: TaskContext) -> SupervisedTask:
    """tiny_task whose model_fn raises (``options.model = "raises"``) or returns an int (``"int"``)."""
    from tests.simulations.test_harness import tiny_task

    def model_fn() -> torch.nn.Module:
        if ctx.options["model"] == "raises":
            raise RuntimeError("model build failed")
        return 5  # type: ignore[return-value]  # the bad return under test

    return replace(tiny_task(ctx), model_fn=model_fn)


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("raises", "its model_fn raised RuntimeError: model build failed"),
        ("int", "the task's model_fn returned a int, not a torch.nn.Module"),
    ],
)
def test_a_model_that_cannot_be_built_is_refused_before_the_output_is_touched(
    tmp_path: Path, model: str, message: str
) -> None:
    from fedcore.errors import ConfigError

    written = _simulate(tmp_path)
    with pytest.raises(ConfigError, match=message):
        _simulate(tmp_path, f"task.factory='{__name__}:unbuildable_task'", f"task.options.model='{model}'")
    assert _files(tmp_path) == written  # the earlier run's model, history and checkpoints stay


def test_a_run_inside_another_runs_directory_is_refused(tmp_path: Path) -> None:
    """An output.dir under another simulation's checkpoints, client state or result files would put files no
    simulation wrote into that run's checkpoints or client state, and its --resume would then refuse: refused before
    anything is written, naming the enclosing directory; that directory itself may be run into again."""
    from fedcore.errors import ConfigError

    outer = tmp_path / "outer"
    written = _simulate(outer)
    for inner in (outer / "state" / "inner", outer / "client-state", outer / "history.png" / "deeper"):
        with pytest.raises(ConfigError, match=rf"lies inside the simulation output directory {str(outer)!r}"):
            _simulate(inner)
        assert not inner.exists() or not any(inner.iterdir())
    assert not (outer / "history.png").is_dir() and _files(outer) == written
    assert _simulate(outer).keys() == written.keys()


def test_runs_in_a_folder_of_another_runs_directory_keep_each_other(tmp_path: Path) -> None:
    """``runs/`` as one run's output and ``runs/ablation/`` as another's, made in either order: each runs again,
    and neither touches the other's files. Before, the folder made first was refused from then on, as
    lying inside the other run."""
    inner = tmp_path / "runs" / "ablation"
    inner_files = _simulate(inner)
    outer_files = _simulate(tmp_path / "runs")
    assert _files(inner) == inner_files
    again = _simulate(inner)  # run again there: same seed, same model
    assert again["model.safetensors"] == inner_files["model.safetensors"]
    inner_files = _files(inner)
    deeper = tmp_path / "runs" / "ablation" / "lr"  # and a third, inside the second's own folder
    _simulate(deeper)
    assert _files(inner) == inner_files
    assert _simulate(tmp_path / "runs").keys() == outer_files.keys()
    assert _files(inner) == inner_files and (deeper / "model.safetensors").is_file()


def test_a_state_linked_into_another_run_is_refused(tmp_path: Path) -> None:
    """A run's state/ or client-state/ that is a symbolic link into another run's directory: --resume went on from
    that run's checkpoints and wrote its rounds there. Refused before anything is read or written; a link to a
    folder of no run (the checkpoints moved to another disk) is resumed from."""
    from fedcore.errors import ConfigError

    first, second = tmp_path / "first", tmp_path / "second"
    first_files = _simulate(first)
    _simulate(second)
    checkpoints = {p: p.read_bytes() for p in sorted((first / "state").rglob("*")) if p.is_file()}
    for name, target in (("state", first / "state"), ("state", first), ("client-state", first / "state")):
        link = second / name
        if link.is_symlink():
            link.unlink()
        elif link.is_dir():
            shutil.rmtree(link)
        link.symlink_to(target, target_is_directory=True)
        for extra in (("output.resume=true", "rounds=4"), ()):
            with pytest.raises(
                ConfigError, match=rf"is a symbolic link into the simulation output directory {str(first)!r}"
            ):
                _simulate(second, *extra)
        link.unlink()
    assert _files(first) == first_files
    assert {p: p.read_bytes() for p in sorted((first / "state").rglob("*")) if p.is_file()} == checkpoints
    elsewhere = tmp_path / "disk" / "checkpoints"  # moved to another disk, and linked: resumed from there
    elsewhere.parent.mkdir()
    _simulate(second)
    shutil.move(second / "state", elsewhere)
    (second / "state").symlink_to(elsewhere, target_is_directory=True)
    _simulate(second, "output.resume=true", "rounds=4")
    assert load_checkpoint(str(second / "model.safetensors")).round == 4
    assert (second / "state").is_symlink() and (elsewhere / "state.db").is_file()


def test_an_earlier_runs_checkpoints_that_cannot_be_removed_leave_its_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new run replaces an earlier run's results, checkpoints and client state; a checkpoint directory that
    cannot be removed (injected: EACCES, as a state/ without write permission gives a user who is not root) is
    refused before the earlier run's results are touched: its model, history and checkpoints stay, and the message
    says so. Before, the results were removed first and the error came after."""
    import errno
    import shutil

    import simulations.harness as harness
    from fedcore.errors import ConfigError

    out = tmp_path / "run"
    written = _simulate(out)
    checkpoints = sorted((out / "state").rglob("*.safetensors"))
    assert checkpoints

    def denied(path: object, *args: object, **kwargs: object) -> None:  # rmtree names a file relative to its dir
        raise PermissionError(errno.EACCES, "Permission denied", "history.csv")

    monkeypatch.setattr(harness.shutil, "rmtree", denied)
    with pytest.raises(ConfigError) as caught:
        _simulate(out, "rounds=2")
    message = str(caught.value)
    assert f"output.dir {str(out)!r} ({out / 'state' / 'history.csv'}): Permission denied" in message
    assert "(an earlier run's results there are left as they were); fix that (permissions, disk space" in message
    assert _files(out) == written and sorted((out / "state").rglob("*.safetensors")) == checkpoints
    monkeypatch.undo()
    assert harness.shutil.rmtree is shutil.rmtree
    assert _simulate(out, "rounds=2").keys() == written.keys()
    assert json.loads((out / "config.json").read_text())["rounds"] == 2


def test_an_output_dir_in_a_loop_of_symbolic_links_is_one_clear_error(tmp_path: Path) -> None:
    """Path.resolve raises RuntimeError on a loop of symbolic links (Python 3.11): a ConfigError that says so."""
    from fedcore.errors import ConfigError

    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    for out in (tmp_path / "a", tmp_path / "a" / "sub"):
        with pytest.raises(ConfigError, match=r"cannot be resolved .*; give a path without a loop of symbolic links"):
            _simulate(out)
