"""Batched clients whose updates are summed where they were trained (FitBatchRes) against one reply per client: the
same mean (bit for bit when a round is one batch), the same history, a diverged client failing alone, and no
pre-summing where the aggregation needs each update."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from fedcore.aggregation import WeightedMean
from fedcore.errors import ConfigError, PayloadError
from fedcore.messages import Failure, FitBatchRes, FitIns, FitRes, PoolReply
from fedcore.strategy import SamplingConfig, Strategy, StrategyConfig, build_strategy
from fedcore.supervised import SupervisedTask
from fedcore.task import FitConfig
from fedcore.tensors import NamedArrays, from_state_dict, spec_of
from server.round_loop import RoundConfig, RoundRecord, run_rounds
from simulations.attacks import AttackConfig, AttackedPool
from simulations.batched import BatchedPool, presum_weight
from simulations.config import load_recipe
from simulations.devices import DevicesConfig, SimulatedDevices
from simulations.harness import run_simulation
from simulations.inmemory import InMemoryPool
from simulations.models import MLP2NN

SEED = 11
FIT = FitConfig(local_epochs=2, batch_size=4, lr=0.1)
SIZES = {"a": 13, "b": 4, "c": 9, "d": 0, "e": 13, "f": 6, "g": 1}


def model_fn() -> torch.nn.Module:
    return MLP2NN(num_inputs=12, num_classes=3, hidden=8)


def client_data(cid: str, *, diverge: bool = False, ignored: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(ord(cid))
    x = torch.randn(SIZES[cid], 12, generator=generator)
    if diverge:
        x[0, 0] = float("nan")  # its first step's gradient is NaN: so is every parameter it trains
    y = torch.randint(0, 3, (SIZES[cid],), generator=generator)
    return x, torch.full_like(y, -100) if ignored else y  # -100: every label ignored, a NaN loss and zero gradients


def pool(diverging: str | None = None, ignored: str | None = None) -> InMemoryPool:
    tasks = {
        cid: SupervisedTask(
            model_fn=model_fn, train_data=client_data(cid, diverge=cid == diverging, ignored=cid == ignored)
        )
        for cid in SIZES
    }
    return InMemoryPool(list(SIZES), tasks.__getitem__)


def start() -> NamedArrays:
    torch.manual_seed(3)
    return from_state_dict(model_fn().state_dict())


def fedavg(**options: object) -> Strategy:
    return build_strategy(
        StrategyConfig(**{"name": "fedavg", **options}),  # type: ignore[arg-type]
        FIT,
        SamplingConfig(fraction_fit=1.0, min_fit_clients=2),
    )


def digits_run(out: Path, clients: int, *extra: str) -> list[str]:
    """Overrides of a one-round FedAvg run of the 2NN on digits over ``clients`` clients, all of them a round."""
    return [
        "data.dataset=digits",
        f"data.num_clients={clients}",
        "model.name=2nn",
        "sampling.fraction_fit=1.0",
        "rounds=1",
        "evaluate_every=1",
        "strategy.name=fedavg",
        "output.progress=false",
        "output.plot=false",
        f"output.dir={str(out)!r}",
        *extra,
    ]


def fold(replies: list[PoolReply], weights: dict[str, float], spec: NamedArrays) -> WeightedMean:
    acc = WeightedMean(spec_of(spec))
    for reply in replies:
        if isinstance(reply, FitBatchRes):
            acc.add_sum(reply.weighted_sum, reply.weights.tolist(), client_ids=reply.client_ids)
        elif isinstance(reply, FitRes):
            acc.add(reply.parameters, weights[reply.client_id], client_id=reply.client_id)
    return acc


@pytest.mark.parametrize("batch_clients", [0, 3])
def test_a_presummed_batch_gives_the_mean_of_one_reply_per_client(batch_clients: int) -> None:
    parameters = start()
    instructions = {cid: FitIns(round=2, parameters=parameters, config=FIT, seed=SEED) for cid in SIZES}
    weigh = presum_weight(fedavg())
    single = list(BatchedPool(pool(), batch_clients=batch_clients).run(instructions))
    summed = list(BatchedPool(pool(), batch_clients=batch_clients, weigh=weigh).run(instructions))
    assert all(isinstance(r, FitRes) for r in single)
    batches = [r for r in summed if isinstance(r, FitBatchRes)]
    assert len(batches) == (1 if batch_clients == 0 else 3) and len(summed) == len(batches)  # nothing else
    # each client's column entries, by client id
    rows = {cid: (batch, position) for batch in batches for position, cid in enumerate(batch.client_ids)}
    assert sorted(rows) == sorted(SIZES)
    for reply in single:
        assert isinstance(reply, FitRes)
        batch, position = rows[reply.client_id]
        assert batch.num_examples[position] == reply.num_examples == SIZES[reply.client_id]
        assert batch.update_bytes == reply.payload_bytes  # the bytes_up column counts the same
        assert batch.received_bytes == reply.payload_bytes * len(batch.client_ids)
        reported = {name for name, column in batch.metrics.items() if not np.isnan(column[position])}
        assert reported == set(reply.metrics)
        if "train_loss" in reply.metrics:
            assert batch.metrics["train_loss"][position] == reply.metrics["train_loss"]
    for batch in batches:
        assert batch.weights.tolist() == [float(n) for n in batch.num_examples.tolist()]  # FedAvg: by example count
    weights = {cid: float(n) for cid, n in SIZES.items()}
    want, got_mean = fold(single, weights, parameters).result(), fold(summed, weights, parameters).result()
    for name, value in want.items():
        if batch_clients == 0:  # one batch, summed by the same kernel in the same order: the very bits
            np.testing.assert_array_equal(got_mean[name], value)
        else:  # three partial sums added: float64 rounding in another order
            np.testing.assert_allclose(got_mean[name], value, rtol=1e-6, atol=1e-7)
        assert np.abs(value - parameters[name]).max() > 1e-3  # they trained


def test_a_diverged_client_fails_alone_and_the_others_are_summed() -> None:
    parameters = start()
    instructions = {cid: FitIns(round=1, parameters=parameters, config=FIT, seed=SEED) for cid in SIZES}
    summed = list(BatchedPool(pool(diverging="c"), weigh=presum_weight(fedavg())).run(instructions))
    batch = next(r for r in summed if isinstance(r, FitBatchRes))
    failures = [r for r in summed if isinstance(r, Failure)]
    assert [f.client_id for f in failures] == ["c"] and "NaN or Inf" in failures[0].reason
    assert "c" not in batch.client_ids and batch.rejected_bytes == batch.update_bytes
    # the others' mean, as the round loop forms it when it rejects c's update from a reply of its own
    single = list(BatchedPool(pool(diverging="c"), batch_clients=0).run(instructions))
    honest = [r for r in single if isinstance(r, FitRes) and r.client_id != "c"]
    bad = next(r for r in single if isinstance(r, FitRes) and r.client_id == "c")
    assert not all(np.isfinite(v).all() for v in bad.parameters.values())
    weights = {cid: float(n) for cid, n in SIZES.items()}
    want = fold(list(honest), weights, parameters).result()
    got = fold([batch], weights, parameters).result()
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-6, atol=1e-7)


def run(
    weigh: bool, strategy: Strategy, rounds: int = 3, ignored: str | None = None
) -> tuple[NamedArrays, list[RoundRecord]]:
    batched = BatchedPool(pool(ignored=ignored), weigh=presum_weight(strategy) if weigh else None)
    config = RoundConfig(num_rounds=rounds, seed=SEED, evaluate_every=rounds)
    state, records = run_rounds(batched, strategy, start(), config)
    return state.parameters, records


@pytest.mark.parametrize(
    "strategy",
    [
        fedavg(),
        fedavg(weighting="uniform"),
        fedavg(name="fedavgm", server_momentum=0.9),
        fedavg(weighting="metric", weight_metric="train_loss", weight_temperature=0.5),
        fedavg(weighting="metric", weight_metric="train_loss", weight_fallback=3.0, weight_times_examples=True),
    ],
    ids=["examples", "uniform", "fedavgm", "loss-softmax", "loss-fallback"],
)
@pytest.mark.parametrize("ignored", [None, "f"], ids=["labels", "f-all-ignored"])
def test_the_round_loop_gives_the_same_history_with_presummed_batches(strategy: Strategy, ignored: str | None) -> None:
    """Weighted by a metric, client d (no data, so no train_loss) is refused without a fallback and fails alone.
    A client whose labels are all -100 reports a NaN train_loss with a finite update: as in process, the loss is
    left out of the round's average (counted in metrics_left_out), and refused as a quality weight."""
    single_model, single = run(False, strategy, ignored=ignored)
    summed_model, summed = run(True, strategy, ignored=ignored)
    refused: tuple[str, ...] = ()
    if strategy.weighting == "metric" and strategy.quality.fallback is None:
        refused = ("d",) if ignored is None else ("d", ignored)
    for a, b in zip(single[1:], summed[1:], strict=True):
        # the all-ignored client replies on its own, after the batch: the same clients, in another order
        assert sorted(a.accepted) == sorted(b.accepted)
        assert sorted(a.failures, key=str) == sorted(b.failures, key=str)  # their reasons too
        assert tuple(sorted(f.client_id for f in a.failures)) == refused
        # d's fit_seconds (0 examples), and f's NaN train_loss: left out unless the client was refused
        assert a.metrics_left_out == sum(cid is not None and cid not in refused for cid in ("d", ignored))
        assert a.train_metrics["train_loss"] == b.train_metrics["train_loss"]  # fit_seconds: wall time
        assert a.bytes_up == b.bytes_up and a.bytes_down == b.bytes_down
        assert sorted((o.client_id, o.num_examples, o.loss) for o in a.observations) == sorted(
            (o.client_id, o.num_examples, o.loss) for o in b.observations
        )
        assert a.train_metrics.keys() == b.train_metrics.keys() and a.metrics_left_out == b.metrics_left_out
        if ignored is None:
            assert a.accepted == b.accepted and a.update_norm == b.update_norm
    for name, value in single_model.items():
        if ignored is None:  # each round is one batch on the CPU: the very bits
            np.testing.assert_array_equal(summed_model[name], value)
        else:  # the batch's sum, then the one reply: float64 sums in another order
            np.testing.assert_allclose(summed_model[name], value, rtol=1e-6, atol=1e-7)


def test_no_presumming_where_the_aggregation_needs_each_update() -> None:
    assert presum_weight(fedavg()) is not None
    assert presum_weight(fedavg(weighting="metric", weight_metric="train_loss")) is not None
    for options in (
        {"aggregator": "median"},
        {"aggregator": "trimmed_mean"},
        {"aggregator": "norm_bound", "norm_bound": 1.0},
        {"name": "scaffold"},
        {"weighting": "server", "weight_metric": "loss"},
    ):
        assert presum_weight(fedavg(**options)) is None, options


def test_the_round_loop_refuses_a_batch_for_an_aggregator_that_needs_each_update() -> None:
    strategy = dataclasses.replace(fedavg(), aggregator=fedavg(aggregator="median").aggregator)
    batched = BatchedPool(pool(), weigh=presum_weight(fedavg()))  # told to pre-sum regardless
    with pytest.raises(ConfigError, match="already summed"):
        run_rounds(batched, strategy, start(), RoundConfig(num_rounds=1, seed=SEED))


def test_a_rewriting_attacker_is_never_summed_unseen() -> None:
    parameters = start()
    instructions = {cid: FitIns(round=1, parameters=parameters, config=FIT, seed=SEED) for cid in SIZES}
    summed = BatchedPool(pool(), weigh=presum_weight(fedavg()))
    attacked = AttackedPool(summed, frozenset({"b"}), AttackConfig(kind="sign_flip", fraction=0.2), seed=SEED)
    with pytest.raises(ConfigError, match="cannot rewrite"):
        list(attacked.run(instructions, timeout_s=None))
    label_attack = AttackedPool(summed, frozenset({"b"}), AttackConfig(kind="label_flip", fraction=0.2), seed=SEED)
    assert isinstance(next(iter(label_attack.run(instructions, timeout_s=None))), FitBatchRes)


def test_simulated_devices_time_each_result_of_a_batch() -> None:
    parameters = start()
    instructions = {cid: FitIns(round=1, parameters=parameters, config=FIT, seed=SEED) for cid in SIZES}
    config = DevicesConfig(slow_fraction=0.5, slowdown=4.0, step_seconds=0.5)
    timed = SimulatedDevices(BatchedPool(pool(), weigh=presum_weight(fedavg())), frozenset({"a"}), config)
    batch = next(iter(timed.run(instructions, timeout_s=None)))
    assert isinstance(batch, FitBatchRes)
    seconds = dict(zip(batch.client_ids, batch.metrics["simulated_seconds"].tolist(), strict=True))
    # E=2 epochs of ceil(n / 4) steps of 0.5 s, the slow client 4x: a has 13 samples, e 13, g 1
    assert seconds["a"] == pytest.approx(4.0 * 2 * 4 * 0.5) and seconds["e"] == pytest.approx(2 * 4 * 0.5)
    assert seconds["g"] == pytest.approx(2 * 1 * 0.5)
    # the very floats of each client's result timed on its own
    one_by_one = SimulatedDevices(BatchedPool(pool()), frozenset({"a"}), config)
    for reply in one_by_one.run(instructions, timeout_s=None):
        assert isinstance(reply, FitRes)
        assert seconds[reply.client_id] == reply.metrics["simulated_seconds"]


def test_a_batched_simulation_with_a_model_poisoning_attack_still_runs(tmp_path: Path) -> None:
    extra = ["simulation.backend=batched", "attack.kind=sign_flip", "attack.fraction=0.25"]
    result = run_simulation(load_recipe(None, digits_run(tmp_path, 8, *extra)), echo=lambda _: None)
    assert list(result.history["clients"]) == [0, 8]


def test_a_batch_must_carry_one_entry_per_client_in_each_column() -> None:
    def batch(**columns: object) -> FitBatchRes:
        fields: dict[str, object] = {
            "num_examples": np.array([3, 4]),
            "weights": np.array([3.0, 4.0]),
            "metrics": {"train_loss": np.array([0.5, np.nan])},
        }
        return FitBatchRes(
            round=1,
            client_ids=("a", "b"),
            weighted_sum={},
            update_bytes=8,
            **{**fields, **columns},  # type: ignore[arg-type]  # deliberate: the tests' columns of the wrong kind
        )

    assert batch().received_bytes == 16
    with pytest.raises(PayloadError, match="carries weights as a float64 array of shape \\(3,\\)"):
        batch(weights=np.array([1.0, 2.0, 3.0]))
    with pytest.raises(PayloadError, match="carries num_examples as a float64 array"):
        batch(num_examples=np.array([3.0, 4.0]))
    with pytest.raises(PayloadError, match="carries metric 'train_loss' as tuple"):
        batch(metrics={"train_loss": (0.5, 0.5)})


def test_the_device_path_sums_and_checks_as_the_cpu_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the sum is a float64 matrix-vector product per chunk of clients and the check a reduction per stacked
    tensor; here they run on the CPU in place of numba's kernels, with chunks of two clients."""
    import simulations.batched as batched

    parameters = start()
    instructions = {cid: FitIns(round=1, parameters=parameters, config=FIT, seed=SEED) for cid in SIZES}
    kernels = list(BatchedPool(pool(diverging="c"), weigh=presum_weight(fedavg())).run(instructions))
    monkeypatch.setattr(batched, "_on_cpu_fused", lambda _stacked: False)
    monkeypatch.setattr(batched, "SUM_CHUNK_BYTES", 2 * 8 * 12 * 8)  # the first layer's rows: two clients a chunk
    device = list(BatchedPool(pool(diverging="c"), weigh=presum_weight(fedavg())).run(instructions))
    assert [type(r) for r in device] == [type(r) for r in kernels] == [FitBatchRes, Failure]
    want, got = kernels[0], device[0]
    assert isinstance(want, FitBatchRes) and isinstance(got, FitBatchRes)
    assert got.client_ids == want.client_ids and got.weights.tolist() == want.weights.tolist()
    for name, value in want.weighted_sum.items():
        assert got.weighted_sum[name].dtype == np.float64
        np.testing.assert_allclose(got.weighted_sum[name], value, rtol=1e-12, atol=1e-12)


class WithTemperature(torch.nn.Module):
    """The 2NN with a learned scalar temperature: a 0-dim parameter, stacked as ``(clients,)``."""

    def __init__(self) -> None:
        super().__init__()
        self.body = model_fn()
        self.temperature = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) / self.temperature


def test_a_scalar_parameter_is_summed_like_the_others() -> None:
    tasks = {cid: SupervisedTask(model_fn=WithTemperature, train_data=client_data(cid)) for cid in SIZES}
    torch.manual_seed(3)
    parameters = from_state_dict(WithTemperature().state_dict())
    instructions = {cid: FitIns(round=1, parameters=parameters, config=FIT, seed=SEED) for cid in SIZES}
    single = list(BatchedPool(InMemoryPool(list(SIZES), tasks.__getitem__)).run(instructions))
    summed = list(
        BatchedPool(InMemoryPool(list(SIZES), tasks.__getitem__), weigh=presum_weight(fedavg())).run(instructions)
    )
    assert [type(r) for r in summed] == [FitBatchRes]
    weights = {cid: float(n) for cid, n in SIZES.items()}
    want, got = fold(single, weights, parameters).result(), fold(summed, weights, parameters).result()
    assert want["temperature"].shape == () and want["temperature"] != parameters["temperature"]  # it trained
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value)


def test_weighting_by_a_metric_a_wrapper_adds_is_not_presummed(tmp_path: Path) -> None:
    """simulated_seconds comes from SimulatedDevices, around the batched pool: weights taken inside the pool would
    not see it, so such a run keeps one reply per client and trains as in-process."""
    assert presum_weight(fedavg(weighting="metric", weight_metric="simulated_seconds")) is None
    extra = [
        "strategy.weighting=metric",
        "strategy.weight_metric=simulated_seconds",
        "strategy.weight_transform=proportional",
        "devices.simulate_time=true",
        "simulation.backend=batched",
    ]
    result = run_simulation(load_recipe(None, digits_run(tmp_path, 6, *extra)), echo=lambda _: None)
    assert list(result.history["clients"]) == [0, 6]


def test_a_rejected_update_counts_its_bytes_as_one_by_one() -> None:
    """The round loop counts an update's bytes when it arrives, before it rejects it; a batch counts those of the
    updates it left out (here a diverged client's) the same way."""
    strategy = fedavg()
    records = {}
    for weigh in (None, presum_weight(strategy)):
        batched = BatchedPool(pool(diverging="c"), weigh=weigh)
        _, records[weigh is None] = run_rounds(batched, strategy, start(), RoundConfig(num_rounds=1, seed=SEED))
    single, summed = records[True][-1], records[False][-1]
    assert [f.client_id for f in single.failures] == [f.client_id for f in summed.failures] == ["c"]
    assert single.accepted == summed.accepted and single.bytes_up == summed.bytes_up
    assert single.bytes_up == len(SIZES) * sum(v.nbytes for v in start().values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bench/gpu_check.sh runs it)")
def test_a_batch_summed_on_the_gpu_gives_the_mean_of_its_updates() -> None:
    """On a GPU: the float64 matrix-vector sums and the finite check on the device, against the same clients'
    updates (trained on the same GPU) folded one by one on the CPU."""
    parameters = start()
    instructions = {cid: FitIns(round=1, parameters=parameters, config=FIT, seed=SEED) for cid in SIZES}
    single = list(BatchedPool(pool(diverging="c"), device="cuda").run(instructions))
    summed = list(BatchedPool(pool(diverging="c"), device="cuda", weigh=presum_weight(fedavg())).run(instructions))
    assert [type(r) for r in summed] == [FitBatchRes, Failure] and isinstance(summed[1], Failure)
    assert summed[1].client_id == "c"
    weights = {cid: float(n) for cid, n in SIZES.items()}
    honest = [r for r in single if isinstance(r, FitRes) and r.client_id != "c"]
    want, got = fold(list(honest), weights, parameters).result(), fold(summed, weights, parameters).result()
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-6, atol=1e-7)
