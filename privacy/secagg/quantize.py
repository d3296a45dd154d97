"""Quantization of a client's update into the field ``Z_{2^b}``, with its example weight folded in, and back.

A client with integer example weight ``w`` (``0 <= w <= W``) and update ``x`` (float tensors, flattened in the
round's spec order) uploads the vector ``(w·q_1, ..., w·q_D, w)`` where, with clipping range ``c`` and ``L``
quantization levels (:class:`~privacy.secagg.config.RoundParams`),

    y_i = (clip(x_i, -c, c) + c) · L / (2c)  in [0, L],      q_i = floor(y_i) + [u_i < y_i - floor(y_i)],  u_i ~ U[0, 1)

is unbiased stochastic rounding (``E[q_i] = y_i``, ``|q_i - y_i| < 1``; the comparison with the exact fractional
part keeps it unbiased for any ``L``). The dither ``u_i`` is ``d_i / 2^32`` for the AES-128-CTR keystream ``d`` (uint32
words) of a 32-byte rounding key (:class:`~privacy.secagg.crypto.MaskExpander`), so rounding never touches numpy's RNG
and is reproducible when the key is given. The bit budget of the config guarantees ``Σ_clients w·q_i <= n·W·L < 2^b``,
so the unmasked sum ``Z`` of ``n`` uploads is exact, and for any number of clients

    Σ_k w_k x_k  ≈  Z_i · 2c/L - c · Σ_k w_k        (error below 2c/L · Σ_k w_k per coordinate)

which :func:`dequantize` returns with the total weight ``Σ_k w_k`` (the last element of ``Z``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from fedcore.errors import ConfigError, PayloadError
from fedcore.kernels import FUSED_DTYPES, quantize_into
from fedcore.tensors import NamedArrays, TensorSpec, check_finite, check_spec
from privacy.secagg.config import RoundParams
from privacy.secagg.crypto import MaskExpander

DITHER_DTYPE = np.dtype("<u4")
_BLOCK = 1 << 18


def vector_length(spec: Sequence[TensorSpec]) -> int:
    """Field elements of an upload for ``spec``: every coordinate plus one for the weight."""
    return sum(int(np.prod(s.shape, dtype=np.int64)) for s in spec) + 1


def check_quantizable(spec: Sequence[TensorSpec]) -> None:
    """Refuse a spec with a non-float tensor or no tensor at all.

    Raises:
        ConfigError: what is wrong with the spec.
    """
    if not spec:
        raise ConfigError("secure aggregation: the model has no tensors to aggregate")
    for s in spec:
        if np.dtype(s.dtype).kind != "f":
            raise ConfigError(
                f"secure aggregation sums float tensors only; {s.name!r} is {s.dtype}. Leave integer buffers "
                "(e.g. BatchNorm's num_batches_tracked) out of the securely aggregated tensors"
            )


def quantize_block(values: np.ndarray, weight: int, params: RoundParams, dither: np.ndarray) -> np.ndarray:
    """``w·q`` for one block of float values (any float dtype) and its uint32 dither words, as ``params.dtype``.

    Pure: the same inputs give the same output. ``values`` may be any shape; the result is flat.
    """
    scale = params.levels / (2.0 * params.clip)
    y = np.clip(np.ravel(values).astype(np.float64), -params.clip, params.clip)
    y += params.clip
    y *= scale
    whole = np.floor(y)
    y -= whole  # the fractional part, exact
    up = dither * (1.0 / 4294967296.0) < y  # probability y - floor(y)
    np.minimum(whole, params.levels, out=whole)  # guards a float rounding up of (c + c)·L/(2c)
    q = whole.astype(np.uint64)
    q += up
    np.minimum(q, np.uint64(params.levels), out=q)
    q *= np.uint64(weight)
    return q.astype(params.dtype)


def check_weight(weight: object, params: RoundParams) -> int:
    """The weight as an int in ``0..max_weight``.

    Raises:
        ConfigError: a non-integer or negative weight, or one above ``max_weight`` (the bit budget).
    """
    if isinstance(weight, bool) or not isinstance(weight, int | np.integer):
        raise ConfigError(f"secure aggregation: the example weight must be an integer, got {weight!r}")
    if not 0 <= int(weight) <= params.max_weight:
        raise ConfigError(
            f"secure aggregation: example weight {int(weight)} is outside 0..max_weight={params.max_weight}; "
            "raise max_weight in the secure aggregation config (it costs field bits) or cap the weight"
        )
    return int(weight)


def quantize(
    update: Mapping[str, np.ndarray],
    weight: int,
    params: RoundParams,
    spec: Sequence[TensorSpec],
    rounding_key: bytes,
) -> np.ndarray:
    """The unmasked upload of one client: ``(w·q_1, ..., w·q_D, w)`` as a flat array of ``params.dtype``.

    float32 and float64 tensors are quantized by :func:`fedcore.kernels.quantize_into` (one compiled pass per
    block, compiled on first use in a process), other float dtypes by :func:`quantize_block`; both round the same
    values to the same integers, bit for bit.

    Args:
        update: ``name -> float array`` with exactly the names, shapes and dtypes of ``spec``.
        weight: integer example weight, ``0..params.max_weight``.
        params: the round's parameters.
        spec: the tensors, in upload order.
        rounding_key: 32 bytes keying the dither stream (AES-128-CTR); a fresh random key per client and round
            in production, a derived one for reproducible runs.

    Raises:
        PayloadError, NonFiniteError: the update does not match ``spec`` or holds NaN/Inf.
        ConfigError: the weight is not an integer in ``0..max_weight``.
    """
    w = check_weight(weight, params)
    check_spec(update, spec)
    check_finite(update)
    out = np.empty(vector_length(spec), dtype=params.dtype)
    dither = MaskExpander(DITHER_DTYPE, block=_BLOCK)
    stream = dither.stream(rounding_key)
    scale = params.levels / (2.0 * params.clip)
    offset = 0
    for s in spec:
        flat = np.ravel(update[s.name])
        fused = flat.dtype in FUSED_DTYPES
        for start in range(0, flat.size, _BLOCK):
            part = flat[start : start + _BLOCK]
            words = dither.take(stream, part.size)
            target = out[offset : offset + part.size]
            if fused:  # one compiled pass, the same rounding as quantize_block's numpy steps
                quantize_into(part, words, params.clip, scale, np.uint64(params.levels), np.uint64(w), target)
            else:
                target[:] = quantize_block(part, w, params, words)
            offset += part.size
    out[-1] = w
    return out


def dequantize(total: np.ndarray, params: RoundParams, spec: Sequence[TensorSpec]) -> tuple[NamedArrays, int]:
    """The weighted sum ``Σ_k w_k·clip(x_k)`` (float64 arrays of ``spec``'s shapes) and the total weight
    ``Σ_k w_k`` from the unmasked sum of the uploads, for any number of clients.

    Raises:
        PayloadError: ``total`` has the wrong length or dtype.
    """
    if total.dtype != params.dtype or total.shape != (vector_length(spec),):
        raise PayloadError(
            f"secure aggregation: the unmasked sum has dtype {total.dtype} and shape {total.shape}, expected "
            f"{params.dtype} and ({vector_length(spec)},)"
        )
    total_weight = int(total[-1])
    step = params.step
    offset_value = params.clip * total_weight
    out: NamedArrays = {}
    offset = 0
    for s in spec:
        size = int(np.prod(s.shape, dtype=np.int64))
        values = total[offset : offset + size].astype(np.float64)
        values *= step
        values -= offset_value
        out[s.name] = values.reshape(s.shape)
        offset += size
    return out, total_weight
