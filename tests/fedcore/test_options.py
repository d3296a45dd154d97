"""Config files, ``--set`` and flags come from one declaration per setting (the config dataclasses), and the
server's whole configuration is checked before anything is created or bound."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import typing
from pathlib import Path

import numpy as np
import pytest

from client.daemon import DaemonConfig, load_daemon_config
from fedcore.cli import build_parser, client_options, main, server_options, simulate_options
from fedcore.errors import ConfigError
from fedcore.options import Option, add_options, derive_options, given_values, plain_text, to_overrides
from fedcore.strategy import StrategyConfig
from fedcore.task import FitConfig
from fedcore.tensors import encode
from server.config import (
    ServerConfig,
    TlsSettings,
    check_server_config,
    load_server_config,
)

#: every ``server start`` flag before the flags were derived: each must still exist and set the same key
OLD_SERVER_FLAGS = {
    "--address": "address", "--state-dir": "state_dir", "--task": "task", "--data-dir": "data_dir",
    "--initial": "initial", "--rounds": "round.rounds", "--seed": "seed", "--evaluate-every": "round.evaluate_every",
    "--round-timeout-s": "round.round_timeout_s", "--wait-for-clients-s": "round.wait_for_clients_s",
    "--min-fit-results": "round.min_fit_results", "--max-round-attempts": "round.max_round_attempts",
    "--heartbeat-interval-s": "pool.heartbeat_interval_s", "--liveness-timeout-s": "pool.liveness_timeout_s",
    "--max-payload-bytes": "pool.max_payload_bytes", "--chunk-bytes": "pool.chunk_bytes",
    "--max-workers": "pool.max_workers", "--max-calls-per-client": "pool.max_calls_per_client",
    "--max-unauthenticated-calls": "pool.max_unauthenticated_calls", "--stream-idle-s": "pool.stream_idle_s",
    "--stream-total-s": "pool.stream_total_s", "--tls-cert": "tls.cert", "--tls-key": "tls.key",
    "--client-ca": "tls.client_ca", "--tokens-file": "auth.tokens_file", "--metrics-port": "metrics_port",
    "--metrics-address": "metrics_address", "--linger-s": "linger_s", "--strategy": "strategy.name",
    "--server-lr": "strategy.server_lr", "--fraction-fit": "sampling.fraction_fit",
    "--min-fit-clients": "sampling.min_fit_clients", "--fraction-evaluate": "sampling.fraction_evaluate",
    "--epochs": "train.local_epochs", "--batch-size": "train.batch_size", "--lr": "train.lr", "--mu": "train.mu",
    "--task-option": "task_options", "--revoke": "auth.revoked", "--insecure": "tls.insecure",
    "--no-evaluate": "round.evaluate",
}  # fmt: skip
OLD_CLIENT_FLAGS = {
    "--server", "--client-id", "--task", "--task-option", "--partition-id", "--num-partitions", "--data-dir",
    "--token", "--token-file", "--insecure", "--ca-cert", "--cert", "--key", "--server-name", "--poll-s",
    "--backoff-max-s", "--give-up-after-s", "--stay", "--threads",
}  # fmt: skip
OLD_SIMULATE_FLAGS = {
    "--rounds", "--seed", "--dataset", "--data-dir", "--clients", "--partition", "--alpha", "--model", "--strategy",
    "--min-fit-clients", "--epochs", "--batch-size", "--lr", "--mu", "--out", "--task", "--task-option",
    "--no-progress",
}  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True)
class RobustStrategyConfig(StrategyConfig):
    """StrategyConfig with the fields "robust" adds.

    Attributes:
        aggregator: how updates are combined: mean, median, trimmed-mean, krum.
        trim_beta: fraction trimmed at each end by trimmed-mean.
    """

    aggregator: str = "mean"
    trim_beta: float = 0.1


@dataclasses.dataclass(frozen=True, kw_only=True)
class RobustRoot:
    strategy: RobustStrategyConfig = dataclasses.field(default_factory=RobustStrategyConfig)
    train: FitConfig = dataclasses.field(default_factory=FitConfig)


@dataclasses.dataclass(frozen=True)
class Twin:
    """Attributes:
    momentum: a twin's.
    """

    momentum: float = 0.0


@dataclasses.dataclass(frozen=True)
class TwinRoot:
    server: Twin = dataclasses.field(default_factory=Twin)
    client: Twin = dataclasses.field(default_factory=Twin)
    set: int = 0


def _leaf_keys(cls: type, prefix: str = "") -> set[str]:
    """Every setting's dotted key, nested config tables walked."""
    hints = typing.get_type_hints(cls)
    keys = set()
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind) and isinstance(kind, type):
            keys |= _leaf_keys(kind, f"{prefix}{f.name}.")
        else:
            keys.add(prefix + f.name)
    return keys


def test_every_server_setting_is_a_flag_and_the_old_flags_keep_their_keys() -> None:
    options = {o.flag: o.key for o in server_options()}
    assert {flag: options.get(flag) for flag in OLD_SERVER_FLAGS} == OLD_SERVER_FLAGS
    assert set(options.values()) == _leaf_keys(ServerConfig)  # no setting without a flag, none twice
    assert {o.flag for o in client_options()} >= OLD_CLIENT_FLAGS
    assert {o.key for o in client_options()} == {f.name for f in dataclasses.fields(DaemonConfig)} - {"parallel"}
    assert {o.flag for o in simulate_options()} >= OLD_SIMULATE_FLAGS


def test_simulate_names_the_minimum_of_clients_a_round_as_the_server_does() -> None:
    # --clients-per-round set sampling.min_fit_clients, a minimum (fraction_fit 0.1 of 100 clients trained 10
    # with --clients-per-round 5): the flag is now --min-fit-clients, as fedcore server start and Flower name it.
    simulate = {o.flag: o.key for o in simulate_options()}
    server = {o.flag: o.key for o in server_options()}
    assert simulate["--min-fit-clients"] == server["--min-fit-clients"] == "sampling.min_fit_clients"
    assert "--clients-per-round" not in simulate


def test_flags_come_with_their_fields_help_and_default() -> None:
    (option,) = [o for o in server_options() if o.flag == "--liveness-timeout-s"]
    assert option.kind is float and option.default == 15.0 and "is dropped and its task failed" in option.help
    (lr,) = [o for o in server_options() if o.flag == "--lr"]
    assert lr.help == "local SGD learning rate (eta_l). > 0." and lr.default == 0.05


def _parse(options: tuple[Option, ...], argv: list[str]) -> dict[str, typing.Any]:
    parser = argparse.ArgumentParser()
    add_options(parser, options)
    return given_values(parser.parse_args(argv), options)


def test_a_new_strategy_field_gets_a_flag_with_no_other_edit() -> None:
    # what "robust" adds to StrategyConfig (an aggregator and its parameter) appears as flags by itself
    options = derive_options(RobustRoot, flags={"strategy.name": "strategy", "train.local_epochs": "epochs"})
    by_flag = {o.flag: o for o in options}
    assert by_flag["--aggregator"].key == "strategy.aggregator" and "trimmed-mean" in by_flag["--aggregator"].help
    assert by_flag["--trim-beta"].kind is float
    values = _parse(options, ["--aggregator", "krum", "--trim-beta", "0.2", "--strategy", "fedavg", "--epochs", "2"])
    assert values == {"strategy": {"aggregator": "krum", "trim_beta": 0.2, "name": "fedavg"},
                      "train": {"local_epochs": 2}}  # fmt: skip
    assert sorted(to_overrides(values)) == ['strategy.aggregator="krum"', 'strategy.name="fedavg"',
                                            "strategy.trim_beta=0.2", "train.local_epochs=2"]  # fmt: skip


def test_fields_of_one_name_in_two_sections_get_their_section_in_front() -> None:
    with pytest.raises(ConfigError, match="config key 'set' wants the flag --set, which the command uses"):
        derive_options(TwinRoot, reserved=("set",))
    options = derive_options(TwinRoot, flags={"set": "set-value"}, reserved=("set",))
    assert [(o.flag, o.key) for o in options] == [
        ("--server-momentum", "server.momentum"),
        ("--client-momentum", "client.momentum"),
        ("--set-value", "set"),
    ]
    assert _parse(options, ["--client-momentum", "0.5"]) == {"client": {"momentum": 0.5}}
    with pytest.raises(ConfigError, match="pin the same flag"):
        derive_options(TwinRoot, flags={"server.momentum": "m", "client.momentum": "m"})


def test_the_file_then_set_then_flags(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "server.toml"
    path.write_text('task = "simulations.tasks:demo_task"\n[tls]\ninsecure = true\n[round]\nrounds = 3\n'
                    "min_fit_results = 2\n[train]\nlr = 0.5\n")  # fmt: skip
    config = load_server_config(path, ["round.rounds=4", "train.lr=0.25"], {"round": {"rounds": 5}})
    assert (config.round.rounds, config.round.min_fit_results, config.train.lr) == (5, 2, 0.25)
    assert config.tls == TlsSettings(insecure=True)
    # a file of the flat layout before the tables still reads, with a warning naming the table
    old = tmp_path / "old.toml"
    old.write_text('task = "simulations.tasks:demo_task"\ninsecure = true\nrounds = 7\ntls_cert = "c.pem"\n'
                   "liveness_timeout_s = 20.0\nrevoked = [\"x\"]\n")  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="fedcore.server"), pytest.raises(ConfigError, match="--tls-cert"):
        load_server_config(old, [])  # tls_cert went to [tls] cert, which --insecure contradicts
    assert "write it as [tls] cert" in caplog.text
    config = load_server_config(None, ['task="m:f"', "insecure=true", "rounds=7", "liveness_timeout_s=20.0",
                                       'revoked=["x"]'])  # fmt: skip
    assert (config.round.rounds, config.pool.liveness_timeout_s, config.auth.revoked) == (7, 20.0, ("x",))
    with pytest.raises(ConfigError, match=r"'rounds' is given both at the top level and as \[round\] rounds"):
        load_server_config(None, ['task="m:f"', "insecure=true", "rounds=7", "round.rounds=8"])
    # --set wins over the file in either layout: its table form over the file's flat key, and its flat form over
    # the file's table
    old.write_text('task = "simulations.tasks:demo_task"\ninsecure = true\nrounds = 7\n')
    with caplog.at_level(logging.WARNING, logger="fedcore.server"):
        assert load_server_config(old, ["round.rounds=8"]).round.rounds == 8
    path.write_text('task = "simulations.tasks:demo_task"\n[tls]\ninsecure = true\n[round]\nrounds = 3\n')
    assert load_server_config(path, ["rounds=9"]).round.rounds == 9


def test_the_cli_flags_win_over_the_config_file(tmp_path: Path) -> None:
    path = tmp_path / "server.toml"
    path.write_text('task = "simulations.tasks:demo_task"\n[tls]\ninsecure = true\n[round]\nrounds = 3\n')
    parser = build_parser()
    args = parser.parse_args(["server", "start", "--config", str(path), "--set", "round.rounds=4", "--rounds", "6",
                              "--revoke", "a", "--revoke", "b", "--task-option", "dataset=digits", "--no-evaluate",
                              "--beta1", "0.8"])  # fmt: skip
    config = load_server_config(args.config, args.overrides, given_values(args, server_options()))
    assert (config.round.rounds, config.round.evaluate, config.auth.revoked) == (6, False, ("a", "b"))
    assert config.task_options == {"dataset": "digits"} and config.strategy.beta1 == 0.8


def test_contradictions_and_missing_files_are_refused_before_anything_is_created(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state"
    (tmp_path / "junk.safetensors").write_bytes(b"not a model")
    base = ["server", "start", "--task", "simulations.tasks:demo_task", "--address", "127.0.0.1:0",
            "--state-dir", str(state)]  # fmt: skip
    cases = [
        (["--insecure", "--tls-cert", "c.pem"], "--tls-cert cannot be combined with --insecure"),
        (["--insecure", "--initial", str(tmp_path / "none.safetensors")], "initial (--initial) '"),
        (["--insecure", "--initial", str(tmp_path / "junk.safetensors")], "is not a usable safetensors model"),
        (["--insecure", "--data-dir", str(tmp_path / "nowhere")], "data_dir (--data-dir) '"),
        (["--insecure", "--tokens-file", str(tmp_path / "none.txt")], "cannot read the tokens file"),
        (["--insecure", "--task", "no_such_module:factory"], "cannot import task module 'no_such_module'"),
        (["--insecure", "--metrics-port", "8443", "--address", "127.0.0.1:8443"], "is the port the server listens"),
        (["--tls-cert", str(tmp_path / "c.pem"), "--tls-key", str(tmp_path / "k.pem")], "c.pem"),
        (["--insecure", "--revoke", ""], "an empty client id cannot be revoked"),
        (["--insecure", "--rounds", "0"], "[round] rounds (--rounds) must be in 1..1,000,000, got 0"),
        (["--insecure", "--rounds", str(10**20)], "rounds (--rounds) must be in 1..1,000,000, got 1000000000000000"),
        (["--tls-cert", str(tmp_path / "c.pem")], "--tls-cert was given without --tls-key: TLS needs both"),
        (["--tls-key", str(tmp_path / "k.pem")], "--tls-key was given without --tls-cert: TLS needs both"),
        (["--insecure", "--max-workers", "2"], "max_workers must be >= 8"),
        (["--insecure", "--max-workers", "100000000"], "max_workers must be <= 100,000"),
        (["--insecure", "--server-lr", "inf"], "server_lr (--server-lr) must be a finite number > 0"),
        (["--insecure", "--strategy", "fedavgm", "--server-momentum", "nan"], "server_momentum (--server-momentum)"),
    ]
    for extra, message in cases:
        assert main([*base, *extra]) == 2, extra
        err = capsys.readouterr().err
        assert message in err, (extra, err)
        assert not state.exists(), extra
    good = tmp_path / "model.safetensors"
    good.write_bytes(encode({"w": np.arange(3, dtype=np.float32)}))
    check_server_config(ServerConfig(initial=good, tls=TlsSettings(insecure=True), state_dir=state))  # no error
    assert not state.exists()
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"state_dir \(--state-dir\) '.*file' is a file"):
        check_server_config(ServerConfig(task="simulations.tasks:demo_task", tls=TlsSettings(insecure=True),
                                         state_dir=tmp_path / "file"))  # fmt: skip
    with pytest.raises(SystemExit):  # a value outside a Literal's choices: argparse's own refusal
        main([*base, "--insecure", "--weighting", "median"])
    assert "invalid choice: 'median'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("file", "flags", "message"),
    [
        ("round = 5\n", ["--wait-for-clients-s", "3"], "round: expected a table, got 5"),
        ('tls = "off"\n', ["--insecure"], "tls: expected a table, got 'off'"),
        ("sampling = 0.5\n", ["--fraction-fit", "0.5"], "sampling: expected a table, got 0.5"),
    ],
)
def test_a_files_value_where_a_flags_table_goes_is_refused_not_replaced(
    file: str, flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A config file's ``round = 5`` was refused ("expected a table") unless a flag of [round] was also given,
    which replaced it silently, as if the file never said it."""
    config = tmp_path / "server.toml"
    config.write_text(file)
    state = tmp_path / "state"
    base = [
        "server",
        "start",
        "--config",
        str(config),
        "--task",
        "simulations.tasks:demo_task",
        "--state-dir",
        str(state),
    ]
    assert main([*base, *([] if "--insecure" in flags else ["--insecure"]), *flags]) == 2
    assert capsys.readouterr().err == f"fedcore: error: {message}\n"
    assert not state.exists()


def test_the_daemon_reads_a_toml_file_and_flags_override_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    token = tmp_path / "token.txt"
    token.write_text("s3cret\n")
    path = tmp_path / "daemon.toml"
    path.write_text(f'server = "127.0.0.1:8443"\nclient_id = "c7"\ninsecure = true\npoll_s = 5.0\n'
                    f'token_file = "{token}"\n[task_options]\ndataset = "digits"\n[parallel]\ndp = 1\n')  # fmt: skip
    parser = build_parser()
    args = parser.parse_args(["client", "start", "--config", str(path), "--poll-s", "7", "--stay",
                              "--task-option", "model=2nn"])  # fmt: skip
    config = load_daemon_config(args.config, args.overrides, given_values(args, client_options()))
    assert (config.server, config.client_id, config.poll_s, config.exit_when_finished) == ("127.0.0.1:8443", "c7",
                                                                                          7.0, False)  # fmt: skip
    assert config.task_options == {"dataset": "digits", "model": "2nn"}  # the flag's table merges into the file's
    assert config.read_token() == "s3cret" and config.parallel is not None
    # the token from the environment when none is configured; both a token and a token file is a contradiction
    env = load_daemon_config(None, [], {"server": "h:1", "client_id": "c", "insecure": True},
                             environ={"FEDCORE_TOKEN": "from-env"})  # fmt: skip
    assert env.read_token() == "from-env"
    with pytest.raises(ConfigError, match="--token or --token-file, not both"):
        load_daemon_config(path, ["token='x'"])
    with pytest.raises(ConfigError, match="give the daemon its server: --server HOST:PORT"):
        load_daemon_config(None, [], {"client_id": "c"})
    with pytest.raises(ConfigError, match=r"unknown key\(s\) 'poll'"):
        load_daemon_config(path, ["poll=3"])
    monkeypatch.delenv("FEDCORE_TOKEN", raising=False)
    assert main(["client", "start", "--config", str(path), "--partition-id", "3", "--num-partitions", "2"]) == 2
    assert "partition_id (--partition-id) 3 is not in 0..1" in capsys.readouterr().err


def test_help_text_has_no_sphinx_markup(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    assert plain_text("needs ``pip install -e '.[ray]'``; see :mod:`simulations.raypool`") == (
        "needs pip install -e '.[ray]'; see simulations.raypool"
    )
    assert plain_text(":class:`~server.config.ServerConfig`, :func:`fedcore.task.load_task`, :py:meth:`A.b`") == (
        "ServerConfig, fedcore.task.load_task, A.b"
    )
    assert plain_text(":class:`the pool <simulations.raypool.RayPool>` and `x` stay") == "the pool and `x` stay"
    (backend,) = [o for o in simulate_options() if o.flag == "--backend"]
    assert "simulations.raypool" in backend.help and ":mod:" not in backend.help
    for name in ("OMP_WAIT_POLICY", "GRPC_VERBOSITY"):  # main() sets them when unset: restored after the test
        if name in os.environ:
            monkeypatch.setenv(name, os.environ[name])
        else:
            monkeypatch.delenv(name, raising=False)
    for argv in (["simulate", "--help"], ["server", "start", "--help"], ["client", "start", "--help"]):
        with pytest.raises(SystemExit) as exit_info:  # argparse prints the help and exits 0
            main(argv)
        assert exit_info.value.code == 0
        out = capsys.readouterr().out
        assert "--backend" in out or "--tokens-file" in out or "--server" in out, argv
        assert "``" not in out and not re.search(r":\w+:`", out), argv
