"""Addresses and ports: one parser (:func:`fedcore.config.parse_address`) for every ``host:port`` a user gives,
checked when the config is built, before any side effect.

Before this check, gRPC bound what it could make of a bad address: ``127.0.0.1:70000`` listened on 4464 (70000
mod 65536), ``:99999`` on a random port, ``:-1`` on 65535 and a missing port on 443.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from client.daemon import DaemonConfig
from fedcore.cli import main
from fedcore.config import Address, check_port, parse_address, parse_host
from fedcore.errors import ConfigError
from server.config import RoundSettings, ServerConfig, TlsSettings, load_server_config

GOOD = {
    "127.0.0.1:8443": Address("127.0.0.1", 8443),
    "0.0.0.0:1": Address("0.0.0.0", 1),
    "localhost:65535": Address("localhost", 65535),
    "fl-server.example.org:443": Address("fl-server.example.org", 443),
    "node_7:8443": Address("node_7", 8443),  # docker-compose service names carry underscores
    "[::1]:8443": Address("::1", 8443),
    "[::]:8443": Address("::", 8443),
    "[fe80::1%eth0]:8443": Address("fe80::1%eth0", 8443),
}


@pytest.mark.parametrize("text", sorted(GOOD))
def test_valid_addresses_parse_and_print_back(text: str) -> None:
    address = parse_address(text, what="--server")
    assert address == GOOD[text]
    assert str(address) == text


BAD = {
    # the four cases gRPC used to bind silently
    "127.0.0.1:70000": "port 70000 in '127.0.0.1:70000' is out of range 1-65535",
    "127.0.0.1:99999": "port 99999 in '127.0.0.1:99999' is out of range 1-65535",
    "127.0.0.1:-1": "port '-1' in '127.0.0.1:-1' is not a number 1-65535",
    "127.0.0.1": "'127.0.0.1' has no port",
    # other ways to get it wrong
    "127.0.0.1:0": "port 0 in '127.0.0.1:0' is out of range 1-65535",
    "127.0.0.1:": "port '' in '127.0.0.1:' is not a number",
    "127.0.0.1:84a3": "port '84a3' in '127.0.0.1:84a3' is not a number",
    "127.0.0.1:８４４３": "is not a number",  # full-width digits: str.isdigit() says yes, int() would take them
    ":8443": "':8443' has no host; give one, e.g. the server's host name or address, as in server.example.org:8443",
    "::1:8443": "an IPv6 address goes in brackets before the port, e.g. [::1]:8443",
    "[::1]": "no port after the IPv6 address; write it as [::1]:8443",
    "[::1:8443": "opens '[' but never closes it",
    "[::g]:8443": "'[::g]' is not a valid IPv6 address",
    "256.1.1.1:8443": "'256.1.1.1' is not a valid IPv4 address",
    "bad host:8443": "contains spaces",
    " 127.0.0.1:8443": "contains spaces",
    "-leading.example.org:8443": "is not a valid host name",
    "dns:///server:8443": "is a URL; give plain HOST:PORT",
    "": "expected HOST:PORT",
}


@pytest.mark.parametrize("text", sorted(BAD))
def test_invalid_addresses_say_what_is_wrong_and_show_the_right_form(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_address(text, what="--server")
    message = str(info.value)
    assert message.startswith("--server: ")
    assert BAD[text] in message
    assert "8443" in message  # every message shows a right form


def test_a_missing_host_is_explained_for_listening_and_for_connecting() -> None:
    """A client's --server ':8443' was told to listen on 0.0.0.0 (the server's wording)."""
    with pytest.raises(ConfigError, match=r"has no host; give one, e.g\. 0\.0\.0\.0:9000 to listen on every interface"):
        parse_address(":9000", what="--address", allow_port_zero=True)
    with pytest.raises(ConfigError, match=r"has no host; give one, e\.g\. the server's host name or address, as in"):
        parse_address(":9000", what="--server")


def test_port_zero_only_where_the_os_is_to_pick() -> None:
    assert parse_address("127.0.0.1:0", what="--address", allow_port_zero=True) == Address("127.0.0.1", 0)
    with pytest.raises(ConfigError, match=r"out of range 0-65535 \(0 lets the OS pick a free port\)"):
        parse_address("127.0.0.1:65536", what="--address", allow_port_zero=True)
    assert check_port(0, what="metrics_port", allow_zero=True) == 0
    assert check_port(65535, what="metrics_port") == 65535
    for bad in (-1, 65536, True, "80"):
        with pytest.raises(ConfigError, match=r"metrics_port must be a TCP port"):
            check_port(bad, what="metrics_port", allow_zero=True)


def test_hosts_without_a_port() -> None:
    assert parse_host("127.0.0.1", what="metrics_address") == "127.0.0.1"
    assert parse_host("[::1]", what="metrics_address") == "::1"
    assert parse_host("::1", what="metrics_address") == "::1"
    with pytest.raises(ConfigError, match=r"'127\.0\.0\.1:9100' is not a valid IPv6 address"):
        parse_host("127.0.0.1:9100", what="metrics_address")
    with pytest.raises(ConfigError, match="expected a host name or IP address"):
        parse_host("", what="metrics_address")


def _server(**kw: object) -> ServerConfig:
    return ServerConfig(task="simulations.tasks:demo_task", tls=TlsSettings(insecure=True), **kw)  # type: ignore[arg-type]


def test_every_server_and_client_address_is_checked_when_the_config_is_built() -> None:
    assert _server(address="[::1]:0").listen_address == Address("::1", 0)
    with pytest.raises(ConfigError, match=r"address \(--address\): port 70000 .* out of range 0-65535"):
        _server(address="0.0.0.0:70000")
    with pytest.raises(ConfigError, match=r"metrics_address \(--metrics-address\): '0.0.0.0:9' is not"):
        _server(metrics_address="0.0.0.0:9")
    with pytest.raises(ConfigError, match=r"metrics_port \(--metrics-port\) must be a TCP port 0-65535"):
        _server(metrics_port=70000)
    # from TOML too: the same check, with the file's value
    with pytest.raises(ConfigError, match="has no port"):
        load_server_config(None, ['task="simulations.tasks:demo_task"', "insecure=true", 'address="myhost"'])

    with pytest.raises(ConfigError, match=r"server \(--server\): port 99999"):
        DaemonConfig(server="127.0.0.1:99999", client_id="c", task="m:f", insecure=True)
    with pytest.raises(ConfigError, match=r"server \(--server\): port 0 .* out of range 1-65535"):
        DaemonConfig(server="127.0.0.1:0", client_id="c", task="m:f", insecure=True)
    with pytest.raises(ConfigError, match=r"server_name \(--server-name\): 'fl server' is not a valid host name"):
        DaemonConfig(server="127.0.0.1:8443", client_id="c", task="m:f", server_name="fl server")
    assert DaemonConfig(server="[::1]:8443", client_id="c", task="m:f", insecure=True).server == "[::1]:8443"


@pytest.mark.parametrize("address", ["127.0.0.1:70000", "127.0.0.1:99999", "127.0.0.1:-1", "127.0.0.1"])
def test_the_server_refuses_a_bad_address_before_any_side_effect(
    address: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state"
    code = main(["server", "start", "--insecure", "--task", "simulations.tasks:demo_task",
                 f"--address={address}", "--state-dir", str(state)])  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("fedcore: error: ") and "address (--address)" in err and "e.g. 127.0.0.1:8443" in err
    assert not state.exists()  # nothing created


def test_the_client_refuses_a_bad_server_address(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["client", "start", "--insecure", "--server", "localhost:70000", "--client-id", "c0"])
    assert code == 2
    assert "server (--server): port 70000 in 'localhost:70000' is out of range 1-65535" in capsys.readouterr().err


@pytest.mark.parametrize("address", ["[127.0.0.1]:0", "127.0.0.1:000"])
def test_the_server_listens_on_the_address_as_parsed(address: str, tmp_path: Path) -> None:
    # gRPC is given the parsed address in its one written form: "[127.0.0.1]:0" passes the parser, and gRPC
    # itself could not parse it ("Unparsable name"), failing to bind after the state directory was made
    from fedcore.errors import RoundFailed
    from server.app import run_server

    lines: list[str] = []
    config = ServerConfig(
        tls=TlsSettings(insecure=True),
        address=address,
        state_dir=tmp_path / "state",
        task="simulations.tasks:demo_task",
        task_options={"dataset": "digits", "num_clients": "2", "model": "logreg"},
        round=RoundSettings(rounds=1, evaluate=False, wait_for_clients_s=1.0),
    )
    with pytest.raises(RoundFailed, match="0 client"):
        run_server(config, echo=lines.append)
    listening = [line for line in lines if line.startswith("fedcore server listening on 127.0.0.1:")]
    assert listening, lines
    assert 0 < int(listening[0].split()[4].rsplit(":", 1)[1]) <= 65535


def test_the_metrics_endpoint_listens_on_the_host_as_parsed_and_names_one_it_cannot_use(tmp_path: Path) -> None:
    # "[::1]" passes parse_host; the HTTP server was given it with its brackets (socket.gaierror traceback)
    import socket

    from fedcore.errors import RoundFailed
    from server.app import run_server

    def config(host: str, state: str) -> ServerConfig:
        return _server(address="127.0.0.1:0", state_dir=tmp_path / state, metrics_address=host, metrics_port=0,
                       task_options={"dataset": "digits", "num_clients": "2", "model": "logreg"},
                       round=RoundSettings(rounds=1, evaluate=False, wait_for_clients_s=1.0))  # fmt: skip

    lines: list[str] = []
    with pytest.raises(RoundFailed, match="0 client"):
        run_server(config("[::1]", "a"), echo=lines.append)
    (line,) = [line for line in lines if line.startswith("metrics on http://[::1]:")]
    port = int(line.removeprefix("metrics on http://[::1]:").removesuffix("/metrics"))
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("::1", port), timeout=5):
        pass  # closed when the server stopped
    with pytest.raises(ConfigError, match=r"cannot serve metrics on no-such-host\.invalid:0: .*--metrics-address"):
        run_server(config("no-such-host.invalid", "b"), echo=lambda _: None)
    assert not (tmp_path / "b").exists()  # refused before the state directory was made


def test_the_client_connects_to_the_address_as_parsed() -> None:
    from concurrent import futures

    import grpc

    from client.daemon import ClientDaemon

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        config = DaemonConfig(server=f"[127.0.0.1]:{port:06d}", client_id="c", task="m:f", insecure=True)
        channel = ClientDaemon(config, factory=lambda ctx: None)._channel()  # type: ignore[arg-type,return-value]
        grpc.channel_ready_future(channel).result(timeout=10)  # "[127.0.0.1]:0PORT" reaches 127.0.0.1:PORT
        channel.close()
    finally:
        server.stop(None)


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--rounds=0", "rounds (--rounds) must be in 1..1,000,000, got 0"),
        ("--evaluate-every=0", "evaluate_every must be >= 1, got 0"),
        ("--max-round-attempts=0", "max_round_attempts must be >= 1, got 0"),
        ("--wait-for-clients-s=nan", "wait_for_clients_s must be a finite number of seconds > 0, got nan"),
        ("--wait-for-clients-s=inf", "wait_for_clients_s must be a finite number of seconds > 0, got inf"),
        ("--round-timeout-s=-1", "round_timeout_s must be a finite number of seconds > 0, or unset for no deadline"),
        # inf was accepted, and every daemon under a parallel plan failed every round ("timeout_s must be finite")
        ("--round-timeout-s=inf", "round_timeout_s must be a finite number of seconds > 0, or unset for no deadline"),
        ("--liveness-timeout-s=nan", "liveness_timeout_s (nan) must exceed heartbeat_interval_s (5.0)"),
        ("--chunk-bytes=0", "chunk_bytes must be in [1 KiB, 64 MiB], got 0"),
        ("--linger-s=nan", "linger_s must be a number of seconds >= 0, got nan"),
        ("--linger-s=inf", "linger_s must be a number of seconds >= 0, got inf"),
        # it ran without effect and without a word, as simulate's did
        ("--min-delta=0.01", "round.min_delta (--min-delta) takes effect only with a plateau rule (--patience N)"),
        ("--set=round.min_delta=0.01", "round.min_delta (--min-delta) takes effect only with a plateau rule"),
        ("--set=min_delta=0.01", "round.min_delta (--min-delta) takes effect only with a plateau rule"),  # flat form
    ],
)
def test_every_server_value_is_checked_before_any_side_effect(
    flag: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # these were checked only after the state directory was made, the data loaded and (for the round settings)
    # the server listening; linger_s NaN raised ValueError after the last round and inf never ended the server
    state = tmp_path / "state"
    code = main(["server", "start", "--insecure", "--task", "simulations.tasks:demo_task", "--address",
                 "127.0.0.1:0", "--state-dir", str(state), flag])  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("fedcore: error: ") and message in err, err
    assert not state.exists()


@pytest.mark.parametrize("value", ["nan", "-5", "0"])
def test_the_client_refuses_a_give_up_time_that_is_not_positive(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    # NaN never gave up (every comparison with it is false); -5 gave up after the first failed attempt (exit 3)
    code = main(["client", "start", "--insecure", "--server", "127.0.0.1:1", "--client-id", "c0",
                 f"--give-up-after-s={value}"])  # fmt: skip
    assert code == 2
    assert f"give_up_after_s (--give-up-after-s) must be > 0 seconds, got {float(value)}" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["inf", "nan", "0"])
def test_the_client_refuses_a_poll_time_that_is_not_finite_and_positive(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """--poll-s inf was accepted, as the server's --wait-for-clients-s inf was: the wait between polls overflowed."""
    code = main(["client", "start", "--insecure", "--server", "127.0.0.1:1", "--client-id", "c0", f"--poll-s={value}"])
    assert code == 2
    assert "poll_s (--poll-s) must be a finite number of seconds > 0" in capsys.readouterr().err
