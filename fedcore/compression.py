"""Update compression: a client mod that shrinks a fit result before it travels, and its server-side inverse.

Four methods, one option (``[strategy] compression``; :class:`CompressionMod` is the ``compress`` client mod):

============  ==========================================================  ===========================================
method        what travels per floating tensor of n elements               bytes / element (float32 model: 4)
============  ==========================================================  ===========================================
``float16``   the update ``y - x`` cast to IEEE half precision              2
``bfloat16``  the update as bfloat16 (float32's top 16 bits, rounded to     2
              nearest even), carried as ``uint16`` bit patterns (numpy has
              no bfloat16 dtype)
``int8``      the update stochastically quantized to 255 levels per block   1 + 4 / block (block 512: 3.97x fewer bytes)
              of ``block`` elements: int8 levels, one float32 scale each
``topk``      the ``k = ceil(fraction * n)`` entries of largest magnitude   8k / n (fraction 0.01: 0.08, 50x fewer)
              of the update plus the client's error-feedback residual
              (per tensor, or over the whole update: ``scope``):
              float values and int32 indices
============  ==========================================================  ===========================================

All four compress the *update* ``y - x`` (the trained model minus the global model the round sent), never the model:
the update is what the aggregator averages, it is orders of magnitude smaller than the weights (so float16 keeps its
relative precision where the weights' own low bits would be lost), and quantization noise and sparsification only
make sense on it (a top-k of the weights would zero most of the model). The server adds the global model back when it
decodes. Tensors that are not floating (integer buffers such as BatchNorm's step counter) travel as they are.
Tensor groups besides the model (SCAFFOLD's ``control``) travel uncompressed.

Methods and the papers followed:

- ``int8``: QSGD's stochastic quantization (Alistarh et al. 2017, "QSGD: Communication-Efficient SGD via Gradient
  Quantization and Encoding"), with its bucketing (one scale per block of ``block`` elements) and the max-norm scale
  the paper's experiments use in place of the 2-norm: for a block v with ``s = max|v_i| / 127``, each element becomes
  ``q_i = floor(v_i / s + u_i)`` with ``u_i ~ U[0, 1)``, so ``q_i`` is ``floor(v_i / s)`` or one more with
  ``P(one more) = frac(v_i / s)`` and ``E[s q_i] = v_i``: unbiased, with variance at most ``s^2 / 4`` per element.
  Levels are written as int8 (no Elias coding: fixed width keeps decoding a block a slice). The uniforms come from
  a generator keyed by (seed, round, client id), so a run is reproducible and simulation and gRPC agree bit for bit.
- ``topk``: top-k sparsification with error feedback (Stich et al. 2018, "Sparsified SGD with Memory"; Lin et al.
  2018, "Deep Gradient Compression", without DGC's momentum correction: the clients train with plain local SGD and
  the server's momentum acts on the aggregate): the client adds the residual kept from its earlier rounds to its
  update, sends the k entries of largest magnitude of the sum, and keeps the rest as the new residual, in its
  persistent state (:class:`client.state.ClientStateStore`, group ``topk-residual``), so nothing it trained is lost,
  only delayed. ``scope = "tensor"`` chooses k per tensor (at least 1), as DGC does per layer; ``scope = "model"``
  chooses ``ceil(fraction * N)`` over all N floating entries of the update together, the top-k operator of Stich
  et al.'s analysis applied to the whole update (Dutta et al. 2020, "On the Discrepancy between the Theoretical
  Analysis and Practical Implementations of Compressed Communication for Distributed Deep Learning", compare the
  two): the same bytes, spent where the update is largest. On the default recipe's CNN the k entries keep 25-29% of
  a first-round update's squared norm per tensor and 42-50% over the model (``bench/compression.py --energy 3``),
  the convolutions and the output layer getting a larger share than their 1%. ``warmup_rounds`` adds DGC's
  exponential sparsity warm-up over the first rounds of the run (:func:`warmup_fraction`): early updates, the
  largest, travel nearly dense, at the price of those rounds' bytes. The residual
  is stored durably before the reply is sent, together with the residual the round started from: a round that is run
  again (the server restarted and lost its replies) starts from that one, so a repeated round counts once (as
  SCAFFOLD's control variates). A client whose update the server rejects keeps its new residual.
- ``float16`` / ``bfloat16``: plain casts (round to nearest even); an update beyond the format's range is refused
  on the client.

On the wire the reply's tensors keep the model's names: ``float16`` / ``bfloat16`` / ``int8`` send one tensor of the
model's shape (dtype float16, uint16, int8), ``topk`` the tensor's k values (the tensor's dtype; with scope ``model``
any k from 0 up, the k of all tensors adding up to ``ceil(fraction * N)``) as the tensor. Side data
travels as a tensor group the server consumes: ``compress-scale`` (int8: float32 scales, ``ceil(n / block)`` per
tensor) and ``compress-index`` (topk: strictly increasing int32 indices into the flattened tensor, int64 beyond 2^31
elements).

Server side (:meth:`CompressionMod.decode`, reached through :func:`fedcore.mods.decode_reply` in the round loop):
the encoded reply is validated completely before anything of it is used (names, dtypes and lengths, the round's
top-k count, indices in range and increasing, scales and values finite and scales >= 0), then it becomes a reply
whose parameters are a :class:`DecodedUpdate`: the model's names, shapes and dtypes, each tensor decoded block by
block as it is read (the global model plus the decoded update, rounded to the model's dtype). The streaming mean
(:class:`~fedcore.aggregation.WeightedMean`) reads it in blocks of 2^18 elements, checks each decoded block is finite
(an overflow is rejected like any NaN) and folds it, so a compressed update never exists densified beyond a block.
The whole-update aggregators (median, Krum, norm bounding, DP) would densify it, so a strategy refuses compression
with anything but the streaming mean, and so does secure aggregation (it masks full updates in a finite field).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, cast

import numpy as np

from fedcore.errors import ClientTaskError, ConfigError, NonFiniteError, PayloadError
from fedcore.messages import FitIns, FitRes, bounded_repr
from fedcore.mods import CallNext, ModContext, StateEntry
from fedcore.seeding import numpy_rng
from fedcore.tensors import NamedArrays, name_mismatch

MOD = "compress"
"""The client mod's registered name."""
METHODS = ("float16", "bfloat16", "int8", "topk")
"""The compression methods (see the module docstring)."""
SCALE_GROUP = "compress-scale"
"""Reply tensor group of the int8 scales (consumed by the server's decode)."""
INDEX_GROUP = "compress-index"
"""Reply tensor group of the top-k indices (consumed by the server's decode)."""
RESIDUAL = "topk-residual"
"""Client state group: the error-feedback residual after the round recorded in :data:`RESIDUAL_ROUND`."""
RESIDUAL_BEFORE = "topk-residual-before"
"""Client state group: the residual that round started from (used when the same round is run again)."""
RESIDUAL_ROUND = "topk-round"
"""Client state group: the round whose residual :data:`RESIDUAL` holds (one int64 scalar ``round``)."""

LEVELS = 127
"""int8 quantization: levels on each side of zero (255 in all; -128 is never written)."""
DEFAULT_BLOCK = 512
"""int8 quantization: elements per scale by default (1 + 4/512 bytes per element: 3.97x fewer than float32)."""
DEFAULT_FRACTION = 0.01
"""top-k: the fraction of each tensor's entries sent by default."""
SCOPES = ("tensor", "model")
"""top-k: where the k entries are chosen: per tensor (layer-wise), or over the whole update (entire-model)."""
_MAX_WARMUP = 1000
_MAX_BLOCK = 1 << 20


# -- pure math --------------------------------------------------------------------------------------------------------


def bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """The bfloat16 bit patterns (``uint16``, same shape) of finite ``values``: float32's top 16 bits, rounded to
    nearest, ties to even (as ``torch.Tensor.to(torch.bfloat16)``). Values beyond bfloat16's range become +-Inf."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def bfloat16_values(bits: np.ndarray) -> np.ndarray:
    """float32 values of bfloat16 bit patterns (``uint16``), exactly."""
    return (np.ascontiguousarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def quantize_int8(values: np.ndarray, block: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """QSGD-style stochastic quantization of a 1-D float array (see the module docstring).

    Args:
        values: shape (n,), finite.
        block: elements per scale, >= 1.
        rng: the uniforms' source (n float32 draws).

    Returns:
        ``(levels, scales)``: int8 of shape (n,) in [-127, 127], and float32 of shape (ceil(n / block),), each
        ``max|v| / 127`` of its block (0 for a block of zeros); ``levels * scales`` (per block) is unbiased for
        ``values``.
    """
    n = values.size
    blocks = -(-n // block)
    padded = np.zeros(blocks * block, dtype=np.float32)
    padded[:n] = values
    rows = padded.reshape(blocks, block)
    scales = (np.abs(rows).max(axis=1) / np.float32(LEVELS)).astype(np.float32)
    safe = np.where(scales > 0, scales, np.float32(1))
    scaled = rows / safe[:, None]
    scaled += rng.random(scaled.shape, dtype=np.float32)
    np.floor(scaled, out=scaled)
    np.clip(scaled, -LEVELS, LEVELS, out=scaled)
    return scaled.reshape(-1)[:n].astype(np.int8), scales


def dequantize_int8(levels: np.ndarray, scales: np.ndarray, block: int, start: int, stop: int) -> np.ndarray:
    """Elements ``[start, stop)`` of a quantized tensor as float64: ``level * scale of its block``."""
    first = start // block
    per_element = np.repeat(scales[first : -(-stop // block)].astype(np.float64), block)
    offset = start - first * block
    return levels[start:stop] * per_element[offset : offset + stop - start]


def topk_count(n: int, fraction: float) -> int:
    """How many of a tensor's ``n`` entries top-k sends: ``ceil(fraction * n)``, at least 1, at most n."""
    return min(n, max(1, math.ceil(fraction * n)))


def warmup_fraction(fraction: float, warmup_rounds: int, rnd: int) -> float:
    """The top-k fraction of round ``rnd`` (1-based) under Deep Gradient Compression's exponential sparsity warm-up
    (Lin et al. 2018, section 3.3): over the first ``warmup_rounds`` rounds of the run the fraction falls
    geometrically from dense to ``fraction``, ``fraction ** (rnd / (warmup_rounds + 1))``, then stays at
    ``fraction``. With ``fraction = 0.001`` and 4 warm-up rounds this is DGC's schedule (sparsity 75%, 93.75%,
    98.4%, 99.6%, then 99.9%); with 0.01 and 3: 0.316, 0.1, 0.0316, then 0.01. Rounds before 1 count as round 1."""
    if warmup_rounds <= 0 or rnd > warmup_rounds:
        return fraction
    return float(fraction ** (max(1, rnd) / (warmup_rounds + 1)))


def index_dtype(n: int) -> np.dtype:
    """The dtype of top-k indices into a tensor of ``n`` elements: int32, int64 beyond 2^31 - 1."""
    return np.dtype(np.int32 if n <= np.iinfo(np.int32).max else np.int64)


def top_k(values: np.ndarray, k: int) -> np.ndarray:
    """The indices (strictly increasing, :func:`index_dtype`) of the ``k`` entries of largest magnitude of 1-D
    ``values`` (ties: whichever ``np.argpartition`` keeps, deterministic for the same input)."""
    n = values.size
    if k >= n:
        chosen = np.arange(n)
    else:
        chosen = np.argpartition(np.abs(values), n - k)[n - k :]
        chosen.sort()
    return chosen.astype(index_dtype(n))


# -- the decoded update (server side) ------------------------------------------------------------------------------


class DecodedTensor:
    """One tensor of a :class:`DecodedUpdate`: decoded block by block as it is read.

    Implements :class:`fedcore.aggregation.BlockArray`: ``read(start, stop)`` (also ``t[start:stop]``) gives the
    flattened elements ``[start, stop)`` in the model's dtype; ``np.asarray(t)`` the whole tensor (one tensor
    densified).
    """

    def __init__(self, reference: np.ndarray, method: str, encoded: np.ndarray, side: np.ndarray | None, block: int):
        self._reference = reference.reshape(-1)
        self._method = method
        self._encoded = encoded.reshape(-1)
        self._side = side
        self._block = block
        self.shape: tuple[int, ...] = tuple(reference.shape)
        self.dtype: np.dtype = reference.dtype
        self.size: int = int(reference.size)
        self.ndim: int = reference.ndim

    def read(self, start: int, stop: int) -> np.ndarray:
        """Flattened elements ``[start, stop)``: the global model plus the decoded update, in the model's dtype."""
        if self._method == "raw":
            return self._encoded[start:stop]
        base = self._reference[start:stop].astype(np.float64)
        if self._method == "float16":
            base += self._encoded[start:stop]
        elif self._method == "bfloat16":
            base += bfloat16_values(self._encoded[start:stop])
        elif self._method == "int8":
            base += dequantize_int8(self._encoded, cast(np.ndarray, self._side), self._block, start, stop)
        else:  # topk: values at strictly increasing indices
            index = cast(np.ndarray, self._side)
            first, last = np.searchsorted(index, (start, stop))
            base[index[first:last].astype(np.int64) - start] += self._encoded[first:last]
        with np.errstate(over="ignore"):  # an overflow gives Inf, which the aggregator's finite check rejects
            return base.astype(self.dtype)

    def __getitem__(self, key: slice) -> np.ndarray:
        """``read(key.start, key.stop)`` for a slice of step 1 over the flattened tensor."""
        start, stop, step = key.indices(self.size)
        if step != 1:
            raise PayloadError("a decoded tensor is read in contiguous blocks only")
        return self.read(start, max(start, stop))

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        """The whole decoded tensor, shaped as the model's."""
        whole = self.read(0, self.size).reshape(self.shape)
        return whole if dtype is None else whole.astype(dtype)


class DecodedUpdate(Mapping[str, DecodedTensor]):
    """A compressed update decoded to the model's spec (names, shapes, dtypes, in the model's order), tensor by
    tensor and block by block as it is read (see :class:`DecodedTensor`); nothing is decoded up front."""

    def __init__(self, tensors: Mapping[str, DecodedTensor]) -> None:
        self._tensors = dict(tensors)

    def __getitem__(self, name: str) -> DecodedTensor:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


# -- the client mod and its inverse --------------------------------------------------------------------------------


@dataclass(frozen=True)
class CompressionMod:
    """The ``compress`` client mod (``ModSpec("compress", {"method": ..., ...})``) and its server-side inverse.

    Args:
        method: ``float16``, ``bfloat16``, ``int8`` or ``topk`` (see the module docstring).
        block: int8: elements per scale, 16..2^20 (default 512).
        fraction: topk: the fraction of the entries sent, in (0, 1] (default 0.01).
        scope: topk: ``tensor`` (k = ``ceil(fraction * n)`` of each tensor of n entries, layer-wise as DGC) or
            ``model`` (k = ``ceil(fraction * N)`` over the whole update's N floating entries, entire-model top-k as
            analysed by Stich et al. 2018; see Dutta et al. 2020 for layer-wise against entire-model).
        warmup_rounds: topk: rounds of DGC's exponential sparsity warm-up at the start of the run
            (:func:`warmup_fraction`), 0..1000 (default 0: ``fraction`` from the first round).

    Raises:
        ConfigError: an unknown method or a parameter out of range.

    Raises (from the call, on the client):
        ClientTaskError: the trained model lacks a tensor of the global model, or its update is not finite (or
            beyond float16's range); top-k on a client that keeps no state; a reply already carrying a compression
            group.
    """

    method: str = "int8"
    block: int = DEFAULT_BLOCK
    fraction: float = DEFAULT_FRACTION
    scope: str = "tensor"
    warmup_rounds: int = 0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(
                f"unknown compression {bounded_repr(self.method, 40)}; choose one of {', '.join(METHODS)}"
            )
        if isinstance(self.block, bool) or not isinstance(self.block, int) or not 16 <= self.block <= _MAX_BLOCK:
            raise ConfigError(
                f"the int8 quantization block must be an integer in 16..{_MAX_BLOCK}, got {bounded_repr(self.block)}"
            )
        fraction = self.fraction
        if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0 < fraction <= 1:
            raise ConfigError(f"the top-k fraction must be a number in (0, 1], got {bounded_repr(fraction)}")
        if self.scope not in SCOPES:
            raise ConfigError(f"the top-k scope must be one of {', '.join(SCOPES)}, got {bounded_repr(self.scope, 40)}")
        warmup = self.warmup_rounds
        if isinstance(warmup, bool) or not isinstance(warmup, int) or not 0 <= warmup <= _MAX_WARMUP:
            raise ConfigError(
                f"the top-k warm-up must be an integer number of rounds in 0..{_MAX_WARMUP}, got {bounded_repr(warmup)}"
            )

    def round_fraction(self, rnd: int) -> float:
        """The top-k fraction of round ``rnd``: ``fraction`` after the warm-up (:func:`warmup_fraction`)."""
        return warmup_fraction(self.fraction, self.warmup_rounds, rnd)

    # -- client -------------------------------------------------------------------------------------------------------

    def __call__(self, instruction: FitIns, context: ModContext, call_next: CallNext) -> FitRes:
        """Train with ``call_next``, then replace the reply's model by its compressed update (module docstring)."""
        rnd, client_id = instruction.round, context.client_id

        def fail(message: str) -> ClientTaskError:
            return ClientTaskError(f"{self.method} compression: {message}", round=rnd, client_id=client_id, stage="fit")

        state = context.state
        if self.method == "topk" and state is None:
            raise fail(
                "top-k keeps its error-feedback residual in the client's state; give the daemon a state directory"
            )
        reply = call_next(instruction)
        global_model, trained = instruction.parameters, reply.parameters
        missing = [name for name in global_model if name not in trained]
        if missing:
            raise fail(f"the trained model lacks tensor(s) {bounded_repr(missing[:5])} of the global model")
        if SCALE_GROUP in reply.groups or INDEX_GROUP in reply.groups:
            raise fail(f"the reply already carries a tensor group {SCALE_GROUP!r} or {INDEX_GROUP!r}")
        floating = [name for name, x in global_model.items() if np.asarray(x).dtype.kind == "f"]
        updates: NamedArrays = {}
        for name in floating:
            x = np.asarray(global_model[name])
            update = np.asarray(trained[name], dtype=np.float64).reshape(-1) - x.astype(np.float64).reshape(-1)
            if not np.isfinite(update).all():
                raise fail(f"the update of tensor {bounded_repr(name)} holds NaN or Inf")
            updates[name] = update
        encoded: NamedArrays = {n: np.asarray(a) for n, a in trained.items() if n in global_model and n not in updates}
        side: NamedArrays = {}
        if self.method in ("float16", "bfloat16"):
            for name, update in updates.items():
                shape = global_model[name].shape
                if self.method == "float16":
                    if np.abs(update).max(initial=0.0) > np.finfo(np.float16).max:
                        raise fail(f"the update of tensor {bounded_repr(name)} is beyond float16's range")
                    encoded[name] = update.astype(np.float16).reshape(shape)
                else:
                    encoded[name] = bfloat16_bits(update).reshape(shape)
        elif self.method == "int8":
            rng = numpy_rng(instruction.seed, MOD, rnd, client_id)
            for name, update in updates.items():
                levels, side[name] = quantize_int8(update, self.block, rng)
                encoded[name] = levels.reshape(global_model[name].shape)
        else:
            residuals = _residual_before(cast(StateEntry, state), rnd, global_model, floating)
            totals = {name: update + residuals[name].astype(np.float64).reshape(-1) for name, update in updates.items()}
            chosen = self._choose(totals, self.round_fraction(rnd))
            kept: NamedArrays = {}
            for name, total in totals.items():
                dtype = np.asarray(global_model[name]).dtype
                index = chosen[name]
                encoded[name] = total[index].astype(dtype)
                total[index] = 0.0
                kept[name] = total.astype(dtype).reshape(global_model[name].shape)
                side[name] = index
            if kept:
                cast(StateEntry, state).put(
                    {
                        RESIDUAL: kept,
                        RESIDUAL_BEFORE: residuals,
                        RESIDUAL_ROUND: {"round": np.array(rnd, dtype=np.int64)},
                    }
                )
        ordered = {name: encoded[name] for name in global_model}
        groups = dict(reply.groups)
        if side:
            groups[SCALE_GROUP if self.method == "int8" else INDEX_GROUP] = side
        return replace(reply, parameters=ordered, groups=groups)

    def _choose(self, totals: Mapping[str, np.ndarray], fraction: float) -> dict[str, np.ndarray]:
        """Per tensor, the indices (strictly increasing, :func:`index_dtype`) of the entries top-k sends of the 1-D
        float64 ``totals`` (update plus residual): the top ``ceil(fraction * n)`` of each tensor (scope ``tensor``),
        or of the ``ceil(fraction * N)`` largest of all of them together, split back by tensor (scope ``model``)."""
        if self.scope == "tensor":
            return {name: top_k(total, topk_count(total.size, fraction)) for name, total in totals.items()}
        sizes = [total.size for total in totals.values()]
        offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        flat = np.concatenate(list(totals.values())) if totals else np.zeros(0)
        chosen = top_k(flat, topk_count(flat.size, fraction)).astype(np.int64)
        bounds = np.searchsorted(chosen, offsets)
        return {
            name: (chosen[bounds[i] : bounds[i + 1]] - offsets[i]).astype(index_dtype(size))
            for i, (name, size) in enumerate(zip(totals, sizes, strict=True))
        }

    # -- server -------------------------------------------------------------------------------------------------------

    def decode(self, reply: FitRes, *, reference: Mapping[str, np.ndarray], round: int) -> FitRes:
        """The reply with its parameters decoded to the spec of ``reference`` (the global model the client trained
        from) as a :class:`DecodedUpdate`, and the compression's tensor group removed. Everything the client sent is
        checked here, before any of it is used; decoding itself happens as the aggregator reads the blocks.

        Raises:
            PayloadError: names, dtypes, shapes or lengths that are not this method's encoding of the model, a
                missing or mismatched compression group, top-k indices out of range or not strictly increasing.
            NonFiniteError: a non-finite scale or top-k value, or a negative scale.
        """
        client_id = reply.client_id

        def fail(message: str, error: type[PayloadError] = PayloadError) -> PayloadError:
            return error(f"{self.method} compression: {message}", round=round, client_id=client_id, stage="decode")

        encoded = reply.parameters if isinstance(reply.parameters, Mapping) else {}
        groups = dict(reply.groups) if isinstance(reply.groups, Mapping) else {}
        if mismatch := name_mismatch(encoded, reference):
            raise fail(f"the update's tensors differ from the model's: {mismatch}")
        floating = [n for n, x in reference.items() if x.dtype.kind == "f"]
        group_name = {"int8": SCALE_GROUP, "topk": INDEX_GROUP}.get(self.method)
        side_group: Mapping[str, np.ndarray] = {}
        if group_name is not None:
            side_group = groups.pop(group_name, {})
            if not isinstance(side_group, Mapping) or set(side_group) != set(floating):
                got = sorted(side_group) if isinstance(side_group, Mapping) else []
                raise fail(
                    f"the tensor group {group_name!r} must hold one tensor per floating tensor of the model; got "
                    f"{bounded_repr(got[:5])}"
                )
        fraction = self.round_fraction(round)
        tensors: dict[str, DecodedTensor] = {}
        sent = 0
        for name, x in reference.items():
            array = encoded[name]
            if not isinstance(array, np.ndarray):
                raise fail(f"tensor {bounded_repr(name)} is a {type(array).__name__}, not an array")
            method = self.method if x.dtype.kind == "f" else "raw"
            k = topk_count(int(x.size), fraction)
            if method == "topk" and self.scope == "model":  # any split of the whole update's k over the tensors
                index = side_group.get(name)
                if not isinstance(index, np.ndarray) or index.ndim != 1 or not 0 <= index.shape[0] <= x.size:
                    raise fail(f"the indices of tensor {bounded_repr(name)} must be a 1-D array of at most {x.size}")
                k = int(index.shape[0])
            side = self._check_tensor(name, x, array, side_group.get(name), method, k, fail)
            tensors[name] = DecodedTensor(x, method, array, side, self.block)
            sent += k if method == "topk" else 0
        if self.method == "topk" and self.scope == "model":
            expected = topk_count(sum(int(reference[n].size) for n in floating), fraction)
            if sent != expected:
                raise fail(
                    f"the update sends {sent} entries in all; entire-model top-k of fraction {fraction:.6g} "
                    f"sends {expected}"
                )
        decoded = cast(NamedArrays, DecodedUpdate(tensors))  # a lazy mapping: the aggregators read it block by block
        return replace(reply, parameters=decoded, groups=groups)

    def _check_tensor(
        self, name: str, x: np.ndarray, array: np.ndarray, side: object, method: str, k: int, fail: Any
    ) -> np.ndarray | None:
        """Check one encoded tensor (and its side tensor) against the model's tensor ``x``, top-k's of ``k``
        entries; return the side tensor."""
        shown, n = bounded_repr(name), int(x.size)

        def expect(what: str, got: np.ndarray, dtype: Any, shape: tuple[int, ...]) -> None:
            if got.dtype != np.dtype(dtype) or tuple(got.shape) != shape:
                raise fail(
                    f"{what} of tensor {shown} is {got.dtype.name} of shape {tuple(got.shape)}, expected "
                    f"{np.dtype(dtype).name} of shape {shape}"
                )

        if method == "raw":
            expect("the value", array, x.dtype, tuple(x.shape))
            return None
        if method in ("float16", "bfloat16", "int8"):
            wire = {"float16": np.float16, "bfloat16": np.uint16, "int8": np.int8}[method]
            expect("the update", array, np.dtype(wire), tuple(x.shape))
        if method in ("float16", "bfloat16"):
            return None
        if not isinstance(side, np.ndarray):
            raise fail(f"the side tensor of {shown} is a {type(side).__name__}, not an array")
        if method == "int8":
            expect("the scales", side, np.float32, (-(-n // self.block),))
            if not np.isfinite(side).all() or (side < 0).any():
                raise fail(f"the scales of tensor {shown} must be finite and >= 0", NonFiniteError)
            return side
        expect("the values", array, x.dtype, (k,))
        expect("the indices", side, index_dtype(n), (k,))
        if k == 0:  # an empty tensor
            return side
        if not np.isfinite(array).all():
            raise fail(f"the values of tensor {shown} hold NaN or Inf", NonFiniteError)
        if side[0] < 0 or side[-1] >= n or (k > 1 and not (np.diff(side) > 0).all()):
            raise fail(f"the indices of tensor {shown} must be strictly increasing, in 0..{n - 1}")
        return side


def _residual_before(
    state: StateEntry, rnd: int, global_model: Mapping[str, np.ndarray], floating: list[str]
) -> NamedArrays:
    """The error-feedback residual to start round ``rnd`` from: zeros the first time (or when the model changed),
    else the stored one, except when it was stored in round ``rnd`` itself (the round is run again): then the one
    from before that round, so a repeated round counts once."""
    stored, before, tag = state.get(RESIDUAL), state.get(RESIDUAL_BEFORE), state.get(RESIDUAL_ROUND)

    def fits(group: NamedArrays | None) -> bool:
        return (
            group is not None
            and set(group) == set(floating)
            and all(
                group[n].shape == np.shape(global_model[n]) and group[n].dtype == np.asarray(global_model[n]).dtype
                for n in floating
            )
        )

    if not fits(stored):
        return {n: np.zeros(np.shape(global_model[n]), dtype=np.asarray(global_model[n]).dtype) for n in floating}
    if tag is not None and "round" in tag and int(tag["round"]) == rnd and fits(before):
        return cast(NamedArrays, before)
    return cast(NamedArrays, stored)
