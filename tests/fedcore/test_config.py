"""Config loading: TOML recipes, overrides, validation with clear errors before a run starts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fedcore.config import apply_overrides, from_mapping, to_mapping
from fedcore.errors import ConfigError
from fedcore.task import FitConfig
from simulations.config import SimulationConfig, load_recipe

RECIPES = Path(__file__).resolve().parents[2] / "simulations" / "recipes"


@pytest.mark.parametrize("recipe", sorted(RECIPES.glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_recipe_loads(recipe: Path) -> None:
    config = load_recipe(recipe)
    assert config.rounds >= 1


def test_default_recipe_file_equals_the_builtin_defaults() -> None:
    assert load_recipe(RECIPES / "default.toml") == load_recipe(None)


def test_defaults_match_the_issue() -> None:
    config = load_recipe(None)
    assert (config.data.dataset, config.data.num_clients, config.data.partition, config.data.alpha) == (
        "fashion-mnist",
        100,
        "dirichlet",
        0.5,
    )
    assert config.model.name == "cnn"
    assert config.sampling.num_fit(config.data.num_clients) == 10


def test_overrides_are_typed_and_do_not_mutate_the_input() -> None:
    base = {"train": {"lr": 0.1}}
    out = apply_overrides(base, ["train.lr=0.5", "rounds=3", "data.dataset=mnist-5k", "output.progress=false"])
    assert base == {"train": {"lr": 0.1}}
    config = from_mapping(SimulationConfig, out)
    assert config.train.lr == 0.5 and config.rounds == 3 and config.data.dataset == "mnist-5k"
    assert config.output.progress is False


def test_a_table_given_whole_is_laid_over_the_recipes_table() -> None:
    """``--set 'data={alpha=0.1}'`` sets data.alpha and keeps data's other keys (the flags before it among them),
    as ``data.alpha=0.1`` does; before, it replaced the whole table, and the run silently went back to the default
    dataset, clients and partition. A value that is not a table still replaces."""
    base = {"data": {"dataset": "digits", "num_clients": 10, "partition": "dirichlet"}, "train": {"lr": 0.1}}
    out = apply_overrides(base, ["data={alpha=0.1, partition='iid'}", "train=3"])
    assert out == {"data": {"dataset": "digits", "num_clients": 10, "partition": "iid", "alpha": 0.1}, "train": 3}
    assert out == apply_overrides(base, ["data.alpha=0.1", "data.partition='iid'", "train=3"])
    assert base["data"] == {"dataset": "digits", "num_clients": 10, "partition": "dirichlet"}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.lr=-1"], "lr must be > 0"),
        (["train.bogus=1"], "unknown key.*'bogus'.*known keys: batch_size"),
        (["backend='batched'"], r"unknown key.*'backend' in \[top level\].*; 'backend' belongs in \[simulation\]"),
        (["lr=0.1", "kind='x'"], r"'kind' belongs in \[attack\]; 'lr' belongs in \[train\]$"),
        (["rounds=abc"], "rounds: expected an integer"),
        (["strategy.name=fedmagic"], "unknown strategy 'fedmagic'"),
        (["data.alpha=0"], "alpha must be a finite number >= 1e-300"),
        (["data.alpha=inf"], "alpha must be a finite number >= 1e-300"),
        (["data.alpha=5e-324"], r"alpha must be a finite number >= 1e-300 \(a smaller one underflows"),
        (["train.lr=inf"], "lr must be a finite number"),
        (["train.lr=1e300"], r"lr must be within float32.s range \(at most 3.403e\+38\), got 1e\+300"),
        (["train.mu=nan"], "mu must be a finite number"),
        (["output.dir=''"], "output.dir is empty"),
        # TOML reads an unquoted 2024 or true as a number or a boolean: the refusal says how to give the string
        (["output.dir=2024"], r"output.dir: expected a path, got 2024 \(.* in quotes: --set \"output.dir='...'\"\)$"),
        (["data.dataset=true"], r"data.dataset: expected a string, got True \(.* in quotes: --set \"data.dataset="),
        (["data.sigma=1000"], r"sigma must be in \[0, 50\]"),
        (["data.sigma=-0.5"], r"sigma must be in \[0, 50\] \(lognormal shape of client sizes; 0 gives equal"),
        (["rounds=99999999999999"], r"rounds must be in 1\.\.1000000"),
        (["data.max_redraws=100000000"], "max_redraws must be in 1..10000"),
        (["data.dataset=synthetic"], "partition = 'natural'"),
        (["sampling.fraction_fit=1.5"], r"fraction_fit must be in \(0, 1\]"),
        (
            ["sampling.min_fit_clients=500"],
            "^sampling.min_fit_clients=500 exceeds data.num_clients=100: no round could select",
        ),
        (
            ["sampling.fraction_evaluate=0.5", "sampling.min_evaluate_clients=101"],
            "min_evaluate_clients=101 exceeds data.num_clients=100: no round could evaluate",
        ),
        (["novalue"], "must look like section.key=value"),
        (["strategy.server_lr=inf"], r"server_lr \(--server-lr\) must be a finite number > 0"),
        (["strategy.name='fedadam'", "strategy.tau=0"], r"tau \(--tau\) must be a finite number > 0"),
        (["strategy.name='fedadam'", "strategy.beta1=nan"], r"beta1 \(--beta1\) must be a finite number >= 0"),
        (["strategy.server_momentum=1.5"], r"server_momentum \(--server-momentum\) must be .* < 1"),
    ],
)
def test_invalid_values_raise_a_clear_config_error(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_recipe(None, overrides)


def test_bad_toml_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("rounds = = 3\n")
    with pytest.raises(ConfigError, match=r"bad\.toml.*not valid TOML"):
        load_recipe(bad)
    binary = tmp_path / "binary.toml"
    binary.write_bytes(bytes(range(256)))
    with pytest.raises(ConfigError, match=r"binary\.toml.*not valid TOML"):
        load_recipe(binary)
    with pytest.raises(ConfigError, match=r"is a directory; give the path of a \.toml file"):
        load_recipe(tmp_path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_recipe(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match=r"'/dev/zero' is not a regular file"):  # read to its end: never
        load_recipe(Path("/dev/zero"))
    os.mkfifo(tmp_path / "pipe.toml")  # opening it would wait for a writer
    with pytest.raises(ConfigError, match=r"pipe\.toml' is not a regular file"):
        load_recipe(tmp_path / "pipe.toml")
    bom = tmp_path / "bom.toml"  # UTF-8 with a byte-order mark, as some Windows editors save it
    bom.write_bytes(b"\xef\xbb\xbfrounds = 3\n")
    assert load_recipe(bom).rounds == 3


def test_round_trip_through_a_mapping() -> None:
    config = load_recipe(None, ["train.mu=0.01", "strategy.name=fedprox"])
    assert from_mapping(SimulationConfig, to_mapping(config)) == config


def test_fit_config_validates_on_construction() -> None:
    with pytest.raises(ConfigError, match="batch_size must be >= 1"):
        FitConfig(batch_size=0)
    with pytest.raises(ConfigError, match="mu"):
        FitConfig(mu=-0.1)


@pytest.mark.parametrize(
    ("overrides", "name", "momentum", "server_lr", "aggregator"),
    [
        (["strategy.server_lr=0.5"], "fedavgm", 0.7, 0.5, "mean"),  # --server-lr alone keeps the default FedAvgM
        (["strategy.aggregator=trimmed_mean"], "fedavgm", 0.7, 1.0, "trimmed_mean"),
        (["strategy.name=fedavgm"], "fedavgm", 0.7, 1.0, "mean"),  # the default's own kind: its momentum stays
        (["strategy.server_momentum=0.9"], "fedavgm", 0.9, 1.0, "mean"),
        (["strategy.name=fedadam", "strategy.server_lr=0.01"], "fedadam", 0.0, 0.01, "mean"),  # another kind
        (["strategy.name=fedavg"], "fedavg", 0.0, 1.0, "mean"),
        # the adaptive strategies' own server lr: it was 1.0, at which FedAdam did not learn (accuracy 0.098)
        (["strategy.name=fedadam"], "fedadam", 0.0, 0.01, "mean"),
        (["strategy.name=fedyogi"], "fedyogi", 0.0, 0.01, "mean"),
        (["strategy.name=fedadagrad", "strategy.server_lr=0.1"], "fedadagrad", 0.0, 0.1, "mean"),
        (["strategy.name=scaffold"], "scaffold", 0.0, 1.0, "mean"),
    ],
)
def test_a_strategy_flag_changes_only_its_key_of_the_default_strategy(
    overrides: list[str], name: str, momentum: float, server_lr: float, aggregator: str
) -> None:
    """`fedcore simulate --server-lr 0.5` (no recipe) is the default run (FedAvgM, momentum 0.7) with that server
    lr, not plain FedAvg rebuilt from the class defaults; naming another strategy starts from that strategy's own
    defaults (FedAvgM's momentum is not carried into FedAdam, where it would be refused)."""
    strategy = load_recipe(None, overrides).strategy
    assert (strategy.name, strategy.server_momentum, strategy.server_lr, strategy.aggregator) == (
        name,
        momentum,
        server_lr,
        aggregator,
    )


def test_a_sampling_or_train_flag_keeps_the_other_defaults_of_its_table() -> None:
    config = load_recipe(None, ["sampling.min_fit_clients=5", "train.lr=0.1"])
    assert (config.sampling.fraction_fit, config.sampling.min_fit_clients) == (0.1, 5)
    assert (config.train.local_epochs, config.train.batch_size, config.train.lr) == (1, 32, 0.1)


def test_a_server_min_fit_clients_flag_keeps_the_servers_fraction_fit() -> None:
    """A server trains every connected client by default (fraction_fit 1.0): --min-fit-clients 3 must not bring
    back the class default 0.1."""
    from server.config import load_server_config

    flags = {"tls": {"insecure": True}, "task": "simulations.tasks:demo_task"}
    assert load_server_config(None, [], flags).sampling.fraction_fit == 1.0
    sampling = load_server_config(None, ["sampling.min_fit_clients=3"], flags).sampling
    assert (sampling.fraction_fit, sampling.min_fit_clients) == (1.0, 3)
    sampling = load_server_config(None, [], {**flags, "sampling": {"min_fit_clients": 3}}).sampling
    assert (sampling.fraction_fit, sampling.min_fit_clients) == (1.0, 3)


def test_a_path_starting_with_a_tilde_is_in_the_home_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a recipe's dir = "~/runs" or --out=~/runs (no shell expansion after '='): the home directory's runs, not a
    # directory named "~" in the working directory
    monkeypatch.setenv("HOME", str(tmp_path))
    recipe = tmp_path / "r.toml"
    recipe.write_text('[output]\ndir = "~/runs/a"\n[data]\ndataset = "fashion-mnist"\ndata_dir = "~/fm"\n')
    config = load_recipe(recipe)
    assert config.output.dir == tmp_path / "runs" / "a" and config.data.data_dir == tmp_path / "fm"
    assert load_recipe(None, ["output.dir='~'"]).output.dir == tmp_path
    assert load_recipe(None, ["output.dir='runs/~x'"]).output.dir == Path("runs/~x")  # only a leading tilde
    with pytest.raises(ConfigError, match=r"output.dir: '~nosuchuser-fedcore/runs' names a home directory that does"):
        load_recipe(None, ["output.dir='~nosuchuser-fedcore/runs'"])


def test_a_config_file_path_starting_with_a_tilde_is_in_the_home_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # --recipe=~/r.toml or --config=~/server.toml: no shell expands a '~' after '=', as with --out=~/runs
    from server.config import load_server_config

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "r.toml").write_text("[train]\nlr = 0.25\n")
    assert load_recipe("~/r.toml").train.lr == 0.25
    (tmp_path / "s.toml").write_text('task = "simulations.tasks:demo_task"\ninsecure = true\n[round]\nrounds = 6\n')
    assert load_server_config("~/s.toml", []).round.rounds == 6
    with pytest.raises(ConfigError, match=r"config file: '~nosuchuser-fedcore/r.toml' names a home directory that"):
        load_recipe("~nosuchuser-fedcore/r.toml")
