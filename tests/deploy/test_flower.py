"""The Flower NumPyClient adapter: a real ``flwr.client.NumPyClient`` driven through fedcore's one client path.

- through :func:`client.runner.run_instruction` it gives exactly what calling its ``fit``/``evaluate`` gives;
- rounds through the in-memory pool and :func:`server.round_loop.run_rounds` equal flwr's own
  ``flwr.server.strategy.aggregate.aggregate`` of the clients' direct fit results;
- wrong returns (count, shape, dtype, type) fail with a clear PayloadError / ClientTaskError;
- ``flower_task_factory`` makes a fedcore task factory of a Flower ``client_fn(context)``, the server's included: a
  standard Flower app (tests/deploy/flower_app.py) runs unchanged, its server side gets partition 0 of 1 or a
  named ``server_fn``;
- numpy scalars where 0-d arrays went in (``p + 1``) are taken, as flwr takes them.
"""

from __future__ import annotations

import logging
from typing import Any, cast

import numpy as np
import pytest
from flwr.client import ClientApp, NumPyClient
from flwr.common import Context
from flwr.server.strategy.aggregate import aggregate

from client.flower import FlowerParameters, FlowerTask, fit_config_dict, flower_context, flower_task_factory
from client.runner import run_instruction
from fedcore.errors import ClientTaskError, ConfigError, PayloadError
from fedcore.messages import EvaluateIns, EvaluateRes, FitIns, FitRes
from fedcore.seeding import derive_seed
from fedcore.strategy import SamplingConfig, StrategyConfig, build_strategy
from fedcore.task import FitConfig, TaskContext, central_evaluation, load_task_factory
from fedcore.tensors import NamedArrays, from_state_dict
from server.round_loop import RoundConfig, run_rounds
from simulations.inmemory import InMemoryPool

FEATURES, CLASSES = 5, 3
CONFIG = FitConfig(local_epochs=2, batch_size=8, lr=0.3, mu=0.05)
SEED = 11


def _data(partition: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1000 + partition)
    x = rng.normal(size=(n, FEATURES)).astype(np.float32)
    y = (x[:, 0] + partition * x[:, 1] > 0).astype(np.int64) + (x[:, 2] > 1)
    return x, y


class LogRegClient(NumPyClient):
    """Multinomial logistic regression in numpy, the way a Flower user writes it: W (float32), b (float64),
    and a 0-d float64 temperature that is never trained; mini-batch SGD with FedProx's proximal term,
    shuffled with the seed fedcore sends."""

    def __init__(self, partition: int, n: int) -> None:
        self.x, self.y = _data(partition, n)
        self.w = np.zeros((FEATURES, CLASSES), np.float32)
        self.b = np.full(CLASSES, 0.1, np.float64)
        self.t = np.array(1.0)

    def get_parameters(self, config):  # type: ignore[no-untyped-def]
        return [self.w, self.b, self.t]

    def _probs(self, x: np.ndarray) -> np.ndarray:
        logits = (x @ self.w + self.b) / self.t
        logits -= logits.max(axis=1, keepdims=True)
        p = np.exp(logits)
        return p / p.sum(axis=1, keepdims=True)

    def fit(self, parameters, config):  # type: ignore[no-untyped-def]
        w0, b0, self.t = parameters
        self.w, self.b = w0.copy(), b0.copy()
        rng = np.random.default_rng(config["seed"])
        lr, mu, bs = config["lr"], config["mu"], config["batch_size"]
        losses = []
        for _ in range(config["local_epochs"]):
            order = rng.permutation(len(self.y))
            for start in range(0, len(order), bs):
                idx = order[start : start + bs]
                p = self._probs(self.x[idx])
                losses.append(-np.log(p[np.arange(len(idx)), self.y[idx]]).mean())
                p[np.arange(len(idx)), self.y[idx]] -= 1.0
                grad_w = self.x[idx].T @ p / len(idx) + mu * (self.w - w0)
                grad_b = p.mean(axis=0) + mu * (self.b - b0)
                self.w = (self.w - lr * grad_w).astype(np.float32)
                self.b = self.b - lr * grad_b
        return [self.w, self.b, self.t], len(self.y), {"train_loss": float(np.mean(losses)), "note": "text"}

    def evaluate(self, parameters, config):  # type: ignore[no-untyped-def]
        self.w, self.b, self.t = parameters
        p = self._probs(self.x)
        loss = float(-np.log(p[np.arange(len(self.y)), self.y]).mean())
        return (
            loss,
            len(self.y),
            {"accuracy": float((p.argmax(axis=1) == self.y).mean()), "batch": config["batch_size"]},
        )


SIZES = {"c0": 40, "c1": 25, "c2": 61}


def _client(cid: str) -> LogRegClient:
    return LogRegClient(int(cid[1:]), SIZES[cid])


def _initial() -> NamedArrays:
    return from_state_dict(FlowerTask(_client("c0")).build_model().state_dict())


def _direct_fit(cid: str, parameters: list[np.ndarray], rnd: int) -> tuple[list[np.ndarray], int, dict[str, Any]]:
    config = fit_config_dict(CONFIG, server_round=rnd, seed=derive_seed(SEED, rnd, cid))
    return _client(cid).fit([a.copy() for a in parameters], config)


def test_model_holds_one_buffer_per_array_with_shapes_and_dtypes() -> None:
    initial = _initial()
    assert list(initial) == ["param_0000", "param_0001", "param_0002"]
    assert [(a.shape, a.dtype) for a in initial.values()] == [
        ((FEATURES, CLASSES), np.float32),
        ((CLASSES,), np.float64),
        ((), np.float64),
    ]
    np.testing.assert_array_equal(initial["param_0001"], np.full(CLASSES, 0.1))
    assert not list(FlowerParameters([np.ones(2)]).parameters())  # buffers only: nothing for autograd


def test_runner_fit_gives_exactly_what_the_numpy_client_gives() -> None:
    initial = _initial()
    reply = run_instruction(
        FlowerTask(_client("c1")), FitIns(round=3, parameters=initial, config=CONFIG, seed=SEED), "c1"
    )
    assert isinstance(reply, FitRes)
    arrays, num_examples, metrics = _direct_fit("c1", list(initial.values()), 3)
    assert list(reply.parameters) == list(initial)
    for got, want in zip(reply.parameters.values(), arrays, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
    assert not np.array_equal(reply.parameters["param_0000"], initial["param_0000"])
    assert reply.num_examples == num_examples == SIZES["c1"]
    assert {k: v for k, v in reply.metrics.items() if k != "fit_seconds"} == {"train_loss": metrics["train_loss"]}


def test_runner_evaluate_gives_exactly_what_the_numpy_client_gives() -> None:
    initial = _initial()
    trained = _direct_fit("c2", list(initial.values()), 1)[0]
    parameters = dict(zip(initial, trained, strict=True))
    reply = run_instruction(FlowerTask(_client("c2")), EvaluateIns(round=1, parameters=parameters, batch_size=64), "c2")
    assert isinstance(reply, EvaluateRes)
    loss, num_examples, metrics = _client("c2").evaluate(trained, {"batch_size": 64})
    assert (reply.loss, reply.num_examples) == (loss, num_examples)
    assert reply.metrics == {"accuracy": metrics["accuracy"], "batch": 64.0}


def test_rounds_equal_flowers_own_aggregate_of_the_direct_fits() -> None:
    strategy = build_strategy(StrategyConfig(), CONFIG, SamplingConfig(fraction_fit=1.0, min_fit_clients=3))
    pool = InMemoryPool(sorted(SIZES), lambda cid: FlowerTask(_client(cid)))
    initial = _initial()
    final, records = run_rounds(pool, strategy, initial, RoundConfig(num_rounds=2, seed=SEED))
    assert [r.accepted for r in records] == [("c0", "c1", "c2")] * 2
    # flwr's aggregate multiplies in the layer's dtype; fedcore folds float32 updates with float64 products
    # (DESIGN.md). So flwr's function gets float64 copies, and its result is cast back to each layer's dtype
    # before the next round, as fedcore stores the global model.
    dtypes = [a.dtype for a in initial.values()]
    expected = list(initial.values())
    for rnd in (1, 2):
        fits = [_direct_fit(cid, expected, rnd) for cid in sorted(SIZES)]
        results = [([a.astype(np.float64) for a in arrays], n) for arrays, n, _ in fits]
        expected = [a.astype(d) for a, d in zip(aggregate(results), dtypes, strict=True)]
    for name, want in zip(final.parameters, expected, strict=True):
        np.testing.assert_allclose(final.parameters[name], want, rtol=1e-6, err_msg=name)
    assert final.parameters["param_0000"].dtype == np.float32


class _Broken(LogRegClient):
    def __init__(self, how: str) -> None:
        super().__init__(0, 10)
        self.how = how

    def fit(self, parameters, config):  # type: ignore[no-untyped-def]
        arrays, n, metrics = super().fit(parameters, config)
        if self.how == "count":
            return arrays[:2], n, metrics
        if self.how == "shape":
            return [arrays[0][:, :2], *arrays[1:]], n, metrics
        if self.how == "dtype":
            return [arrays[0].astype(np.float64), *arrays[1:]], n, metrics
        if self.how == "examples":
            return arrays, float(n), metrics
        return arrays, n  # not a 3-tuple


@pytest.mark.parametrize(
    ("how", "error", "match"),
    [
        ("count", PayloadError, r"returned 2 array\(s\) from fit, expected 3"),
        ("shape", PayloadError, r"array 0 \(param_0000\) with shape \(5, 2\), expected \(5, 3\)"),
        ("dtype", PayloadError, r"array 0 \(param_0000\) with dtype float64, expected float32"),
        ("examples", ClientTaskError, r"num_examples=10.0 \(float\); it must be an int"),
        ("tuple", ClientTaskError, r"must return \(parameters: list of numpy arrays, num_examples: int"),
    ],
)
def test_wrong_returns_are_refused_with_a_clear_error(how: str, error: type[Exception], match: str) -> None:
    ins = FitIns(round=2, parameters=_initial(), config=CONFIG, seed=SEED)
    with pytest.raises(error, match=match) as info:
        run_instruction(FlowerTask(_Broken(how)), ins, "c9")
    assert "round 2, client 'c9', stage fit" in str(info.value)


def test_a_wrong_update_is_a_failure_and_the_round_goes_on() -> None:
    strategy = build_strategy(StrategyConfig(), CONFIG, SamplingConfig(fraction_fit=1.0, min_fit_clients=3))
    tasks = {"c0": FlowerTask(_client("c0")), "c1": FlowerTask(_client("c1")), "c9": FlowerTask(_Broken("shape"))}
    _, records = run_rounds(
        InMemoryPool(sorted(tasks), tasks.__getitem__), strategy, _initial(), RoundConfig(num_rounds=1)
    )
    assert records[0].accepted == ("c0", "c1")
    assert [f.client_id for f in records[0].failures] == ["c9"] and "shape" in records[0].failures[0].reason


def client_fn(context: Context):  # type: ignore[no-untyped-def]
    """A Flower ClientApp-style client_fn, as in Flower's quickstarts."""
    partition = int(context.node_config.get("partition-id", 0))
    return LogRegClient(partition, int(context.run_config["n"])).to_client()


factory = flower_task_factory(client_fn)


def test_factory_gives_the_client_fn_a_flower_context() -> None:
    loaded = load_task_factory(f"{__name__}:factory")
    task = loaded(TaskContext(client_id="c2", partition_id=2, num_partitions=3, options={"n": "17"}))
    assert isinstance(task, FlowerTask)
    client = task.client
    assert isinstance(client, LogRegClient)  # to_client() unwrapped
    assert len(client.y) == 17
    np.testing.assert_array_equal(client.x, _data(2, 17)[0])
    server_task = loaded(TaskContext(role="server", options={"n": "5"}))
    assert list(from_state_dict(server_task.build_model().state_dict())) == list(_initial())

    seen: list[TaskContext] = []

    def own_client_fn(ctx: TaskContext) -> LogRegClient:
        seen.append(ctx)
        return _client("c0")

    own = flower_task_factory(own_client_fn, context="fedcore")
    ctx = TaskContext(client_id="c0")
    assert isinstance(own(ctx), FlowerTask) and seen == [ctx]


def test_what_is_not_a_numpy_client_is_refused() -> None:
    class NoParameters(NumPyClient):
        pass

    with pytest.raises(ConfigError, match="does not implement get_parameters"):
        FlowerTask(NoParameters())
    with pytest.raises(ConfigError, match="not a Flower NumPyClient"):
        FlowerTask(object())
    with pytest.raises(ConfigError, match="'flower' or 'fedcore'"):
        flower_task_factory(client_fn, context="other")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------------------
# a standard Flower client app (tests/deploy/flower_app.py) on both sides, server included

APP_OPTIONS = {"lr": "0.1"}


def test_a_standard_client_fn_gets_partition_0_of_1_on_the_server() -> None:
    from tests.deploy import flower_app

    assert isinstance(flower_app.app, ClientApp)  # the module is a real Flower app
    server_task = load_task_factory("tests.deploy.flower_app:factory")(TaskContext(role="server", options=APP_OPTIONS))
    assert isinstance(server_task, FlowerTask)
    client = cast(flower_app.LinearClient, server_task.client)
    x, y, x_test, _ = flower_app.load_data(0, 1)  # the whole data set as one partition
    np.testing.assert_array_equal(client.x, x)
    assert (len(y), len(x_test)) == (96, 24)
    model = from_state_dict(server_task.build_model().state_dict())
    assert [(a.shape, a.dtype) for a in model.values()] == [((4,), np.float32), ((), np.float32)]


def test_a_standard_flower_app_runs_rounds_and_the_server_evaluates_with_it() -> None:
    from tests.deploy import flower_app

    factory = load_task_factory("tests.deploy.flower_app:factory")
    server_task = factory(TaskContext(role="server", options=APP_OPTIONS))
    clients = {f"c{i}": factory(TaskContext(client_id=f"c{i}", partition_id=i, num_partitions=2,
                                            options=APP_OPTIONS)) for i in range(2)}  # fmt: skip
    config = FitConfig(local_epochs=3, batch_size=8, lr=0.1)
    strategy = build_strategy(StrategyConfig(), config, SamplingConfig(fraction_fit=1.0, min_fit_clients=2))
    initial = from_state_dict(server_task.build_model().state_dict())
    final, records = run_rounds(
        InMemoryPool(sorted(clients), clients.__getitem__),
        strategy,
        initial,
        RoundConfig(num_rounds=2, seed=SEED),
        evaluate_fn=central_evaluation(server_task, 32),
    )
    # by hand: both partitions hold 48 training examples, so FedAvg is the plain mean of the two clients' fits
    w, b = flower_app.fedavg_by_hand(rounds=2, local_epochs=3, lr=0.1)
    np.testing.assert_allclose(final.parameters["param_0000"], w, rtol=1e-6)
    np.testing.assert_allclose(final.parameters["param_0001"], b, rtol=1e-6)
    assert final.parameters["param_0001"].shape == ()
    # the server's evaluation is that of partition 0 of 1: the whole data's 24 test examples
    loss, count, _ = flower_app.LinearClient(flower_app.load_data(0, 1), 0.1).evaluate([w, b], {})
    assert count == 24
    assert records[-1].eval_loss == pytest.approx(loss, rel=1e-6)


def test_a_named_server_fn_serves_the_server_and_clients_keep_client_fn() -> None:
    factory = load_task_factory("tests.deploy.flower_app:factory_with_server_fn")
    server = factory(TaskContext(role="server", options=APP_OPTIONS))
    assert isinstance(server, FlowerTask)
    assert len(cast(Any, server.client).y_test) == 20
    client = factory(TaskContext(client_id="c1", partition_id=1, num_partitions=2, options=APP_OPTIONS))
    assert isinstance(client, FlowerTask)
    assert len(cast(Any, client.client).y) == 48


def test_a_key_the_client_fn_was_not_given_is_a_clear_error() -> None:
    from tests.deploy import flower_app

    with pytest.raises(ConfigError) as info:
        flower_task_factory(flower_app.client_fn)(TaskContext(role="server"))  # no --task-option lr=...
    message = str(info.value)
    assert "the Flower client_fn for the server read a key it was not given: 'lr'" in message
    assert "node_config holds ['fedcore-client-id', 'fedcore-role', 'num-partitions', 'partition-id']" in message
    with pytest.raises(ConfigError, match="the Flower client_fn for client 'c3' read a key it was not given"):
        flower_task_factory(flower_app.client_fn)(TaskContext(client_id="c3", options=APP_OPTIONS))
    custom = flower_task_factory(flower_app.client_fn, server_node_config={"partition-id": 1, "num-partitions": 4})
    task = custom(TaskContext(role="server", options=APP_OPTIONS))
    assert isinstance(task, FlowerTask)
    assert len(cast(Any, task.client).y) == 24  # 80% of partition 1 of 4 (30 examples)
    with pytest.raises(ConfigError, match="server_node_config is a Flower node_config: it needs context='flower'"):
        flower_task_factory(flower_app.client_fn, context="fedcore", server_node_config={"partition-id": 0})


def test_the_error_for_a_missing_key_says_which_config_lacked_it_and_how_to_give_it() -> None:
    def reads(where: str, key: str) -> Any:
        def client_fn(context: Context) -> object:
            return getattr(context, where)[key]

        return client_fn

    client = TaskContext(client_id="c1", options={"lr": "0.1"})
    cases = {
        ("node_config", "partition-id"): "give the daemon --partition-id/--num-partitions",
        ("node_config", "dataset-path"): "fedcore's node_config gives only partition-id and num-partitions "
        "(--partition-id/--num-partitions) and data-dir (--data-dir), not 'dataset-path': read such a setting "
        "from context.run_config and give it as --task-option key=value",
        ("run_config", "epochs"): "give it as --task-option epochs=VALUE, to the server and to every daemon",
    }
    for (where, key), advice in cases.items():
        with pytest.raises(ConfigError) as info:
            flower_task_factory(reads(where, key))(client)
        assert f"read a key it was not given: {key!r}" in str(info.value) and advice in str(info.value)
    # otherwise the dicts behave as Flower's: equal to plain dicts, .get with a default raises nothing
    flower = flower_context(TaskContext(client_id="c1", partition_id=0, num_partitions=2, options={"lr": "0.1"}))
    assert flower.run_config == {"lr": 0.1} and flower.run_config.get("epochs", 3) == 3
    assert {k: flower.node_config[k] for k in ("partition-id", "num-partitions")} == {
        "partition-id": 0,
        "num-partitions": 2,
    }


# ---------------------------------------------------------------------------------------------------------------
# 0-d arrays: numpy scalars come back where 0-d arrays went in (p + 1), as flwr accepts


class _ScalarClient(NumPyClient):
    """A weight vector and a 0-d float32 counter; fit adds 1 to both, which makes the counter a numpy scalar."""

    def get_parameters(self, config):  # type: ignore[no-untyped-def]
        return [np.zeros(2, np.float32), np.float32(0.0)]  # a numpy scalar from get_parameters too

    def fit(self, parameters, config):  # type: ignore[no-untyped-def]
        return [p + 1 for p in parameters], 5, {"counter": parameters[1] + 1}

    def evaluate(self, parameters, config):  # type: ignore[no-untyped-def]
        return np.asarray(parameters[1] * 2), 5, {"half": np.asarray(np.float32(0.5))}


def test_numpy_scalars_and_0d_arrays_are_taken_as_flwr_takes_them() -> None:
    task = FlowerTask(_ScalarClient())
    initial = from_state_dict(task.build_model().state_dict())
    assert initial["param_0001"].shape == () and initial["param_0001"].dtype == np.float32
    assert isinstance(_ScalarClient().fit(list(initial.values()), {})[0][1], np.float32)  # not an ndarray
    reply = run_instruction(task, FitIns(round=1, parameters=initial, config=CONFIG, seed=SEED), "c0")
    assert isinstance(reply, FitRes)
    np.testing.assert_array_equal(reply.parameters["param_0000"], [1.0, 1.0])
    assert reply.parameters["param_0001"].shape == () and float(reply.parameters["param_0001"]) == 1.0
    assert reply.metrics["counter"] == 1.0
    evaluated = run_instruction(task, EvaluateIns(round=1, parameters=reply.parameters, batch_size=4), "c0")
    assert isinstance(evaluated, EvaluateRes)
    assert (evaluated.loss, evaluated.metrics) == (2.0, {"half": 0.5})


def test_what_is_no_number_is_still_refused_as_an_array() -> None:
    class Texts(_ScalarClient):
        def fit(self, parameters, config):  # type: ignore[no-untyped-def]
            return [parameters[0], "1.0"], 5, {}

    ins = FitIns(round=1, parameters=from_state_dict(FlowerTask(Texts()).build_model().state_dict()), config=CONFIG,
                 seed=SEED)  # fmt: skip
    with pytest.raises(PayloadError, match=r"fit returned a str as array 1 \(param_0001\); return numeric"):
        run_instruction(FlowerTask(Texts()), ins, "c0")


def test_flower_metric_values_of_every_kind_never_fail_the_instruction(caplog: pytest.LogCaptureFixture) -> None:
    # flwr's Scalar allows any int: 10**400 (like float("inf"), NaN or a string) must not fail the client's fit
    class Odd(_ScalarClient):
        def fit(self, parameters, config):  # type: ignore[no-untyped-def]
            metrics = {"huge": 10**400, "minus": -(10**400), "nan": np.float32("nan"), "flag": np.bool_(True),
                       "zero_d": np.array(2, np.int64), "text": "x", "raw": b"y", "vector": np.ones(2)}  # fmt: skip
            return [p + 1 for p in parameters], 5, metrics

        def evaluate(self, parameters, config):  # type: ignore[no-untyped-def]
            return 10**400, 5, {"ok": 0.25}

    task = FlowerTask(Odd())
    initial = from_state_dict(task.build_model().state_dict())
    with caplog.at_level(logging.WARNING, logger="fedcore"):
        reply = run_instruction(task, FitIns(round=1, parameters=initial, config=CONFIG, seed=SEED), "c0")
    assert isinstance(reply, FitRes)
    metrics = {k: v for k, v in reply.metrics.items() if k != "fit_seconds"}
    assert np.isnan(metrics.pop("nan"))  # passed on, for the server to leave out of its average
    assert metrics == {"huge": np.inf, "minus": -np.inf, "flag": 1.0, "zero_d": 2.0}
    # strings and bytes are Flower Scalars fedcore cannot carry (dropped quietly); a vector is none (said out loud)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        "the Flower client's fit returned 1 metric(s) that are not Flower Scalars (bool, bytes, float, int, str), "
        "dropped: 'vector' (ndarray)"
    ]
    # a loss beyond the float range: inf, passed on for the server to leave out (and count)
    evaluated = run_instruction(task, EvaluateIns(round=1, parameters=reply.parameters, batch_size=4), "c0")
    assert isinstance(evaluated, EvaluateRes)
    assert (evaluated.loss, evaluated.num_examples, evaluated.metrics) == (np.inf, 5, {"ok": 0.25})


def test_task_options_are_typed_as_flowers_run_config_types_them() -> None:
    """``--task-option k=v`` reaches a Flower client_fn as ``flwr run --run-config "k=v"`` would give it (flwr's
    own parse_config_args, TOML values); Python's float() made 'NaN' and 'Infinity' numbers where Flower refuses
    them. Unquoted strings, which Flower would refuse, stay strings; True/False in any case are booleans."""
    import math

    from flwr.common.config import parse_config_args

    same = ["nan", "inf", "-inf", "3", "-7", "1_000", "0x10", "1e-3", "2.5", "true", "false", '"quoted"']
    options = {f"k{i}": text for i, text in enumerate(same)}
    options.update({"a": "NaN", "b": "Infinity", "c": "hello", "d": "False", "e": "2026-01-01"})
    got = flower_context(TaskContext(client_id="c1", options=options)).run_config
    for i, text in enumerate(same):
        (expected,) = parse_config_args([f"k={text}"]).values()
        value = got[f"k{i}"]
        assert type(value) is type(expected), text
        assert value == expected or (math.isnan(cast(float, value)) and math.isnan(cast(float, expected))), text
    assert [got[k] for k in "abcde"] == ["NaN", "Infinity", "hello", False, "2026-01-01"]
