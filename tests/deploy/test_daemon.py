"""The client daemon against an in-process server on 127.0.0.1: heartbeats while the task is built, and the
task stream. (Connection errors and TLS: tests/deploy/test_daemon_connect.py.)"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
from pathlib import Path
from typing import cast

import numpy as np
import pytest

from client.daemon import ClientDaemon, DaemonConfig, DamagedTask, receive_task, result_chunks
from fedcore.errors import PayloadError
from fedcore.messages import Failure, FitIns
from fedcore.payload import iter_data_chunks, payload_segments
from fedcore.proto.v1 import fedcore_pb2 as pb
from fedcore.task import FitConfig, Task, TaskContext
from fedcore.tensors import NamedArrays, decode
from fedcore.wire import BackgroundDigest, chunk_body, parse_result_chunk, parse_task_chunk, serialize_chunk
from tests.deploy.test_service import Harness

pytestmark = pytest.mark.timeout(60)


def test_heartbeats_keep_the_session_alive_while_the_task_is_built(tmp_path: Path) -> None:
    liveness_s = 1.0
    h = Harness(tmp_path, seed=7, heartbeat_interval_s=0.2, liveness_timeout_s=liveness_s)
    seen: list[bool] = []
    seeds: list[int | None] = []

    def slow_factory(context: TaskContext) -> Task:
        # loading data that takes longer than the server's liveness timeout
        seeds.append(context.seed)
        until = time.monotonic() + 2.5 * liveness_s
        while time.monotonic() < until:
            seen.append("slow" in h.pool.available())
            time.sleep(0.05)
        return cast(Task, object())  # never run: the server hands out no task

    config = DaemonConfig(server=f"127.0.0.1:{h.port}", client_id="slow", task="unused:factory", insecure=True,
                          poll_s=0.5, backoff_initial_s=0.05, backoff_max_s=0.2)  # fmt: skip
    daemon = ClientDaemon(config, factory=slow_factory)
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(daemon.run()), daemon=True)
    try:
        thread.start()
        deadline = time.monotonic() + 20
        while len(seen) < 40 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        assert seeds == [7]  # the task is built once, with the run's seed from the join reply
        assert seen and all(seen), "the client was dropped while its task was being built"
        assert h.pool.available() == ["slow"]
        h.pool.finish()
        thread.join(20)
        assert codes == [0]
    finally:
        daemon.stop()
        h.close()


def _task_stream(payload: bytes, *, chunk_bytes: int, digest: bytes | None = None) -> list[object]:
    """A PullTask stream as the daemon's stub delivers it: header, data chunks as memoryviews, trailer."""
    header = pb.TaskChunk(header=pb.TaskHeader(task_id="t1", round=3, stage=pb.STAGE_FIT, payload_bytes=len(payload)))
    data = [parse_task_chunk(serialize_chunk(c)) for c in iter_data_chunks([memoryview(payload)], chunk_bytes)]
    trailer = pb.TaskChunk(trailer=pb.Trailer(sha256=digest or hashlib.sha256(payload).digest()))
    return [header, *data, trailer]


def _payload(arrays: dict[str, np.ndarray]) -> bytes:
    return b"".join(bytes(s) for s in payload_segments(arrays))


def _receive(stream: list[object], limit: int = 1 << 20) -> object:
    return receive_task(iter(stream), max_payload_bytes=limit, client_id="c1")  # type: ignore[arg-type]


def test_receive_task_decodes_views_of_one_checked_buffer() -> None:
    arrays: NamedArrays = {"w": np.arange(1000, dtype=np.float32).reshape(10, 100), "step": np.array(4, np.int64)}
    got = _receive(_task_stream(_payload(arrays), chunk_bytes=333))
    assert isinstance(got, tuple)
    header, params, metadata = got
    assert header.task_id == "t1" and list(params) == ["w", "step"] and metadata == {}
    np.testing.assert_array_equal(params["w"], arrays["w"])
    assert int(params["step"]) == 4 and params["w"].base is not None  # a view of the receive buffer
    params["w"] += 1  # writable: the runner may load it in place
    assert _receive([pb.TaskChunk(idle=pb.Idle(finished=True))]) is True


def test_receive_task_names_the_task_it_cannot_use() -> None:
    payload = _payload({"w": np.ones(100, np.float32)})
    with pytest.raises(DamagedTask, match="SHA-256") as info:
        _receive(_task_stream(payload, chunk_bytes=333, digest=b"x" * 32))
    assert info.value.round == 3 and info.value.client_id == "c1" and info.value.header.task_id == "t1"
    assert isinstance(info.value.cause, PayloadError)
    with pytest.raises(DamagedTask, match="exceeds the limit"):
        _receive(_task_stream(payload, chunk_bytes=333), limit=100)
    # a tensor no array can have (65 dimensions), with a correct digest: refused with the reason, not a crash
    header = json.dumps({"t": {"dtype": "F32", "shape": [1] * 65, "data_offsets": [0, 4]}}).encode()
    header += b" " * (-len(header) % 8)
    deep = len(header).to_bytes(8, "little") + header + bytes(4)
    with pytest.raises(DamagedTask, match="65 dims"):
        _receive(_task_stream(deep, chunk_bytes=64))
    with pytest.raises(PayloadError, match="must start with a header"):
        _receive([pb.TaskChunk(trailer=pb.Trailer(sha256=b"x" * 32))])


def test_result_chunks_stream_the_update_without_an_encoded_copy() -> None:
    update: NamedArrays = {"w": np.linspace(0, 1, 5000, dtype=np.float32), "b": np.ones(3, np.float64)}
    segments = payload_segments(update)
    header = pb.ResultHeader(task_id="t1", round=2, payload_bytes=sum(len(s) for s in segments))
    messages = list(result_chunks(header, segments, BackgroundDigest(segments), 4096))
    parsed = [parse_result_chunk(serialize_chunk(m)) for m in messages]
    assert chunk_body(parsed[0])[0] == "header" and chunk_body(parsed[-1])[0] == "trailer"
    payload = b"".join(bytes(chunk_body(m)[1]) for m in parsed[1:-1])
    assert len(payload) == header.payload_bytes and len(parsed) == 2 + -(-len(payload) // 4096)
    assert parsed[-1].trailer.sha256 == hashlib.sha256(payload).digest()  # type: ignore[union-attr]
    out = decode(payload)
    np.testing.assert_array_equal(out["w"], update["w"])
    np.testing.assert_array_equal(out["b"], update["b"])
    # a failure carries no payload: header only
    assert len(list(result_chunks(pb.ResultHeader(failure="boom"), [], BackgroundDigest([]), 4096))) == 1


def test_a_task_the_daemon_cannot_use_is_reported_at_once(tmp_path: Path) -> None:
    h = Harness(tmp_path, heartbeat_interval_s=0.2, liveness_timeout_s=2.0)
    config = DaemonConfig(server=f"127.0.0.1:{h.port}", client_id="small", task="unused:factory", insecure=True,
                          poll_s=0.5, backoff_initial_s=0.05, backoff_max_s=0.2, max_payload_bytes=64)  # fmt: skip
    daemon = ClientDaemon(config, factory=lambda context: cast(Task, object()))
    thread = threading.Thread(target=daemon.run, daemon=True)
    try:
        thread.start()
        h.pool.wait_for(1, timeout_s=10)
        ins = FitIns(round=1, parameters={"w": np.zeros(100, np.float32)}, config=FitConfig(), seed=0)
        started = time.monotonic()
        (reply,) = list(h.pool.run({"small": ins}, timeout_s=60))
        assert time.monotonic() - started < 10  # not the 60 s deadline
        assert isinstance(reply, Failure) and "could not use the task" in reply.reason
        assert "exceeds the limit of 64 bytes" in reply.reason
    finally:
        daemon.stop()
        h.pool.finish()
        thread.join(10)
        h.close()


@pytest.mark.parametrize("raised", ["config", "bug"])
def test_a_daemon_whose_task_cannot_be_built_leaves_at_once_and_exits_with_code_2(raised: str, tmp_path: Path) -> None:
    # it exits: a FedcoreError, which the CLI prints in one line with code 2 (retrying cannot fix it), also when
    # the factory has a bug (a legacy Flower client_fn(cid) given a Context: TypeError); and the server must not
    # keep it as connected until the liveness timeout, or a round selects it and waits 15 s for it
    from fedcore.errors import ClientTaskError, ConfigError, FedcoreError

    h = Harness(tmp_path, heartbeat_interval_s=0.2, liveness_timeout_s=30.0)

    def broken_factory(context: TaskContext) -> Task:
        assert "broken" in h.pool.available()  # joined, heartbeating
        if raised == "config":
            raise ConfigError("the Flower client_fn read a key it was not given: 'partition-id'")
        return cast(Task, int(context))  # type: ignore[call-overload]

    config = DaemonConfig(server=f"127.0.0.1:{h.port}", client_id="broken", task="mine:factory", insecure=True)
    try:
        with pytest.raises(FedcoreError) as info:
            ClientDaemon(config, factory=broken_factory).run()
        if raised == "config":
            assert isinstance(info.value, ConfigError) and "partition-id" in str(info.value)
        else:
            assert isinstance(info.value, ClientTaskError)
            assert "the task factory 'mine:factory' raised TypeError: \"int() argument must be" in str(info.value)
        assert h.pool.available() == []  # left at once; 30 s before the liveness timeout would have dropped it
    finally:
        h.close()


def test_a_daemon_with_a_parallel_plan_refuses_a_task_with_its_own_loop_at_start(tmp_path: Path) -> None:
    # the engine would train its own loop instead of the task's train(): refused with what to add, before any round
    from fedcore.engine.plan import ParallelPlan
    from fedcore.errors import ConfigError
    from tests.engine import engine_tasks

    h = Harness(tmp_path, heartbeat_interval_s=0.2, liveness_timeout_s=30.0)
    config = DaemonConfig(server=f"127.0.0.1:{h.port}", client_id="own", task="tests.engine.engine_tasks:own_loop_task",
                          insecure=True, parallel=ParallelPlan(data_parallel=2))  # fmt: skip
    try:
        with pytest.raises(ConfigError, match="a parallel plan cannot train this task") as info:
            ClientDaemon(config, factory=engine_tasks.own_loop_task).run()
        assert "lacks a training_data() method" in str(info.value) and "client 'own'" in str(info.value)
        assert h.pool.available() == []  # left at once
    finally:
        h.close()


def test_a_daemon_whose_training_blows_up_says_so_in_its_own_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A task whose training turns the model NaN: the daemon logged 'round 1 trained: 12 examples' and sent the
    update, and only the server's log said it was rejected, so the data holder never learned. The daemon now
    fails the round itself, with the tensor and the advice in its log, and the server records that reason."""
    import logging

    import torch

    from fedcore.strategy import SamplingConfig, Strategy
    from fedcore.task import EvalResult, FitConfig, TrainContext, TrainResult, initial_parameters
    from server.round_loop import RoundConfig, initial_state, run_rounds
    from tests.deploy.daemon_threads import daemon_threads
    from tests.server.test_scaffold import make_task, model_fn

    class Exploding:
        def __init__(self) -> None:
            self.inner = make_task("a")

        def build_model(self) -> torch.nn.Module:
            return model_fn()

        def train(self, model: torch.nn.Module, config: FitConfig, context: TrainContext) -> TrainResult:
            with torch.no_grad():
                next(model.parameters())[0, 0] = float("inf")  # the Linear's weight
            return TrainResult(num_examples=12, metrics={})

        def evaluate(self, model: torch.nn.Module, batch_size: int) -> EvalResult:
            return self.inner.evaluate(model, batch_size)

    strategy = Strategy(fit=FitConfig(lr=0.1), sampling=SamplingConfig(fraction_fit=1.0, min_fit_clients=2))
    start = initial_state(initial_parameters(model_fn, 3), strategy)
    h = Harness(tmp_path, heartbeat_interval_s=0.2, liveness_timeout_s=5.0)
    try:
        tasks: dict[str, Task] = {"good": make_task("b"), "bad": Exploding()}
        with caplog.at_level(logging.INFO, logger="fedcore.client"), daemon_threads(h, list(tasks), tasks.__getitem__):
            _, records = run_rounds(h.pool, strategy, start, RoundConfig(num_rounds=1, seed=3, round_timeout_s=60))
    finally:
        h.pool.finish()
        h.close()
    advice = "tensor 'weight' holds 1 NaN/Inf value(s); the update is rejected. Check the client's learning rate"
    assert records[0].accepted == ("good",)
    assert [f.client_id for f in records[0].failures] == ["bad"] and advice in records[0].failures[0].reason
    lines = [r.getMessage() for r in caplog.records if r.name == "fedcore.client"]
    assert any(line.startswith("round 1 fit failed: [round 1, client 'bad'] " + advice) for line in lines), lines
    assert sum(line.startswith("round 1 trained") for line in lines) == 1  # the good client's alone


def test_a_parallel_workers_traceback_stays_in_the_clients_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A rank of a daemon's dp=2 plan raises: the server's failure reason is one line naming the rank and its
    exception; the worker's traceback, with the client machine's paths, was forwarded into it (and into the
    server's log and final error, newlines shown as '?'). The daemon's own log keeps the traceback."""
    import logging
    import threading

    from fedcore.engine.plan import ParallelPlan
    from fedcore.strategy import SamplingConfig, Strategy
    from fedcore.task import FitConfig
    from server.round_loop import RoundConfig, initial_state, run_rounds
    from tests.engine import engine_tasks

    strategy = Strategy(fit=FitConfig(lr=0.1), sampling=SamplingConfig(fraction_fit=1.0, min_fit_clients=1))
    start = initial_state(engine_tasks.initial_parameters(engine_tasks.mlp), strategy)
    h = Harness(tmp_path, heartbeat_interval_s=0.2, liveness_timeout_s=30.0)
    daemons = [
        ClientDaemon(DaemonConfig(server=f"127.0.0.1:{h.port}", client_id=cid, task=f"{engine_tasks.__name__}:{name}",
                                  insecure=True, poll_s=0.5, exit_when_finished=False, parallel=plan),
                     factory=getattr(engine_tasks, name))
        for cid, name, plan in (("c1", "crashing_task", ParallelPlan(data_parallel=2)), ("c2", "mlp_task", None))
    ]  # fmt: skip
    threads = [threading.Thread(target=daemon.run, daemon=True) for daemon in daemons]
    try:
        with caplog.at_level(logging.INFO, logger="fedcore.client"):
            for thread in threads:
                thread.start()
            h.pool.wait_for(2, timeout_s=30)
            _, records = run_rounds(h.pool, strategy, start, RoundConfig(num_rounds=1, seed=3, round_timeout_s=120))
    finally:
        for daemon in daemons:
            daemon.stop()
        for thread in threads:
            thread.join(10)
        h.pool.finish()
        h.close()
    assert records[0].accepted == ("c2",)
    [failure] = records[0].failures
    assert failure.reason == (
        "client reported: [round 1, client 'c1'] worker rank 1 failed: RuntimeError: boom on rank 1 "
        "(the worker's traceback is in the client's log)"
    )
    logged = "\n".join(r.getMessage() for r in caplog.records if r.name == "fedcore.client")
    assert "worker rank 1 failed: RuntimeError: boom on rank 1\n" in logged and "engine_tasks.py" in logged


@pytest.mark.parametrize(
    ("plan", "refusal"),
    [
        ({"data_parallel": 2, "precision": "bf16"}, "bf16 autocast needs CUDA, and training runs on the CPU here"),
        ({"tensor_parallel": 2}, "tensor_parallel=2, but Sequential declares no tensor-parallel plan"),
        ({"data_parallel": 8}, "8 ranks on the CPU are 8 processes"),  # with 1000 MiB free, below
    ],
)
def test_a_plan_no_round_can_run_on_this_machine_is_refused_at_start(
    plan: dict[str, object], refusal: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 on a machine without CUDA, or tensor parallelism for a model that gives no tensor-parallel plan: the
    daemon joined and failed every round, and the server aborted the run after 3 attempts. More CPU ranks than the
    machine's memory holds: the daemon joined, and the first round started processes until memory ran out."""
    from fedcore.engine import plan as plan_module
    from fedcore.engine.plan import ParallelPlan
    from fedcore.errors import ConfigError
    from tests.engine import engine_tasks

    monkeypatch.setattr(plan_module, "available_memory_mib", lambda: 1000.0)  # 6 ranks of 145 MiB

    h = Harness(tmp_path, heartbeat_interval_s=0.2, liveness_timeout_s=30.0)
    config = DaemonConfig(server=f"127.0.0.1:{h.port}", client_id="c1", task=f"{engine_tasks.__name__}:mlp_task",
                          insecure=True, parallel=ParallelPlan.from_mapping(plan))  # fmt: skip
    try:
        with pytest.raises(ConfigError, match=refusal):
            ClientDaemon(config, factory=engine_tasks.mlp_task).run()
        assert h.pool.available() == []  # left at once
    finally:
        h.close()


def test_a_plan_this_machine_cannot_run_is_refused_before_joining(monkeypatch: pytest.MonkeyPatch) -> None:
    """More CPU ranks than memory holds is known before the server is reached: the daemon refuses it even with no
    server listening (it retried the connection until it gave up). It joined first, and a round could select it in
    the moment before it left."""
    from fedcore.engine import plan as plan_module
    from fedcore.engine.plan import ParallelPlan
    from fedcore.errors import ConfigError
    from tests.engine import engine_tasks

    monkeypatch.setattr(plan_module, "available_memory_mib", lambda: 1000.0)  # 6 ranks of 145 MiB

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = DaemonConfig(server=f"127.0.0.1:{port}", client_id="c1", task=f"{engine_tasks.__name__}:mlp_task",
                          insecure=True, give_up_after_s=5.0, parallel=ParallelPlan(data_parallel=8))  # fmt: skip
    with pytest.raises(ConfigError, match="8 ranks on the CPU are 8 processes"):
        ClientDaemon(config, factory=engine_tasks.mlp_task).run()
