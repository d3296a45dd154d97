"""SecAgg+ parts with hand-checkable numbers: configuration and bit budget, graph, Shamir, crypto, quantization."""

from __future__ import annotations

import math
from itertools import combinations

import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from fedcore.config import from_mapping
from fedcore.errors import ConfigError, ProtocolError
from fedcore.kernels import quantize_into
from fedcore.tensors import TensorSpec
from privacy.secagg import crypto, shamir
from privacy.secagg.config import RoundParams, SecAggConfig, default_neighbours
from privacy.secagg.graph import harary, permutation
from privacy.secagg.quantize import check_quantizable, dequantize, quantize, quantize_block

SEED = bytes(range(32))


# -- configuration ------------------------------------------------------------------------------------------------


def test_default_neighbours_is_odd_where_possible_and_regular() -> None:
    assert [default_neighbours(n) for n in (2, 3, 4, 10, 50, 100, 101, 1000)] == [1, 2, 3, 7, 13, 15, 16, 21]
    for n in range(2, 300):
        k = default_neighbours(n)
        assert 1 <= k <= n - 1 and (n * k) % 2 == 0
        assert k >= min(2 * math.log2(n), n - 1)
        if n % 2 == 0 and k < n - 1:
            assert k % 2 == 1


def test_resolve_defaults() -> None:
    params = SecAggConfig().resolve(10)
    assert (params.neighbours, params.threshold, params.field_bits) == (7, 4, 32)
    assert params.levels == (2**32 - 1) // (10 * 1024)
    assert params.dtype == np.dtype("<u4")
    assert SecAggConfig(field_bits=16, max_weight=1).resolve(4).dtype == np.dtype("<u2")
    assert SecAggConfig(field_bits=33).resolve(4).dtype == np.dtype("<u8")


@pytest.mark.parametrize(
    ("config", "clients", "words"),
    [
        (SecAggConfig(), 1, "must be >= 2"),
        (SecAggConfig(neighbours=10), 10, "at least 11 clients"),
        (SecAggConfig(neighbours=3), 11, "n·k must be even"),
        (SecAggConfig(neighbours=4, threshold=2), 10, "k/2 < t <= k"),
        (SecAggConfig(neighbours=4, threshold=5), 10, "k/2 < t <= k"),
        (SecAggConfig(field_bits=8), 100, "field_bits >= 17"),
        (SecAggConfig(field_bits=16, max_weight=100, quantization_levels=100), 10, "quantization_levels <= 65"),
    ],
)
def test_resolve_refuses_what_cannot_be_honoured(config: SecAggConfig, clients: int, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        config.resolve(clients)
    with pytest.raises(ConfigError):
        config.check(clients)


def test_bit_budget_edge_is_exact() -> None:
    # 10 clients x weight 100 x 65 levels = 65000 <= 2^16 - 1: accepted; 66 levels: 66000 > 65535, refused
    assert SecAggConfig(field_bits=16, max_weight=100, quantization_levels=65).resolve(10).levels == 65
    with pytest.raises(ConfigError, match="could overflow"):
        SecAggConfig(field_bits=16, max_weight=100, quantization_levels=66).resolve(10)
    assert SecAggConfig(field_bits=16, max_weight=100).resolve(10).levels == 65


@pytest.mark.parametrize(
    "kwargs",
    [
        {"neighbours": 0},
        {"threshold": 0},
        {"neighbours": True},
        {"field_bits": 7},
        {"field_bits": 65},
        {"clip": 0.0},
        {"clip": float("nan")},
        {"clip": float("inf")},
        {"max_weight": 0},
        {"quantization_levels": 0},
        {"quantization_levels": 2**53},
    ],
)
def test_config_refuses_bad_values(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        SecAggConfig(**kwargs)  # type: ignore[arg-type]


def test_config_loads_from_a_toml_table() -> None:
    config = from_mapping(SecAggConfig, {"neighbours": 7, "clip": 0.5, "field_bits": 24})
    assert config == SecAggConfig(neighbours=7, clip=0.5, field_bits=24)
    with pytest.raises(ConfigError, match="unknown key"):
        from_mapping(SecAggConfig, {"neighbors": 7})


def test_only_float_tensors_are_quantizable() -> None:
    check_quantizable([TensorSpec("w", (2,), "float32")])
    with pytest.raises(ConfigError, match="num_batches_tracked"):
        check_quantizable([TensorSpec("bn.num_batches_tracked", (), "int64")])
    with pytest.raises(ConfigError):
        check_quantizable([])


# -- graph --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "k"), [(2, 1), (3, 2), (4, 3), (10, 7), (11, 4), (50, 13), (51, 50)])
def test_harary_graph_is_k_regular_and_symmetric(n: int, k: int) -> None:
    graph = harary(n, k, SEED)
    for i, neighbours in enumerate(graph):
        assert len(neighbours) == k and i not in neighbours
        assert all(i in graph[j] for j in neighbours)
    assert harary(n, k, SEED) == graph


def test_harary_graph_unpermuted_shape_and_seeds() -> None:
    order = permutation(10, SEED)
    assert sorted(order) == list(range(10)) and order != list(range(10))
    graph = harary(10, 3, SEED)
    position = {c: p for p, c in enumerate(order)}
    for c, neighbours in enumerate(graph):  # ring neighbours +-1 and the opposite client
        assert {(position[v] - position[c]) % 10 for v in neighbours} == {1, 9, 5}
    assert harary(50, 13, SEED) != harary(50, 13, bytes(32))
    with pytest.raises(ConfigError, match="n·k must be even"):
        harary(11, 3, SEED)


# -- Shamir -------------------------------------------------------------------------------------------------------


def test_shamir_hand_polynomial() -> None:
    # f(x) = s + 3x + 5x^2: f(1) = s + 8, f(2) = s + 26, f(4) = s + 92
    s = 123456789
    shares = {1: s + 8, 2: s + 26, 4: s + 92}
    assert shamir.combine(shares, 3) == s.to_bytes(32, "big")


def test_shamir_any_t_of_k_reconstruct_and_fewer_do_not() -> None:
    secret = bytes(range(100, 132))
    shares = shamir.split(secret, 4, [3, 5, 8, 9, 11, 12, 20])
    for subset in combinations(shares.items(), 4):
        assert shamir.combine(dict(subset), 4) == secret
    with pytest.raises(ProtocolError, match="cannot reconstruct"):
        shamir.combine(dict(list(shares.items())[:3]), 4)
    # three shares interpolated as if the threshold were 3 give a field element unrelated to the secret
    with pytest.raises(ProtocolError, match="do not belong to one secret"):
        shamir.combine(dict(list(shares.items())[:3]), 3)
    assert shamir.decode(shamir.encode(shares[3])) == shares[3]
    with pytest.raises(ProtocolError):
        shamir.split(secret, 8, [1, 2, 3])
    with pytest.raises(ProtocolError):
        shamir.split(secret, 2, [1, 1, 2])
    with pytest.raises(ProtocolError):
        shamir.decode(b"\xff" * shamir.SHARE_BYTES)


# -- crypto -------------------------------------------------------------------------------------------------------


def test_mask_is_the_aes_ctr_keystream() -> None:
    raw = Cipher(algorithms.AES(SEED[:16]), modes.CTR(bytes(16))).encryptor().update(bytes(4 * 1000))
    assert np.array_equal(crypto.expand(SEED, 1000, np.dtype("<u4")), np.frombuffer(raw, "<u4"))
    expander = crypto.MaskExpander(np.dtype("<u4"), block=7)  # blocks that cut the keystream anywhere
    out = np.zeros(1000, dtype="<u4")
    expander.apply(out, [(expander.stream(SEED), 1)])
    assert np.array_equal(out, np.frombuffer(raw, "<u4"))
    expander.apply(out, [(expander.stream(SEED), -1)])
    assert not out.any()


def test_key_agreement_and_authenticated_encryption() -> None:
    a, b = crypto.new_private_key(), crypto.new_private_key()
    info = crypto.context(3, 1, "a", "b")
    key = crypto.agree(a, crypto.public_bytes(b), b"share-encryption", info)
    assert key == crypto.agree(b, crypto.public_bytes(a), b"share-encryption", info)
    assert key != crypto.agree(a, crypto.public_bytes(b), b"pairwise-mask", info)
    assert key != crypto.agree(a, crypto.public_bytes(b), b"share-encryption", crypto.context(4, 1, "a", "b"))
    assert key != crypto.agree(a, crypto.public_bytes(b), b"share-encryption", crypto.context(3, 2, "a", "b"))
    message = crypto.encrypt(key, b"shares", b"ad")
    assert crypto.decrypt(key, message, b"ad") == b"shares"
    tampered = bytearray(message)
    tampered[-20] ^= 1
    with pytest.raises(ProtocolError, match="failed authentication"):
        crypto.decrypt(key, bytes(tampered), b"ad")
    with pytest.raises(ProtocolError, match="failed authentication"):
        crypto.decrypt(key, message, b"other")
    with pytest.raises(ProtocolError, match=r"low order|failed"):
        crypto.agree(a, bytes(32), b"x", info)
    assert crypto.context(1, 1, "ab", "c") != crypto.context(1, 1, "a", "bc")


# -- quantization -------------------------------------------------------------------------------------------------


def _params(levels: int = 4, clip: float = 1.0, bits: int = 32) -> RoundParams:
    return RoundParams(
        num_clients=3, neighbours=2, threshold=2, field_bits=bits, clip=clip, max_weight=10, levels=levels
    )


def test_quantize_hand_values() -> None:
    # clip 1, 4 levels: x -> (clip(x) + 1) * 2; integers are exact whatever the dither; weight 3 folded in
    spec = [TensorSpec("w", (2, 3), "float32")]
    update = {"w": np.array([[-1, 1, 0], [0.5, 2, -3]], dtype=np.float32)}
    out = quantize(update, 3, _params(), spec, SEED)
    assert out.dtype == np.dtype("<u4")
    assert out.tolist() == [0, 12, 6, 9, 12, 0, 3]
    weighted, total = dequantize(out, _params(), spec)
    assert total == 3
    np.testing.assert_allclose(weighted["w"], 3 * np.clip(update["w"], -1, 1))
    with pytest.raises(ConfigError, match="max_weight"):
        quantize(update, 11, _params(), spec, SEED)
    with pytest.raises(ConfigError):
        quantize(update, 2.5, _params(), spec, SEED)  # type: ignore[arg-type]


def test_stochastic_rounding_is_unbiased_and_within_one_step() -> None:
    values = np.full(200_000, 0.3, dtype=np.float32)  # y = 1.3 * 2 = 2.6: q in {2, 3}, E[q] = 2.6
    dither = crypto.expand(SEED, values.size, np.dtype("<u4"))
    q = quantize_block(values, 1, _params(), dither)
    assert set(np.unique(q).tolist()) == {2, 3}
    assert abs(q.mean() - 2.6) < 5 * math.sqrt(0.24 / values.size)


@pytest.mark.parametrize("bits", [8, 24, 32, 64])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_compiled_quantization_equals_the_numpy_steps_bit_for_bit(bits: int, dtype: type) -> None:
    # quantize() runs fedcore.kernels.quantize_into for float32/float64; quantize_block (numpy) is the reference.
    # Values on the grid, just off it, at and beyond the clip; dither words 0 and 2^32 - 1 (never / always up).
    params = SecAggConfig(field_bits=bits, clip=0.5, max_weight=3).resolve(2)
    rng = np.random.default_rng(bits)
    grid = np.arange(2001) / params.levels - 0.5
    x = np.concatenate([rng.uniform(-1, 1, 5000), grid, np.nextafter(grid, 1), [-0.5, 0.5, 0.0, -1e30, 1e30]])
    x = x.astype(dtype)
    dither = crypto.expand(SEED, x.size, np.dtype("<u4"))  # quantize()'s dither: the stream of its key SEED
    extreme = dither.copy()
    extreme[:500], extreme[500:1000] = 0, 2**32 - 1
    spec = [TensorSpec("w", (x.size,), np.dtype(dtype).name)]
    scale = params.levels / (2 * params.clip)
    for weight in (0, 1, 3):
        got = quantize({"w": x}, weight, params, spec, SEED)
        assert got.dtype == params.dtype and got[-1] == weight
        np.testing.assert_array_equal(got[:-1], quantize_block(x, weight, params, dither))
        out = np.empty(x.size, params.dtype)
        quantize_into(x, extreme, params.clip, scale, np.uint64(params.levels), np.uint64(weight), out)
        np.testing.assert_array_equal(out, quantize_block(x, weight, params, extreme))


def test_dequantize_three_clients_hand_values() -> None:
    # levels 4, clip 1: three clients with weights 1, 2, 3 and exact grid values x = -1, 0, 0.5 on one coordinate
    spec = [TensorSpec("w", (1,), "float32")]
    params = _params()
    uploads = [
        quantize({"w": np.array([x], np.float32)}, w, params, spec, SEED) for x, w in ((-1, 1), (0, 2), (0.5, 3))
    ]
    total = np.sum(uploads, axis=0, dtype=np.uint64).astype("<u4")
    assert total.tolist() == [0 * 1 + 2 * 2 + 3 * 3, 6]
    weighted, weight = dequantize(total, params, spec)
    assert weight == 6 and weighted["w"].tolist() == [-1 * 1 + 0 * 2 + 0.5 * 3]
