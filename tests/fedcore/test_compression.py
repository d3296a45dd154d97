"""Update compression: the codecs with hand-computed numbers and torch as reference, the client mod and its
server-side inverse, what the inverse refuses, and the streaming mean folding a decoded update block by block."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from client.state import ClientStateStore
from fedcore.aggregation import WeightedMean
from fedcore.compression import (
    INDEX_GROUP,
    RESIDUAL,
    SCALE_GROUP,
    CompressionMod,
    DecodedUpdate,
    bfloat16_bits,
    bfloat16_values,
    dequantize_int8,
    quantize_int8,
    top_k,
    topk_count,
    warmup_fraction,
)
from fedcore.errors import ClientTaskError, ConfigError, NonFiniteError, PayloadError
from fedcore.messages import FitIns, FitRes, ModParam, ModSpec
from fedcore.mods import ModContext, build_mod, decode_reply, server_inverses
from fedcore.seeding import numpy_rng
from fedcore.task import FitConfig
from fedcore.tensors import NamedArrays, spec_of


def test_bfloat16_rounds_to_nearest_even_like_torch() -> None:
    one_and_half_ulp = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, -2.5, 0.0], dtype=np.float32)
    # 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even pattern 0x3F80; 1 + 3*2^-8 rounds up to 0x3F82
    assert bfloat16_bits(one_and_half_ulp).tolist() == [0x3F80, 0x3F80, 0x3F82, 0xC020, 0x0000]
    values = np.random.default_rng(0).normal(size=10_000).astype(np.float32) * 1e-3
    want = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(bfloat16_bits(values), want)
    np.testing.assert_array_equal(bfloat16_values(want), torch.from_numpy(values).to(torch.bfloat16).float().numpy())


def test_int8_levels_and_scales_by_hand() -> None:
    # block maxima 31.75 = 127 * 0.25 and 15.875 = 127 * 0.125: exact scales; multiples of them are exact levels,
    # whatever the uniforms; the last block is padded
    values = np.array([31.75, -1.0, 0.5, 0.0, 15.875, -0.125], dtype=np.float32)
    levels, scales = quantize_int8(values, 4, np.random.default_rng(0))
    assert scales.tolist() == [0.25, 0.125]
    assert levels.tolist() == [127, -4, 2, 0, 127, -1]
    np.testing.assert_array_equal(dequantize_int8(levels, scales, 4, 0, 6), values)
    np.testing.assert_array_equal(dequantize_int8(levels, scales, 4, 3, 5), [0.0, 15.875])
    zero_levels, zero_scales = quantize_int8(np.zeros(5, np.float32), 4, np.random.default_rng(0))
    assert zero_levels.tolist() == [0] * 5 and zero_scales.tolist() == [0.0, 0.0]


def test_int8_is_unbiased_with_bounded_variance() -> None:
    # QSGD's property: E[s q] = v and Var <= s^2 / 4 per element; 4000 draws of one block
    values = np.array([0.3, -0.7, 1.0, 0.01, -0.123, 0.5, 0.0, 0.999], dtype=np.float32)
    draws = np.stack([dequantize_int8(*quantize_int8(values, 8, numpy_rng(1, k)), 8, 0, 8) for k in range(4000)])
    scale = 1.0 / 127
    np.testing.assert_allclose(draws.mean(axis=0), values, atol=4 * (scale / 2) / math.sqrt(4000))
    assert (draws.var(axis=0) <= scale**2 / 4 + 1e-12).all()
    # each element lands on one of its two neighbouring levels
    assert (np.abs(draws - values) < scale + 1e-7).all()


def test_top_k_picks_largest_magnitudes_in_index_order() -> None:
    values = np.array([0.1, -5.0, 0.2, 3.0, -0.05, 4.0])
    assert top_k(values, 3).tolist() == [1, 3, 5]
    assert top_k(values, 3).dtype == np.int32
    assert top_k(values, 10).tolist() == [0, 1, 2, 3, 4, 5]
    assert [topk_count(n, 0.01) for n in (1, 99, 100, 101, 1000)] == [1, 1, 1, 2, 10]


# -- the mod and its inverse ---------------------------------------------------------------------------------------

GLOBAL: NamedArrays = {
    "w": np.linspace(-1, 1, 1200, dtype=np.float32).reshape(40, 30),
    "b": np.array([0.5, -0.25, 0.0], dtype=np.float32),
    "steps": np.array(7, dtype=np.int64),
}


def trained(seed: int = 0) -> NamedArrays:
    rng = np.random.default_rng(seed)
    return {
        "w": GLOBAL["w"] + rng.normal(scale=1e-2, size=(40, 30)).astype(np.float32),
        "b": GLOBAL["b"] + np.array([1e-3, -2e-3, 0.0], dtype=np.float32),
        "steps": np.array(9, dtype=np.int64),
    }


def instruction(rnd: int = 1) -> FitIns:
    return FitIns(round=rnd, parameters=GLOBAL, config=FitConfig(), seed=5)


def encode(mod: CompressionMod, model: NamedArrays, *, state: ClientStateStore | None = None, rnd: int = 1) -> FitRes:
    context = ModContext(client_id="c1", model=None, state=state.entry("c1") if state is not None else None)
    return mod(
        instruction(rnd), context, lambda ins: FitRes(client_id="c1", round=ins.round, parameters=model, num_examples=3)
    )


def dense(reply: FitRes) -> NamedArrays:
    return {name: np.asarray(tensor) for name, tensor in reply.parameters.items()}


@pytest.mark.parametrize(
    ("method", "wire", "bytes_per_element"), [("float16", "float16", 2), ("bfloat16", "uint16", 2), ("int8", "int8", 1)]
)
def test_casts_and_int8_shrink_the_update_and_decode_near_it(method: str, wire: str, bytes_per_element: int) -> None:
    mod = CompressionMod(method=method, block=512)
    y = trained()
    reply = encode(mod, y)
    assert reply.parameters["w"].dtype == np.dtype(wire) and reply.parameters["w"].shape == (40, 30)
    assert reply.parameters["steps"].tolist() == 9  # not floating: as it is
    side = sum(g["w"].nbytes for g in reply.groups.values())
    assert reply.parameters["w"].nbytes + side <= 1200 * bytes_per_element + 3 * 4  # 3 scales of 512
    decoded = mod.decode(reply, reference=GLOBAL, round=1)
    assert decoded.groups == {}  # the scales are consumed
    out = dense(decoded)
    assert [(n, a.dtype, a.shape) for n, a in out.items()] == [(n, a.dtype, a.shape) for n, a in GLOBAL.items()]
    update = y["w"].astype(np.float64) - GLOBAL["w"]
    tolerance = {"float16": 2**-11, "bfloat16": 2**-8, "int8": 2 / 127}[method] * np.abs(update).max()
    np.testing.assert_allclose(out["w"], y["w"], rtol=0, atol=tolerance + 1e-7)
    assert out["steps"] == 9


def test_int8_draws_are_keyed_by_seed_round_and_client() -> None:
    mod = CompressionMod(method="int8")
    first, again = encode(mod, trained()), encode(mod, trained())
    np.testing.assert_array_equal(first.parameters["w"], again.parameters["w"])
    later = encode(mod, trained(), rnd=2)
    assert not np.array_equal(first.parameters["w"], later.parameters["w"])


def test_topk_keeps_the_rest_as_residual_and_a_repeated_round_counts_once(tmp_path: Path) -> None:
    store = ClientStateStore(tmp_path)
    mod = CompressionMod(method="topk", fraction=0.01)
    y = trained()
    reply = encode(mod, y, state=store)
    update = y["w"].astype(np.float64).reshape(-1) - GLOBAL["w"].reshape(-1)
    chosen = np.sort(np.argsort(-np.abs(update))[:12])  # ceil(0.01 * 1200) = 12
    assert reply.groups[INDEX_GROUP]["w"].tolist() == chosen.tolist()
    np.testing.assert_array_equal(reply.parameters["w"], update[chosen].astype(np.float32))
    assert reply.parameters["b"].shape == (1,) and reply.groups[INDEX_GROUP]["b"].tolist() == [1]  # -2e-3 is largest
    residual = store.entry("c1").get(RESIDUAL)
    assert residual is not None
    want = update.copy()
    want[chosen] = 0
    np.testing.assert_array_equal(residual["w"].reshape(-1), want.astype(np.float32))
    # server side: the model plus the 12 values, the other entries exactly the global model's
    out = dense(mod.decode(reply, reference=GLOBAL, round=1))["w"].reshape(-1)
    np.testing.assert_array_equal(np.delete(out, chosen), np.delete(GLOBAL["w"].reshape(-1), chosen))
    # the next round adds the residual; round 2 run again starts from the same residual (counted once)
    second = encode(mod, trained(1), state=store, rnd=2)
    repeated = encode(mod, trained(1), state=store, rnd=2)
    np.testing.assert_array_equal(second.parameters["w"], repeated.parameters["w"])
    sum_two = np.asarray(trained(1)["w"], np.float64).reshape(-1) - GLOBAL["w"].reshape(-1) + want.astype(np.float32)
    np.testing.assert_array_equal(
        second.groups[INDEX_GROUP]["w"], np.sort(np.argsort(-np.abs(sum_two))[:12]).astype(np.int32)
    )


def test_warmup_fractions_fall_geometrically_to_the_target() -> None:
    # fraction ** (r / (W + 1)) for r <= W: with 1e-4 over 3 rounds 0.1, 0.01, 0.001, then 1e-4 for good
    got = [warmup_fraction(1e-4, 3, r) for r in (1, 2, 3, 4, 30)]
    assert got == pytest.approx([0.1, 0.01, 0.001, 1e-4, 1e-4], rel=1e-12)
    # DGC's own schedule (Lin et al. 2018): 0.1% over 4 rounds gives sparsity 75%, 93.75%, 98.4%, 99.6%
    dgc = [1 - warmup_fraction(0.001, 4, r) for r in (1, 2, 3, 4, 5)]
    assert dgc == pytest.approx([0.749, 0.937, 0.984, 0.996, 0.999], abs=3e-3)
    assert warmup_fraction(0.01, 0, 1) == 0.01 and warmup_fraction(0.01, 2, 0) == pytest.approx(0.01 ** (1 / 3))
    mod = CompressionMod(method="topk", fraction=0.01, warmup_rounds=1)
    assert mod.round_fraction(1) == pytest.approx(0.1) and mod.round_fraction(2) == 0.01


def test_topk_warmup_sends_more_in_its_rounds_and_the_server_expects_that_count(tmp_path: Path) -> None:
    store = ClientStateStore(tmp_path)
    mod = CompressionMod(method="topk", fraction=0.01, warmup_rounds=1)
    first = encode(mod, trained(), state=store, rnd=1)  # fraction 0.1: ceil(0.1 * 1200) = 120, ceil(0.3) = 1
    assert first.parameters["w"].shape == (120,) and first.parameters["b"].shape == (1,)
    update = trained()["w"].astype(np.float64).reshape(-1) - GLOBAL["w"].reshape(-1)
    assert first.groups[INDEX_GROUP]["w"].tolist() == np.sort(np.argsort(-np.abs(update))[:120]).tolist()
    np.testing.assert_array_equal(
        np.delete(dense(mod.decode(first, reference=GLOBAL, round=1))["w"].reshape(-1), first.groups[INDEX_GROUP]["w"]),
        np.delete(GLOBAL["w"].reshape(-1), first.groups[INDEX_GROUP]["w"]),
    )
    with pytest.raises(PayloadError, match="shape \\(12,\\)"):  # round 2 is past the warm-up: 12 entries
        mod.decode(first, reference=GLOBAL, round=2)
    assert encode(mod, trained(1), state=store, rnd=2).parameters["w"].shape == (12,)


def test_model_scope_chooses_the_largest_entries_over_all_tensors(tmp_path: Path) -> None:
    # N = 1203 floating entries, k = ceil(0.01 * 1203) = 13 in all: b's two nonzero entries (1.0, -2.0) are the
    # largest, so w gets the other 11 (per tensor, b would get 1 and w 12)
    store = ClientStateStore(tmp_path)
    mod = CompressionMod(method="topk", fraction=0.01, scope="model")
    y = {**trained(), "b": GLOBAL["b"] + np.array([1.0, -2.0, 0.0], dtype=np.float32)}
    reply = encode(mod, y, state=store)
    update = y["w"].astype(np.float64).reshape(-1) - GLOBAL["w"].reshape(-1)
    chosen = np.sort(np.argsort(-np.abs(update))[:11])
    assert reply.groups[INDEX_GROUP]["b"].tolist() == [0, 1] and reply.groups[INDEX_GROUP]["b"].dtype == np.int32
    assert reply.groups[INDEX_GROUP]["w"].tolist() == chosen.tolist()
    np.testing.assert_array_equal(reply.parameters["b"], [1.0, -2.0])
    residual = store.entry("c1").get(RESIDUAL)
    assert residual is not None
    want = update.copy()
    want[chosen] = 0
    np.testing.assert_array_equal(residual["w"].reshape(-1), want.astype(np.float32))
    np.testing.assert_array_equal(residual["b"], [0.0, 0.0, 0.0])
    out = dense(mod.decode(reply, reference=GLOBAL, round=1))
    np.testing.assert_array_equal(out["b"], y["b"])
    # the server checks the split: any per-tensor lengths, but 13 in all, values and indices of one length
    index = reply.groups[INDEX_GROUP]
    short = _tampered(_tampered(reply, INDEX_GROUP, "w", index["w"][:-1]), None, "w", reply.parameters["w"][:-1])
    bad: list[tuple[FitRes, str]] = [
        (short, "sends 12 entries in all"),
        (_tampered(reply, None, "w", reply.parameters["w"][:-1]), "shape \\(11,\\)"),
        (_tampered(reply, INDEX_GROUP, "b", np.arange(4, dtype=np.int32)), "at most 3"),
        (_tampered(reply, INDEX_GROUP, "b", np.zeros((2, 1), dtype=np.int32)), "1-D"),
    ]
    for tampered, words in bad:
        with pytest.raises(PayloadError, match=words):
            mod.decode(tampered, reference=GLOBAL, round=1)


def test_topk_needs_client_state() -> None:
    with pytest.raises(ClientTaskError, match="state directory"):
        encode(CompressionMod(method="topk"), trained())


def test_the_mod_is_registered_and_checks_its_parameters() -> None:
    assert isinstance(build_mod(ModSpec("compress", {"method": "int8", "block": 256})), CompressionMod)
    cases: list[tuple[dict[str, ModParam], str]] = [
        ({"method": "zip"}, "unknown compression"),
        ({"method": "int8", "block": 3}, "block"),
        ({"method": "topk", "fraction": 0.0}, "fraction"),
        ({"method": "topk", "fraction": 1.5}, "fraction"),
        ({"method": "topk", "scope": "layer"}, "scope"),
        ({"method": "topk", "warmup_rounds": 1001}, "warm-up"),
        ({"method": "topk", "warmup_rounds": True}, "warm-up"),
    ]
    for params, words in cases:
        with pytest.raises(ConfigError, match=words):
            build_mod(ModSpec("compress", params))
    (inverse,) = server_inverses((ModSpec("compress", {"method": "float16"}),))
    reply = encode(CompressionMod(method="float16"), trained())
    assert np.asarray(decode_reply((inverse,), reply, reference=GLOBAL, round=1).parameters["b"]).dtype == np.float32
    assert server_inverses(()) == ()


def test_a_nonfinite_update_is_refused_on_the_client() -> None:
    bad = {**trained(), "b": np.array([np.nan, 0, 0], dtype=np.float32)}
    with pytest.raises(ClientTaskError, match="NaN or Inf"):
        encode(CompressionMod(method="int8"), bad)
    huge = {**trained(), "b": np.array([1e6, 0, 0], dtype=np.float32)}
    with pytest.raises(ClientTaskError, match="float16's range"):
        encode(CompressionMod(method="float16"), huge)


def _tampered(reply: FitRes, group: str | None, name: str, value: np.ndarray) -> FitRes:
    if group is None:
        return replace(reply, parameters={**reply.parameters, name: value})
    return replace(reply, groups={**reply.groups, group: {**reply.groups[group], name: value}})


def test_bad_encoded_input_is_rejected_with_its_reason(tmp_path: Path) -> None:
    int8 = CompressionMod(method="int8")
    topk = CompressionMod(method="topk", fraction=0.01)
    q = encode(int8, trained())
    t = encode(topk, trained(), state=ClientStateStore(tmp_path))
    index = t.groups[INDEX_GROUP]["w"]
    bad: list[tuple[CompressionMod, FitRes, type[PayloadError], str]] = [
        (int8, _tampered(q, None, "w", q.parameters["w"].astype(np.int16)), PayloadError, "int16 of shape"),
        (int8, _tampered(q, None, "w", q.parameters["w"][:20]), PayloadError, "expected int8 of shape"),
        (int8, _tampered(q, SCALE_GROUP, "w", np.array([1, np.inf, 1], np.float32)), NonFiniteError, "finite"),
        (int8, _tampered(q, SCALE_GROUP, "w", np.array([1, -1, 1], np.float32)), NonFiniteError, ">= 0"),
        (int8, _tampered(q, SCALE_GROUP, "w", np.ones(2, np.float32)), PayloadError, "scales of tensor 'w'"),
        (int8, replace(q, groups={}), PayloadError, "compress-scale"),
        (int8, _tampered(q, None, "extra", np.ones(2, np.float32)), PayloadError, "unexpected"),
        (topk, _tampered(t, INDEX_GROUP, "w", np.r_[index[:-1], 1200].astype(np.int32)), PayloadError, "0..1199"),
        (topk, _tampered(t, INDEX_GROUP, "w", np.r_[index[:-1], -1].astype(np.int32)), PayloadError, "increasing"),
        (topk, _tampered(t, INDEX_GROUP, "w", index[::-1].copy()), PayloadError, "increasing"),
        (topk, _tampered(t, INDEX_GROUP, "w", index.astype(np.int64)), PayloadError, "expected int32"),
        (topk, _tampered(t, None, "w", np.full(12, np.nan, np.float32)), NonFiniteError, "NaN"),
        (topk, _tampered(t, None, "w", np.ones(13, np.float32)), PayloadError, "shape \\(12,\\)"),
        (topk, _tampered(t, None, "steps", np.array(9.0)), PayloadError, "float64"),
    ]
    for mod, reply, error, words in bad:
        with pytest.raises(error, match=words) as caught:
            mod.decode(reply, reference=GLOBAL, round=4)
        assert caught.value.round == 4 and caught.value.client_id == "c1" and caught.value.stage == "decode"


# -- the streaming mean reads a decoded update block by block -------------------------------------------------------


def test_weighted_mean_folds_decoded_updates_block_by_block_as_dense_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    import fedcore.aggregation.streaming as streaming

    monkeypatch.setattr(streaming, "_BLOCK", 256)  # several blocks per tensor, blocks that cut int8 scale blocks
    mod = CompressionMod(method="int8", block=64)
    decoded = [mod.decode(encode(mod, trained(k)), reference=GLOBAL, round=1).parameters for k in range(3)]
    lazy, plain = WeightedMean(spec_of(GLOBAL), threads=2), WeightedMean(spec_of(GLOBAL), threads=2)
    reads: list[tuple[int, int]] = []
    for k, update in enumerate(decoded):
        assert isinstance(update, DecodedUpdate)
        plain.add({n: np.asarray(t) for n, t in update.items()}, k + 1.0, client_id=f"c{k}")  # densified here
        original = update["w"].read
        monkeypatch.setattr(update["w"], "read", lambda i, j, f=original: reads.append((i, j)) or f(i, j))
        lazy.add(update, k + 1.0, client_id=f"c{k}")
    assert max(j - i for i, j in reads) == 256 and len(reads) == 3 * 2 * 5  # 5 blocks, read to check and to fold
    for name, value in plain.result().items():
        np.testing.assert_array_equal(lazy.result()[name], value, err_msg=name)


def test_a_decoded_overflow_is_rejected_and_leaves_the_sum_untouched() -> None:
    mod = CompressionMod(method="int8")
    good = mod.decode(encode(mod, trained()), reference=GLOBAL, round=1).parameters
    reply = encode(mod, trained(1))
    huge = _tampered(reply, SCALE_GROUP, "w", np.full(3, 3e38, np.float32))  # finite scale, infinite model
    acc = WeightedMean(spec_of(GLOBAL))
    acc.add(good, 1.0)
    with pytest.raises(NonFiniteError, match="'w'"):
        acc.add(mod.decode(huge, reference=GLOBAL, round=1).parameters, 1.0)
    np.testing.assert_array_equal(acc.result()["w"], np.asarray(good["w"]))
