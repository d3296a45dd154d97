"""TLS files are loaded and checked with ``cryptography`` before gRPC sees them, so each problem is named.

gRPC itself reported all of these on the server as "cannot listen on ... Failed to bind", and on the client
as a closed socket, retried forever.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from client.daemon import ClientDaemon, DaemonConfig
from fedcore.cli import main
from fedcore.errors import ConfigError
from privacy.tls import CLIENT_FLAGS, SERVER_FLAGS, init_certs, load_ca_bundle, load_identity


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("certs")
    init_certs(out, clients=["client-000"])
    return out


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _encrypted_key(certs: Path, tmp: Path) -> Path:
    key = serialization.load_pem_private_key((certs / "server.key").read_bytes(), password=None)
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"secret"),
    )
    return _write(tmp / "encrypted.key", pem)


def _expired_cert(certs: Path, tmp: Path) -> Path:
    """The server's own key, in a certificate from the run's CA that expired yesterday."""
    ca_cert = x509.load_pem_x509_certificate((certs / "ca.pem").read_bytes())
    ca_key = serialization.load_pem_private_key((certs / "ca.key").read_bytes(), password=None)
    key = serialization.load_pem_private_key((certs / "server.key").read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey) and isinstance(key, ec.EllipticCurvePrivateKey)
    now = datetime.datetime(2026, 1, 10, tzinfo=datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, "localhost")]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(7)
        .not_valid_before(now - datetime.timedelta(days=30))
        .not_valid_after(now - datetime.timedelta(days=1))
        .sign(ca_key, hashes.SHA256())
    )
    return _write(tmp / "expired.pem", cert.public_bytes(serialization.Encoding.PEM))


def _der_cert(certs: Path, tmp: Path) -> Path:
    cert = x509.load_pem_x509_certificate((certs / "server.pem").read_bytes())
    return _write(tmp / "server.der", cert.public_bytes(serialization.Encoding.DER))


def _empty(certs: Path, tmp: Path) -> Path:
    return _write(tmp / "empty.pem", b"\n")


#: a file relative to the certs directory, or a maker of one from (certs directory, temporary directory)
CaseFile = str | Callable[[Path, Path], Path]

# case: (certificate, key) relative to the certs directory, or a maker, and the expected message
CASES: dict[str, tuple[CaseFile, CaseFile, str]] = {
    "encrypted key": ("server.pem", _encrypted_key, "--tls-key '{key}' is encrypted with a passphrase, which gRPC "
                      "cannot ask for; write an unencrypted copy"),
    "key of another certificate": ("server.pem", "clients/client-000.key", "--tls-key '{key}' is not the private "
                                   "key of the certificate --tls-cert '{cert}' (issued to 'CN=localhost,O=fedcore')"),
    "cert and key swapped": ("server.key", "server.pem", "--tls-cert '{cert}' holds a private key, not a "
                             "certificate; are the certificate and key files swapped?"),
    "certificate not PEM": (_der_cert, "server.key", "--tls-cert '{cert}' is not PEM (perhaps DER or another "
                            "format); expected a PEM certificate beginning with '-----BEGIN CERTIFICATE-----'"),
    "key not PEM": ("server.pem", "ca.pem", "--tls-key '{key}' holds a certificate, not a private key"),
    "expired certificate": (_expired_cert, "server.key", "--tls-cert '{cert}': the certificate for 'CN=localhost' "
                            "expired on 2026-01-09 00:00 UTC; issue a new one"),
    "missing certificate": ("nowhere.pem", "server.key", "--tls-cert '{cert}': no such file (the certificate); "
                            "make a matching set with `fedcore certs init"),
    "a client certificate": ("clients/client-000.pem", "clients/client-000.key", "--tls-cert '{cert}' is a client "
                             "certificate (its extended key usage does not allow server authentication)"),
    "the CA's own pair": ("ca.pem", "ca.key", "--tls-cert '{cert}' is a CA certificate ('CN=fedcore CA,O=fedcore'), "
                          "not the server's own; give the server's certificate and key signed by that CA"),
    "empty certificate": (_empty, "server.key", "--tls-cert '{cert}' is empty; give the certificate file"),
    "empty key": ("server.pem", _empty, "--tls-key '{key}' is empty; give the private key file"),
}  # fmt: skip


def _paths(case: str, certs: Path, tmp: Path) -> tuple[Path, Path, str]:
    cert, key, message = CASES[case]
    cert_path = cert(certs, tmp) if callable(cert) else certs / cert
    key_path = key(certs, tmp) if callable(key) else certs / key
    return cert_path, key_path, message.format(cert=cert_path, key=key_path)


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_problem_with_the_servers_pair_is_named(case: str, certs: Path, tmp_path: Path) -> None:
    cert, key, message = _paths(case, certs, tmp_path)
    with pytest.raises(ConfigError) as info:
        load_identity(cert, key, role="server", flags=SERVER_FLAGS)
    assert message in str(info.value)


def test_the_good_pair_loads_as_written(certs: Path) -> None:
    identity = load_identity(certs / "server.pem", certs / "server.key", role="server", flags=SERVER_FLAGS)
    assert identity.cert_pem == (certs / "server.pem").read_bytes()
    assert identity.key_pem == (certs / "server.key").read_bytes()
    assert load_ca_bundle(certs / "ca.pem", flag="--client-ca") == (certs / "ca.pem").read_bytes()
    assert load_ca_bundle(None, flag="--client-ca") is None


def test_ca_files_are_checked(certs: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"--client-ca '.*ca\.key' holds a private key, not a CA certificate"):
        load_ca_bundle(certs / "ca.key", flag="--client-ca")
    with pytest.raises(ConfigError, match="the CA certificate for 'CN=localhost' expired on 2026-01-09"):
        load_ca_bundle(_expired_cert(certs, tmp_path), flag="--ca-cert")
    garbage = _write(
        tmp_path / "garbage.pem", b"-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydA==\n-----END CERTIFICATE-----\n"
    )
    with pytest.raises(ConfigError, match="the CA certificate cannot be parsed"):
        load_ca_bundle(garbage, flag="--ca-cert")
    # a leaf certificate where the CA belongs (it says CA:FALSE: it cannot have signed the other side's)
    with pytest.raises(ConfigError, match=r"--client-ca '.*server\.pem' holds the certificate of 'CN=localhost,"
                       r"O=fedcore', which is not a CA \(basic constraints CA:FALSE\)"):  # fmt: skip
        load_ca_bundle(certs / "server.pem", flag="--client-ca")
    with pytest.raises(ConfigError, match=r"--ca-cert '.*empty\.pem' is empty; give the CA certificate file"):
        load_ca_bundle(_empty(certs, tmp_path), flag="--ca-cert")


@pytest.mark.parametrize("case", ["encrypted key", "cert and key swapped", "key of another certificate"])
def test_the_server_names_the_problem_before_creating_anything(
    case: str, certs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cert, key, message = _paths(case, certs, tmp_path)
    state = tmp_path / "state"
    code = main(["server", "start", "--task", "simulations.tasks:demo_task", "--address", "127.0.0.1:0",
                 "--state-dir", str(state), "--tls-cert", str(cert), "--tls-key", str(key)])  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and "Failed to bind" not in err
    assert not state.exists()


def test_the_client_pair_and_ca_are_checked_before_connecting(certs: Path, tmp_path: Path) -> None:
    def daemon(**kw: object) -> ClientDaemon:
        config = DaemonConfig(server="127.0.0.1:1", client_id="client-000", task="m:f", **kw)  # type: ignore[arg-type]
        return ClientDaemon(config, factory=lambda ctx: None)  # type: ignore[arg-type,return-value]

    clients = certs / "clients"
    with pytest.raises(ConfigError, match=r"--key '.*server\.key' is not the private key of the certificate --cert"):
        daemon(ca_cert=certs / "ca.pem", cert=clients / "client-000.pem", key=certs / "server.key")
    with pytest.raises(ConfigError, match=r"--cert '.*server\.pem' is a server certificate"):
        daemon(ca_cert=certs / "ca.pem", cert=certs / "server.pem", key=certs / "server.key")
    with pytest.raises(ConfigError, match=r"--cert '.*ca\.pem' is a CA certificate .*, not the client's own"):
        daemon(ca_cert=certs / "ca.pem", cert=certs / "ca.pem", key=certs / "ca.key")
    with pytest.raises(ConfigError, match=r"--ca-cert '.*server\.pem' holds the certificate of 'CN=localhost"):
        daemon(ca_cert=certs / "server.pem")
    with pytest.raises(ConfigError, match=r"--ca-cert '.*missing\.pem': no such file \(the CA certificate\)"):
        daemon(ca_cert=tmp_path / "missing.pem")
    encrypted = _encrypted_key(certs, tmp_path)
    with pytest.raises(ConfigError, match=r"--key .* is encrypted with a passphrase"):
        load_identity(certs / "server.pem", encrypted, role="client", flags=CLIENT_FLAGS)


def test_certs_init_refuses_a_host_with_a_port_and_a_damaged_ca(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"--host \(a DNS name or IP address, no port\): 'server.example.org:8443'"):
        init_certs(tmp_path / "a", hosts=("server.example.org:8443",))
    assert not (tmp_path / "a").exists()
    init_certs(tmp_path / "b")
    (tmp_path / "b" / "ca.key").write_bytes((tmp_path / "b" / "ca.pem").read_bytes())
    with pytest.raises(ConfigError, match=r"--out '.*ca\.key' holds a certificate, not a private key"):
        init_certs(tmp_path / "b", clients=["client-000"])


def test_certs_init_refuses_to_sign_with_a_key_that_is_not_the_cas(tmp_path: Path) -> None:
    # the certificates it wrote would fail verification against ca.pem on every connection
    init_certs(tmp_path, clients=["client-000"])
    (tmp_path / "ca.key").write_bytes((tmp_path / "server.key").read_bytes())
    before = (tmp_path / "server.pem").read_bytes()
    with pytest.raises(ConfigError, match=r"ca\.key is not the key of ca\.pem"):
        init_certs(tmp_path, clients=["client-001"])
    assert (tmp_path / "server.pem").read_bytes() == before and not (tmp_path / "clients" / "client-001.pem").exists()


def test_adding_a_client_keeps_the_servers_certificate(tmp_path: Path) -> None:
    """`certs init --client client-002` on a CA made with `--host server.example.org` wrote the server certificate
    again for localhost, and clients connecting by the server's name failed after its restart."""
    out = tmp_path / "certs"
    assert main(["certs", "init", "--out", str(out), "--host", "server.example.org", "--clients", "2"]) == 0
    server, key, tokens = (out / "server.pem").read_bytes(), (out / "server.key").read_bytes(), (out / "tokens.txt")
    first_tokens = tokens.read_text().splitlines()[1:]
    assert main(["certs", "init", "--out", str(out), "--client", "client-002"]) == 0
    assert (out / "server.pem").read_bytes() == server and (out / "server.key").read_bytes() == key
    assert tokens.read_text().splitlines()[1:3] == first_tokens and (out / "clients" / "client-002.pem").exists()
    assert main(["certs", "init", "--out", str(out), "--host", "other.example.org"]) == 0  # names given: written
    assert (out / "server.pem").read_bytes() != server
