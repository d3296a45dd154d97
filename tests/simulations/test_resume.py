"""A simulation's checkpoints: a run stopped (or killed) after some rounds and resumed with ``--resume`` ends with
the very history and model of the run never stopped; a resume with another recipe is refused."""

from __future__ import annotations

import io
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from fedcore.errors import ConfigError, RoundFailed, StateError
from fedcore.tensors import decode
from server.state import load_checkpoint
from simulations.config import load_recipe
from simulations.harness import RUN_LOCK, RUN_STATE_DIR, client_ids, lock_output, run_simulation
from tests.simulations import test_harness

SMALL = [
    *test_harness.SMALL,
    "evaluate_every=1",  # every round evaluated: a run's last round is, whether or not it is stopped there
    "output.plot=false",
]


def simulate(out: Path, *extra: str, lines: list[str] | None = None) -> pd.DataFrame:
    config = load_recipe(None, [*SMALL, f"output.dir={str(out)!r}", *extra])
    return run_simulation(config, echo=(lambda _: None) if lines is None else lines.append).history


def model(out: Path) -> dict[str, np.ndarray]:
    return decode((out / "model.safetensors").read_bytes())


def assert_same_run(a: Path, b: Path) -> None:
    """The same history (but the wall time) and the same final model, bit for bit."""
    history_a = pd.read_csv(a / "history.csv").drop(columns="seconds")
    history_b = pd.read_csv(b / "history.csv").drop(columns="seconds")
    pd.testing.assert_frame_equal(history_a, history_b, check_exact=True)
    model_a, model_b = model(a), model(b)
    assert set(model_a) == set(model_b)
    for name in model_a:
        assert np.array_equal(model_a[name], model_b[name]), name


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe",
    [
        # the server optimizer's momentum, learned client selection (losses and durations)
        ["strategy.name='fedavgm'", "strategy.server_momentum=0.9", "strategy.selection='oort'"],
        # the server's control variate (a tensor group) and every client's own, kept in output.dir/client-state
        ["strategy.name='scaffold'", "strategy.server_lr=1.0", "strategy.weighting='uniform'", "train.lr=0.05"],
        # batched clients, FedAdam's two moments
        ["strategy.name='fedadam'", "strategy.server_lr=0.01", "simulation.backend='batched'"],
    ],  # (not DP: its noise comes from the OS's entropy, so no DP run repeats, resumed or not)
    ids=["fedavgm-oort", "scaffold", "fedadam-batched"],
)
def test_a_run_resumed_after_it_stopped_is_the_run_never_stopped(tmp_path: Path, recipe: list[str]) -> None:
    simulate(tmp_path / "whole", *recipe, "rounds=5")
    simulate(tmp_path / "resumed", *recipe, "rounds=2")
    lines: list[str] = []
    history = simulate(tmp_path / "resumed", *recipe, "rounds=5", "output.resume=true", lines=lines)
    assert f"resuming after round 2 from {tmp_path / 'resumed' / RUN_STATE_DIR}" in lines
    assert list(history["round"]) == [0, 1, 2, 3, 4, 5]  # the rounds before the resume are in the result too
    assert_same_run(tmp_path / "whole", tmp_path / "resumed")
    if "scaffold" in recipe[0]:
        assert any((tmp_path / "resumed" / "client-state").iterdir())  # kept across the resume


@pytest.mark.slow
def test_a_lost_round_whose_clients_kept_state_runs_again_as_it_first_ran(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SCAFFOLD's clients write their control variates as round 4 trains; round 4's checkpoint is then lost (a
    kill before it was written, or a damaged file): the resumed run marks round 4's record superseded and trains
    it again, the clients from the variates they had before it (the mod keeps them, see
    :func:`fedcore.algorithms.scaffold._control_before`), and ends as the run never stopped."""
    scaffold = ["strategy.name='scaffold'", "strategy.server_lr=1.0", "strategy.weighting='uniform'", "train.lr=0.05"]
    simulate(tmp_path / "whole", *scaffold, "rounds=5")
    lost = tmp_path / "lost"
    simulate(lost, *scaffold, "rounds=4")
    (lost / RUN_STATE_DIR / "checkpoints" / "round-000004.safetensors").unlink()
    with caplog.at_level("WARNING"):
        simulate(lost, *scaffold, "rounds=5", "output.resume=true")
    assert "the newest intact checkpoint is of round 3 but state.db recorded round 4" in caplog.text
    assert_same_run(tmp_path / "whole", lost)


@pytest.mark.slow
def test_a_killed_run_resumes_to_the_same_model(tmp_path: Path) -> None:
    """``fedcore simulate`` killed with SIGKILL in the middle of its rounds (once a few checkpoints exist), then run
    again with ``--resume``: the history and model of the run never killed."""
    args = [
        "--dataset", "digits", "--clients", "10", "--model", "2nn", "--rounds", "40", "--min-fit-clients", "5",
        "--strategy", "fedavgm", "--seed", "3", "--no-progress",
        "--set", "data.min_partition_size=5", "--set", "evaluate_every=1", "--set", "output.plot=false",
        "--set", "sampling.fraction_fit=0.5", "--set", "train.batch_size=16",
    ]  # fmt: skip
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    command = [sys.executable, "-m", "fedcore.cli", "simulate", *args]
    done = subprocess.run([*command, "--out", str(whole)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    proc = subprocess.Popen([*command, "--out", str(killed)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    checkpoints = killed / RUN_STATE_DIR / "checkpoints"
    deadline = time.monotonic() + 240
    while not list(checkpoints.glob("round-00000[3-9].safetensors")) and proc.poll() is None:
        assert time.monotonic() < deadline, "no checkpoint of round 3 within 240 s"
        time.sleep(0.005)
    # a second simulation into the output.dir of the running one is refused, with checkpoints or without, and
    # changes nothing there (the running one goes on to be killed below)
    for extra in (["output.checkpoints=false"], [], ["output.resume=true"]):
        with pytest.raises(StateError, match=rf"in use by another simulation \(pid {proc.pid}\).*another --out"):
            simulate(killed, "rounds=1", *extra)
    assert proc.poll() is None, "the run ended before it could be killed; give it more rounds"
    assert (killed / RUN_STATE_DIR / "state.db").exists()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed; give it more rounds"
    assert not (killed / "model.safetensors").exists()
    resumed = subprocess.run([*command, "--out", str(killed), "--resume"], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming after round " in resumed.stdout
    assert_same_run(whole, killed)


def test_resume_with_another_recipe_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "run"
    simulate(out, "rounds=1")
    before = (out / "history.csv").read_text()
    recorded = out / "config.json"
    with pytest.raises(ConfigError, match=r"another recipe \(train\.lr: 0\.1 recorded, 0\.05 now\).*--resume"):
        simulate(out, "rounds=2", "output.resume=true", "train.lr=0.05")
    with pytest.raises(
        ConfigError, match=rf"seed: 0 recorded, 1 now.* \(--recipe {re.escape(str(recorded))} --resume;"
    ):
        simulate(out, "rounds=2", "output.resume=true", "seed=1")
    assert (out / "history.csv").read_text() == before
    # what the refusal says to do is a resume (the recorded recipe is the run's config.json)
    again = tmp_path / "again"
    shutil.copytree(out, again)
    resumed = load_recipe(again / "config.json", ["rounds=2", "output.resume=true", f"output.dir={str(again)!r}"])
    assert resumed == load_recipe(None, [*SMALL, f"output.dir={str(again)!r}", "rounds=2", "output.resume=true"])
    lines: list[str] = []
    assert list(run_simulation(resumed, echo=lines.append).history["round"]) == [0, 1, 2]
    assert any(line.startswith("resuming after round 1") for line in lines), lines
    # rounds, [output] and [simulation] may change
    history = simulate(out, "rounds=2", "output.resume=true", "simulation.backend='batched'", "output.plot=true")
    assert list(history["round"]) == [0, 1, 2]
    assert (out / "history.png").exists()


def test_resume_with_checkpoints_but_no_state_db_is_refused_and_removes_nothing(tmp_path: Path) -> None:
    """Checkpoints without the records of state.db cannot be resumed; starting afresh would delete them, so
    --resume refuses and says what to do (as it does for an empty state.db)."""
    out = tmp_path / "run"
    simulate(out, "rounds=2")
    (out / RUN_STATE_DIR / "state.db").unlink()
    kept = sorted(p.name for p in (out / RUN_STATE_DIR / "checkpoints").iterdir())
    with pytest.raises(ConfigError, match=r"checkpoints \(round-000002\.safetensors the newest\) are there but not "
                       r"state/state\.db.*run without --resume to start afresh"):  # fmt: skip
        simulate(out, "rounds=3", "output.resume=true")
    assert sorted(p.name for p in (out / RUN_STATE_DIR / "checkpoints").iterdir()) == kept


def test_resume_says_when_the_clients_own_state_is_gone(tmp_path: Path) -> None:
    """SCAFFOLD's clients keep their control variates in client-state/: resumed without it, the run goes on (the
    clients start from none) and says that it will differ from the run never stopped; with it, nothing is said."""
    out = tmp_path / "run"
    scaffold = ["strategy.name='scaffold'", "strategy.server_lr=1.0", "train.lr=0.05"]
    simulate(out, "rounds=1", *scaffold)
    lines: list[str] = []
    simulate(out, "rounds=2", "output.resume=true", *scaffold, lines=lines)
    assert not any("client-state" in line for line in lines)
    shutil.rmtree(out / "client-state")
    simulate(out, "rounds=3", "output.resume=true", *scaffold, lines=lines)
    assert any("client-state is missing or empty" in line and "will differ" in line for line in lines), lines


def test_resume_without_checkpoints_starts_a_new_run_and_says_so(tmp_path: Path) -> None:
    lines: list[str] = []
    history = simulate(tmp_path / "new", "rounds=1", "output.resume=true", lines=lines)
    assert list(history["round"]) == [0, 1]
    assert any("nothing to resume in" in line and "starting a new run" in line for line in lines)
    with pytest.raises(ConfigError, match=r"output\.resume goes on from the run's checkpoints.*--no-checkpoints"):
        load_recipe(None, ["output.resume=true", "output.checkpoints=false"])


def test_no_checkpoints_leaves_no_state_and_a_new_run_clears_the_old_ones(tmp_path: Path) -> None:
    out = tmp_path / "run"
    simulate(out, "rounds=2")
    assert sorted(p.name for p in (out / RUN_STATE_DIR / "checkpoints").iterdir()) == [
        "round-000001.safetensors",
        "round-000002.safetensors",
    ]
    simulate(out, "rounds=1", "output.checkpoints=false")  # a new run: the old run's checkpoints go
    assert not (out / RUN_STATE_DIR).exists()
    assert list(pd.read_csv(out / "history.csv")["round"]) == [0, 1]


def test_a_second_simulation_into_a_running_ones_output_dir_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "run"
    simulate(out, "rounds=1")
    held = lock_output(out)  # as the running simulation holds it (a real one: test_a_killed_run_resumes_...)
    try:
        for extra in ([], ["output.resume=true"], ["output.checkpoints=false"]):
            with pytest.raises(StateError, match=r"output\.dir .* is in use by another simulation \(pid \d+\)"):
                simulate(out, "rounds=2", *extra)
    finally:
        os.close(held)
    assert list(pd.read_csv(out / "history.csv")["round"]) == [0, 1]
    simulate(out, "rounds=1", "output.checkpoints=false")  # once it has ended, the directory is free again
    os.close(lock_output(out))  # ... and so when the run has ended


def test_resume_with_fewer_rounds_than_finished_is_refused_and_the_same_count_rewrites_the_results(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    simulate(out, "rounds=2")
    recipe, history, weights = (out / "config.json").read_text(), (out / "history.csv").read_text(), model(out)
    with pytest.raises(ConfigError, match=r"with rounds = 1: it has finished 2 rounds already.*rounds >= 2"):
        simulate(out, "rounds=1", "output.resume=true")
    assert (out / "config.json").read_text() == recipe  # the recorded recipe still says 2 rounds
    assert (out / "history.csv").read_text() == history
    lines: list[str] = []
    again = simulate(out, "rounds=2", "output.resume=true", lines=lines)  # nothing to train: the results again
    assert "resuming after round 2 from " + str(out / RUN_STATE_DIR) in lines
    assert list(again["round"]) == [0, 1, 2]
    pd.testing.assert_frame_equal(
        pd.read_csv(out / "history.csv").drop(columns="seconds"),
        pd.read_csv(io.StringIO(history)).drop(columns="seconds"),
        check_exact=True,
    )
    assert all(np.array_equal(weights[name], array) for name, array in model(out).items())


def _without_start_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """The median without its start check, as an aggregator of the user's own that has none: a round too small
    for it then fails on the recipe in the middle of the run (fedcore's median refuses min_fit_clients = 3 for
    byzantine = 3 before anything is written)."""
    from fedcore.aggregation import MedianAggregator

    monkeypatch.setattr(MedianAggregator, "preflight", lambda self, smallest, spec: None)


def test_a_round_that_fails_on_the_recipe_does_not_advise_a_plain_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The coordinate-wise median with byzantine = 3 needs 7 clients a round: round 1 has all 10, round 2 only the
    5 online (a csv trace), and fails on the recipe, which a plain --resume would fail on again."""
    _without_start_check(monkeypatch)
    trace = tmp_path / "online.csv"
    trace.write_text("client,from_round,to_round\n" + "".join(f"{cid},1,1\n" for cid in client_ids(10)[5:]))
    median = [
        "sampling.fraction_fit=1.0",
        "sampling.min_fit_clients=3",
        "strategy.aggregator='median'",
        "strategy.byzantine=3",
        "devices.availability='csv'",
        f"devices.availability_file={str(trace)!r}",
    ]
    lines: list[str]
    out, lines = tmp_path / "run", []
    with pytest.raises(ConfigError, match=r"^\[round 2\] the coordinate-wise median tolerates 3 .* got 5"):
        simulate(out, "rounds=3", *median, lines=lines)
    assert any("the error is in the recipe" in line and "[simulation]" in line for line in lines)
    assert not any(line.startswith("checkpoints kept: run the same command") for line in lines)
    assert list(pd.read_csv(out / "history.csv")["round"]) == [0, 1]  # round 1's row and model stay


def test_a_resumed_run_whose_first_round_fails_keeps_its_model_and_says_how_to_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Clients 1-9 are online in rounds 1-2 only (a csv trace): round 3 finds 1 of the 2 clients it needs and
    fails, in the run resumed after round 2, before it finished a round of its own. (A simulation counts a trace's
    online clients ahead and refuses such a recipe at start; that check is taken away here, so that the round
    stands for any failure not known ahead, such as every update refused.)"""
    from simulations import harness

    monkeypatch.setattr(harness, "check_online_counts", lambda *args: None)
    trace = tmp_path / "online.csv"
    trace.write_text("client,from_round,to_round\n" + "".join(f"{cid},1,2\n" for cid in client_ids(10)[1:]))
    recipe = ["sampling.min_fit_clients=2", "devices.availability='csv'", f"devices.availability_file={str(trace)!r}"]
    out = tmp_path / "run"
    simulate(out, *recipe, "rounds=2")
    round_2 = model(out)
    lines: list[str] = []
    with pytest.raises(RoundFailed, match=r"^\[round 3\] only 1 of 10 clients are online"):
        simulate(out, *recipe, "rounds=4", "output.resume=true", lines=lines)
    assert any(line.startswith("checkpoints kept: run the same command with --resume") for line in lines)
    assert load_checkpoint(str(out / "model.safetensors")).round == 2  # the resumed run's model is not lost
    assert all(np.array_equal(round_2[name], array) for name, array in model(out).items())
    assert list(pd.read_csv(out / "history.csv")["round"]) == [0, 1, 2]


def test_resume_of_a_run_with_no_finished_round_starts_anew_whatever_its_recipe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _without_start_check(monkeypatch)
    out = tmp_path / "run"
    trace = tmp_path / "online.csv"  # round 1 fails: 5 clients online, the median with byzantine = 3 needs 7
    trace.write_text("client,from_round,to_round\n" + "".join(f"{cid},2,9\n" for cid in client_ids(10)[5:]))
    failing = ["strategy.aggregator='median'", "strategy.byzantine=3", "sampling.fraction_fit=1.0",
               "devices.availability='csv'", f"devices.availability_file={str(trace)!r}"]  # fmt: skip
    lines: list[str] = []
    with pytest.raises(ConfigError, match="at least 7"):
        simulate(out, "rounds=2", *failing, lines=lines)
    assert not any("checkpoints kept" in line or "--resume" in line for line in lines)  # none to go on from
    assert (out / RUN_STATE_DIR / "state.db").exists()
    lines.clear()
    history = simulate(out, "rounds=2", "output.resume=true", "train.lr=0.05", lines=lines)  # another recipe
    assert any("nothing to resume" in line and "starting a new run" in line for line in lines)
    assert list(history["round"]) == [0, 1, 2]


def test_a_file_in_the_way_of_the_checkpoints_or_the_lock_is_refused_in_words(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / RUN_STATE_DIR).write_text("notes")
    with pytest.raises(ConfigError, match=r"is a file, where this simulation keeps its checkpoints; move it"):
        simulate(out, "rounds=1")
    assert (out / RUN_STATE_DIR).read_text() == "notes"  # not removed
    dangling = tmp_path / "dangling"
    (dangling / RUN_STATE_DIR).parent.mkdir()
    (dangling / RUN_STATE_DIR).symlink_to(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match=r"is a symbolic link to nothing, where this simulation keeps its"):
        simulate(dangling, "rounds=1")
    # nor does a run without checkpoints take it: it is no simulation's, under a name a run replaces
    with pytest.raises(ConfigError, match=r"holds 'state', which no fedcore simulation wrote there"):
        simulate(out, "rounds=1", "output.checkpoints=false")
    assert (out / RUN_STATE_DIR).read_text() == "notes"
    (out / RUN_STATE_DIR).unlink()
    history = simulate(out, "rounds=1", "output.checkpoints=false")
    assert list(history["round"]) == [0, 1]
    (out / RUN_LOCK).unlink()
    (out / RUN_LOCK).mkdir()
    with pytest.raises(ConfigError, match=r"output\.dir .*: its lock file .* cannot be opened .*move what is in"):
        simulate(out, "rounds=1")
    (out / RUN_LOCK).rmdir()
    os.mkfifo(out / RUN_LOCK)
    with pytest.raises(ConfigError, match=r"its lock file .* cannot be written .*must be a plain file"):
        simulate(out, "rounds=1")
    (out / RUN_LOCK).unlink()
    precious = tmp_path / "precious.txt"
    precious.write_text("mine")
    (out / RUN_LOCK).symlink_to(precious)  # never followed: its target is not overwritten with a pid
    with pytest.raises(ConfigError, match=r"its lock file .* cannot be opened"):
        simulate(out, "rounds=1")
    assert precious.read_text() == "mine"
    assert list(pd.read_csv(out / "history.csv")["round"]) == [0, 1]  # the run before all this is intact


def test_a_round_whose_checkpoint_cannot_be_written_is_not_in_the_history(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Round 2's checkpoint fails (the disk full, as the OS would say it): the run stops with that error, its
    history.csv and model.safetensors end at round 1, the last round saved, and --resume then ends as the run
    never stopped."""
    from server.state import StateStore

    save = StateStore.save_checkpoint

    def disk_full_at_round_2(self: StateStore, state: object, record: object) -> Path:
        if getattr(record, "round", None) == 2:
            raise StateError("cannot write the checkpoint of round 2: [Errno 28] No space left on device")
        return save(self, state, record)  # type: ignore[arg-type]

    monkeypatch.setattr(StateStore, "save_checkpoint", disk_full_at_round_2)
    with pytest.raises(StateError, match="No space left on device"):
        simulate(tmp_path / "full", "rounds=3")
    assert list(pd.read_csv(tmp_path / "full" / "history.csv")["round"]) == [0, 1]
    from fedcore.payload import open_safetensors

    assert open_safetensors(tmp_path / "full" / "model.safetensors")[1]["round"] == "1"
    monkeypatch.setattr(StateStore, "save_checkpoint", save)
    simulate(tmp_path / "full", "rounds=3", "output.resume=true")
    simulate(tmp_path / "never", "rounds=3")
    assert_same_run(tmp_path / "full", tmp_path / "never")


def test_a_resume_checks_the_trace_files_contents_not_its_path(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An edited availability file at the same path was resumed without a word, the history a mix of two traces;
    the same file by another path was refused. Now the contents count: the same bytes elsewhere resume, and the
    same path with other contents is refused before any round."""
    ids = client_ids(10)
    rows = "".join(f"{cid},1,9\n" for cid in ids[:6])
    trace = tmp_path / "online.csv"
    trace.write_text("client,from_round,to_round\n" + rows)
    recipe = ["devices.availability='csv'", "sampling.min_fit_clients=2"]
    out = tmp_path / "run"
    simulate(out, *recipe, f"devices.availability_file={str(trace)!r}", "rounds=2")
    moved = tmp_path / "elsewhere" / "trace.csv"
    moved.parent.mkdir()
    moved.write_bytes(trace.read_bytes())
    history = simulate(out, *recipe, f"devices.availability_file={str(moved)!r}", "rounds=3", "output.resume=true")
    assert list(history["round"]) == [0, 1, 2, 3]
    trace.write_text("client,from_round,to_round\n" + "".join(f"{cid},5,9\n" for cid in ids[:6]))
    with pytest.raises(ConfigError, match=r"availability trace file .* holds other contents than the one this run"):
        simulate(out, *recipe, f"devices.availability_file={str(trace)!r}", "rounds=4", "output.resume=true")
    assert list(pd.read_csv(out / "history.csv")["round"]) == [0, 1, 2, 3]
    # a run of an earlier fedcore recorded no contents: taken with a warning, and recorded from then on
    import sqlite3

    with sqlite3.connect(out / RUN_STATE_DIR / "state.db") as db:
        db.execute("DELETE FROM meta WHERE key = 'trace'")
    db.close()
    with caplog.at_level(logging.WARNING, logger="fedcore.server"):
        simulate(out, *recipe, f"devices.availability_file={str(trace)!r}", "rounds=4", "output.resume=true")
    assert "recorded no availability trace contents (an earlier fedcore's run)" in caplog.text
