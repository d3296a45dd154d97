"""``fedcore client start``: the client daemon on a data holder's machine.

It connects out to the server (the client initiates every call), authenticates (token and/or client
certificate), then loops: long-poll for a task, run it through :func:`client.runner.run_instruction` (the same
code path simulation uses), push the reply. A heartbeat thread keeps the session alive independently of
training. A transient network failure (connection refused, a restarting server, a deadline) leads to a
reconnect with exponential backoff and full jitter, its reason logged once; a lost session (server restart) to a
fresh join. A failure that retrying cannot fix (TLS trust or identity, a refused join) ends the daemon with a
TransportError naming it (:func:`classify_connection_error`; exit codes at :data:`EXIT_FINISHED`). A push is
retried with the same task id until the server answers, and the server treats a repeated push as a duplicate,
so retrying is harmless.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import random
import signal
import socket
import ssl
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import grpc

from client.runner import ModelCache, ParallelTraining, run_instruction
from client.stages import ClientStages
from client.state import ClientStateStore
from fedcore.config import apply_overrides, from_mapping, load_toml, merge_mappings, parse_address, parse_host
from fedcore.engine.plan import ParallelPlan, refine_options
from fedcore.errors import (
    ClientTaskError,
    ConfigError,
    FedcoreError,
    ModelMismatch,
    PayloadError,
    TransportError,
    failure_reason,
)
from fedcore.messages import (
    Failure,
    FitRes,
    Reply,
    ServerMessage,
    Stage,
    StageIns,
    StageRes,
    bounded_repr,
    payload_arrays,
)
from fedcore.payload import DEFAULT_CHUNK_BYTES, DataChunk, iter_data_chunks, payload_segments
from fedcore.proto.v1 import fedcore_pb2 as pb
from fedcore.proto.v1 import fedcore_pb2_grpc as pb_grpc
from fedcore.selection import check_attributes
from fedcore.task import Task, TaskContext, TaskFactory, check_engine_task, load_task_factory
from fedcore.tensors import NamedArrays, check_finite, decode, read_metadata
from fedcore.wire import (
    TRANSFER_OPTIONS,
    BackgroundDigest,
    BufferSink,
    PayloadReceiver,
    chunk_body,
    coordinator_stub,
    instruction_from_header,
    join_metadata,
    message_kind,
    result_header,
    session_metadata,
)
from privacy.tls import CLIENT_FLAGS, exposure_warning, load_ca_bundle, load_identity

log = logging.getLogger("fedcore.client")

#: ``fedcore client start`` exit codes (the README's "Client daemon exit codes" lists them):
#: 0 the run finished (or the daemon was stopped); 2 an error that retrying cannot fix, printed as one
#: "fedcore: error: ..." line (bad settings or TLS files, a server certificate this client cannot trust, a client
#: certificate or token the server refuses, a revoked id) -- the CLI's code for every FedcoreError; 3 the server
#: stayed unreachable for ``give_up_after_s``.
EXIT_FINISHED = 0
EXIT_GAVE_UP = 3

_RETRYABLE = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
)


@dataclass(frozen=True, kw_only=True)
class DaemonConfig:
    """Settings of one client daemon.

    A TOML file (``fedcore client start --config daemon.toml``, :func:`load_daemon_config`) has these keys and a
    ``[parallel]`` table; each key is also a flag (:mod:`fedcore.options`), and flags win over the file.

    Attributes:
        server: HOST:PORT of the coordinator ([::1]:8443 for IPv6).
        client_id: this client's id (with mutual TLS: its certificate's common name).
        task: task factory module:attr.
        task_options: string options for the task factory (the demo task: dataset, partition, model, ...).
        partition_id: which shard of the built-in dataset this client holds (demo data).
        num_partitions: into how many shards the built-in dataset is split (demo data).
        data_dir: data directory handed to the task (where the user's data lives).
        token: this client's token, if the server uses tokens; write --token=VALUE if it begins with '-'. On the
            command line every local user sees it: prefer token_file or FEDCORE_TOKEN.
        token_file: read the token from this file (its first line).
        insecure: plaintext gRPC, no TLS (the server must be --insecure too).
        ca_cert: CA certificate (PEM) that signed the server certificate (unset: the system roots).
        cert: client certificate (PEM) for mutual TLS.
        key: client key (PEM) for mutual TLS.
        server_name: name expected in the server certificate (default: the host of server).
        poll_s: long-poll duration in seconds.
        backoff_initial_s: first reconnect delay in seconds (exponential, full jitter).
        backoff_max_s: longest reconnect delay in seconds.
        give_up_after_s: exit when the server stays unreachable this long, in seconds (unset: never).
        exit_when_finished: exit once the server says the run is over (on by default); --stay turns it off:
            the daemon keeps running, for the server's next run.
        max_payload_bytes: largest global model accepted from the server, in bytes.
        threads: torch threads for local training (default: one per core).
        parallel: train each round under this parallel plan (data/sharded/pipeline parallel, see
            :mod:`fedcore.engine`); None or a plan of all ones trains in this process.
        state_dir: where this client keeps its persistent state between rounds and restarts (client mods such as
            SCAFFOLD's control variate; :class:`client.state.ClientStateStore`, one file per client id), written
            only when a mod keeps state.
        attributes: what this client declares about itself at join (``--attribute region=eu``), read by the
            server's stratified client selection (``selector.stratify_by``); at most 16, each key and value
            1..64 printable characters.
    """

    server: str
    client_id: str
    task: str = "simulations.tasks:demo_task"
    task_options: Mapping[str, str] = field(default_factory=dict)
    partition_id: int | None = None
    num_partitions: int | None = None
    data_dir: Path | None = None
    token: str = ""
    token_file: Path | None = None
    insecure: bool = False
    ca_cert: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    server_name: str | None = None
    poll_s: float = 20.0
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    give_up_after_s: float | None = None
    exit_when_finished: bool = True
    max_payload_bytes: int = 8 << 30
    threads: int | None = None
    parallel: ParallelPlan | None = None
    state_dir: Path = Path("fedcore-client-state")
    attributes: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.client_id:
            raise ConfigError("client_id must not be empty")
        check_attributes(self.attributes)
        parse_address(self.server, what="server (--server)")
        if self.server_name is not None:
            parse_host(self.server_name, what="server_name (--server-name)")
        if self.token and self.token_file is not None:
            raise ConfigError("give the token once: --token or --token-file, not both")
        if self.token_file is not None and not self.token_file.is_file():
            raise ConfigError(f"token_file (--token-file) {str(self.token_file)!r} is not a file")
        if self.data_dir is not None and not self.data_dir.is_dir():  # TLS files: client_credentials checks them
            raise ConfigError(f"data_dir (--data-dir) {str(self.data_dir)!r} is not a directory")
        if (self.cert is None) != (self.key is None):
            raise ConfigError("give both --cert and --key for mutual TLS, or neither")
        if self.insecure and (self.cert is not None or self.ca_cert is not None):
            raise ConfigError("--insecure cannot be combined with certificates")
        if not 0 < self.backoff_initial_s <= self.backoff_max_s or not math.isfinite(self.backoff_max_s):
            raise ConfigError(
                "backoff_initial_s and backoff_max_s (--backoff-initial-s, --backoff-max-s) must be finite seconds "
                f"with 0 < initial <= max, got {self.backoff_initial_s} and {self.backoff_max_s}"
            )
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"threads must be >= 1, got {self.threads}")
        if not 0 < self.poll_s < math.inf:  # inf overflowed the wait between polls and the call's deadline
            raise ConfigError(f"poll_s (--poll-s) must be a finite number of seconds > 0, got {self.poll_s}")
        if self.give_up_after_s is not None and not self.give_up_after_s > 0:  # NaN never gave up, -5 at once
            raise ConfigError(f"give_up_after_s (--give-up-after-s) must be > 0 seconds, got {self.give_up_after_s}")
        if self.max_payload_bytes < 1:
            raise ConfigError(f"max_payload_bytes must be >= 1, got {self.max_payload_bytes}")
        pid, count = self.partition_id, self.num_partitions
        if count is not None and count < 1:
            raise ConfigError(f"num_partitions (--num-partitions) must be >= 1, got {count}")
        if pid is not None and count is not None and not 0 <= pid < count:
            raise ConfigError(
                f"partition_id (--partition-id) {pid} is not in 0..{count - 1} (--num-partitions {count})"
            )

    def read_token(self) -> str:
        """The token: ``token`` (the config's, ``--token`` or ``FEDCORE_TOKEN``), or the first line of
        ``token_file``; surrounding whitespace and a UTF-8 byte-order mark are not part of it (a token has no
        whitespace: the server's tokens file separates fields by it).

        Raises:
            ConfigError: the token file cannot be read or is empty, or the token holds whitespace inside.
        """
        if self.token_file is None:
            token, source = self.token.strip(), "the token (--token, or FEDCORE_TOKEN)"
        else:
            source = f"the token in token_file (--token-file) {str(self.token_file)!r}"
            try:
                text = self.token_file.read_text(encoding="utf-8-sig").strip()
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigError(f"cannot read token_file (--token-file) {str(self.token_file)!r}: {exc}") from None
            if not text:
                raise ConfigError(f"token_file (--token-file) {str(self.token_file)!r} is empty; write the token in it")
            token = text.splitlines()[0].strip()
        if self.token and not token:
            raise ConfigError(f"{source} is only whitespace; give the token the server's tokens file holds")
        if len(token.split()) > 1:
            raise ConfigError(
                f"{source} holds whitespace inside it, which no token has; give the token alone, as the server's "
                "tokens file holds it after the client id"
            )
        return token


def load_daemon_config(
    path: str | Path | None,
    overrides: Sequence[str] = (),
    flags: Mapping[str, Any] | None = None,
    *,
    parallel: ParallelPlan | None = None,
    parallel_items: Sequence[str] = (),
    parallel_file: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> DaemonConfig:
    """Build a daemon's config from an optional TOML file, then ``key=value`` overrides, then ``flags`` (a nested
    mapping, as :func:`fedcore.options.given_values` makes), each winning over the one before. Without a token or
    token file, the token comes from ``FEDCORE_TOKEN`` in ``environ`` (default: the process's).

    The parallel plan, unless ``parallel`` gives it whole, is built the same way, each source winning over the one
    before under any name of an option (``dp`` or ``data_parallel``): the ``[parallel]`` table of
    ``parallel_file`` (``--parallel-config``), else of the file at ``path`` (``--config``); then the
    ``parallel.KEY=VALUE`` overrides (``--set``); then ``parallel_items`` (``--parallel KEY=VALUE``). None of them:
    no plan.

    Raises:
        ConfigError: unreadable file, unknown key, wrong type or invalid value, no server or client id, or a plan
            :meth:`ParallelPlan.from_cli` refuses.
    """
    plan_sets = [  # parallel.KEY=VALUE and parallel={KEY=VALUE, ...} alike
        item for item in overrides if item.partition("=")[0].strip().split(".")[0] == "parallel"
    ]
    data: dict[str, Any] = load_toml(Path(path)) if path is not None else {}
    data = merge_mappings(apply_overrides(data, [item for item in overrides if item not in plan_sets]), flags or {})
    table = data.pop("parallel", None)
    if parallel_file is not None:
        table = load_toml(Path(parallel_file)).get("parallel", {})
    if parallel is None and (table is not None or plan_sets or parallel_items):
        if table is not None and not isinstance(table, Mapping):
            raise ConfigError(f"[parallel] must be a table of the plan's keys, got {table!r}")
        refined = refine_options(table or {}, apply_overrides({}, plan_sets).get("parallel", {}), "--set parallel.*")
        parallel = ParallelPlan.from_cli(parallel_items, refined)
    for key, flag in (("server", "--server HOST:PORT"), ("client_id", "--client-id ID")):
        if key not in data:
            raise ConfigError(f"give the daemon its {key}: {flag}, or {key} = ... in the --config file")
    env = os.environ if environ is None else environ
    if not data.get("token") and data.get("token_file") is None and env.get("FEDCORE_TOKEN"):
        data["token"] = env["FEDCORE_TOKEN"]
    return dataclasses.replace(from_mapping(DaemonConfig, data), parallel=parallel)


class DamagedTask(FedcoreError):
    """A task whose header arrived but which cannot be used: its payload is over the limit, truncated, corrupted
    or not safetensors, or its settings are invalid. ``header`` names the task; ``cause`` is the error."""

    def __init__(self, header: pb.TaskHeader, cause: FedcoreError) -> None:
        super().__init__(cause.message, round=cause.round, client_id=cause.client_id, stage=cause.stage)
        self.header = header
        self.cause = cause


class _Stopped(BaseException):
    """Raised in the main thread by the daemon's SIGTERM handler: a BaseException, so that no handler of failures in
    the user's task code takes it for one."""


class _SessionLost(Exception):
    """The server no longer knows our session: join again."""


def backoff_delays(initial_s: float, max_s: float, rng: random.Random) -> Iterator[float]:
    """Exponential backoff with full jitter: the k-th delay is uniform in [0, min(max, initial * 2^k)]."""
    ceiling = initial_s
    while True:
        yield rng.uniform(0.0, ceiling)
        ceiling = min(max_s, ceiling * 2)


class ClientDaemon:
    """Runs one client until the run finishes, it is stopped, or the server stays unreachable.

    Args:
        config: the daemon's settings.
        factory: the task factory (default: ``load_task_factory(config.task)``).
    """

    def __init__(self, config: DaemonConfig, factory: TaskFactory | None = None) -> None:
        self.config = config
        self._factory = factory if factory is not None else load_task_factory(config.task)
        self._stop = threading.Event()
        self._session = ""
        self._session_ok = threading.Event()
        self._heartbeat_s = 5.0
        self._chunk_bytes = DEFAULT_CHUNK_BYTES
        self._task: Task | None = None
        self._task_seed: int | None = None
        self._parallel: ParallelTraining | None = None
        self._models = ModelCache()
        self._deadline_s = 0.0  # seconds the server gave the current task until its round's deadline (0: none)
        self._rng = random.Random()
        self._credentials = client_credentials(config)  # TLS files checked now, before the first connection
        self._token = config.read_token()
        secrets = [(config.token_file, "token_file (--token-file)"), (None if config.insecure else config.key, "--key")]
        for path, what in secrets:
            warning = exposure_warning(path, what) if path is not None else None
            if warning is not None:
                log.warning("%s", warning)
        self._damage_delays: Iterator[float] | None = None  # backoff while the server hands out unusable tasks
        self._mismatch: ModelMismatch | None = None  # the last task's global model did not fit the task's model
        self._state = ClientStateStore(config.state_dir)
        # round protocols' client sides: those registered in this process (e.g. by the task's module, imported above)
        self._stages = ClientStages()

    def stop(self) -> None:
        """Ask the daemon to stop after the current call."""
        self._stop.set()

    # ----------------------------------------------------------------- channel
    def _channel(self) -> grpc.Channel:
        cfg = self.config
        cap = 64 << 20
        options: list[tuple[str, int | str]] = [
            ("grpc.max_receive_message_length", cap),
            ("grpc.max_send_message_length", cap),
            ("grpc.keepalive_time_ms", 20_000),
            ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.enable_retries", 0),
            *TRANSFER_OPTIONS,
        ]
        # the parsed address in its one written form: gRPC never sees a form it reads otherwise ([127.0.0.1]:1)
        target = str(parse_address(cfg.server, what="server (--server)"))
        if cfg.insecure:
            return grpc.insecure_channel(target, options=options)
        if cfg.server_name:
            options.append(("grpc.ssl_target_name_override", cfg.server_name))
        return grpc.secure_channel(target, self._credentials, options=options)

    # ------------------------------------------------------------------- main
    def run(self) -> int:
        """Serve until finished or stopped. Returns the process exit code (:data:`EXIT_FINISHED` finished or
        stopped, :data:`EXIT_GAVE_UP` the server stayed unreachable for ``give_up_after_s``).

        Transient connection problems (connection refused, a restarting server, a deadline) are retried with
        backoff; each distinct reason is logged once, not on every attempt. SIGTERM (``systemctl stop``; run on the
        main thread, where SIGTERM had its default action) stops the daemon at once, even in the middle of training:
        it leaves its session, so the server drops it now rather than after its liveness timeout, logs that it
        stopped and returns :data:`EXIT_FINISHED`. Ctrl-C leaves the session too, then raises KeyboardInterrupt.

        Raises:
            ConfigError: the parallel plan cannot run on this machine (before joining), or does not fit the task's
                model (after joining, the session left first).
            TransportError: a problem retrying cannot fix (see :func:`classify_connection_error`): the server's
                certificate is not trusted or not for this name, the server refuses this client's certificate
                (or needs one), speaks TLS to an ``--insecure`` client or plaintext to a TLS one, or refuses the
                join (token, revoked id).
            ModelMismatch: the global model does not fit the model this daemon's task builds (another task than
                the server's); the failure is reported to the server and the session left first. Not with
                ``exit_when_finished`` off (``--stay``), where a later run may fit: each such round fails.
        """
        if self.config.threads is not None:
            import torch

            torch.set_num_threads(self.config.threads)
        if self.config.parallel is not None and not self.config.parallel.is_single_process:
            # what the machine cannot run (bf16 without CUDA, too few GPUs, more ranks than memory holds) before
            # joining: a daemon that joined and left at once could be selected in between and fail a round attempt.
            # The model's fit (split points, tensor parallelism) is checked once the task is built for the seed.
            self.config.parallel.check_runtime()
        handled = threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) in (
            signal.SIG_DFL,
            None,
        )
        if handled:

            def on_sigterm(signum: int, frame: FrameType | None) -> None:
                self._stop.set()
                raise _Stopped()

            signal.signal(signal.SIGTERM, on_sigterm)
        try:
            return self._run()
        except _Stopped:
            log.info("stopped (SIGTERM); the session is left, and the server drops this client")
            return EXIT_FINISHED
        finally:
            if handled:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def _run(self) -> int:
        delays = backoff_delays(self.config.backoff_initial_s, self.config.backoff_max_s, self._rng)
        unreachable_since: float | None = None
        shown_reason = ""
        while not self._stop.is_set():
            channel = self._channel()
            try:
                stub = coordinator_stub(channel)  # payload chunks without protobuf copies
                try:
                    outcome = self._attempt(stub, delays, unreachable_since, shown_reason)
                except (_Stopped, KeyboardInterrupt):
                    if self._session:  # the server drops this client now, not after its liveness timeout
                        self._leave(stub)
                    raise
            finally:
                channel.close()
            if isinstance(outcome, int):
                return outcome
            delays, unreachable_since, shown_reason = outcome
        return EXIT_FINISHED

    def _attempt(
        self,
        stub: pb_grpc.CoordinatorStub,
        delays: Iterator[float],
        unreachable_since: float | None,
        shown_reason: str,
    ) -> int | tuple[Iterator[float], float | None, str]:
        """One connection: join, build the task, serve. Returns an exit code when the daemon is done, else the
        retry state for the next connection (backoff delays, since when the server is unreachable, the reason
        last logged)."""
        heartbeat: threading.Thread | None = None
        try:
            seed = self._join(stub)
            unreachable_since, shown_reason = None, ""
            delays = backoff_delays(self.config.backoff_initial_s, self.config.backoff_max_s, self._rng)
            # heartbeats start before the task is built: loading data can outlast the server's liveness
            # timeout, and the session must stay alive meanwhile
            heartbeat = threading.Thread(target=self._heartbeat_loop, args=(stub,), daemon=True)
            heartbeat.start()
            try:
                self._prepare_task(seed)
            except (_Stopped, KeyboardInterrupt):
                raise  # the caller leaves the session
            except BaseException:  # the task cannot be built (bad settings, the factory raised):
                self._leave(stub)  # the server drops this client now, not after its liveness timeout
                raise
            if self._serve(stub):
                log.info("the server finished the run; exiting")
                self._leave(stub)
                return EXIT_FINISHED
        except _SessionLost:
            log.info("session lost; joining again")
        except grpc.RpcError as exc:
            problem = classify_connection_error(exc, self.config, joined=bool(self._session))
            if problem.permanent:  # the CLI prints it as "fedcore: error: ..." and exits with code 2
                raise TransportError(problem.reason, client_id=self.config.client_id) from exc
            now = time.monotonic()
            unreachable_since = unreachable_since if unreachable_since is not None else now
            limit = self.config.give_up_after_s
            if problem.reason != shown_reason:  # once per distinct reason, not on every attempt
                log.warning(
                    "cannot reach the server %s: %s; retrying with backoff (up to %g s apart)%s",
                    self.config.server,
                    problem.reason,
                    self.config.backoff_max_s,
                    f", giving up after {limit:g} s" if limit is not None else "",
                )
                shown_reason = problem.reason
            if limit is not None and now - unreachable_since > limit:
                log.error(
                    "server %s unreachable for %.0f s; giving up (%s)",
                    self.config.server,
                    now - unreachable_since,
                    problem.reason,
                )
                return EXIT_GAVE_UP
            delay = next(delays)
            log.debug("connection problem (%s); retrying in %.1f s", problem.reason, delay)
            self._stop.wait(delay)
        finally:
            self._session_ok.clear()
            if heartbeat is not None:
                heartbeat.join(timeout=1)
        return delays, unreachable_since, shown_reason

    def _join(self, stub: pb_grpc.CoordinatorStub) -> int:
        """Open a session; returns the run's seed (for :meth:`_prepare_task`). Heartbeats may start at once.

        The credentials travel in the call metadata; so does the session held before a reconnect, which lets the
        server hand this daemon its id back at once. While another daemon holds the id (ALREADY_EXISTS), the
        server's reason is logged once and the join is tried again every ``backoff_max_s``.
        """
        previous, self._session = self._session, ""
        cfg = self.config
        request = pb.JoinRequest(client_id=cfg.client_id, token=self._token, attributes=dict(cfg.attributes))
        refused = False
        while True:
            try:
                reply = stub.Join(request, metadata=join_metadata(cfg.client_id, self._token, previous), timeout=30)
                break
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.ALREADY_EXISTS or self._stop.is_set():
                    raise
                if not refused:  # once: the reason stays the same while the other daemon runs
                    refused = True
                    log.error(
                        "the server refused client id %r: %s; trying again every %.0f s",
                        cfg.client_id,
                        _details(exc),
                        cfg.backoff_max_s,
                    )
                self._stop.wait(cfg.backoff_max_s)
        self._session = reply.session
        self._heartbeat_s = max(0.1, reply.heartbeat_interval_s)
        self._chunk_bytes = reply.chunk_bytes or DEFAULT_CHUNK_BYTES
        self._session_ok.set()
        log.info("joined %s as %s", self.config.server, self.config.client_id)
        return int(reply.seed)

    def _prepare_task(self, seed: int) -> None:
        """Build the task for the run's ``seed`` (loads the data; may take long), unless built for it already.

        Called with the heartbeat thread running, so the session stays alive however long it takes.

        Raises:
            ConfigError: the task's settings are wrong (e.g. a Flower client_fn read a key it was not given).
            ClientTaskError: the factory raised anything else (its traceback is logged).
        """
        if self._task is not None and self._task_seed == seed:
            return
        context = TaskContext(
            role="client",
            client_id=self.config.client_id,
            partition_id=self.config.partition_id,
            num_partitions=self.config.num_partitions,
            data_dir=self.config.data_dir,
            seed=seed,
            options=dict(self.config.task_options),
        )
        started = time.perf_counter()
        try:
            self._task = self._factory(context)
        except FedcoreError:
            raise
        except Exception as exc:  # a bug or a missing file in the user's task: retrying cannot fix it (exit 2)
            log.error("the task factory %s raised", self.config.task, exc_info=True)
            raise ClientTaskError(
                f"the task factory {self.config.task!r} raised {type(exc).__name__}: {bounded_repr(str(exc), 300)} "
                "(traceback above); fix the task or its options and start the daemon again",
                client_id=self.config.client_id,
                stage="build",
            ) from exc
        self._task_seed = seed
        self._models = ModelCache()  # the model is built once per task and reused by every round
        plan = self.config.parallel
        if plan is not None and not plan.is_single_process:
            check_engine_task(self._task, client_id=self.config.client_id)  # a task with its own loop: refused now
            from fedcore.engine.train import check_plan_here  # the engine's modules: only under a plan

            # a bad split point, a tensor-parallel degree the model cannot take, bf16 without CUDA: refused now
            check_plan_here(self._task, self._task.build_model(), plan)
            self._parallel = ParallelTraining(task_factory=self.config.task, task_context=context, plan=plan)
        log.debug("task ready in %.2f s", time.perf_counter() - started)

    def _heartbeat_loop(self, stub: pb_grpc.CoordinatorStub) -> None:
        while self._session_ok.is_set() and not self._stop.wait(self._heartbeat_s):
            try:
                stub.Heartbeat(
                    pb.HeartbeatRequest(session=self._session),
                    metadata=session_metadata(self._session),
                    timeout=max(2.0, self._heartbeat_s * 2),
                )
            except grpc.RpcError as exc:
                log.debug("heartbeat failed: %s", _details(exc))
            except ValueError:  # the channel was closed under us (reconnecting or stopping): this loop is done
                return

    def _leave(self, stub: pb_grpc.CoordinatorStub) -> None:
        with contextlib.suppress(grpc.RpcError):
            stub.Leave(pb.LeaveRequest(session=self._session), metadata=session_metadata(self._session), timeout=5)

    def _serve(self, stub: pb_grpc.CoordinatorStub) -> bool:
        """Pull, run and push until the run finishes (True) or the daemon is stopped (False)."""
        finished = False  # with --stay, the run's end is told once, not at every poll after it
        while not self._stop.is_set():
            pulled = self._pull(stub)
            if pulled is True:
                if self.config.exit_when_finished:
                    return True
                if not finished:
                    log.info("the server finished the run; staying for the next (--stay)")
                    finished = True
                self._stop.wait(self.config.poll_s)
                continue
            if pulled is False:
                continue
            finished = False  # a task: a new run started
            task_id, instruction = pulled
            reply = self._execute(instruction)
            self._push(stub, task_id, reply)  # a failure too: the server hears why at once
            if self._mismatch is not None and self.config.exit_when_finished:  # no retry fixes another task's model
                self._leave(stub)  # the server drops this client now, and selects it no more
                raise self._mismatch  # the CLI prints it as one line and exits with code 2
            self._mismatch = None
        return False

    def _pull(self, stub: pb_grpc.CoordinatorStub) -> tuple[str, ServerMessage] | bool:
        timeout = self.config.poll_s + 600.0
        stream = stub.PullTask(
            pb.PullTaskRequest(session=self._session, wait_s=self.config.poll_s),
            metadata=session_metadata(self._session),
            timeout=timeout,
        )
        try:
            got = receive_task(stream, max_payload_bytes=self.config.max_payload_bytes, client_id=self.config.client_id)
            if isinstance(got, bool):
                return got
            header, parameters, metadata = got
            try:
                instruction = instruction_from_header(header, parameters, metadata)
            except FedcoreError as exc:  # an unknown stage or invalid settings: the task cannot run here
                raise DamagedTask(header, exc) from exc
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise _SessionLost() from exc
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # the server is at its limit of long-polls
                delay = self._rng.uniform(0.5, 2.0)
                log.debug("pull refused (%s); pulling again in %.1f s", _details(exc), delay)
                self._stop.wait(delay)
                return False
            raise
        except FedcoreError as exc:
            if isinstance(exc, DamagedTask):
                # tell the server at once, so the round goes on without waiting for its deadline and this task is
                # not handed out again
                self._report_unusable(stub, exc.header, exc.cause)
            if self._damage_delays is None:
                self._damage_delays = backoff_delays(
                    self.config.backoff_initial_s, self.config.backoff_max_s, self._rng
                )
            delay = next(self._damage_delays)
            log.warning("discarded a task that cannot be used (%s); pulling again in %.1f s", exc, delay)
            self._stop.wait(delay)
            return False
        self._damage_delays = None
        self._deadline_s = header.deadline_s
        return header.task_id, instruction

    def _report_unusable(self, stub: pb_grpc.CoordinatorStub, header: pb.TaskHeader, cause: FedcoreError) -> None:
        failure = pb.ResultHeader(
            session=self._session,
            task_id=header.task_id,
            round=header.round,
            stage=header.stage,
            failure=f"the client could not use the task: {cause}",
        )
        try:
            stub.PushResult(
                iter([pb.ResultChunk(header=failure)]), metadata=session_metadata(self._session), timeout=30
            )
        except grpc.RpcError as exc:
            log.warning("could not tell the server about the unusable task: %s", _details(exc))

    def _execute(self, instruction: ServerMessage) -> Reply:
        assert self._task is not None  # set by _prepare_task
        started = time.perf_counter()
        log.debug("round %d %s started", instruction.round, _what(instruction))
        try:
            reply: Reply
            if isinstance(instruction, StageIns):  # a round protocol's exchange: the round's state machine answers
                reply = self._stages.handle(instruction, self.config.client_id)
            else:
                self._stages.observe(instruction.round)
                parallel = self._parallel
                if parallel is not None and 0 < self._deadline_s < math.inf:  # workers are killed at the deadline
                    parallel = dataclasses.replace(parallel, timeout_s=self._deadline_s)
                reply = run_instruction(
                    self._task,
                    instruction,
                    self.config.client_id,
                    models=self._models,
                    parallel=parallel,
                    state=self._state,
                    stages=self._stages,
                )
                if isinstance(reply, FitRes):  # said here, where the data holder reads: not only in the server's log
                    check_finite(reply.parameters, round=instruction.round, client_id=self.config.client_id)
        except Exception as exc:  # a fedcore error, or a bug in user code: reported, not fatal
            if isinstance(exc, FedcoreError):
                if isinstance(exc, ModelMismatch):
                    self._mismatch = exc
                log.warning("round %d %s failed: %s", instruction.round, _what(instruction), exc)
            else:
                log.exception("the task raised")
            reply = Failure(
                client_id=self.config.client_id,
                round=instruction.round,
                stage=instruction.stage,
                reason=failure_reason(exc),
            )
        seconds = time.perf_counter() - started
        if isinstance(reply, FitRes):  # the one INFO line of a round: what was trained, how long it took
            log.info("round %d trained: %d examples in %.2f s", instruction.round, reply.num_examples, seconds)
        else:
            log.debug("round %d %s done in %.2f s", instruction.round, _what(instruction), seconds)
        return reply

    def _push(self, stub: pb_grpc.CoordinatorStub, task_id: str, reply: Reply) -> None:
        segments: list[memoryview] = []
        arrays, metadata = payload_arrays(reply)
        if isinstance(reply, FitRes) or arrays:  # a stage reply without tensors has no payload
            try:
                # views of the update and its tensor groups: no encoded copy of the model
                segments = payload_segments(arrays, metadata)
            except FedcoreError as exc:  # e.g. a dtype safetensors cannot hold: the server hears why
                log.warning("round %d: cannot send the update: %s", reply.round, exc)
                stage = Stage.PROTOCOL if isinstance(reply, StageRes) else Stage.FIT
                reply = Failure(client_id=self.config.client_id, round=reply.round, stage=stage, reason=str(exc))
        digest = BackgroundDigest(segments)  # overlaps the first push
        delays = backoff_delays(self.config.backoff_initial_s, self.config.backoff_max_s, self._rng)
        for attempt in range(1, 1000):
            if self._stop.is_set():
                return
            header = result_header(
                reply, session=self._session, task_id=task_id, payload_bytes=sum(len(s) for s in segments)
            )
            try:
                chunks = result_chunks(header, segments, digest, self._chunk_bytes)
                answer = stub.PushResult(chunks, metadata=session_metadata(self._session), timeout=600)  # type: ignore[arg-type]  # the stub's serializer takes DataChunk
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                    # the server restarted: join again and push under the new session (the task may be gone)
                    self._rejoin(stub)
                    continue
                if exc.code() not in _RETRYABLE:
                    log.warning("push of round %d refused: %s", reply.round, _details(exc))
                    return
                delay = next(delays)
                log.log(
                    logging.WARNING if attempt == 1 else logging.DEBUG,  # the reason once, not on every attempt
                    "push attempt %d failed (%s); retrying in %.1f s",
                    attempt,
                    _details(exc),
                    delay,
                )
                self._stop.wait(delay)
                continue
            if answer.accepted:
                log.debug("round %d result accepted%s", reply.round, " (duplicate)" if answer.duplicate else "")
            else:
                log.warning("round %d result not taken: %s", reply.round, answer.reason)
            return

    def _rejoin(self, stub: pb_grpc.CoordinatorStub) -> None:
        # the heartbeat thread of run() is still running and picks up the new session
        self._prepare_task(self._join(stub))


def _what(instruction: ServerMessage) -> str:
    """How the log names an instruction: its stage, or a protocol stage's protocol and name."""
    if isinstance(instruction, StageIns):
        return f"{instruction.protocol} stage {instruction.name!r}"
    return instruction.stage.value


def receive_task(
    chunks: Iterator[memoryview | pb.TaskChunk], *, max_payload_bytes: int, client_id: str
) -> tuple[pb.TaskHeader, NamedArrays, dict[str, str]] | bool:
    """Read one ``PullTask`` stream: the task header and its payload, decoded.

    The payload is received into one buffer allocated after its announced size passed ``max_payload_bytes``,
    with its SHA-256 computed alongside on a helper thread and checked against the trailer; the returned arrays
    are views into that buffer (no further copy of the model).

    Returns:
        ``(header, arrays, metadata)`` (the payload's arrays, tensor groups included, and its header metadata,
        which :func:`fedcore.wire.instruction_from_header` splits them by); or a bool when the server had no
        task: True when the run is finished, False when there is nothing yet (or the stream ended early), so the
        caller polls again.

    Raises:
        DamagedTask: the header arrived but the payload is over the limit, truncated, corrupted or not
            safetensors (``cause`` says which).
        PayloadError: the stream did not start with a header or an idle message.
        grpc.RpcError: the call failed.
    """
    first = next(chunks, None)
    if first is None:
        return False
    kind = chunk_body(first)[0]
    if kind == "idle" and not isinstance(first, memoryview):
        return bool(first.idle.finished)
    if kind != "header" or isinstance(first, memoryview):
        raise PayloadError(f"a task stream must start with a header, not {message_kind(kind)}", stage="transfer")
    header = first.header
    try:
        sink = BufferSink(header.payload_bytes)  # allocated at the first chunk, after the limit check
        receiver = PayloadReceiver(
            sink, announced=header.payload_bytes, limit=max_payload_bytes, round=header.round, client_id=client_id
        )
        with receiver:
            receiver.finish(receiver.read_until_trailer(chunks))
        parameters = decode(sink.buffer, allow_nonfinite=True, copy=False, round=header.round, client_id=client_id)
        metadata = read_metadata(sink.buffer)
    except FedcoreError as exc:
        raise DamagedTask(header, exc) from exc
    return header, parameters, metadata


def result_chunks(
    header: pb.ResultHeader, segments: list[memoryview], digest: BackgroundDigest, chunk_bytes: int
) -> Iterator[pb.ResultChunk | DataChunk]:
    """One ``PushResult`` stream: the header, the payload ``segments`` (see :func:`fedcore.payload.payload_segments`)
    cut into framed chunks of ``chunk_bytes`` (each byte copied once), then the trailer with ``digest``."""
    yield pb.ResultChunk(header=header)
    if segments:
        yield from iter_data_chunks(segments, chunk_bytes)
        yield pb.ResultChunk(trailer=pb.Trailer(sha256=digest.digest()))


def client_credentials(config: DaemonConfig) -> grpc.ChannelCredentials | None:
    """gRPC channel credentials from the config's PEM files (None with ``insecure``), checked first.

    Raises:
        ConfigError: a file is missing, unreadable, not PEM, swapped, encrypted or expired; the key is not the
            certificate's; the certificate is not a client certificate (see :func:`privacy.tls.load_identity`).
    """
    if config.insecure:
        return None
    identity = None
    if config.cert is not None and config.key is not None:
        identity = load_identity(config.cert, config.key, role="client", flags=CLIENT_FLAGS)
    return grpc.ssl_channel_credentials(
        root_certificates=load_ca_bundle(config.ca_cert, flag=CLIENT_FLAGS.ca),
        private_key=identity.key_pem if identity is not None else None,
        certificate_chain=identity.cert_pem if identity is not None else None,
    )


@dataclass(frozen=True)
class ConnectionProblem:
    """Why a call to the server failed: ``permanent`` when retrying cannot fix it; ``reason`` says what and what
    to do (the same text for the same cause, so that it is logged once)."""

    permanent: bool
    reason: str


_MAX_DETAILS = 300  # characters of a server's error details kept in a message


def classify_connection_error(exc: grpc.RpcError, config: DaemonConfig, *, joined: bool) -> ConnectionProblem:
    """Tell a failure that retrying cannot fix from a transient one, from the gRPC status and its details.

    Permanent: the join refused (UNAUTHENTICATED / PERMISSION_DENIED before a session: token, revoked id,
    certificate name); a server certificate this client cannot verify or that is not issued to the name it
    connects to; a plaintext server for a TLS client. gRPC shows a client certificate the server refuses (or a
    missing one under mutual TLS), and a TLS server for an ``--insecure`` client, only as "Socket closed"; then
    :func:`probe_tls` repeats the handshake with Python's ``ssl`` to tell them from a server that went away.
    Everything else (connection refused, a restarting server, a deadline) is transient.
    """
    code = exc.code() if hasattr(exc, "code") else None
    lowered = _details(exc).lower()
    details = _details(exc)[:_MAX_DETAILS]  # text from the server: bounded before it is shown
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED) and not joined:
        return ConnectionProblem(True, f"the server refused to let this client join: {details}")
    if code == grpc.StatusCode.UNAVAILABLE and not config.insecure:
        if "hostname verification" in lowered or "no match found for server name" in lowered:
            return ConnectionProblem(
                True,
                f"TLS: the server certificate is not issued to the name this client connects to "
                f"({config.server_name or parse_address(config.server, what='server').host}); pass --server-name "
                "with a name in the server certificate (or connect by such a name)",
            )
        if "wrong_version_number" in lowered:
            return ConnectionProblem(
                True,
                "TLS: the server does not speak TLS; it was probably started with --insecure (then pass --insecure "
                "here too, on a trusted network only)",
            )
        if "ssl_error_ssl" in lowered or "certificate" in lowered:  # an SSL-level verdict, not a cut connection
            return ConnectionProblem(
                True,
                "TLS: this client could not verify the server certificate "
                f"({_ssl_cause(details)}); check that --ca-cert is the CA that signed the server's --tls-cert",
            )
    if code == grpc.StatusCode.UNAVAILABLE and not joined and ("socket closed" in lowered or "reset" in lowered):
        # twice, so that a server killed in the middle of the first probe is not taken for a refusal
        refused = probe_tls(config)
        if refused is not None:
            time.sleep(0.5)
            if probe_tls(config) == refused:
                return ConnectionProblem(True, refused)
    if "connection refused" in lowered:
        return ConnectionProblem(False, "connection refused (the server is not running, or restarting)")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return ConnectionProblem(False, "no answer within the call's deadline")
    return ConnectionProblem(False, f"{code.name if code is not None else 'error'}: {details}")


def _ssl_cause(details: str) -> str:
    """The OpenSSL reason at the end of a gRPC handshake failure's details (e.g. "certificate signature
    failure"), or the details themselves."""
    for marker in ("OPENSSL_internal:", "SSL_ERROR_SSL: "):
        if marker in details:
            return details.split(marker)[-1].split(": OK")[0].strip()
    return details


_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def probe_tls(config: DaemonConfig, *, timeout_s: float = 5.0) -> str | None:
    """Repeat the TLS handshake with Python's ``ssl`` to learn why the server closed the connection.

    With TLS 1.3 a server checks the client certificate after the client has finished its part of the
    handshake, and a gRPC server that refuses it (or finds none under mutual TLS) closes the connection without
    an alert: the client sees the connection close before the server's first HTTP/2 frame. A server that
    accepts answers the HTTP/2 preface with its settings.

    Returns:
        Why the server refuses this client (retrying cannot help), or None when the probe is inconclusive (the
        server answered, cannot be reached, or timed out): treat the failure as transient.
    """
    address = parse_address(config.server, what="server")
    if config.insecure:  # does the server speak TLS to this plaintext client?
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        try:
            with (
                socket.create_connection((address.host, address.port), timeout=timeout_s) as raw,
                context.wrap_socket(raw, server_hostname=address.host),
            ):
                pass
        except (OSError, ssl.SSLError):
            return None
        return (
            "the server speaks TLS, and this client was started with --insecure; drop --insecure and give "
            "--ca-cert (the CA that signed the server certificate)"
        )
    try:
        context = ssl.create_default_context(cafile=str(config.ca_cert) if config.ca_cert is not None else None)
        context.set_alpn_protocols(["h2"])
        if config.cert is not None and config.key is not None:
            context.load_cert_chain(str(config.cert), str(config.key))
        with (
            socket.create_connection((address.host, address.port), timeout=timeout_s) as raw,
            context.wrap_socket(raw, server_hostname=config.server_name or address.host) as tls,
        ):
            tls.sendall(_H2_PREFACE)
            answered = tls.recv(1)
    except ssl.SSLCertVerificationError as exc:
        return f"TLS: this client could not verify the server certificate ({exc.verify_message}); check --ca-cert"
    except ssl.SSLError as exc:
        return f"TLS: the handshake with the server failed ({exc.reason or exc})"
    except OSError:
        return None
    if answered:
        return None
    if config.cert is None:
        return (
            "TLS: the server requires a client certificate (mutual TLS) and this client has none; give --cert and "
            "--key (clients/<id>.pem and .key from `fedcore certs init`)"
        )
    return (
        f"TLS: the server does not accept this client certificate (--cert {config.cert}): it closed the connection "
        "right after the handshake; the certificate must be signed by the CA the server was given as --client-ca "
        "(its common name must be the --client-id)"
    )


def _details(exc: grpc.RpcError) -> str:
    details = getattr(exc, "details", None)
    return str(details()) if callable(details) else str(exc)
