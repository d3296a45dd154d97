"""SecAgg+ in real federated rounds (simulation): the model equals FedAvg's within the quantization bound round by
round, only masked uint32 uploads leave the clients, dropouts at any stage are recovered, and settings the
protocol cannot honour are refused before any client is contacted."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterator, Mapping

import numpy as np
import pytest
import torch
from torch import nn

from fedcore.cli import server_options, simulate_options
from fedcore.config import from_mapping
from fedcore.errors import ConfigError, RoundFailed
from fedcore.messages import Failure, FitIns, FitRes, Reply, ServerMessage, StageIns
from fedcore.options import add_options, given_values
from fedcore.strategy import SamplingConfig, Strategy, StrategyConfig, build_strategy
from fedcore.supervised import SupervisedTask
from fedcore.task import FitConfig, TaskContext, initial_parameters, trainable_names
from privacy.secagg.codec import MASKED
from privacy.secagg.config import SecAggConfig
from privacy.secagg.rounds import secure_aggregation
from server.round_loop import RoundConfig, RoundRecord, ServerState, initial_state, run_rounds
from simulations.inmemory import InMemoryPool

IDS = ["a", "b", "c", "d"]
SIZES = {"a": 8, "b": 12, "c": 16, "d": 20}  # unequal example counts: the weights matter
SEED = 5
FIT = FitConfig(local_epochs=2, batch_size=8, lr=0.1)
SAMPLING = SamplingConfig(fraction_fit=1.0, min_fit_clients=2)
SECAGG = SecAggConfig(field_bits=24, clip=1.0, max_weight=64)  # a coarse field: the quantization error shows


def model_fn() -> nn.Module:
    return nn.Linear(4, 3)


def make_task(cid: str) -> SupervisedTask:
    g = torch.Generator().manual_seed(ord(cid))
    x = torch.randn(SIZES[cid], 4, generator=g) + ord(cid) % 3
    y = torch.randint(0, 3, (SIZES[cid],), generator=g)
    return SupervisedTask(model_fn=model_fn, train_data=(x, y))


def plain() -> Strategy:
    return build_strategy(StrategyConfig(), FIT, SAMPLING)


def secure() -> Strategy:
    return build_strategy(StrategyConfig(secure_aggregation=True, secagg=SECAGG), FIT, SAMPLING)


class Recording:
    """A pool that records what the clients send and can make one client drop out at one stage."""

    def __init__(self, pool: InMemoryPool, drop: set[tuple[str, str]] | None = None) -> None:
        self.pool = pool
        self.drop = drop or set()
        self.fit_replies: list[FitRes] = []
        self.stages: list[str] = []

    def available(self) -> list[str]:
        return self.pool.available()

    def wait_for(self, num_clients: int, timeout_s: float) -> list[str]:
        return self.pool.wait_for(num_clients, timeout_s)

    def run(self, instructions: Mapping[str, ServerMessage], *, timeout_s: float | None) -> Iterator[Reply]:
        first = next(iter(instructions.values()))
        stage = first.name if isinstance(first, StageIns) else "fit" if isinstance(first, FitIns) else "evaluate"
        self.stages.append(stage)
        for reply in self.pool.run(instructions, timeout_s=timeout_s):
            if (reply.client_id, stage) in self.drop:
                yield Failure(client_id=reply.client_id, round=first.round, stage=first.stage, reason="injected")
                continue
            if isinstance(reply, FitRes):
                self.fit_replies.append(reply)
            yield reply


def start_state(strategy: Strategy) -> ServerState:
    return initial_state(initial_parameters(model_fn, SEED), strategy, trainable=trainable_names(model_fn))


def one_round(
    strategy: Strategy, state: ServerState, ids: list[str], drop: set[tuple[str, str]] | None = None
) -> tuple[ServerState, RoundRecord, Recording]:
    pool = Recording(InMemoryPool(ids, make_task), drop=drop)
    final, records = run_rounds(pool, strategy, state, RoundConfig(num_rounds=state.round + 1, seed=SEED))
    return final, records[-1], pool


def max_error(a: ServerState, b: ServerState) -> float:
    return max(float(np.max(np.abs(a.parameters[n].astype(np.float64) - b.parameters[n]))) for n in a.parameters)


def test_three_secure_rounds_equal_fedavg_within_the_quantization_bound() -> None:
    bound = SECAGG.resolve(len(IDS)).error_bound
    state = start_state(secure())
    for _ in range(3):
        reference, _, _ = one_round(plain(), state, IDS)
        state, record, pool = one_round(secure(), state, IDS)
        assert record.accepted == tuple(sorted(IDS)) or sorted(record.accepted) == IDS
        assert pool.stages == ["advertise_keys", "share_keys", "collect_masked_input", "fit", "unmask"]
        for reply in pool.fit_replies:  # only the masked upload left each client, at the field's width
            assert list(reply.parameters) == [MASKED]
            assert reply.parameters[MASKED].dtype == np.uint32
            assert reply.parameters[MASKED].shape == (4 * 3 + 3 + 1,)
        error = max_error(state, reference)
        assert 0 < error <= bound + 1e-6, (error, bound)
    assert state.round == 3


@pytest.mark.parametrize(
    ("stage", "survivors"),
    [
        ("advertise_keys", ["a", "b", "d"]),
        ("collect_masked_input", ["a", "b", "d"]),
        ("fit", ["a", "b", "d"]),  # shared its keys, sent no masked input: its masks are recovered
        ("unmask", IDS),  # its masked input is in the sum; the others' shares unmask it
    ],
)
def test_a_dropout_at_any_stage_is_recovered(stage: str, survivors: list[str]) -> None:
    bound = SECAGG.resolve(len(IDS)).error_bound
    state = start_state(secure())
    secured, record, _ = one_round(secure(), state, IDS, drop={("c", stage)})
    assert sorted(record.accepted) == [cid for cid in survivors]
    assert any(f.client_id == "c" for f in record.failures)
    reference, _, _ = one_round(plain(), state, survivors)
    assert max_error(secured, reference) <= bound + 1e-6


def test_too_many_dropouts_abort_the_attempt_and_nothing_is_unmasked() -> None:
    # 2 of 4 clients drop after sharing their keys: a survivor keeps fewer than t = 2 of its k = 3 neighbours, so
    # the server may not ask for the shares that would unmask the dropouts; both attempts fail, the model stays
    strategy = secure()
    state = start_state(strategy)
    pool = Recording(InMemoryPool(IDS, make_task), drop={("c", "fit"), ("d", "fit")})
    with pytest.raises(RoundFailed, match=r"after 2 attempt.*nothing is revealed.*fewer than the threshold 2"):
        run_rounds(pool, strategy, state, RoundConfig(num_rounds=1, seed=SEED, max_round_attempts=2))
    assert pool.stages.count("fit") == 2 and "unmask" not in pool.stages


def test_settings_the_protocol_cannot_honour_are_refused_before_any_client_is_contacted() -> None:
    overflowing = build_strategy(
        StrategyConfig(secure_aggregation=True, secagg=SecAggConfig(field_bits=8, max_weight=1024)), FIT, SAMPLING
    )
    pool = Recording(InMemoryPool(IDS, make_task))
    with pytest.raises(ConfigError, match="field_bits >= 13"):
        run_rounds(pool, overflowing, start_state(overflowing), RoundConfig(num_rounds=1, seed=SEED))
    assert pool.stages == []
    with pytest.raises(ConfigError, match="threshold"):
        SecAggConfig(neighbours=3, threshold=1).resolve(4)
    with pytest.raises(ConfigError, match="aggregator = 'mean'"):
        StrategyConfig(secure_aggregation=True, aggregator="median")
    with pytest.raises(ConfigError, match="not scaffold"):
        StrategyConfig(secure_aggregation=True, name="scaffold")
    with pytest.raises(ConfigError, match="clip"):
        StrategyConfig(secure_aggregation=True, secagg=SecAggConfig(clip=0.0))


def test_a_client_with_more_examples_than_max_weight_is_dropped_and_recovered() -> None:
    strategy = secure_aggregation(plain(), SecAggConfig(field_bits=24, clip=1.0, max_weight=16))
    _, record, _ = one_round(strategy, start_state(strategy), IDS)
    assert sorted(record.accepted) == ["a", "b", "c"]  # d has 20 examples > 16
    assert [f.client_id for f in record.failures] == ["d"]
    assert "max_weight" in record.failures[0].reason


def test_secure_aggregation_is_one_flag_of_simulate_and_server_start_with_its_parameters() -> None:
    for options in (simulate_options(), server_options()):
        by_flag = {o.flag: o for o in options}
        assert by_flag["--secure-aggregation"].key == "strategy.secure_aggregation"
        parser = argparse.ArgumentParser()
        add_options(parser, options)
        values = given_values(parser.parse_args(["--secure-aggregation", "--field-bits", "40"]), options)
        assert values == {"strategy": {"secure_aggregation": True, "secagg": {"field_bits": 40}}}
    config = from_mapping(StrategyConfig, {"secure_aggregation": True, "secagg": {"field_bits": 40, "clip": 0.5}})
    assert config.secagg == SecAggConfig(field_bits=40, clip=0.5)
    with pytest.raises(ConfigError, match="field_bits"):
        from_mapping(StrategyConfig, {"secure_aggregation": True, "secagg": {"field_bits": 70}})


def test_uniform_weighting_folds_weight_one() -> None:
    config = StrategyConfig(weighting="uniform")
    uniform = build_strategy(config, FIT, SAMPLING)
    secured = build_strategy(dataclasses.replace(config, secure_aggregation=True, secagg=SECAGG), FIT, SAMPLING)
    assert secured.mods[0].params == {"weighting": "uniform"}
    state = start_state(secured)
    reference, _, _ = one_round(uniform, state, IDS)
    result, _, _ = one_round(secured, state, IDS)
    weighted, _, _ = one_round(plain(), state, IDS)
    bound = SECAGG.resolve(len(IDS)).error_bound
    assert max_error(result, reference) <= bound + 1e-6
    assert max_error(result, weighted) > 10 * bound  # the weighting changes the model by more than the bound


def task_factory(context: TaskContext) -> SupervisedTask:
    """The task of a daemon started with ``--task tests.privacy.secagg.test_rounds:task_factory``."""
    return make_task(context.client_id)
