"""A simulation stops at its target accuracy and says after how many rounds and seconds; its history has the
bytes and update-norm columns and its plot the accuracy against wall time and bytes; noisy labels are drawn
as stated; the quality options are flags of both commands."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from fedcore.cli import server_options, simulate_options
from fedcore.errors import ConfigError
from fedcore.seeding import numpy_rng
from fedcore.strategy import StrategyConfig
from fedcore.supervised import SupervisedTask
from fedcore.task import initial_parameters
from server.config import RoundSettings, ServerConfig, TlsSettings
from simulations.attacks import noisy_labels
from simulations.config import load_recipe
from simulations.harness import (
    VALIDATION_EXAMPLES,
    plot_history,
    run_simulation,
    unplotted,
    validation_evaluation,
)
from simulations.models import MLP2NN

SMALL = [
    "data.dataset=digits",
    "data.num_clients=4",
    "data.partition=iid",
    "model.name=logreg",
    "sampling.min_fit_clients=4",
    "sampling.fraction_fit=1.0",
    "train.batch_size=32",
    "train.lr=0.1",
    "evaluate_every=1",
    "rounds=10",
    "output.progress=false",
    "output.plot=false",
]


def test_a_simulation_stops_at_its_target_and_reports_rounds_and_seconds(tmp_path: Path) -> None:
    lines: list[str] = []
    config = load_recipe(None, [*SMALL, f"output.dir={str(tmp_path)!r}", "target_accuracy=0.8"])
    result = run_simulation(config, echo=lines.append)
    history = result.history
    assert result.stop is not None and result.stop.rule == "target_accuracy"
    last = int(history["round"].iloc[-1])
    assert result.final.round == last == result.stop.round < 10
    accuracy = history["test_accuracy"].to_numpy()
    assert accuracy[-1] >= 0.8 and (accuracy[:-1] < 0.8).all()  # the first round to reach it
    assert result.reached == (last, pytest.approx(history["seconds"].sum()))
    assert any(f"reached at round {last} after" in line for line in lines)
    on_disk = pd.read_csv(tmp_path / "history.csv")
    assert (
        on_disk["stopped_target_accuracy"].iloc[-1] == 1 and on_disk["stopped_target_accuracy"].iloc[:-1].isna().all()
    )
    model_bytes = (64 * 10 + 10) * 4  # logistic regression on 8x8 digits, float32
    assert list(on_disk["bytes_down"]) == [0] + [4 * model_bytes] * last
    assert list(on_disk["bytes_up"]) == [0] + [4 * model_bytes] * last
    assert on_disk["update_norm"].iloc[0] != on_disk["update_norm"].iloc[0]  # NaN: round 0 trains nothing
    assert (on_disk["update_norm"].iloc[1:] > 0).all()
    png = plot_history(on_disk, tmp_path / "history.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_plot_says_what_it_cannot_draw(tmp_path: Path) -> None:
    # a diverged run's infinite losses and a run without test evaluations made panels that looked like a run
    # without trouble: the infinite points left out, or four empty axes without a word
    inf, nan = float("inf"), float("nan")
    diverged = pd.DataFrame(
        {"round": [0, 1, 2, 3], "train_loss": [nan, 1.5, inf, -inf], "test_loss": [2.3, inf, nan, 0.9],
         "test_accuracy": [0.1, 0.1, nan, 0.2], "seconds": [0.1, 0.2, 0.3, 0.4]}
    )  # fmt: skip
    assert unplotted(diverged) == (None, "not finite, not drawn:\ntrain loss in round(s) 2, 3\ntest loss in round(s) 1")
    unevaluated = pd.DataFrame(
        {"round": [1, 2], "train_loss": [1.0, 0.5], "test_loss": [nan, nan], "test_accuracy": [nan, nan],
         "seconds": [0.1, 0.2]}
    )  # fmt: skip
    assert unplotted(unevaluated) == ("no round has a test evaluation", None)
    assert unplotted(unevaluated.assign(test_accuracy=[nan, 0.5], test_loss=[nan, 0.7])) == (None, None)
    # on the image: the same history with the infinite losses absent instead (rounds not trained) draws the same
    # points, and only the note tells them apart
    train_diverged = diverged.assign(test_loss=[2.3, 1.1, nan, 0.9])
    plain = train_diverged.assign(train_loss=[nan, 1.5, nan, nan])
    assert unplotted(plain) == (None, None)
    drawn = [plot_history(h, tmp_path / f"{n}.png").read_bytes() for n, h in (("a", train_diverged), ("b", plain))]
    assert drawn[0] != drawn[1]


def test_symmetric_label_noise_by_hand() -> None:
    y = torch.arange(10).repeat(1000)
    always = noisy_labels(y, 10, 1.0, numpy_rng(0, "label_noise", "c"))
    assert always.dtype == torch.int64 and always.shape == y.shape
    kept = (always == y).float().mean().item()
    assert abs(kept - 0.1) < 0.02  # every label redrawn uniformly: one in ten lands on itself
    some = noisy_labels(y, 10, 0.3, numpy_rng(0, "label_noise", "c"))
    assert abs((some != y).float().mean().item() - 0.3 * 0.9) < 0.02  # P(changed) = rate * (1 - 1/C)
    again = noisy_labels(y, 10, 0.3, numpy_rng(0, "label_noise", "c"))
    assert torch.equal(some, again)  # drawn from (seed, client): the same for the same seed
    assert np.bincount(always.numpy(), minlength=10).min() > 800  # uniform over the classes


def test_the_options_are_flags_of_both_commands_and_server_weighting_needs_a_task() -> None:
    flags = {o.flag for o in simulate_options()}
    assert {"--target-accuracy", "--patience", "--min-delta", "--weighting", "--weight-temperature"} <= flags
    flags = {o.flag for o in server_options()}
    assert {"--target-accuracy", "--patience", "--min-delta", "--weighting", "--weight-metric"} <= flags
    with pytest.raises(ConfigError, match="weighting 'server'"):
        ServerConfig(
            initial=Path("model.safetensors"),
            tls=TlsSettings(insecure=True),
            strategy=StrategyConfig(weighting="server"),
        )
    with pytest.raises(ConfigError, match="target_accuracy"):
        load_recipe(None, ["target_accuracy=1.5"])
    # a stop rule in a run that evaluates nothing would never fire: refused by both commands' configs
    with pytest.raises(ConfigError, match=r"patience reads .*\(drop --no-server-evaluation\)"):
        load_recipe(None, ["patience=2", "task.server_evaluation=false"])
    assert load_recipe(None, ["patience=2", "task.server_evaluation=false", "sampling.fraction_evaluate=0.5"])
    with pytest.raises(ConfigError, match=r"target_accuracy reads .* without --no-evaluate"):
        ServerConfig(
            task="simulations.tasks:demo_task",
            tls=TlsSettings(insecure=True),
            round=RoundSettings(evaluate=False, target_accuracy=0.9),
        )
    with pytest.raises(ConfigError, match="target_accuracy reads"):  # an initial model alone: nothing to evaluate
        ServerConfig(
            initial=Path("model.safetensors"), tls=TlsSettings(insecure=True), round=RoundSettings(target_accuracy=0.9)
        )


def test_the_simulations_validation_data_is_a_seeded_subset_of_the_test_split() -> None:
    def model_fn() -> torch.nn.Module:
        return MLP2NN(num_inputs=4, num_classes=3, hidden=8)

    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(1500, 4, generator=generator), torch.randint(0, 3, (1500,), generator=generator)
    task = SupervisedTask(model_fn=model_fn, train_data=None, test_data=(x, y))
    parameters = initial_parameters(model_fn, 0)
    first = validation_evaluation(task, 256, seed=1)(parameters, 1)
    assert first.num_examples == VALIDATION_EXAMPLES == 1000
    assert validation_evaluation(task, 256, seed=1)(parameters, 1) == first  # the same examples for the same seed
    assert validation_evaluation(task, 256, seed=2)(parameters, 1).loss != first.loss  # others for another seed
    small = SupervisedTask(model_fn=model_fn, train_data=None, test_data=(x[:300], y[:300]))
    assert validation_evaluation(small, 256, seed=1)(parameters, 1).num_examples == 300  # the whole split


def test_the_console_table_keeps_its_columns_for_a_diverging_loss() -> None:
    from simulations.harness import _format_row

    # 2.79e30 printed with 4 decimals took 36 characters and pushed every later column out of line
    row = {"round": 1, "clients": 2, "train_loss": 2.793103e30, "test_loss": -1.5e12, "test_accuracy": 0.9164,
           "seconds": 0.7122}  # fmt: skip
    assert _format_row(row) == ("         1          2  2.793e+30 -1.500e+12     0.9164     0.7122")
    assert _format_row({"round": 0, "train_loss": 12345.6789, "test_loss": float("nan")}).split() == [
        "0", "-", "12345.6789", "-", "-", "-"
    ]  # fmt: skip
