"""Tensor groups: their payload encoding, the gRPC conversion, and the round loop's generic fold of a group rule
(a reply missing a group, or with a wrong spec, is rejected like any bad update)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np
import pytest

from fedcore.aggregation import Aggregator, MeanAggregator
from fedcore.errors import ConfigError, PayloadError
from fedcore.messages import FitIns, FitRes, ModSpec, Reply, ServerMessage, payload_arrays
from fedcore.payload import GROUPS_KEY, pack_groups, unpack_groups
from fedcore.strategy import SamplingConfig, Strategy
from fedcore.task import FitConfig
from fedcore.tensors import NamedArrays, decode, encode, read_metadata
from fedcore.wire import instruction_from_header, reply_from_header, result_header, task_header
from server.round_loop import RoundConfig, initial_state, run_rounds

MODEL: NamedArrays = {"w": np.arange(4, dtype=np.float32), "n": np.array(7, np.int64)}
EXTRA: NamedArrays = {"w": np.full(4, 0.5, np.float32)}


def test_groups_travel_in_the_model_payload_and_come_back_apart() -> None:
    arrays, metadata = pack_groups(MODEL, {"control": EXTRA, "second": {"s": np.ones(2, np.float64)}})
    assert list(arrays) == ["w", "n", "@control/w", "@second/s"] and arrays["@control/w"] is EXTRA["w"]  # no copy
    assert json.loads(metadata[GROUPS_KEY]) == ["control", "second"]
    data = encode(arrays, metadata)
    model, groups = unpack_groups(decode(data), read_metadata(data))
    assert list(model) == ["w", "n"] and list(groups) == ["control", "second"]
    np.testing.assert_array_equal(groups["control"]["w"], EXTRA["w"])
    assert pack_groups(MODEL, {}) == (MODEL, {})  # a FedAvg payload is unchanged


@pytest.mark.parametrize(
    ("arrays", "metadata", "match"),
    [
        ({"@other/w": EXTRA["w"]}, {GROUPS_KEY: '["control"]'}, "belongs to no tensor group"),
        ({"@control/w": EXTRA["w"]}, {GROUPS_KEY: '["control", "control"]'}, "lists a tensor group twice"),
        ({"@control/w": EXTRA["w"]}, {}, "belongs to no tensor group"),
        ({"w": EXTRA["w"]}, {GROUPS_KEY: '["control"]'}, "carrying no tensor"),
        ({"w": EXTRA["w"]}, {GROUPS_KEY: '["../x"]'}, "cannot name a tensor group"),
        ({"w": EXTRA["w"]}, {GROUPS_KEY: "{"}, "not JSON"),
        ({"w": EXTRA["w"]}, {GROUPS_KEY: '{"a": 1}'}, "not a list"),
    ],
)
def test_unknown_duplicate_or_malformed_groups_are_refused(
    arrays: NamedArrays, metadata: dict[str, str], match: str
) -> None:
    with pytest.raises(PayloadError, match=match) as info:
        unpack_groups(arrays, metadata, round=2, client_id="c1")
    assert info.value.round == 2 and info.value.client_id == "c1"


def test_a_model_tensor_named_like_a_group_is_refused() -> None:
    with pytest.raises(PayloadError, match="reserved for tensor groups"):
        pack_groups({"@x": EXTRA["w"]}, {"control": EXTRA})
    with pytest.raises(PayloadError, match="empty"):
        pack_groups(MODEL, {"control": {}})


def test_fit_instruction_and_reply_carry_groups_and_mods_over_grpc() -> None:
    mods = (ModSpec("scaffold"),)
    ins = FitIns(round=3, parameters=MODEL, config=FitConfig(), seed=1, groups={"control": EXTRA}, mods=mods)
    arrays, metadata = payload_arrays(ins)
    data = encode(arrays, metadata)
    header = task_header(ins, task_id="t", payload_bytes=len(data))
    back = instruction_from_header(header, decode(data), read_metadata(data))
    assert isinstance(back, FitIns) and back.mods == mods and list(back.parameters) == ["w", "n"]
    np.testing.assert_array_equal(back.groups["control"]["w"], EXTRA["w"])
    res = FitRes(client_id="c", round=3, parameters=MODEL, num_examples=5, groups={"control": EXTRA})
    arrays, metadata = payload_arrays(res)
    data = encode(arrays, metadata)
    got = reply_from_header(
        result_header(res, session="s", task_id="t"),
        client_id="c",
        parameters=decode(data),
        metadata=read_metadata(data),
    )
    assert isinstance(got, FitRes) and list(got.groups) == ["control"] and list(got.parameters) == ["w", "n"]


def test_an_unknown_mod_or_bad_parameters_are_refused_on_both_ends() -> None:
    with pytest.raises(ConfigError, match=r"unknown client mod 'nope'; known mods: .*scaffold"):
        Strategy(mods=(ModSpec("nope"),))
    with pytest.raises(ConfigError, match="client mod 'scaffold' refuses its parameters"):
        Strategy(mods=(ModSpec("scaffold", {"beta": 0.5}),))
    with pytest.raises(ConfigError, match="declared twice"):
        Strategy(mods=(ModSpec("scaffold"), ModSpec("scaffold")))
    ins = FitIns(round=1, parameters=MODEL, config=FitConfig(), seed=1, mods=(ModSpec("nope", {"k": 2, "f": True}),))
    header = task_header(ins, task_id="t", payload_bytes=0)
    assert header.mods[0].params["k"].integer == 2 and header.mods[0].params["f"].flag is True
    with pytest.raises(ConfigError, match="unknown client mod"):
        instruction_from_header(header, MODEL, {})


# --------------------------------------------------------------------------------------------------------------
# the round loop's generic fold


@dataclass(frozen=True)
class CountRule:
    """A made-up group rule: the state is a running total of the clients' means, scaled by accepted / available."""

    aggregator: Aggregator = field(default_factory=MeanAggregator)

    def init(self, parameters: NamedArrays, *, trainable: frozenset[str] | None) -> NamedArrays:
        return {"t": np.zeros(2, np.float32)}

    def weight(self, num_examples: int) -> float:
        return float(num_examples)

    def update(self, state: NamedArrays, combined: NamedArrays, *, accepted: int, available: int) -> NamedArrays:
        return {"t": (state["t"] + combined["t"] * accepted / available).astype(np.float32)}


class ScriptedPool:
    """Three clients whose fit replies are scripted per client (no training: the fold is what is tested)."""

    def __init__(self, groups: Mapping[str, Mapping[str, NamedArrays]]) -> None:
        self.groups = groups
        self.seen: list[Mapping[str, NamedArrays]] = []

    def available(self) -> list[str]:
        return ["a", "b", "c", "d"]

    def wait_for(self, num_clients: int, timeout_s: float) -> list[str]:
        return self.available()

    def run(self, instructions: Mapping[str, ServerMessage], *, timeout_s: float | None) -> Iterator[Reply]:
        for cid, ins in instructions.items():
            assert isinstance(ins, FitIns)
            self.seen.append(ins.groups)
            update = {n: a + 1 for n, a in ins.parameters.items()}
            yield FitRes(client_id=cid, round=ins.round, parameters=update, num_examples=2, groups=self.groups[cid])


def test_the_round_loop_folds_groups_by_their_rule_and_rejects_bad_ones() -> None:
    good = {"g": {"t": np.array([1.0, 3.0], np.float32)}}
    pool = ScriptedPool(
        {
            "a": good,
            "b": {},  # missing
            "c": {"g": {"t": np.zeros(3, np.float32)}},  # wrong shape
            "d": {"g": {"t": np.array([3.0, 5.0], np.float32)}},
        }
    )
    strategy = Strategy(sampling=SamplingConfig(fraction_fit=1.0, min_fit_clients=4), groups={"g": CountRule()})
    start = initial_state({"w": np.zeros(2, np.float32)}, strategy)
    final, records = run_rounds(pool, strategy, start, RoundConfig(num_rounds=1))
    assert records[-1].accepted == ("a", "d")
    reasons = {f.client_id: f.reason for f in records[-1].failures}
    assert "missing g" in reasons["b"] and "shape" in reasons["c"]
    np.testing.assert_array_equal(final.groups["g"]["t"], [2.0 * 2 / 4, 4.0 * 2 / 4])  # mean of a, d; |S| / N
    np.testing.assert_array_equal(final.parameters["w"], [1.0, 1.0])  # only accepted updates in the model
    assert all(list(g) == ["g"] for g in pool.seen)  # every instruction carried the group's server state


def test_a_bad_group_leaves_the_model_and_group_state_untouched() -> None:
    pool = ScriptedPool({cid: {"g": {"t": np.array([np.nan, 0.0], np.float32)}} for cid in "abcd"})
    strategy = Strategy(sampling=SamplingConfig(fraction_fit=1.0, min_fit_clients=4), groups={"g": CountRule()})
    start = initial_state({"w": np.zeros(2, np.float32)}, strategy)
    with pytest.raises(Exception, match="round failed"):
        run_rounds(pool, strategy, start, RoundConfig(num_rounds=1, max_round_attempts=1))
    np.testing.assert_array_equal(start.groups["g"]["t"], [0.0, 0.0])
    np.testing.assert_array_equal(start.parameters["w"], [0.0, 0.0])
