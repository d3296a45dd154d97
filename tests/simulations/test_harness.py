"""End-to-end simulations on real data: learning happens, runs are reproducible, the CLI reports."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch

from fedcore.cli import main
from fedcore.errors import ConfigError
from fedcore.supervised import SupervisedTask
from fedcore.task import TaskContext, build_server_task
from fedcore.tensors import decode
from simulations.config import load_recipe
from simulations.harness import RUN_LOCK, clients_left_out, run_simulation

SMALL = [
    "data.dataset=digits",
    "data.num_clients=10",
    "data.partition=dirichlet",
    "data.alpha=0.5",
    "data.min_partition_size=5",
    "model.name=2nn",
    "sampling.min_fit_clients=5",
    "sampling.fraction_fit=0.5",
    "train.batch_size=16",
    "train.lr=0.1",
    "train.local_epochs=2",
    "rounds=8",
    "output.progress=false",
]


def simulate(tmp_path: Path, *extra: str) -> pd.DataFrame:
    config = load_recipe(None, [*SMALL, f"output.dir={str(tmp_path)!r}", *extra])
    return run_simulation(config, echo=lambda _: None).history


@pytest.mark.slow
def test_small_simulation_learns_far_above_chance(tmp_path: Path) -> None:
    history = simulate(tmp_path)
    assert list(history["round"]) == list(range(9))
    assert history["test_accuracy"].iloc[0] < 0.25  # the random initial model: near chance (0.1)
    assert history["test_accuracy"].iloc[-1] > 0.8
    assert (history.loc[1:, "clients"] == 5).all()
    on_disk = pd.read_csv(tmp_path / "history.csv")
    assert len(on_disk) == 9
    np.testing.assert_allclose(on_disk["test_accuracy"], history["test_accuracy"])
    assert (tmp_path / "history.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    model = decode((tmp_path / "model.safetensors").read_bytes())
    assert set(model) == {"net.1.weight", "net.1.bias", "net.3.weight", "net.3.bias", "net.5.weight", "net.5.bias"}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fedavgm", "fedadam"])
def test_same_seed_gives_identical_histories(tmp_path: Path, strategy: str) -> None:
    extra = [f"strategy.name={strategy!r}", "rounds=4"]
    extra += ["strategy.server_momentum=0.9"] if strategy == "fedavgm" else ["strategy.server_lr=0.01"]
    a = simulate(tmp_path / "a", *extra).drop(columns="seconds")
    b = simulate(tmp_path / "b", *extra).drop(columns="seconds")
    c = simulate(tmp_path / "c", *extra, "seed=1").drop(columns="seconds")
    pd.testing.assert_frame_equal(a, b, check_exact=True)
    assert not a.equals(c)
    model_a = decode((tmp_path / "a" / "model.safetensors").read_bytes())
    model_b = decode((tmp_path / "b" / "model.safetensors").read_bytes())
    assert all(np.array_equal(model_a[n], model_b[n]) for n in model_a)


def test_a_run_without_server_evaluation_says_it_has_no_test_accuracy(tmp_path: Path) -> None:
    """No round has a server evaluation: the final line says so, rather than 'final test accuracy nan'."""
    overrides = [
        "data.dataset='digits'",
        "data.num_clients=4",
        "model.name='logreg'",
        "rounds=1",
        "task.server_evaluation=false",
        "output.progress=false",
        "output.plot=false",
        f"output.dir={str(tmp_path)!r}",
    ]
    lines: list[str] = []
    run_simulation(load_recipe(None, overrides), echo=lines.append)
    assert lines[-1].startswith("final test accuracy none (no round has a server evaluation of it) after 1 rounds")


@pytest.mark.slow
def test_cli_simulate_prints_the_final_line_and_writes_the_report(tmp_path: Path) -> None:
    args = [
        "--dataset", "digits", "--clients", "6", "--model", "2nn", "--rounds", "2", "--min-fit-clients", "3",
        "--set", "data.min_partition_size=5", "--out", str(tmp_path), "--no-progress",
    ]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "fedcore.cli", "simulate", *args], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("final test accuracy ")
    assert str(tmp_path / "history.csv") in last and str(tmp_path / "history.png") in last


def test_cli_reports_bad_config_in_one_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "fedcore.cli", "simulate", "--lr", "-1"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "fedcore: error: [train] lr must be > 0, got -1.0"


def test_cli_reports_a_bad_flag_value_without_the_usage_block(capsys: pytest.CaptureFixture[str]) -> None:
    """argparse's own refusal (a typo in a choice) is the error and where the help is, not 84 lines of usage."""
    with pytest.raises(SystemExit) as exit_info:
        main(["simulate", "--backend", "batch"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "fedcore simulate: error: argument --backend: invalid choice: 'batch' (choose from 'inprocess', 'batched', "
        "'process', 'ray')",
        "(all options: fedcore simulate --help)",
    ]


def test_cli_partition_shows_the_skew_without_training(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "fedcore.cli", "partition", "--dataset", "digits", "--clients", "8", "--alpha", "0.3",
         "--set", "data.min_partition_size=5", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    counts = pd.read_csv(tmp_path / "counts.csv", index_col="client")
    assert len(counts) == 8 and counts["total"].sum() == 1438  # digits: 1797 samples, stratified 80% train split
    assert (tmp_path / "heatmap.png").read_bytes()[:4] == b"\x89PNG"
    assert "heatmap.png" in proc.stdout


def test_cli_partition_refuses_an_out_it_cannot_write_before_partitioning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from fedcore.cli import main

    (tmp_path / "afile").write_text("mine")
    (tmp_path / "taken" / "counts.csv").mkdir(parents=True)
    for out, message in (
        (tmp_path / "afile", r"cannot write the partition report into --out '.*afile': File exists"),
        (tmp_path / "taken", r"'.*taken/counts\.csv' is a directory, where the partition report goes"),
        ("", r"--out is empty"),
    ):
        assert main(["partition", "--dataset", "digits", "--clients", "8", "--out", str(out)]) == 2
        assert re.search(message, capsys.readouterr().err), message
    assert (tmp_path / "afile").read_text() == "mine"


def test_cli_out_starting_with_a_tilde_is_in_the_home_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--out=~/x (no shell expands a '~' after '='): partition and certs init wrote into a directory named '~' in the
    working directory, as simulate's --out=~/runs did before b281910 (a later `rm -r ~` there removes the home)."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    assert main(["partition", "--dataset", "digits", "--clients", "4", "--out=~/p"]) == 0
    assert main(["certs", "init", "--clients", "1", "--out=~/certs"]) == 0
    assert (home / "p" / "counts.csv").is_file() and (home / "certs" / "clients" / "client-000.pem").is_file()
    assert list(work.iterdir()) == []  # no directory named '~' here


def test_cli_partition_refuses_what_it_would_ignore_and_a_running_simulations_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An override of another table, or of no recipe key, and a misspelt table in the recipe are refused (a
    partition reads only [data] and seed: they would change nothing); so is the output directory of a simulation
    that is running (holds its lock). Once the simulation has ended, its directory takes the report."""
    from fedcore.cli import main
    from simulations.harness import lock_output

    recipe = tmp_path / "recipe.toml"
    recipe.write_text("[dat]\nnum_clients = 5\n")
    base = ["partition", "--dataset", "digits", "--clients", "8", "--out", str(tmp_path / "report")]
    for extra, message in (
        (["--set", "model.name=cnn"], r"--set 'model\.name=cnn': 'model' is not read by a partition; .* drop it"),
        (["--set", "dat.num_clients=5"], r"--set 'dat\.num_clients=5': 'dat' is no recipe key"),
        (["--recipe", str(recipe)], r"unknown key\(s\) 'dat' at the top level of '.*recipe\.toml'; known keys: .*data"),
    ):
        assert main([*base, *extra]) == 2
        assert re.search(message, capsys.readouterr().err), message
    assert not (tmp_path / "report").exists()
    running = tmp_path / "run"
    held = lock_output(running)  # as a running simulation holds it
    try:
        assert main([*base[:-1], str(running)]) == 2
        assert re.search(
            r"--out '.*run' is in use by another fedcore process \(pid \d+\) \(a simulation writing",
            capsys.readouterr().err,
        )
        assert not (running / "counts.csv").exists()
    finally:
        os.close(held)
    assert main([*base[:-1], str(running)]) == 0  # ended: its directory takes the report
    assert (running / "counts.csv").is_file()
    (running / "state").mkdir()
    assert main([*base[:-1], str(running / "state")]) == 2  # its checkpoints' directory: never
    assert re.search(r"lies inside the simulation output directory '.*run'", capsys.readouterr().err)
    target, links = tmp_path / "target.csv", tmp_path / "links"
    target.write_text("mine")
    links.mkdir()
    (links / "counts.csv").symlink_to(target)
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "heatmap.png")  # would block the write forever
    for out in (links, fifo):
        assert main([*base[:-1], str(out)]) == 2
        assert "is a symbolic link or a special file, where the partition report goes" in capsys.readouterr().err
    assert target.read_text() == "mine"


def tiny_task(ctx: TaskContext) -> SupervisedTask:
    """A user's own task: a linear model on a fixed synthetic problem, sharded by partition id."""
    generator = torch.Generator().manual_seed(int(ctx.options.get("data_seed", "0")))
    x = torch.randn(400, 5, generator=generator)
    y = (x[:, 0] + x[:, 1] > 0).long()
    test = (x[320:], y[320:])
    if ctx.role == "server":
        return SupervisedTask(model_fn=lambda: torch.nn.Linear(5, 2), test_data=test)
    assert ctx.partition_id is not None and ctx.num_partitions is not None
    shard = torch.arange(ctx.partition_id, 320, ctx.num_partitions)
    return SupervisedTask(model_fn=lambda: torch.nn.Linear(5, 2), train_data=(x[shard], y[shard]), test_data=test)


def test_simulate_runs_a_users_own_task_factory(tmp_path: Path) -> None:
    overrides = [
        f"task.factory='{__name__}:tiny_task'",
        "task.options.data_seed='3'",
        "data.num_clients=4",
        "sampling.min_fit_clients=4",
        "train.lr=0.5",
        "rounds=5",
        "output.progress=false",
        f"output.dir={str(tmp_path)!r}",
    ]
    result = run_simulation(load_recipe(None, overrides), echo=lambda _: None)
    assert list(result.history["clients"]) == [0, 4, 4, 4, 4, 4]
    assert result.history["test_accuracy"].iloc[-1] > 0.9  # the classes are linearly separable
    assert list(result.final.parameters) == ["weight", "bias"]


def _broken_factory(context: TaskContext) -> SupervisedTask:
    raise FileNotFoundError(f"no data for {context.role}")


def test_a_task_factory_that_raises_or_returns_no_task_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    context = TaskContext(role="server", seed=0)
    with pytest.raises(
        ConfigError, match=r"'m:f' raised FileNotFoundError building the server's task: no data for server"
    ):
        build_server_task(_broken_factory, context, spec="m:f")
    with pytest.raises(ConfigError, match=r"'m:f' returned a str, not a Task"):
        build_server_task(lambda _: "not a task", context, spec="m:f")  # type: ignore[arg-type,return-value]
    # `--task os:getcwd` names a callable that is no factory: was a TypeError traceback
    code = main(["simulate", "--task", "os:getcwd", "--rounds", "1", "--clients", "4", "--out", str(tmp_path / "o")])
    assert code == 2
    assert "the task factory 'os:getcwd' raised TypeError" in capsys.readouterr().err


def _recorded(function: Callable[[Any, Any], Any], into: list[Any]) -> Callable[[Any, Any], Any]:
    """``function``, also keeping each of its results in ``into``."""

    def call(state: Any, where: Any) -> Any:
        result = function(state, where)
        into.append(result)
        return result

    return call


@pytest.mark.parametrize(
    ("strategy", "backend"), [("fedavgm", "inprocess"), ("fedadam", "inprocess"), ("fedavgm", "batched")]
)
def test_a_mapped_round_state_gives_the_same_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, strategy: str, backend: str
) -> None:
    """The global model and optimizer state mapped from a file between rounds (as a model over MAP_STATE_BYTES's
    are) give the very history and model of the state kept in memory; the clients (one by one, or batched) and the
    server steps read them from the maps."""
    import server.state
    from server.round_loop import ServerState

    extra = [f"strategy.name={strategy!r}", "rounds=3", "data.num_clients=6", "sampling.min_fit_clients=3"]
    extra += ["strategy.server_momentum=0.9"] if strategy == "fedavgm" else ["strategy.server_lr=0.01"]
    extra += [f"simulation.backend={backend!r}", "output.checkpoints=false"]  # with them: the next test
    kept = simulate(tmp_path / "kept", *extra).drop(columns="seconds")
    mapped_states: list[ServerState] = []
    monkeypatch.setattr(server.state, "MAP_STATE_BYTES", 0)  # every state is mapped
    monkeypatch.setattr("simulations.harness.map_round_state", _recorded(server.state.map_round_state, mapped_states))
    mapped = simulate(tmp_path / "mapped", *extra).drop(columns="seconds")
    pd.testing.assert_frame_equal(kept, mapped, check_exact=True)
    assert len(mapped_states) == 4  # round 0's evaluation and three rounds
    assert all(isinstance(a, np.memmap) for s in mapped_states for a in s.optimizer_state.values() if a.size)
    assert all(isinstance(a, np.memmap) for s in mapped_states for a in s.parameters.values() if a.size)
    model_kept = decode((tmp_path / "kept" / "model.safetensors").read_bytes())
    model_mapped = decode((tmp_path / "mapped" / "model.safetensors").read_bytes())
    assert all(np.array_equal(model_kept[n], model_mapped[n]) for n in model_kept)
    # no mapped state left behind (only the run's lock file, which stays so that no two runs ever hold two locks)
    assert [p.name for p in (tmp_path / "mapped").iterdir() if p.name.startswith(".")] == [RUN_LOCK]


def test_a_round_state_mapped_from_its_checkpoint_gives_the_same_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With checkpoints, a state of MAP_STATE_BYTES or more goes on mapped from the checkpoint just written (no
    second file), a smaller one from memory; either way the run is the run without checkpoints."""
    import server.state
    from server.round_loop import ServerState

    extra = ["strategy.name='fedavgm'", "strategy.server_momentum=0.9", "rounds=3", "data.num_clients=6"]
    extra += ["sampling.min_fit_clients=3"]
    plain = simulate(tmp_path / "plain", *extra, "output.checkpoints=false").drop(columns="seconds")
    continued: list[ServerState] = []
    monkeypatch.setattr("simulations.harness.continue_from", _recorded(server.state.continue_from, continued))
    small = simulate(tmp_path / "small", *extra).drop(columns="seconds")
    assert len(continued) == 3 and not any(isinstance(a, np.memmap) for s in continued for a in s.parameters.values())
    continued.clear()
    monkeypatch.setattr(server.state, "MAP_STATE_BYTES", 0)  # every state is mapped
    mapped = simulate(tmp_path / "mapped", *extra).drop(columns="seconds")
    assert len(continued) == 3
    assert all(isinstance(a, np.memmap) for s in continued for a in s.optimizer_state.values() if a.size)
    assert all(isinstance(a, np.memmap) for s in continued for a in s.parameters.values() if a.size)
    pd.testing.assert_frame_equal(plain, small, check_exact=True)
    pd.testing.assert_frame_equal(plain, mapped, check_exact=True)
    assert [p.name for p in (tmp_path / "mapped").iterdir() if p.name.startswith(".")] == [RUN_LOCK]  # no 2nd file


def test_only_a_large_model_has_its_blocks_returned_to_the_os(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """glibc's 1 MiB mmap threshold (return_large_blocks_to_the_os) is set for a model of
    STEP_IN_BACKWARD_MIN_ELEMENTS or more, where it lowers the peak, and not for a smaller one, whose per-step
    blocks it would make fault in again at every step; never for batched clients."""
    import simulations.harness

    calls: list[int] = []
    monkeypatch.setattr(simulations.harness, "return_large_blocks_to_the_os", lambda: calls.append(1))
    short = ["rounds=1", "data.num_clients=4", "sampling.min_fit_clients=2"]
    simulate(tmp_path / "small", *short)  # the 2NN of digits: 64*200 + 200 + 200*200 + 200 + 200*10 + 10 = 55,210
    assert calls == []
    monkeypatch.setattr(simulations.harness, "STEP_IN_BACKWARD_MIN_ELEMENTS", 55_211)
    simulate(tmp_path / "just-small", *short)
    assert calls == []
    monkeypatch.setattr(simulations.harness, "STEP_IN_BACKWARD_MIN_ELEMENTS", 55_210)
    simulate(tmp_path / "large", *short)
    assert calls == [1]
    simulate(tmp_path / "batched", *short, "simulation.backend='batched'")
    assert calls == [1]


def test_a_killed_runs_mapped_round_state_is_removed_from_the_output_dir(tmp_path: Path) -> None:
    """A run killed between writing its round state's file and unlinking it (or while writing it) leaves a hidden
    file of the model's size; the next run in that directory removes it, and nothing else of the user's."""
    out = tmp_path / "out"
    out.mkdir()
    stale = [
        out / ".round-state-r000003-4242.safetensors",
        out / "..round-state-r000003-4242.safetensors.tmp-4242",
    ]
    for path in stale:
        path.write_bytes(b"x" * 100)
    (out / ".keep").write_text("mine")
    (out / ".round-state-backup").mkdir()  # a directory of that name is the user's, and no obstacle
    simulate(out, "rounds=1", "data.num_clients=4", "sampling.min_fit_clients=2")
    assert not any(path.exists() for path in stale)
    assert (out / ".keep").read_text() == "mine" and (out / ".round-state-backup").is_dir()


def test_a_run_keeps_no_round_records_and_leaves_nothing_frozen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each round's row goes to the history as the round ends; the records themselves (an observation per client)
    are not kept for the run's length, where they piled up a thousand objects a round at 1,000 clients a round and
    made every round's collection walk them. The first round's lasting objects are frozen out of the collector
    during the run (after a collection) and unfrozen at its end."""
    import gc

    import server.round_loop
    from server.round_loop import RoundRecord

    live: list[int] = []
    frozen: list[int] = []
    release = server.round_loop.release_memory

    def counting() -> None:
        release()
        live.append(sum(isinstance(o, RoundRecord) for o in gc.get_objects()))
        frozen.append(gc.get_freeze_count())

    monkeypatch.setattr(server.round_loop, "release_memory", counting)
    before = gc.get_freeze_count()
    history = simulate(tmp_path, "rounds=4")
    assert list(history["round"]) == [0, 1, 2, 3, 4]
    assert live == [0, 0, 0, 0]  # with the records kept: [0, 1, 2, 3]
    assert frozen[0] > before and max(frozen[1:]) <= frozen[0]  # frozen once, after the first round (some freed since)
    assert gc.get_freeze_count() == before


def test_what_the_caller_froze_stays_frozen_after_a_run(tmp_path: Path) -> None:
    import gc

    gc.freeze()
    try:
        assert gc.get_freeze_count() > 0
        simulate(tmp_path, "rounds=1")
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


FAILING_ROUND_4 = [  # clients without data (min_partition_size 0): round 4's selection holds only empty ones
    "data.dataset=digits",
    "data.num_clients=100",
    "data.partition=dirichlet",
    "data.alpha=0.001",
    "data.min_partition_size=0",
    "model.name=2nn",
    "sampling.fraction_fit=0.02",
    "rounds=15",
    "evaluate_every=1",
    "output.progress=false",
    "output.plot=false",
    "simulation.threads=1",
]


def test_a_failed_round_keeps_the_last_finished_rounds_model(tmp_path: Path) -> None:
    """Round 4 fails (its clients hold no data): the run raises, and model.safetensors holds round 3's model, bit for
    bit the model of the same run stopped after 3 rounds, beside the history of rounds 0-3."""
    from fedcore.errors import RoundFailed

    lines: list[str] = []
    failing = load_recipe(None, [*FAILING_ROUND_4, f"output.dir={str(tmp_path / 'failed')!r}"])
    with pytest.raises(RoundFailed, match=r"round 4.*sum to 0.*The global model stays at round 3\.$"):
        run_simulation(failing, echo=lines.append)
    assert any("round 3's global model, the last round that finished" in line for line in lines)
    assert list(pd.read_csv(tmp_path / "failed" / "history.csv")["round"]) == [0, 1, 2, 3]
    three = load_recipe(None, [*FAILING_ROUND_4, "rounds=3", f"output.dir={str(tmp_path / 'three')!r}"])
    run_simulation(three, echo=lambda _: None)
    got = decode((tmp_path / "failed" / "model.safetensors").read_bytes())
    want = decode((tmp_path / "three" / "model.safetensors").read_bytes())
    assert set(got) == set(want)
    for name in want:
        assert np.array_equal(got[name], want[name]), name


def test_a_server_step_that_overflows_names_the_server_lr_not_the_clients(tmp_path: Path) -> None:
    config = load_recipe(
        None,
        [*SMALL, "rounds=1", "strategy.name='fedavg'", "strategy.server_lr=1e300", f"output.dir={str(tmp_path)!r}"],
    )
    from fedcore.errors import RoundFailed

    with pytest.raises(RoundFailed) as caught:
        run_simulation(config, echo=lambda _: None)
    message = str(caught.value)
    assert "the server step made the new global model non-finite" in message
    assert "Lower the server learning rate (--server-lr, now 1e+300)" in message
    assert "Check the client's" not in message and "lower the quorum" not in message


def test_rounds_that_went_on_without_clients_are_summed_up_in_one_line() -> None:
    """By hand: rounds 2 and 3 lost clients; round 3 kept 1 update of 10 (share 0.1 < 0.5: a warning)."""
    history = pd.DataFrame({"round": [0, 1, 2, 3, 4], "clients": [0, 10, 7, 1, 10], "failures": [0, 0, 3, 9, 0]})
    assert clients_left_out(history) == (
        "WARNING: 2 of 4 round(s) went on without some of their clients (12 failed or rejected update(s) in all; "
        "the fewest kept: round 3, 1 update(s) kept and 9 failed or rejected); the log gives each reason, "
        "history.csv's failures column the counts"
    )
    mild = history.assign(clients=[0, 10, 7, 8, 10], failures=[0, 0, 3, 2, 0])
    line = clients_left_out(mild)
    assert line is not None and not line.startswith("WARNING") and "round 2, 7 update(s) kept and 3" in line
    assert clients_left_out(history.assign(failures=0)) is None


def test_a_run_whose_updates_overflow_says_so_at_its_end(tmp_path: Path) -> None:
    """Three of ten clients scale their updates by 1e300: float32 overflows to Inf, so each is rejected and every
    round goes on with the other seven; the run's last lines say so."""
    attack = ['attack.kind="scale"', "attack.fraction=0.3", "attack.scale=1e300", "rounds=2"]
    every = ["sampling.fraction_fit=1.0", "sampling.min_fit_clients=10"]
    config = load_recipe(None, [*SMALL, *attack, *every, f"output.dir={str(tmp_path)!r}"])
    lines: list[str] = []
    result = run_simulation(config, echo=lines.append)
    assert list(result.history["failures"]) == [0, 3, 3] and list(result.history["clients"].iloc[1:]) == [7, 7]
    assert (
        "2 of 2 round(s) went on without some of their clients (6 failed or rejected update(s) in all; the fewest "
        "kept: round 1, 7 update(s) kept and 3 failed or rejected)"
    ) in "\n".join(lines)


def test_a_final_model_that_cannot_be_written_says_training_finished_and_how_to_get_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk fills as the final model is written (injected: ENOSPC on model.safetensors alone): the error says
    training finished and that --resume writes the model from the checkpoints, which it then does, bit for bit the
    model of an undisturbed run; without checkpoints it says the model is lost. A plot that cannot be written is a
    warning: the results are there."""
    import errno

    import simulations.harness as harness
    from fedcore.errors import StateError

    original = harness.save_payload

    def full_disk(path: Any, *args: Any, **kwargs: Any) -> Any:
        if Path(path).name == "model.safetensors":
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(path, *args, **kwargs)

    def overrides(out: Path, *extra: str) -> list[str]:
        return [*SMALL, "rounds=2", f"output.dir={str(out)!r}", *extra]

    monkeypatch.setattr(harness, "save_payload", full_disk)
    with pytest.raises(StateError) as caught:
        run_simulation(load_recipe(None, overrides(tmp_path / "full")), echo=lambda _: None)
    assert "training finished after round 2, but its model could not be written to" in str(caught.value)
    assert "No space left on device; its checkpoints hold the model" in str(caught.value)
    assert "--resume (output.resume = true), which writes it without training again" in str(caught.value)
    with pytest.raises(StateError, match=r"kept no checkpoints \(--no-checkpoints\), so the model is lost"):
        run_simulation(load_recipe(None, overrides(tmp_path / "bare", "output.checkpoints=false")), echo=print)
    monkeypatch.setattr(harness, "save_payload", original)

    def no_plot(history: pd.DataFrame, path: Any) -> Path:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(harness, "plot_history", no_plot)
    lines: list[str] = []
    resumed = run_simulation(load_recipe(None, overrides(tmp_path / "full", "output.resume=true")), echo=lines.append)
    assert resumed.final.round == 2 and resumed.plot_path is None
    assert any(line.startswith("WARNING: the plot could not be written to") for line in lines)
    run_simulation(load_recipe(None, overrides(tmp_path / "clean")), echo=lambda _: None)
    got = decode((tmp_path / "full" / "model.safetensors").read_bytes())
    want = decode((tmp_path / "clean" / "model.safetensors").read_bytes())
    assert set(got) == set(want) and all(np.array_equal(got[name], want[name]) for name in want)


@pytest.mark.parametrize("where", ["results", "checkpoints"])
def test_a_history_that_cannot_be_written_mid_run_says_which_round_is_saved_and_resume_goes_on(
    where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk fills as round 2's row goes into a history.csv (injected: ENOSPC; the run's own, or the one beside
    its checkpoints), after the round's checkpoint was written: the error names the file and says --resume goes on,
    which it does, to the model and history of an undisturbed run. Without checkpoints it says the run cannot go
    on."""
    import errno

    import simulations.harness as harness
    from fedcore.errors import StateError

    original = harness.HistoryFile.add
    full = tmp_path / "full" / ("history.csv" if where == "results" else "state/history.csv")

    def full_disk(self: Any, row: Any) -> None:
        if row["round"] == 2 and (self.path.parent.name == "state") == (where == "checkpoints"):
            raise OSError(errno.ENOSPC, "No space left on device")
        original(self, row)

    def overrides(out: Path, *extra: str) -> list[str]:
        return [*SMALL, "rounds=3", f"output.dir={str(out)!r}", *extra]

    monkeypatch.setattr(harness.HistoryFile, "add", full_disk)
    with pytest.raises(StateError) as caught:
        run_simulation(load_recipe(None, overrides(tmp_path / "full")), echo=lambda _: None)
    message = str(caught.value)
    assert f" history {str(full)!r}: [Errno 28] No space left on device" in message
    if where == "results":
        assert "round 2's checkpoint is saved: fix what stops the write (a full disk, or something" in message
        assert "and run the same command with --resume" in message
        with pytest.raises(StateError, match=r"kept no checkpoints \(--no-checkpoints\), so it cannot go on"):
            run_simulation(load_recipe(None, overrides(tmp_path / "bare", "output.checkpoints=false")), echo=print)
    else:
        assert "Round 2 is recorded in" in message and "and run the same command with --resume to go on" in message
    monkeypatch.setattr(harness.HistoryFile, "add", original)
    lines: list[str] = []
    resumed = run_simulation(load_recipe(None, overrides(tmp_path / "full", "output.resume=true")), echo=lines.append)
    assert "resuming after round 2" in "\n".join(lines) and resumed.final.round == 3
    clean = run_simulation(load_recipe(None, overrides(tmp_path / "clean")), echo=lambda _: None)
    got = decode((tmp_path / "full" / "model.safetensors").read_bytes())
    want = decode((tmp_path / "clean" / "model.safetensors").read_bytes())
    assert set(got) == set(want) and all(np.array_equal(got[name], want[name]) for name in want)
    for written in (full.parent / "history.csv", tmp_path / "full" / "history.csv"):
        rows = pd.read_csv(written)
        assert list(rows["round"]) == [0, 1, 2, 3]
        assert np.array_equal(rows["test_loss"], clean.history["test_loss"], equal_nan=True)  # NaN: not evaluated
