"""``fedcore server start`` and ``fedcore client start`` refuse what they can before anything is created: a task
that fails to build leaves no state directory; weighting ``server`` names a value the server's evaluation gives;
secret files others may read draw a warning with the chmod that fixes it."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from client.daemon import ClientDaemon, DaemonConfig
from fedcore.cli import main
from privacy.tls import exposure_warning

DEMO = ["--task", "simulations.tasks:demo_task", "--task-option", "dataset=synthetic", "--task-option",
        "partition=natural", "--task-option", "model=logreg"]  # fmt: skip


def _start(state: Path, *flags: str) -> list[str]:
    return ["server", "start", "--insecure", "--address", "127.0.0.1:0", "--state-dir", str(state), *flags]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--task", "simulations.tasks:demo_task", "--task-option", "dataset=bogus"], "unknown dataset 'bogus'"),
        ([*DEMO, "--task-option", "num_clients=abc"], "num_clients: expected an integer, got 'abc'"),
        (["--task", "os:getcwd"], "the task factory 'os:getcwd' raised TypeError"),
        (
            [*DEMO, "--weighting", "server", "--weight-metric", "bogus"],
            "'bogus' is not a value the server's evaluation gives; weighting 'server' can use: loss, accuracy",
        ),
        (
            ["--task", "tests.simulations.test_setup_refusals:regression_task", "--target-accuracy", "0.5"],
            "declares that its evaluate reports ['mae'] (eval_metric_names), no 'accuracy', so it would never stop",
        ),
    ],
)
def test_a_task_that_fails_to_build_leaves_no_state_directory(
    flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state"
    assert main(_start(state, *flags)) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not state.exists()


def test_a_client_whose_task_cannot_be_loaded_leaves_no_state_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "client-state"
    code = main(["client", "start", "--insecure", "--server", "127.0.0.1:1", "--client-id", "c0", "--task",
                 "nosuch_module:f", "--state-dir", str(state)])  # fmt: skip
    assert code == 2
    assert "cannot import task module 'nosuch_module'" in capsys.readouterr().err
    assert not state.exists()


@pytest.mark.parametrize(
    ("mode", "who"), [(0o644, "its group and others"), (0o640, "its group"), (0o604, "others"), (0o600, None)]
)
def test_a_secret_file_others_may_read_draws_a_warning_with_the_fix(mode: int, who: str | None, tmp_path: Path) -> None:
    path = tmp_path / "my tokens.txt"
    path.write_text("client-000 abc\n")
    os.chmod(path, mode)
    warning = exposure_warning(path, "the tokens file (--tokens-file)")
    if who is None:
        assert warning is None
    else:
        assert warning == (
            f"the tokens file (--tokens-file) {str(path)!r} has mode {mode:04o}: {who} may read it, and with it this "
            f"secret; make it readable by its owner only: chmod 600 '{path}'"
        )


def test_the_server_warns_of_a_tokens_file_others_may_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tokens = tmp_path / "tokens.txt"
    tokens.write_text("client-000 abc\n")
    tokens.chmod(0o644)
    # the warning comes first; the bad task option then stops the server before it creates anything
    code = main(_start(tmp_path / "state", "--tokens-file", str(tokens), *DEMO, "--task-option", "num_clients=x"))
    out = capsys.readouterr().out
    assert code == 2
    assert f"WARNING: the tokens file (--tokens-file) {str(tokens)!r} has mode 0644" in out
    assert f"chmod 600 {tokens}\n" in out
    tokens.chmod(0o600)
    assert main(_start(tmp_path / "state", "--tokens-file", str(tokens), *DEMO, "--task-option", "num_clients=x")) == 2
    assert "WARNING: the tokens file" not in capsys.readouterr().out


def test_the_daemon_warns_of_a_token_file_others_may_read(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    token = tmp_path / "token"
    token.write_text("abc\n")
    token.chmod(0o640)
    config = DaemonConfig(server="127.0.0.1:1", client_id="c0", insecure=True, token_file=token)
    with caplog.at_level(logging.WARNING, logger="fedcore.client"):
        ClientDaemon(config)
        token.chmod(0o400)
        ClientDaemon(config)
    assert [r.getMessage() for r in caplog.records] == [
        f"token_file (--token-file) {str(token)!r} has mode 0640: its group may read it, and with it this secret; "
        f"make it readable by its owner only: chmod 600 {token}"
    ]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--backoff-max-s", "nan"], "must be finite seconds with 0 < initial <= max, got 0.5 and nan"),
        (["--backoff-initial-s", "5", "--backoff-max-s", "1"], "got 5.0 and 1.0"),
        (["--num-partitions", "0"], "num_partitions (--num-partitions) must be >= 1, got 0"),
        (["--num-partitions", "0", "--partition-id", "0"], "num_partitions (--num-partitions) must be >= 1, got 0"),
    ],
)
def test_a_daemons_bad_backoff_or_partition_count_is_refused_with_the_value(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["client", "start", "--insecure", "--server", "127.0.0.1:1", "--client-id", "c0", *extra])
    assert code == 2
    assert message in capsys.readouterr().err


def test_an_address_the_server_cannot_listen_on_leaves_no_state_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A port another process listens on, a host that cannot be resolved, an address not on this machine: the
    server created state.db, checkpoints/, spill/ and state.lock before gRPC failed to bind, and gRPC's message
    hid the reason ("set GRPC_VERBOSITY=debug"). Each is now refused first, with the OS's reason and the fix."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cases = [
            (f"127.0.0.1:{port}", f"cannot listen on 127.0.0.1:{port}: Address already in use; another process"),
            ("nonexistent.invalid:8443", "the host 'nonexistent.invalid' cannot be resolved"),
            (
                "192.0.2.1:8443",
                "cannot listen on 192.0.2.1:8443: Cannot assign requested address; it is not an address",
            ),
        ]  # 192.0.2.1: TEST-NET-1 (RFC 5737), on no machine's interface
        for address, message in cases:
            state = tmp_path / "state"
            flags = ["server", "start", "--insecure", "--address", address, "--state-dir", str(state), *DEMO]
            assert main(flags) == 2
            err = capsys.readouterr().err
            assert message in err and err.count("fedcore: error:") == 1, err
            assert not state.exists()
