"""Server optimizers: one or two steps computed by hand on 2-3 element arrays."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from fedcore.errors import ConfigError, PayloadError
from fedcore.payload import open_safetensors, save_payload
from fedcore.server_opt import ServerAdaptive, ServerOptimizer, ServerSGD
from fedcore.tensors import NamedArrays
from tests.residency import mapping_rss, needs_smaps


def _copy(d: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v.copy() for k, v in d.items()}


def _assert_unchanged(before: dict[str, np.ndarray], after: dict[str, np.ndarray]) -> None:
    assert list(before) == list(after)
    for k in before:
        assert np.array_equal(before[k], after[k])


def test_fedavg_returns_the_average_exactly() -> None:
    rng = np.random.default_rng(0)
    params: NamedArrays = {"w": rng.standard_normal(1000).astype(np.float32), "n": np.array(5, np.int64)}
    average: NamedArrays = {"w": rng.standard_normal(1000).astype(np.float32) * 1e-3 + 1e4, "n": np.array(7, np.int64)}
    opt: ServerOptimizer = ServerSGD()
    state = opt.init(params)
    assert state == {}
    new, new_state = opt.step(params, average, state)
    assert new_state == {}
    assert np.array_equal(new["w"], average["w"]) and new["w"].dtype == np.float32
    assert new["n"] == 7
    assert new["w"] is not average["w"]  # a copy, not an alias of the caller's array


def test_fedavgm_two_steps_by_hand() -> None:
    # lr = 0.5, momentum = 0.9; x0 = [1, 2]
    # step 1: avg = [2, 0]  -> Δ = [1, -2]; v = 0.9·0 + Δ = [1, -2]; x1 = x0 + 0.5·v = [1.5, 1.0]
    # step 2: avg = [1.5, 2] -> Δ = [0, 1]; v = 0.9·[1, -2] + [0, 1] = [0.9, -0.8]; x2 = [1.5 + 0.45, 1 - 0.4]
    opt = ServerSGD(lr=0.5, momentum=0.9)
    x0 = {"w": np.array([1.0, 2.0])}
    s0 = opt.init(x0)
    np.testing.assert_array_equal(s0["v/w"], [0.0, 0.0])
    x1, s1 = opt.step(x0, {"w": np.array([2.0, 0.0])}, s0)
    np.testing.assert_allclose(s1["v/w"], [1.0, -2.0])
    np.testing.assert_allclose(x1["w"], [1.5, 1.0])
    x2, s2 = opt.step(x1, {"w": np.array([1.5, 2.0])}, s1)
    np.testing.assert_allclose(s2["v/w"], [0.9, -0.8], rtol=1e-15)
    np.testing.assert_allclose(x2["w"], [1.95, 0.6], rtol=1e-15)


def test_server_sgd_lr_without_momentum() -> None:
    # x = [4], avg = [2]: Δ = -2, x = 4 + 0.25·(-2) = 3.5
    new, state = ServerSGD(lr=0.25).step({"w": np.array([4.0])}, {"w": np.array([2.0])}, {})
    assert new["w"][0] == 3.5 and state == {}


# One adaptive step, tau = 0.1, lr = 0.1, beta1 = 0.9, beta2 = 0.99; x0 = [1, 2, 3], avg = [1.5, 1, 3]:
#   Δ = [0.5, -1, 0], m = 0.9·0 + 0.1·Δ = [0.05, -0.1, 0], Δ² = [0.25, 1, 0], v0 = τ² = 0.01
X0 = np.array([1.0, 2.0, 3.0])
AVG = np.array([1.5, 1.0, 3.0])
M1 = np.array([0.05, -0.1, 0.0])


@pytest.mark.parametrize(
    ("kind", "v1"),
    [
        # adagrad: v = 0.01 + Δ² = [0.26, 1.01, 0.01]
        ("adagrad", np.array([0.26, 1.01, 0.01])),
        # adam: v = 0.99·0.01 + 0.01·Δ² = [0.0099 + 0.0025, 0.0099 + 0.01, 0.0099] = [0.0124, 0.0199, 0.0099]
        ("adam", np.array([0.0124, 0.0199, 0.0099])),
        # yogi: v = 0.01 − 0.01·Δ²·sign(0.01 − Δ²); signs [-1, -1, +1] (Δ² = 0 < v):
        #   [0.01 + 0.0025, 0.01 + 0.01, 0.01 − 0] = [0.0125, 0.02, 0.01]
        ("yogi", np.array([0.0125, 0.02, 0.01])),
    ],
)
def test_adaptive_one_step_by_hand(kind: str, v1: np.ndarray) -> None:
    opt = ServerAdaptive(kind=kind, lr=0.1, beta1=0.9, beta2=0.99, tau=0.1)  # type: ignore[arg-type]
    params = {"w": X0.copy(), "steps": np.array([3], np.int64)}
    average = {"w": AVG.copy(), "steps": np.array([9], np.int64)}
    state = opt.init(params)
    assert set(state) == {"m/w", "v/w"}
    np.testing.assert_allclose(state["v/w"], [0.01, 0.01, 0.01], rtol=1e-15)  # τ² = 0.1² (rounded)
    before_p, before_a, before_s = _copy(params), _copy(average), _copy(state)
    new, new_state = opt.step(params, average, state)
    _assert_unchanged(before_p, params)
    _assert_unchanged(before_a, average)
    _assert_unchanged(before_s, state)
    np.testing.assert_allclose(new_state["m/w"], M1, rtol=1e-14)
    np.testing.assert_allclose(new_state["v/w"], v1, rtol=1e-14)
    # x = x0 + 0.1·m / (√v + 0.1), e.g. adagrad w[0]: 1 + 0.1·0.05 / (√0.26 + 0.1) = 1 + 0.005 / 0.609902 = 1.008198
    expected = X0 + 0.1 * M1 / (np.sqrt(v1) + 0.1)
    np.testing.assert_allclose(new["w"], expected, rtol=1e-14)
    assert new["steps"][0] == 9  # integer buffers take the average
    if kind == "adagrad":
        np.testing.assert_allclose(new["w"][0], 1.0081979, rtol=1e-6)


def test_adaptive_keeps_float32_dtype_and_state_dtype() -> None:
    opt = ServerAdaptive(kind="adam")
    params = {"w": np.array([1.0, 2.0], np.float32)}
    state = opt.init(params)
    new, new_state = opt.step(params, {"w": np.array([1.5, 2.5], np.float32)}, state)
    assert new["w"].dtype == np.float32
    assert new_state["m/w"].dtype == np.float32 and new_state["v/w"].dtype == np.float32


def test_fedavgm_does_not_mutate_inputs() -> None:
    opt = ServerSGD(lr=1.0, momentum=0.5)
    params = {"w": np.array([1.0, 2.0], np.float32)}
    average = {"w": np.array([0.0, 0.0], np.float32)}
    state = opt.init(params)
    before = (_copy(params), _copy(average), _copy(state))
    opt.step(params, average, state)
    _assert_unchanged(before[0], params)
    _assert_unchanged(before[1], average)
    _assert_unchanged(before[2], state)


@pytest.mark.parametrize(
    "make",
    [
        lambda: ServerSGD(lr=0.0),
        lambda: ServerSGD(lr=-1.0),
        lambda: ServerSGD(lr=float("nan")),
        lambda: ServerSGD(momentum=1.0),
        lambda: ServerSGD(momentum=-0.1),
        lambda: ServerAdaptive(kind="rmsprop"),  # type: ignore[arg-type]
        lambda: ServerAdaptive(kind="adam", tau=0.0),
        lambda: ServerAdaptive(kind="adam", beta1=1.0),
        lambda: ServerAdaptive(kind="yogi", beta2=1.5),
        lambda: ServerAdaptive(kind="adagrad", lr=float("inf")),
    ],
)
def test_invalid_configs_raise_config_error(make: Callable[[], object]) -> None:
    with pytest.raises(ConfigError):
        make()


def test_configs_are_frozen_and_keyword_only() -> None:
    opt = ServerSGD(lr=0.5)
    with pytest.raises(AttributeError):
        opt.lr = 2.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        ServerSGD(0.5)  # type: ignore[call-arg]


OPTIMIZERS = [
    ServerSGD(lr=0.5, momentum=0.9),
    ServerSGD(lr=0.5),
    ServerAdaptive(kind="adagrad", lr=1.0),
    ServerAdaptive(kind="adam", lr=1.0),
    ServerAdaptive(kind="yogi", lr=1.0),
]
OPTIMIZER_IDS = ["fedavgm", "sgd-lr", "fedadagrad", "fedadam", "fedyogi"]


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=OPTIMIZER_IDS)
def test_buffers_take_the_average_and_only_trainable_parameters_are_stepped(opt: ServerOptimizer) -> None:
    # A BatchNorm layer: weight/bias are trainable, running statistics and the counter are buffers.
    params: NamedArrays = {
        "bn.weight": np.array([1.0, 1.0], np.float32),
        "bn.running_var": np.array([1.0, 1.0], np.float32),
        "bn.running_mean": np.array([0.0, 0.0], np.float32),
        "bn.num_batches_tracked": np.array(4, np.int64),
    }
    # the clients' running variance shrank to 0.01: Adam's normalized step (lr·m/(√v+τ) ≈ lr·sign(Δ)) would move
    # it by about -1 and below zero; the example-weighted average is the right value
    average: NamedArrays = {
        "bn.weight": np.array([0.5, 2.0], np.float32),
        "bn.running_var": np.array([0.01, 0.02], np.float32),
        "bn.running_mean": np.array([0.3, -0.3], np.float32),
        "bn.num_batches_tracked": np.array(8, np.int64),
    }
    trainable = frozenset({"bn.weight"})
    state = opt.init(params, trainable=trainable)
    assert {k.split("/", 1)[1] for k in state} <= trainable  # no state for buffers
    new, new_state = opt.step(params, average, state, trainable=trainable)
    for buffer in ("bn.running_var", "bn.running_mean", "bn.num_batches_tracked"):
        assert np.array_equal(new[buffer], average[buffer]) and new[buffer].dtype == params[buffer].dtype, buffer
    assert set(new_state) == set(state)
    # the trainable parameter is stepped exactly as when it is the only tensor
    alone, _ = opt.step(
        {"bn.weight": params["bn.weight"]},
        {"bn.weight": average["bn.weight"]},
        opt.init({"bn.weight": params["bn.weight"]}),
    )
    assert np.array_equal(new["bn.weight"], alone["bn.weight"])
    # trainable=None (a model without named parameters): every floating tensor is stepped, as in flwr's FedOpt
    everything, _ = opt.step(params, average, opt.init(params))
    assert not np.array_equal(everything["bn.running_var"], average["bn.running_var"])


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=OPTIMIZER_IDS)
def test_zero_d_parameters_stay_zero_d_arrays(opt: ServerOptimizer) -> None:
    params = {"scale": np.array(2.0, np.float32), "w": np.array([1.0, 2.0], np.float32)}
    average = {"scale": np.array(3.0, np.float32), "w": np.array([1.5, 1.5], np.float32)}
    state = opt.init(params)
    for _ in range(2):
        params, state = opt.step(params, average, state)
        for name, value in [*params.items(), *state.items()]:
            assert type(value) is np.ndarray and value.dtype == np.float32, (name, type(value))
        assert params["scale"].shape == () and all(state[k].shape == () for k in state if k.endswith("/scale"))


def test_a_state_of_another_strategy_is_refused_with_a_clear_error() -> None:
    params = {"w": np.array([1.0, 2.0])}
    with pytest.raises(PayloadError, match=r"lacks 2 entries.*'m/w'.*another strategy"):
        ServerAdaptive(kind="adam").step(params, {"w": np.array([0.0, 0.0])}, {})
    with pytest.raises(PayloadError, match="'v/w'"):
        ServerSGD(momentum=0.9).step(params, {"w": np.array([0.0, 0.0])}, {"m/w": np.zeros(2), "v/x": np.zeros(2)})


# more elements than one block of the step (2**18), and not a multiple of it
BIG = 2**18 * 2 + 12_345


def _whole_array_reference(opt: ServerOptimizer, x: np.ndarray, avg: np.ndarray, state: dict[str, np.ndarray]) -> tuple:
    """The step's formulas applied to whole float64 arrays, as the step computed them before it went block-wise."""
    x64, delta = x.astype(np.float64), avg.astype(np.float64) - x.astype(np.float64)
    if isinstance(opt, ServerSGD):
        v = opt.momentum * state["v/w"].astype(np.float64) + delta
        return (x64 + opt.lr * v).astype(np.float32), {"v/w": v.astype(np.float32)}
    assert isinstance(opt, ServerAdaptive) and opt.kind == "adam"
    m = opt.beta1 * state["m/w"].astype(np.float64) + (1 - opt.beta1) * delta
    v = opt.beta2 * state["v/w"].astype(np.float64) + (1 - opt.beta2) * delta * delta
    new = x64 + opt.lr * m / (np.sqrt(v) + opt.tau)
    return new.astype(np.float32), {"m/w": m.astype(np.float32), "v/w": v.astype(np.float32)}


@pytest.mark.parametrize("opt", [ServerSGD(lr=0.9, momentum=0.7), ServerAdaptive(kind="adam", lr=0.05)])
def test_block_wise_step_equals_the_whole_array_formula_and_may_reuse_the_average(opt: ServerOptimizer) -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal(BIG).astype(np.float32)
    avg = (x + 1e-2 * rng.standard_normal(BIG)).astype(np.float32)
    state = {k: np.abs(v) + rng.random(BIG).astype(np.float32) for k, v in opt.init({"w": x}).items()}
    expected, expected_state = _whole_array_reference(opt, x, avg, state)
    new, new_state = opt.step({"w": x}, {"w": avg.copy()}, state)
    assert np.array_equal(new["w"], expected) and new["w"].dtype == np.float32
    assert all(np.array_equal(new_state[k], expected_state[k]) for k in expected_state)
    given = {"w": avg.copy()}
    reused, reused_state = opt.step({"w": x}, given, state, reuse_average=True)
    assert reused["w"] is given["w"]  # written into the average's memory, which the caller gave up
    assert np.array_equal(reused["w"], expected)
    assert all(np.array_equal(reused_state[k], expected_state[k]) for k in expected_state)


def test_fedavg_with_reuse_returns_the_average_itself() -> None:
    average: NamedArrays = {"w": np.arange(3, dtype=np.float32), "n": np.array(4, np.int64)}
    new, state = ServerSGD().step(
        {"w": np.zeros(3, np.float32), "n": np.array(1, np.int64)}, average, {}, reuse_average=True
    )
    assert new["w"] is average["w"] and new["n"] is average["n"] and state == {}


@needs_smaps
@pytest.mark.parametrize(
    "opt", [ServerSGD(lr=0.7, momentum=0.9), ServerAdaptive(kind="adam", lr=0.01)], ids=["fedavgm", "fedadam"]
)
def test_a_step_reads_a_mapped_model_and_state_without_keeping_them_resident(
    tmp_path: Path, opt: ServerOptimizer
) -> None:
    """Parameters and state mapped read-only from a file (as a checkpoint or a simulation's state between rounds)
    give the very step of the same arrays in memory, and their pages leave the resident set as the step reads
    them: the old state is never resident whole beside the new one (here 3 blocks of the largest tensor)."""
    rng = np.random.default_rng(3)
    size = 3 * (1 << 18) + 1000  # three blocks and a bit
    params = {"w": rng.standard_normal(size).astype(np.float32), "b": rng.standard_normal(7).astype(np.float32)}
    average = {n: a + rng.standard_normal(a.shape).astype(np.float32) * 0.1 for n, a in params.items()}
    state = {n: a + 1.0 for n, a in opt.step(params, average, opt.init(params))[1].items()}  # a nonzero state
    save_payload(tmp_path / "state.safetensors", {**{f"p.{n}": a for n, a in params.items()}, **state})
    views, _ = open_safetensors(tmp_path / "state.safetensors")
    mapped_params = {n: views[f"p.{n}"] for n in params}
    mapped_state = {n: views[n] for n in state}
    for array in (mapped_params["w"], *(mapped_state[k] for k in mapped_state if k.endswith("/w"))):
        assert isinstance(array, np.memmap) and float(np.sum(array, dtype=np.float64)) != 0.0  # all read in
        assert mapping_rss(array) >= array.nbytes - 4096
    expected = opt.step(params, _copy(average), state)
    got = opt.step(mapped_params, _copy(average), mapped_state, reuse_average=True)
    for name in expected[0]:
        assert np.array_equal(got[0][name], expected[0][name])
    for name in expected[1]:
        assert np.array_equal(got[1][name], expected[1][name])
    large = [mapped_params["w"], *(mapped_state[k] for k in mapped_state if k.endswith("/w"))]
    assert [mapping_rss(array) <= 8192 for array in large] == [True] * len(large)  # at most the pages at its ends
    assert np.array_equal(mapped_params["w"], params["w"])  # the file's pages come back when read again
