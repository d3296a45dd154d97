"""A tokens file that holds no token is refused: the server would otherwise run open, letting any client id join
where the user asked for tokens (an empty policy means "no check")."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fedcore.cli import main
from fedcore.errors import ConfigError
from server.service import AuthPolicy, hash_token, load_tokens


@pytest.mark.parametrize("text", ["", "\n\n", "# client_id token\n", "   # only comments\n# here\n"])
def test_a_tokens_file_without_tokens_is_refused(text: str, tmp_path: Path) -> None:
    path = tmp_path / "tokens.txt"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"tokens file '.*tokens\.txt' holds no 'client_id token' line"):
        load_tokens(path)


def test_one_token_makes_a_closed_policy(tmp_path: Path) -> None:
    path = tmp_path / "tokens.txt"
    path.write_text("# comment\nclient-000 abc  # trailing comment\n")
    policy = AuthPolicy(tokens=load_tokens(path))
    assert policy.tokens == {"client-000": hash_token("abc")} and not policy.open


def test_the_server_refuses_an_empty_tokens_file_before_creating_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "tokens.txt").write_text("")
    _refused_at_start(tmp_path, "holds no 'client_id token' line", capsys)


def _refused_at_start(tmp_path: Path, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``fedcore server start --tokens-file tmp_path/tokens.txt`` exits 2 with ``message``, creating no state."""
    state = tmp_path / "state"
    code = main(["server", "start", "--insecure", "--task", "simulations.tasks:demo_task", "--address",
                 "127.0.0.1:0", "--state-dir", str(state), "--tokens-file", str(tmp_path / "tokens.txt")])  # fmt: skip
    assert code == 2
    assert message in capsys.readouterr().err
    assert not state.exists()


def test_a_binary_tokens_file_is_a_clear_error_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a UTF-16 export (its byte-order mark 0xff 0xfe) or a key file given by mistake
    (tmp_path / "tokens.txt").write_bytes(b"\xff\xfec\x00l\x00i\x00")
    with pytest.raises(ConfigError, match=r"tokens file '.*tokens\.txt' is not UTF-8 text"):
        load_tokens(tmp_path / "tokens.txt")
    _refused_at_start(tmp_path, "is not UTF-8 text", capsys)


def test_certs_init_refuses_to_overwrite_a_binary_tokens_file(tmp_path: Path) -> None:
    from privacy.tls import init_certs

    junk = b"\xff\xfec\x00l\x00i\x00"
    (tmp_path / "tokens.txt").write_bytes(junk)
    with pytest.raises(ConfigError, match=r"tokens\.txt' is not UTF-8 text"):
        init_certs(tmp_path, clients=["client-000"])
    assert (tmp_path / "tokens.txt").read_bytes() == junk
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokens.txt"]  # refused before any key was written


def test_a_tokens_file_saved_with_a_byte_order_mark_reads_its_first_client(tmp_path: Path) -> None:
    """A Windows editor's UTF-8 byte-order mark made the first client id '\ufeffclient-000': that client's join
    was refused as unknown."""
    path = tmp_path / "tokens.txt"
    path.write_bytes("\ufeffclient-000 abc\r\nclient-001 def\r\n".encode())
    assert load_tokens(path) == {"client-000": hash_token("abc"), "client-001": hash_token("def")}


@pytest.mark.parametrize(
    ("given", "file_bytes"),
    [
        ("abc\n", None),  # FEDCORE_TOKEN="$(cat token)\n", or a TOML string with its newline
        ("  abc\r\n", None),
        ("", b"abc\n"),
        ("", b"\n  abc  \r\n\n"),
        ("", b"\xef\xbb\xbfabc\r\n"),  # a byte-order mark
    ],
)
def test_every_source_of_the_daemons_token_gives_the_same_token(
    given: str, file_bytes: bytes | None, tmp_path: Path
) -> None:
    """--token-file stripped whitespace while --token and FEDCORE_TOKEN did not: a token with its newline was
    refused by the server as a wrong token, a misleading diagnosis. Every source now gives 'abc'."""
    from client.daemon import DaemonConfig

    file = None
    if file_bytes is not None:
        file = tmp_path / "token"
        file.write_bytes(file_bytes)
    config = DaemonConfig(server="127.0.0.1:1", client_id="c0", insecure=True, token_file=file, token=given)
    assert config.read_token() == "abc"


@pytest.mark.parametrize(
    ("token", "message"),
    [
        ("   \n", "the token (--token, or FEDCORE_TOKEN) is only whitespace"),
        ("abc def", "the token (--token, or FEDCORE_TOKEN) holds whitespace inside it"),
    ],
)
def test_a_token_of_whitespace_or_with_whitespace_inside_is_refused(token: str, message: str) -> None:
    from client.daemon import DaemonConfig

    with pytest.raises(ConfigError, match=re.escape(message)):
        DaemonConfig(server="127.0.0.1:1", client_id="c0", insecure=True, token=token).read_token()
