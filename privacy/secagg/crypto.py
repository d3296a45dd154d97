"""The cryptography of SecAgg+, all from the ``cryptography`` library (Bonawitz et al. 2017, §4; Bell et al. 2020).

- Key agreement: X25519 (RFC 7748). Each client makes two fresh key pairs per round: one to encrypt the shares
  it sends its neighbours, one whose agreements seed the pairwise masks.
- Key derivation: HKDF-SHA256 (RFC 5869) of the agreed secret, with ``info`` naming the purpose, the round and
  both client ids, so no key serves two purposes, rounds or pairs.
- Share encryption: AES-256-GCM with a random 96-bit nonce; the associated data binds the round, the sender and
  the receiver, so a ciphertext replayed in another round or redirected to another client fails authentication.
- Mask expansion: AES-128-CTR keystream keyed by the first 16 bytes of a 32-byte seed (nonce 0: each seed expands
  exactly one mask), read as little-endian unsigned field elements. Never numpy's RNG. The seeds are uniformly
  random (HKDF outputs or OS CSPRNG bytes), so those 16 bytes are a uniform 128-bit key: 128-bit security, as
  X25519's, with 10 AES rounds per block instead of AES-256's 14 (expanding masks is most of the protocol's
  compute).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, CipherContext, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

from fedcore.errors import ProtocolError

KEY_BYTES = 32
"""Bytes of an X25519 public or private key, of a derived key and of a PRG seed."""

MASK_KEY_BYTES = 16
"""Bytes of a seed that key its mask's AES-128-CTR keystream (:class:`MaskExpander`)."""

NONCE_BYTES = 12
TAG_BYTES = 16
_LABEL = b"fedcore/secagg/v1/"
_ZERO_COUNTER = bytes(16)


def new_private_key() -> X25519PrivateKey:
    """A fresh X25519 private key from the OS CSPRNG."""
    return X25519PrivateKey.generate()


def public_bytes(key: X25519PrivateKey) -> bytes:
    """The raw 32-byte public key of ``key``."""
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def private_bytes(key: X25519PrivateKey) -> bytes:
    """The raw 32-byte private key (what SecAgg+ secret-shares as the mask secret key)."""
    return key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())


def private_key(raw: bytes) -> X25519PrivateKey:
    """The X25519 private key of 32 raw bytes (a reconstructed mask secret key).

    Raises:
        ProtocolError: not 32 bytes.
    """
    if len(raw) != KEY_BYTES:
        raise ProtocolError(f"an X25519 private key has {KEY_BYTES} bytes, got {len(raw)}")
    return X25519PrivateKey.from_private_bytes(raw)


def context(round: int, attempt: int, *ids: str) -> bytes:
    """Unambiguous bytes of a round, its attempt and client ids (each length-prefixed), for HKDF info and AEAD
    data."""
    parts = [struct.pack(">QI", round, attempt)]
    for client_id in ids:
        data = client_id.encode()
        parts.append(struct.pack(">H", len(data)) + data)
    return b"".join(parts)


def agree(key: X25519PrivateKey, peer_public: bytes, purpose: bytes, info: bytes) -> bytes:
    """A 32-byte key for ``purpose``: HKDF-SHA256 of the X25519 agreement of ``key`` with ``peer_public``.

    Args:
        key: our private key.
        peer_public: the peer's raw 32-byte public key.
        purpose: what the key is for (e.g. ``b"share-encryption"``); keys for different purposes differ.
        info: the round, attempt and pair of client ids (:func:`context`, the ids in the same order on both
            sides).

    Raises:
        ProtocolError: a public key of the wrong size, or one of low order (the agreement would be all zeros).
    """
    if len(peer_public) != KEY_BYTES:
        raise ProtocolError(f"an X25519 public key has {KEY_BYTES} bytes, got {len(peer_public)}")
    try:
        shared = key.exchange(X25519PublicKey.from_public_bytes(peer_public))
    except ValueError as exc:  # all-zero shared secret: a low-order public key
        raise ProtocolError(f"X25519 agreement failed: {exc}") from None
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=_LABEL + purpose + info).derive(shared)


def derive(seed: bytes, purpose: bytes, info: bytes) -> bytes:
    """A 32-byte key for ``purpose`` derived from a secret ``seed`` by HKDF-SHA256."""
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=_LABEL + purpose + info).derive(seed)


def encrypt(key: bytes, plaintext: bytes, associated: bytes) -> bytes:
    """AES-256-GCM: ``nonce || ciphertext || tag`` (``len(plaintext) + 28`` bytes), authenticating ``associated``."""
    nonce = os.urandom(NONCE_BYTES)
    return nonce + AESGCM(key).encrypt(nonce, plaintext, associated)


def decrypt(key: bytes, message: bytes, associated: bytes) -> bytes:
    """The plaintext of :func:`encrypt`'s ``message``.

    Raises:
        ProtocolError: the message is too short, or it or ``associated`` was altered (wrong round, wrong sender
            or receiver, tampered bytes).
    """
    if len(message) < NONCE_BYTES + TAG_BYTES:
        raise ProtocolError(f"a share ciphertext has at least {NONCE_BYTES + TAG_BYTES} bytes, got {len(message)}")
    try:
        return AESGCM(key).decrypt(message[:NONCE_BYTES], message[NONCE_BYTES:], associated)
    except InvalidTag:
        raise ProtocolError(
            "a share ciphertext failed authentication (tampered, or bound to another round, sender or receiver)"
        ) from None


class MaskExpander:
    """Expands 32-byte seeds into masks over the field and adds or subtracts them from a vector, block by block.

    Each seed's keystream is AES-128-CTR keyed by the seed's first :data:`MASK_KEY_BYTES` bytes (``cryptography``'s
    OpenSSL, AES-NI where the CPU has it) with a zero counter block; element ``i`` of the mask is the little-endian
    unsigned integer of keystream bytes ``[i·w, (i+1)·w)`` for the field dtype's width ``w``. Arithmetic wraps modulo
    ``2^(8w)``, which is also correct modulo ``2^b`` for ``b <= 8w`` once the caller reduces the result. Memory: one
    block of keystream, shared by all seeds.

    Args:
        dtype: an unsigned little-endian numpy dtype (``RoundParams.dtype``).
        block: elements per block.
    """

    def __init__(self, dtype: np.dtype, *, block: int = 1 << 18) -> None:
        self.dtype = np.dtype(dtype)
        self.block = block
        nbytes = block * self.dtype.itemsize
        self._zeros = memoryview(bytes(nbytes))
        self._buffer = bytearray(nbytes + 15)  # update_into needs block_size - 1 spare bytes

    def stream(self, seed: bytes) -> CipherContext:
        """A fresh keystream of ``seed``; pass it to :meth:`apply` for consecutive blocks of one vector."""
        if len(seed) != KEY_BYTES:
            raise ProtocolError(f"a mask seed has {KEY_BYTES} bytes, got {len(seed)}")
        return Cipher(algorithms.AES(seed[:MASK_KEY_BYTES]), modes.CTR(_ZERO_COUNTER)).encryptor()

    def take(self, stream: CipherContext, count: int) -> np.ndarray:
        """The next ``count`` (<= block) mask elements of ``stream``: a view valid until the next call."""
        nbytes = count * self.dtype.itemsize
        stream.update_into(self._zeros[:nbytes], self._buffer)
        return np.frombuffer(self._buffer, dtype=self.dtype, count=count)

    def apply(self, out: np.ndarray, streams: Sequence[tuple[CipherContext, int]]) -> None:
        """Add (sign +1) or subtract (sign -1) the next ``out.size`` elements of each stream to ``out`` in place."""
        for start in range(0, out.size, self.block):
            part = out[start : start + self.block]
            for stream, sign in streams:
                mask = self.take(stream, part.size)
                if sign > 0:
                    np.add(part, mask, out=part)
                else:
                    np.subtract(part, mask, out=part)


def expand(seed: bytes, length: int, dtype: np.dtype) -> np.ndarray:
    """The whole mask of ``seed``: ``length`` elements of ``dtype`` (a new array)."""
    out = np.zeros(length, dtype=dtype)
    expander = MaskExpander(dtype, block=min(max(length, 1), 1 << 18))
    expander.apply(out, [(expander.stream(seed), 1)])
    return out
