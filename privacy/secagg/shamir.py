"""Shamir t-of-k secret sharing over the prime field GF(2^521 - 1) (Shamir 1979).

SecAgg+ shares two 32-byte secrets of each client with its ``k`` neighbours: the self-mask seed and the mask
secret key (Bonawitz et al. 2017, §4; Bell et al. 2020). A 256-bit secret is an element of GF(p) for the Mersenne
prime ``p = 2^521 - 1``; the share for the neighbour with evaluation point ``x`` (a nonzero integer, distinct per
neighbour) is ``f(x)`` for a random polynomial ``f`` of degree ``t - 1`` with ``f(0) = secret``. Any ``t`` shares
give the secret back by Lagrange interpolation at 0; fewer than ``t`` reveal nothing about it (every secret is
equally likely). Coefficients come from :mod:`secrets` (the OS CSPRNG). Python integers: sharing and
reconstructing 256-bit secrets among tens of neighbours takes microseconds to milliseconds.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping

from fedcore.errors import ProtocolError

PRIME = (1 << 521) - 1
"""The field's modulus, a Mersenne prime."""

SHARE_BYTES = 66
"""Bytes of one encoded share (a field element, big-endian)."""

SECRET_BYTES = 32
"""Bytes of a shared secret (an X25519 private key or a PRG seed)."""


def split(secret: bytes, threshold: int, points: Iterable[int]) -> dict[int, int]:
    """Shares of ``secret`` (``SECRET_BYTES`` bytes) for the evaluation ``points``, any ``threshold`` of which
    reconstruct it.

    Args:
        secret: the secret, read as a big-endian integer.
        threshold: ``t >= 1``, the polynomial has degree ``t - 1``.
        points: distinct integers in ``1..p-1`` (one per shareholder); at least ``threshold`` of them.

    Returns:
        ``point -> f(point)``, each an integer in ``0..p-1``.

    Raises:
        ProtocolError: a secret of the wrong size, a threshold below 1 or above the number of points, or points
            that repeat or fall outside ``1..p-1``.
    """
    if len(secret) != SECRET_BYTES:
        raise ProtocolError(f"Shamir: a secret has {SECRET_BYTES} bytes, got {len(secret)}")
    xs = list(points)
    if len(set(xs)) != len(xs) or any(not 0 < x < PRIME for x in xs):
        raise ProtocolError("Shamir: evaluation points must be distinct integers in 1..p-1")
    if not 1 <= threshold <= len(xs):
        raise ProtocolError(f"Shamir: threshold {threshold} must be between 1 and the {len(xs)} shareholders")
    coefficients = [int.from_bytes(secret, "big")] + [secrets.randbelow(PRIME) for _ in range(threshold - 1)]
    shares = {}
    for x in xs:
        y = 0
        for c in reversed(coefficients):  # Horner
            y = (y * x + c) % PRIME
        shares[x] = y
    return shares


def combine(shares: Mapping[int, int], threshold: int) -> bytes:
    """The secret from ``threshold`` (or more; the first ``threshold`` are used) shares ``point -> value``.

    Raises:
        ProtocolError: fewer than ``threshold`` shares, repeated or zero points, values outside the field, or a
            result that is not a ``SECRET_BYTES``-byte secret (shares of different secrets mixed).
    """
    if len(shares) < threshold:
        raise ProtocolError(
            f"Shamir: {len(shares)} shares cannot reconstruct a secret shared with threshold {threshold}"
        )
    points = list(shares.items())[:threshold]
    if any(not 0 < x < PRIME or not 0 <= y < PRIME for x, y in points):
        raise ProtocolError("Shamir: a share's point or value lies outside the field")
    secret = 0
    for i, (xi, yi) in enumerate(points):
        numerator, denominator = 1, 1
        for j, (xj, _) in enumerate(points):
            if i != j:
                numerator = numerator * xj % PRIME
                denominator = denominator * (xj - xi) % PRIME
        secret = (secret + yi * numerator * pow(denominator, -1, PRIME)) % PRIME
    if secret >> (8 * SECRET_BYTES):
        raise ProtocolError("Shamir: the shares do not belong to one secret (reconstruction out of range)")
    return secret.to_bytes(SECRET_BYTES, "big")


def encode(value: int) -> bytes:
    """A share value as ``SHARE_BYTES`` big-endian bytes."""
    return value.to_bytes(SHARE_BYTES, "big")


def decode(data: bytes) -> int:
    """The share value of ``encode``'s bytes.

    Raises:
        ProtocolError: not ``SHARE_BYTES`` bytes, or a value outside the field.
    """
    if len(data) != SHARE_BYTES:
        raise ProtocolError(f"Shamir: an encoded share has {SHARE_BYTES} bytes, got {len(data)}")
    value = int.from_bytes(data, "big")
    if value >= PRIME:
        raise ProtocolError("Shamir: an encoded share lies outside the field")
    return value
