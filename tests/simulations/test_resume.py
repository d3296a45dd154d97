"""A simulation's checkpoints: a run stopped (or killed) after some rounds and resumed with ``--resume`` ends with
the very history and model of the run never stopped; a resume with another recipe is refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from fedcore.errors import ConfigError, StateError
from fedcore.tensors import decode
from server.state import lock_directory
from simulations.config import load_recipe
from simulations.harness import RUN_STATE_DIR, run_simulation
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
    with pytest.raises(ConfigError, match=r"another recipe \(train\.lr: 0\.1 recorded, 0\.05 now\).*--resume"):
        simulate(out, "rounds=2", "output.resume=true", "train.lr=0.05")
    with pytest.raises(ConfigError, match=r"seed: 0 recorded, 1 now"):
        simulate(out, "rounds=2", "output.resume=true", "seed=1")
    assert (out / "history.csv").read_text() == before
    # rounds, [output] and [simulation] may change
    history = simulate(out, "rounds=2", "output.resume=true", "simulation.backend='batched'", "output.plot=true")
    assert list(history["round"]) == [0, 1, 2]
    assert (out / "history.png").exists()


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
    held = lock_directory(out / RUN_STATE_DIR)  # as the running simulation holds it
    try:
        for extra in ([], ["output.resume=true"]):
            with pytest.raises(StateError, match=r"in use by another simulation \(pid \d+\).*another --out"):
                simulate(out, "rounds=2", *extra)
    finally:
        os.close(held)
    assert list(pd.read_csv(out / "history.csv")["round"]) == [0, 1]
