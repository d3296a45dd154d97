"""TLS identities for deployment, made with ``cryptography``: a CA, a server certificate, client certificates.

``fedcore certs init --out certs --client client-000 --client client-001`` writes::

    ca.pem  ca.key                  the run's certificate authority (keep ca.key offline)
    server.pem  server.key          the server's certificate (names from --host; localhost and 127.0.0.1 default)
    clients/<id>.pem  <id>.key      one certificate per client, common name = client id (mutual TLS)
    tokens.txt                      "client_id token" lines for the server's tokens_file (random, 256-bit, hex)

Keys are ECDSA P-256; private key files and tokens.txt are written with mode 0600. A secret file the server or a
daemon reads (a private key, a tokens or token file) that its group or others may read draws a warning with the
``chmod`` that fixes it (:func:`exposure_warning`), for every such file alike; it is not refused, since a group
may be exactly who is meant to share it.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
import shlex
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes, PublicKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedcore.config import parse_host
from fedcore.errors import ConfigError

_VALID_DAYS = 365


@dataclass(frozen=True)
class Identity:
    """A certificate and its private key, PEM-encoded."""

    cert_pem: bytes
    key_pem: bytes


_CERT_BEGIN = b"-----BEGIN CERTIFICATE-----"
_MAKE_THEM = "make a matching set with `fedcore certs init --out certs`"


@dataclass(frozen=True)
class TlsFiles:
    """The flag names under which the user gave the TLS files, for messages (server and client differ)."""

    cert: str
    key: str
    ca: str


SERVER_FLAGS = TlsFiles(cert="--tls-cert", key="--tls-key", ca="--client-ca")
CLIENT_FLAGS = TlsFiles(cert="--cert", key="--key", ca="--ca-cert")


def _read_file(path: Path, flag: str, what: str) -> bytes:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{flag} {str(path)!r}: no such file (the {what}); {_MAKE_THEM}") from None
    except IsADirectoryError:
        raise ConfigError(f"{flag} {str(path)!r} is a directory; give the {what} file") from None
    except OSError as exc:
        raise ConfigError(f"{flag} {str(path)!r}: cannot read the {what}: {exc.strerror or exc}") from None
    if not data.strip():
        raise ConfigError(f"{flag} {str(path)!r} is empty; give the {what} file ({_MAKE_THEM})")
    return data


def exposure_warning(path: Path, what: str) -> str | None:
    """A warning for a secret file ``path`` (``what`` names it: "the tokens file (--tokens-file)") whose POSIX
    mode lets its group or others read or write it, with the ``chmod`` that fixes it; None when only its owner may
    (mode ``0600`` or stricter), on a system without POSIX modes, or when it cannot be examined (reading it then
    says why).
    """
    if os.name != "posix":
        return None
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError:
        return None
    if not mode & 0o077:
        return None
    who = " and ".join(w for w, bits in (("its group", 0o070), ("others", 0o007)) if mode & bits)
    return (
        f"{what} {str(path)!r} has mode {mode:04o}: {who} may read it, and with it this secret; make it readable "
        f"by its owner only: chmod 600 {shlex.quote(str(path))}"
    )


def _is_ca(cert: x509.Certificate) -> bool | None:
    """Whether ``cert`` may sign certificates (basic constraints CA:TRUE); None when it does not say."""
    try:
        return bool(cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca)
    except x509.ExtensionNotFound:
        return None


def _is_private_key_pem(data: bytes) -> bool:
    return b"-----BEGIN" in data and b"PRIVATE KEY-----" in data


def load_certificates(path: Path, *, flag: str, what: str = "certificate") -> list[x509.Certificate]:
    """Read a PEM file of one or more certificates (a chain, or CA certificates) and check each is valid now.

    Args:
        path: the file. flag: the option that named it (for messages). what: what the file is meant to hold.

    Raises:
        ConfigError: missing, empty or unreadable file, a private key or non-PEM data where certificates belong, a
            certificate that cannot be parsed, is expired or not yet valid. The message names the file and what
            to do.
    """
    data = _read_file(path, flag, what)
    if _CERT_BEGIN not in data:
        if _is_private_key_pem(data):
            raise ConfigError(
                f"{flag} {str(path)!r} holds a private key, not a {what}; are the certificate and key files swapped?"
            )
        kind = "a PEM file of another kind" if b"-----BEGIN" in data else "not PEM (perhaps DER or another format)"
        raise ConfigError(
            f"{flag} {str(path)!r} is {kind}; expected a PEM {what} beginning with '-----BEGIN CERTIFICATE-----' "
            "(convert DER with `openssl x509 -inform der -in FILE -out FILE.pem`)"
        )
    try:
        certs = x509.load_pem_x509_certificates(data)
    except ValueError as exc:
        raise ConfigError(f"{flag} {str(path)!r}: the {what} cannot be parsed ({exc}); {_MAKE_THEM}") from None
    now = datetime.datetime.now(datetime.UTC)
    for cert in certs:
        subject = cert.subject.rfc4514_string()
        if now < cert.not_valid_before_utc:
            raise ConfigError(
                f"{flag} {str(path)!r}: the {what} for {subject!r} is not valid before "
                f"{cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC; check this machine's clock"
            )
        if now > cert.not_valid_after_utc:
            raise ConfigError(
                f"{flag} {str(path)!r}: the {what} for {subject!r} expired on "
                f"{cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC; issue a new one (`fedcore certs init` reuses the CA)"
            )
    return certs


def load_private_key(path: Path, *, flag: str) -> PrivateKeyTypes:
    """Read an unencrypted PEM private key.

    Raises:
        ConfigError: missing, empty or unreadable file, a certificate where the key belongs, a passphrase-encrypted key
            (gRPC cannot ask for a passphrase), or data that is not a private key.
    """
    data = _read_file(path, flag, "private key")
    if not _is_private_key_pem(data):
        if _CERT_BEGIN in data:
            raise ConfigError(
                f"{flag} {str(path)!r} holds a certificate, not a private key; are the certificate and key files "
                "swapped?"
            )
        raise ConfigError(
            f"{flag} {str(path)!r} is not a PEM private key (expected '-----BEGIN PRIVATE KEY-----' or "
            "'-----BEGIN EC/RSA PRIVATE KEY-----')"
        )
    try:
        return serialization.load_pem_private_key(data, password=None)
    except TypeError:  # cryptography: "Password was not given but private key is encrypted"
        raise ConfigError(
            f"{flag} {str(path)!r} is encrypted with a passphrase, which gRPC cannot ask for; write an "
            f"unencrypted copy readable only by this user (`openssl pkey -in {path} -out plain.key` and "
            "chmod 600 plain.key)"
        ) from None
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise ConfigError(f"{flag} {str(path)!r}: the private key cannot be loaded ({exc})") from None


def _public_der(key: PublicKeyTypes | PrivateKeyTypes) -> bytes:
    public = key.public_key() if hasattr(key, "public_key") else key
    return public.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def load_identity(cert: Path, key: Path, *, role: Literal["server", "client"], flags: TlsFiles) -> Identity:
    """Load and check a certificate (chain) and its private key before gRPC gets them.

    gRPC reports every problem with these files as a failure to bind (server) or a closed socket (client); this
    says what is wrong instead.

    Args:
        cert, key: the PEM files. role: what the certificate is for (checked against its extended key usage,
            when it has one). flags: the option names, for messages.

    Returns:
        The PEM bytes, as read.

    Raises:
        ConfigError: a file is missing, unreadable, not PEM, swapped with the other, encrypted, expired or not
            yet valid; the key does not belong to the certificate; the certificate is a CA's or not for ``role``.
    """
    chain = load_certificates(cert, flag=flags.cert)
    private = load_private_key(key, flag=flags.key)
    leaf = chain[0]
    if _public_der(leaf.public_key()) != _public_der(private):
        raise ConfigError(
            f"{flags.key} {str(key)!r} is not the private key of the certificate {flags.cert} {str(cert)!r} "
            f"(issued to {leaf.subject.rfc4514_string()!r}); give the key made together with that certificate"
        )
    if _is_ca(leaf):
        made = "server.pem and server.key" if role == "server" else "clients/<id>.pem and .key"
        raise ConfigError(
            f"{flags.cert} {str(cert)!r} is a CA certificate ({leaf.subject.rfc4514_string()!r}), not the {role}'s "
            f"own; give the {role}'s certificate and key signed by that CA ({made} from `fedcore certs init`)"
        )
    try:
        usage = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        usage = None
    wanted = ExtendedKeyUsageOID.SERVER_AUTH if role == "server" else ExtendedKeyUsageOID.CLIENT_AUTH
    if usage is not None and wanted not in usage and ExtendedKeyUsageOID.ANY_EXTENDED_KEY_USAGE not in usage:
        other = "client" if role == "server" else "server"
        made = "server.pem" if role == "server" else "clients/<id>.pem"
        raise ConfigError(
            f"{flags.cert} {str(cert)!r} is a {other} certificate (its extended key usage does not allow "
            f"{role} authentication); give the {role}'s certificate ({made} from `fedcore certs init`)"
        )
    return Identity(_read_file(cert, flags.cert, "certificate"), _read_file(key, flags.key, "private key"))


def load_ca_bundle(path: Path | None, *, flag: str) -> bytes | None:
    """Read and check a CA certificate file (PEM, one or more certificates); None when no path was given.

    Raises:
        ConfigError: see :func:`load_certificates` (missing, empty, not PEM, a key instead, expired, not yet valid);
            a certificate that says it is no CA (basic constraints CA:FALSE, e.g. a server's).
    """
    if path is None:
        return None
    for cert in load_certificates(path, flag=flag, what="CA certificate"):
        if _is_ca(cert) is False:
            raise ConfigError(
                f"{flag} {str(path)!r} holds the certificate of {cert.subject.rfc4514_string()!r}, which is not a CA "
                "(basic constraints CA:FALSE) and cannot have signed the other side's certificate; give the CA "
                "certificate (ca.pem from `fedcore certs init`)"
            )
    return _read_file(path, flag, "CA certificate")


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedcore"), x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    )


def make_ca(common_name: str = "fedcore CA", *, days: int = _VALID_DAYS) -> Identity:
    """A self-signed CA certificate (path length 0) and its key."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return Identity(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def issue(
    ca: Identity, common_name: str, *, hosts: Sequence[str] = (), client: bool, days: int = _VALID_DAYS
) -> Identity:
    """Issue a leaf certificate signed by ``ca``.

    Args:
        ca: the issuing CA.
        common_name: the subject's common name (for clients: the client id the server checks).
        hosts: DNS names and IP addresses for the subject alternative name (servers).
        client: a client certificate (extended key usage clientAuth) rather than a server one (serverAuth).
    """
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem)
    ca_key = serialization.load_pem_private_key(ca.key_pem, password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ConfigError("the CA key must be an EC key made by `fedcore certs init`")
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH]),
            critical=False,
        )
    )
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    if not client and not names:
        names.append(x509.DNSName(common_name))
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    return Identity(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def _write(path: Path, data: bytes, *, private: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)


DEFAULT_HOSTS = ("localhost", "127.0.0.1")
"""The names a server certificate is made for when none are given (``fedcore certs init`` without ``--host``)."""


def init_certs(out: Path, *, hosts: Sequence[str] | None = None, clients: Sequence[str] = ()) -> list[Path]:
    """Write a CA, a server identity for ``hosts``, one identity and one token per client into ``out``.

    An existing CA in ``out`` is reused (so more clients can be added later), and so is an existing server identity
    when ``hosts`` is None (adding a client keeps the server's names, e.g. ``server.example.org``); with ``hosts``
    given, or none there yet, the server identity is written for ``hosts`` (default :data:`DEFAULT_HOSTS`). Client
    files are overwritten; tokens of clients not named again are kept.

    Returns:
        The files written.

    Raises:
        ConfigError: a client id is empty or not usable as a file name; a host is not a DNS name or IP address
            (e.g. it carries a port); the CA found in ``out`` is damaged, expired or encrypted, or its key is not
            that of its certificate.
    """
    for cid in clients:
        if not cid or "/" in cid or cid.startswith(".") or not cid.isprintable() or " " in cid:
            raise ConfigError(f"client id {cid!r} cannot be used (no spaces, slashes or leading dots)")
    keep_server = hosts is None and (out / "server.pem").exists() and (out / "server.key").exists()
    hosts = [parse_host(host, what="--host (a DNS name or IP address, no port)") for host in hosts or DEFAULT_HOSTS]
    tokens_path = out / "tokens.txt"
    tokens: dict[str, str] = {}
    if tokens_path.exists():
        try:
            kept = tokens_path.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError as exc:  # not ours: refuse rather than overwrite it
            raise ConfigError(
                f"{str(tokens_path)!r} is not UTF-8 text ({exc.reason} at byte {exc.start}); it is not a tokens "
                "file fedcore wrote: move it away or choose another --out"
            ) from None
        for line in kept:
            parts = line.split()
            if len(parts) == 2 and not line.startswith("#"):
                tokens[parts[0]] = parts[1]
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    ca_pem, ca_key = out / "ca.pem", out / "ca.key"
    if ca_pem.exists() and ca_key.exists():
        (ca_cert, *_) = load_certificates(ca_pem, flag="--out", what="CA certificate")  # damaged, expired: named
        if _public_der(load_private_key(ca_key, flag="--out")) != _public_der(ca_cert.public_key()):
            raise ConfigError(
                f"--out {str(out)!r}: ca.key is not the key of ca.pem; certificates signed with it would fail "
                "verification. Put back the CA's own key, or use another --out for a new CA"
            )
        ca = Identity(ca_pem.read_bytes(), ca_key.read_bytes())
    else:
        ca = make_ca()
        _write(ca_pem, ca.cert_pem, private=False)
        _write(ca_key, ca.key_pem, private=True)
        written += [ca_pem, ca_key]
    if not keep_server:
        server = issue(ca, hosts[0] if hosts else "localhost", hosts=hosts, client=False)
        _write(out / "server.pem", server.cert_pem, private=False)
        _write(out / "server.key", server.key_pem, private=True)
        written += [out / "server.pem", out / "server.key"]
    for cid in clients:
        ident = issue(ca, cid, client=True)
        _write(out / "clients" / f"{cid}.pem", ident.cert_pem, private=False)
        _write(out / "clients" / f"{cid}.key", ident.key_pem, private=True)
        written += [out / "clients" / f"{cid}.pem", out / "clients" / f"{cid}.key"]
        # hex: 256 bits that never begin with '-', so `--token VALUE` cannot be read as an option
        tokens[cid] = secrets.token_hex(32)
    if clients:
        text = "# client_id token  (give each client its own line's token; the server reads this file)\n"
        text += "".join(f"{cid} {tok}\n" for cid, tok in sorted(tokens.items()))
        _write(tokens_path, text.encode(), private=True)
        written.append(tokens_path)
    return written
