"""What a simulation refuses before its first round, and what it leaves behind when it does: an unknown weighting
metric is named with the ones available before any data is loaded or any output written; a recipe whose task fails
to build leaves no output directory; the process and ray backends never start more workers than a round can use."""

from __future__ import annotations

import logging
from pathlib import Path

import pandas as pd
import pytest
import torch

from fedcore.cli import main
from fedcore.errors import ConfigError, RoundFailed
from fedcore.task import EvalResult, FitConfig, TaskContext, TrainContext, TrainResult
from fedcore.training import train_supervised
from simulations.config import load_recipe
from simulations.harness import clients_at_once, run_simulation, worker_count

TINY = "tests.simulations.test_harness:tiny_task"  # a plain SupervisedTask: declares train_loss and accuracy
OWN_LOOP = "tests.simulations.procpool_tasks:tiny_task"  # overrides train (reports pid, times): declares nothing
REGRESSION = "tests.simulations.test_setup_refusals:regression_task"  # declares eval metric mae, no accuracy


class RegressionTask:
    """A user's regression task (the protocol, no SupervisedTask): its evaluate reports a loss and ``mae``."""

    fit_metric_names = ("train_loss",)
    eval_metric_names = ("mae",)

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(40, 3, generator=g)
        self.y = self.x @ torch.tensor([1.0, -2.0, 0.5])

    def build_model(self) -> torch.nn.Module:
        return torch.nn.Linear(3, 1)

    def loss(self, out: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        return torch.nn.functional.mse_loss(out.squeeze(-1), y, reduction=reduction)

    def train(self, model: torch.nn.Module, config: FitConfig, context: TrainContext) -> TrainResult:
        return train_supervised(
            model, self.x, self.y, config, generator=context.generator,
            global_parameters=context.global_parameters, loss_fn=self.loss,
        )  # fmt: skip

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, batch_size: int) -> EvalResult:
        error = model(self.x).squeeze(-1) - self.y
        return EvalResult(loss=float(error.pow(2).mean()), num_examples=len(self.y),
                          metrics={"mae": float(error.abs().mean())})  # fmt: skip


def regression_task(ctx: TaskContext) -> RegressionTask:
    return RegressionTask(ctx.partition_id or 0)


def _simulate(*flags: str) -> list[str]:
    """``fedcore simulate`` of the synthetic recipe's data for one round, with ``flags``."""
    return ["simulate", "--dataset", "synthetic", "--partition", "natural", "--clients", "4", "--model", "logreg",
            "--min-fit-clients", "2", "--rounds", "1", "--no-progress", "--no-plot", *flags]  # fmt: skip


def test_an_unknown_client_metric_is_refused_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    code = main(_simulate("--weighting", "metric", "--weight-metric", "bogus", "--out", str(out)))
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1  # one line
    assert "'bogus' is not a value the clients report with their updates" in err
    assert "weighting 'metric' can use: train_loss (val_loss, val_accuracy with" in err
    assert not out.exists()


@pytest.mark.parametrize(
    ("flags", "refusal"),
    [
        # every client always online: each round selects max(2, floor(0.5 * 4)) = 2 clients, fewer than the median
        # needs to tolerate 1 Byzantine client (3)
        (
            ["--aggregator", "median", "--set", "strategy.byzantine=1", "--fraction-fit", "0.5"],
            "the coordinate-wise median tolerates 1 Byzantine client(s) only with at least 3 clients per round, got "
            "2; select more clients or lower strategy.byzantine",
        ),
        # clients online by a diurnal trace: round 1 has 4 of the 6 online, and selects those 4, fewer than Krum
        # needs for 1 Byzantine client (5). This was checked only with every client always online: with a trace
        # the run wrote its output directory and stopped at the first round with fewer than 5 online
        (
            [
                "--aggregator",
                "krum",
                "--byzantine",
                "1",
                "--min-fit-clients",
                "3",
                "--fraction-fit",
                "1.0",
                "--clients",
                "6",
                "--availability",
                "diurnal",
                "--online-fraction",
                "0.6",
                "--period",
                "4",
            ],
            "krum tolerates 1 Byzantine client(s) only with at least 5 clients per round (n > 2f + 2), got 4; select "
            "more clients or lower strategy.byzantine (a round may select as few as 4 clients: min_fit_clients, "
            "--min-fit-clients)",
        ),
    ],
    ids=["always-online", "diurnal"],
)
def test_a_robust_rule_the_rounds_are_too_small_for_is_refused_before_anything_is_written(
    flags: list[str], refusal: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    code = main(_simulate(*flags, "--out", str(out)))
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip() == f"fedcore: error: {refusal}"
    assert not out.exists()


def test_an_unknown_server_evaluation_value_is_refused_with_the_ones_it_gives(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    # val_accuracy is a client's validation metric, not a value of the server's evaluation
    code = main(_simulate("--weighting", "server", "--weight-metric", "val_accuracy", "--out", str(out)))
    assert code == 2
    assert "weighting 'server' can use: loss, accuracy\n" in capsys.readouterr().err
    assert not out.exists()


def test_validation_metrics_and_simulated_durations_count_where_they_are_reported() -> None:
    base = [f"output.dir='{Path('unused')}'", "data.num_clients=4"]
    with pytest.raises(ConfigError, match="can use: train_loss, simulated_seconds"):  # not wall-clock fit_seconds
        load_recipe(
            None, [*base, "strategy.weighting='metric'", "strategy.weight_metric='x'", "devices.slow_fraction=0.5"]
        )
    config = load_recipe(
        None,
        [*base, "strategy.weighting='metric'", "strategy.weight_metric='val_accuracy'", "train.report_validation=true"],
    )
    assert config.strategy.weight_metric == "val_accuracy"


def _tiny(out: Path, factory: str, *extra: str) -> list[str]:
    fixed = ["data.num_clients=4", "sampling.min_fit_clients=2", "sampling.fraction_fit=0.5", "rounds=1"]
    return [
        f"task.factory='{factory}'",
        *fixed,
        "output.progress=false",
        "output.plot=false",
        f"output.dir={str(out)!r}",
        *extra,
    ]


def test_a_custom_tasks_declared_metrics_are_checked_once_it_is_built(tmp_path: Path) -> None:
    out = tmp_path / "run"
    bad = _tiny(out, TINY, "strategy.weighting='server'", "strategy.weight_metric='f1'")
    with pytest.raises(ConfigError, match=r"'f1' is not a value the server's evaluation gives; .* loss, accuracy$"):
        run_simulation(load_recipe(None, bad), echo=lambda _: None)
    assert not out.exists()
    # what the task does report trains: weighted by each client's validation accuracy (proportional)
    good = _tiny(out, TINY, "strategy.weighting='metric'", "strategy.weight_metric='val_accuracy'",
                 "strategy.weight_transform='proportional'", "train.report_validation=true")  # fmt: skip
    result = run_simulation(load_recipe(None, good), echo=lambda _: None)
    assert list(result.history["clients"]) == [0, 2]


def test_a_task_that_declares_nothing_fails_round_one_saying_what_its_clients_reported(tmp_path: Path) -> None:
    out = tmp_path / "run"
    config = load_recipe(None, _tiny(out, OWN_LOOP, "strategy.weighting='metric'", "strategy.weight_metric='bogus'"))
    with pytest.raises(RoundFailed) as caught:
        run_simulation(config, echo=lambda _: None)
    message = caught.value.message
    # the clients' shared reason once, after who gave it, with what they reported instead
    assert message.count("gave no usable 'bogus'") == 1
    assert (
        "client-00" in message
        and "it reported: ended, fit_seconds, pid, started, train_loss; choose one with --weight-metric" in message
    )


def test_a_task_that_fails_to_build_leaves_no_output_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    code = main(_simulate("--task", "os:getcwd", "--out", str(out)))  # a callable that is no task factory
    assert code == 2
    assert "the task factory 'os:getcwd' raised TypeError" in capsys.readouterr().err
    assert not out.exists()
    assert main(_simulate("--out", str(tmp_path / "file"), "--task", "os:getcwd")) == 2  # refused as before
    (tmp_path / "afile").write_text("x")
    assert main(_simulate("--out", str(tmp_path / "afile"))) == 2
    assert "output.dir (--out)" in capsys.readouterr().err and (tmp_path / "afile").read_text() == "x"


def test_workers_are_capped_at_the_clients_a_round_instructs(caplog: pytest.LogCaptureFixture) -> None:
    def config(*extra: str):  # type: ignore[no-untyped-def]
        return load_recipe(None, ["data.num_clients=10", "sampling.fraction_fit=0.3", "sampling.min_fit_clients=2",
                                  "simulation.backend='process'", *extra])  # fmt: skip

    assert clients_at_once(config()) == 3  # floor(0.3 * 10)
    assert clients_at_once(config("sampling.fraction_evaluate=0.5")) == 5  # evaluation asks 5 at once
    assert clients_at_once(config("sampling.min_fit_clients=10", "sampling.fraction_fit=1.0")) == 10
    with caplog.at_level(logging.WARNING, logger="fedcore.simulation"):
        assert worker_count(config("simulation.workers=2")) == 2
        assert not caplog.records
        assert worker_count(config("simulation.workers=4096")) == 3
    assert [r.getMessage() for r in caplog.records] == [
        "workers = 4096 capped at 3: a round instructs at most 3 of the 10 clients at once, so more worker "
        "processes would never get one"
    ]
    default = worker_count(config())
    assert default is not None and default <= 3  # the default (cores) too


def test_a_client_count_beyond_the_cap_is_refused_not_partitioned(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 10^20 synthetic devices: making the partition ran for minutes before the cap
    assert main(_simulate("--clients", str(10**20), "--out", str(tmp_path / "run"))) == 2
    assert "num_clients must be in 1..1,000,000, got 100000000000000000000" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--dataset", "digits", "--partition", "iid", "--alpha", "0.1"],
            "data.alpha (--alpha) is read only with partition 'dirichlet' or 'dirichlet-client', and this run's "
            "partition is 'iid', which would ignore it; drop it, or choose such a partition",
        ),
        (
            ["--dataset", "synthetic", "--partition", "natural", "--alpha", "0.1"],
            "partition is 'natural', which would ignore it (the Synthetic dataset's heterogeneity is "
            "--synthetic-alpha / --synthetic-beta)",
        ),
        (
            ["--dataset", "digits", "--partition", "dirichlet", "--set", "data.sigma=2"],
            "data.sigma is read only with partition 'quantity', and this run's partition is 'dirichlet'",
        ),
        (
            ["--dataset", "digits", "--partition", "quantity", "--synthetic-beta", "2"],
            "data.synthetic_beta (--synthetic-beta) is read only with dataset 'synthetic', and this run's dataset "
            "is 'digits'",
        ),
        (
            ["--dataset", "shakespeare", "--partition", "natural", "--no-normalize"],
            "data.normalize (--no-normalize) is read only with any dataset but 'shakespeare', and this run's "
            "dataset is 'shakespeare'",
        ),
        (
            ["--dataset", "digits", "--partition", "dirichlet-client", "--shards-per-client", "3"],
            "data.shards_per_client (--shards-per-client) is read only with partition 'shards'",
        ),
        (["--dataset", "digits", "--partition", "iid", "--set", "data={alpha=0.1}"], "data.alpha is read only with"),
        (["--dataset", "digits", "--partition", "iid", "--alpha", "0.1", "--set", "data.alpha=0.2"], "(--alpha) is"),
        (
            ["--dataset", "digits", "--partition", "quantity", "--data-dir", "/nonexistent"],
            "data.data_dir (--data-dir) is read only with dataset 'fashion-mnist' or 'shakespeare', and this run's "
            "dataset is 'digits'",
        ),
    ],
)
def test_a_data_flag_the_partition_or_dataset_would_ignore_is_refused(
    flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A [data] flag (or --set) that the run's partition or dataset does not read would change nothing while the
    user thinks it did: simulate and partition both refuse it in one line, before anything is written."""
    for command in ("simulate", "partition"):
        out = tmp_path / command
        model = ["--model", "char-lstm" if "shakespeare" in flags else "logreg"] if command == "simulate" else []
        assert main([command, "--clients", "4", *flags, *model, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
        assert not out.exists()


def test_a_recipes_own_data_keys_stay_when_a_flag_picks_another_partition(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The pathological recipe sets shards_per_client for its shards; a flag that picks an IID split keeps the
    recipe (its key is the recipe's, not the user's flag) and partitions IID: 6 clients of digits' 1438 training
    samples, 239 or 240 each."""
    recipe = "simulations/recipes/fedavg_pathological.toml"
    out = tmp_path / "report"
    flags = ["--recipe", recipe, "--dataset", "digits", "--clients", "6", "--partition", "iid", "--out", str(out)]
    assert main(["partition", *flags]) == 0
    counts = pd.read_csv(out / "counts.csv", index_col="client")
    assert sorted(set(counts["total"])) == [239, 240] and counts["total"].sum() == 1438


def test_a_users_task_is_handed_data_dir_whatever_the_dataset() -> None:
    """A task factory of the user's own (--task) receives data_dir in its TaskContext: --data-dir is not refused
    for it, while the built-in task's digits would ignore it."""
    from simulations.config import DataConfig, check_given_data_keys

    digits = DataConfig(dataset="digits", partition="iid")
    check_given_data_keys(digits, ["data.data_dir='/somewhere'"], own_task=True)
    with pytest.raises(ConfigError, match=r"data\.data_dir is read only with dataset 'fashion-mnist' or"):
        check_given_data_keys(digits, ["data.data_dir='/somewhere'"])


def test_weighting_by_wall_clock_time_is_refused_in_a_simulation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Weights from each client's wall-clock fit time: two runs of one command ended at accuracy 0.3231 and 0.4123
    with different models, where a simulation gives the same model for the same seed."""
    out = tmp_path / "run"
    code = main(_simulate("--weighting", "metric", "--weight-metric", "fit_seconds", "--out", str(out)))
    err = capsys.readouterr().err
    assert code == 2 and "'fit_seconds' is each client's wall-clock training time" in err
    assert "--weight-metric simulated_seconds with --simulate-time" in err
    assert not out.exists()


@pytest.mark.parametrize(
    ("flags", "refusal"),
    [
        (["--slowdown", "5"], "devices.slowdown (--slowdown) takes effect only with slow clients (--slow-fraction"),
        (["--step-seconds", "5"], "devices.step_seconds (--step-seconds) takes effect only with timed devices"),
        (["--online-fraction", "0.3"], "devices.online_fraction (--online-fraction) takes effect only with a diurnal"),
        (["--period", "4"], "devices.period (--period) takes effect only with a diurnal trace"),
        (["--min-delta", "0.01"], "min_delta (--min-delta) takes effect only with a plateau rule (--patience N)"),
        (["--set", "devices.slowdown=5"], "devices.slowdown takes effect only with slow clients"),
    ],
)
def test_a_flag_the_run_leaves_without_effect_is_refused(
    flags: list[str], refusal: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """These ran with no effect and no word: no simulated_seconds column, no stop rule (the [data] keys were
    already checked this way)."""
    out = tmp_path / "run"
    code = main(_simulate(*flags, "--out", str(out)))
    err = capsys.readouterr().err
    assert code == 2 and refusal in err, err
    assert err.rstrip().endswith("which this run has not; drop it, or add that")
    assert not out.exists()
    # with what it needs, the same flag runs
    enabled = ["--slow-fraction", "0.5", "--availability", "diurnal", "--online-fraction", "0.5", "--patience", "3"]
    assert main(_simulate(*flags, *enabled, "--out", str(out))) == 0


def test_stop_rules_a_regression_tasks_evaluation_could_never_fire_are_refused(tmp_path: Path) -> None:
    out = tmp_path / "run"
    for rule in ("target_accuracy=0.5", "patience=2"):
        with pytest.raises(ConfigError, match=r"'.*:regression_task' \(RegressionTask\) declares that its evaluate "
                           r"reports \['mae'\] \(eval_metric_names\), no 'accuracy'"):  # fmt: skip
            run_simulation(load_recipe(None, _tiny(out, REGRESSION, rule)), echo=lambda _: None)
        assert not out.exists()
    # without a stop rule it trains; with clients that evaluate, theirs might report an accuracy: not refused
    result = run_simulation(load_recipe(None, _tiny(out, REGRESSION, "rounds=2")), echo=lambda _: None)
    assert list(result.history["round"]) == [0, 1, 2] and "test_mae" in result.history
    run_simulation(
        load_recipe(None, _tiny(out, REGRESSION, "patience=2", "sampling.fraction_evaluate=0.5")), echo=lambda _: None
    )
