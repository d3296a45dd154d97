"""Bytes on the wire over gRPC (client daemons as threads): a round's bytes up are the payloads the server
received, its bytes down the model payload it sent times the clients, for training and for federated evaluation
(as the service's own counters of the streamed payloads), and its model and update norm are the in-memory
simulation's, bit for bit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from fedcore.aggregation.weights import QualityWeights, WeightRule
from fedcore.messages import EvaluateIns, FitIns
from fedcore.strategy import SamplingConfig, Strategy
from fedcore.supervised import SupervisedTask
from fedcore.task import FitConfig, Task, initial_parameters
from fedcore.tensors import safetensors_header
from server.round_loop import RoundConfig, run_rounds
from simulations.datasets import load_digits_dataset
from simulations.inmemory import InMemoryPool
from simulations.models import MLP2NN
from simulations.partition import iid
from tests.deploy.daemon_threads import daemon_threads
from tests.deploy.test_service import Harness

pytestmark = pytest.mark.timeout(120)

IDS = ["a", "b"]
FIT = FitConfig(local_epochs=1, batch_size=16, lr=0.1)
SAMPLING = SamplingConfig(fraction_fit=1.0, min_fit_clients=2, fraction_evaluate=1.0, min_evaluate_clients=2)


def model_fn() -> torch.nn.Module:
    return MLP2NN(num_inputs=64, num_classes=10, hidden=32)


def make_task(cid: str) -> Task:
    data = load_digits_dataset(seed=0)
    part = iid(data.y_train, len(IDS), seed=0)[IDS.index(cid)]
    x, y = torch.from_numpy(data.x_train[part]), torch.from_numpy(data.y_train[part])
    return SupervisedTask(model_fn=model_fn, train_data=(x, y), test_data=(x[:20], y[:20]))


@pytest.mark.parametrize("weighting", ["examples", "metric"])
def test_grpc_round_counts_the_bytes_received_and_sent(tmp_path: Path, weighting: WeightRule) -> None:
    """Also: quality weighting by the clients' reported loss gives the simulation's model over gRPC, to the bit."""
    strategy = Strategy(fit=FIT, sampling=SAMPLING, weighting=weighting, quality=QualityWeights(temperature=0.1))
    initial = initial_parameters(model_fn, seed=1)
    config = RoundConfig(num_rounds=1, seed=3, round_timeout_s=60)
    simulated, sim_records = run_rounds(InMemoryPool(IDS, make_task), strategy, initial, config)
    h = Harness(tmp_path, heartbeat_interval_s=0.2, liveness_timeout_s=5.0)
    try:
        with daemon_threads(h, IDS, make_task):
            final, records = run_rounds(h.pool, strategy, initial, config)
        model_payload = h.pool.payload_bytes(FitIns(round=1, parameters=initial, config=FIT, seed=3))
        eval_payload = h.pool.payload_bytes(EvaluateIns(round=1, parameters=final.parameters))
        streamed_out = h.metrics.registry.get_sample_value("fedcore_bytes_out_total")
        streamed_in = h.metrics.registry.get_sample_value("fedcore_bytes_in_total")
    finally:
        h.pool.finish()
        h.close()
    tensors = sum(a.nbytes for a in initial.values())
    # a safetensors payload: 8 bytes of header length, the JSON header, the tensors' data
    assert model_payload == len(safetensors_header(initial)) + tensors > tensors
    record = records[-1]
    assert record.federated_eval_loss is not None and sim_records[-1].federated_eval_loss is not None
    assert eval_payload == model_payload  # the model, as a fit instruction without tensor groups carries it
    assert record.bytes_down == 2 * model_payload + 2 * eval_payload == streamed_out  # fit, then evaluate
    assert record.bytes_up == 2 * model_payload == streamed_in  # the updates: the model's names, shapes, dtypes
    # the in-memory pool counts the tensors alone; the model and the update norm are the same to the bit
    assert sim_records[-1].bytes_down == 4 * tensors and sim_records[-1].bytes_up == 2 * tensors
    assert record.update_norm == sim_records[-1].update_norm
    for name, value in simulated.parameters.items():
        np.testing.assert_array_equal(final.parameters[name], value, err_msg=name)
