"""``fedcore server start``: the coordinator process.

It builds the strategy and the initial model (from the same Task the clients run, or a checkpoint file), opens
the state directory (resuming after its newest intact checkpoint; a state directory whose records and checkpoints
disagree, or that holds a run of another model or strategy, is refused: see :mod:`server.state`), starts the
gRPC service and the Prometheus endpoint, and runs :func:`server.round_loop.run_rounds` over the
:class:`~server.grpc_pool.GrpcClientPool`. After every round the record goes to SQLite and history.csv and the
global model to an atomic checkpoint; nothing of a finished round stays in memory: the loop continues from the
checkpoint mapped read-only (clean file pages, not anonymous memory), records are not collected, and the
evaluation model exists only while it evaluates. SIGTERM (and Ctrl-C) stops cleanly: the last checkpoint stays,
and a restart on the same state directory resumes at the next round.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from fedcore.config import Address, apply_overrides, check_port, from_mapping, load_toml, parse_address, parse_host
from fedcore.errors import ConfigError, PayloadError, StateError
from fedcore.kernels import warm_up as warm_up_kernels
from fedcore.payload import DEFAULT_CHUNK_BYTES
from fedcore.strategy import SamplingConfig, Strategy, StrategyConfig, build_strategy
from fedcore.task import (
    FitConfig,
    Task,
    TaskContext,
    central_evaluation,
    initial_parameters,
    load_task_factory,
    trainable_names,
)
from fedcore.tensors import check_spec, state_spec
from privacy.dp.config import PrivacyConfig, apply_dp
from privacy.tls import SERVER_FLAGS, load_ca_bundle, load_identity
from server.grpc_pool import GrpcClientPool, PoolConfig
from server.limits import ServiceLimits
from server.metrics import DEFAULT_METRICS_ADDRESS, ServerMetrics
from server.round_loop import (
    EvaluateFn,
    RoundConfig,
    RoundRecord,
    ServerState,
    glibc_function,
    initial_state,
    resident_mib,
    run_rounds,
)
from server.service import AuthPolicy, CoordinatorService, build_server, load_tokens
from server.state import StateStore, load_checkpoint

log = logging.getLogger("fedcore.server")


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """Everything ``fedcore server start`` needs; a TOML file with these keys (tables ``[strategy]``,
    ``[sampling]``, ``[train]``, ``[task_options]``), every top-level key also a ``--flag``.

    Attributes:
        address: where to listen, ``host:port`` (port 0 picks a free one; the chosen port is printed).
        state_dir: SQLite database, checkpoints, history.csv and spill files; reusing it resumes the run.
        task: the task factory ``module:attr`` (initial model and server-side evaluation).
        task_options: string options for the task factory (for the demo task: dataset, partition, model ...).
        data_dir: data directory handed to the task.
        initial: start from this safetensors model/checkpoint instead of the task's fresh model.
        rounds: total rounds. seed: the run's seed.
        evaluate: evaluate the global model with the server's task after each round (needs its test data).
        evaluate_every, round_timeout_s, wait_for_clients_s, min_fit_results, max_round_attempts: see
            :class:`server.round_loop.RoundConfig`.
        heartbeat_interval_s, liveness_timeout_s, max_payload_bytes, chunk_bytes: see
            :class:`server.grpc_pool.PoolConfig`.
        max_workers: gRPC worker threads. Each daemon's waiting long-poll holds one; a tenth (at least 40) are
            kept for heartbeats and joins. About 1.1x the number of daemons + 40 (the default holds 1,000).
        max_calls_per_client: see :class:`server.grpc_pool.PoolConfig`.
        max_unauthenticated_calls, stream_idle_s, stream_total_s: see :class:`server.limits.ServiceLimits`.
        insecure: serve plaintext (no TLS). Prints a warning; for tests and trusted networks only.
        tls_cert, tls_key: the server's certificate chain and key (PEM), required unless ``insecure``.
        client_ca: CA certificate (PEM) for client certificates: turns on mutual TLS, the certificate's common
            name must equal the client id.
        tokens_file: ``client_id token`` lines: only these clients may join, each with its token.
        revoked: client ids refused at join.
        metrics_port: Prometheus endpoint port (None: off).
        metrics_address: interface the Prometheus endpoint listens on (default loopback only; "0.0.0.0" lets a
            Prometheus server on another machine scrape it).
        linger_s: after the last round, keep answering for this long so daemons learn the run finished.
        strategy, sampling, train: the strategy, client selection and local training settings.
        privacy: client-level differential privacy (``[privacy]``, :class:`privacy.dp.config.PrivacyConfig`; off
            by default; a server needs ``privacy.population``).
    """

    address: str = "0.0.0.0:8443"
    state_dir: Path = Path("fedcore-state")
    task: str | None = None
    task_options: Mapping[str, str] = field(default_factory=dict)
    data_dir: Path | None = None
    initial: Path | None = None
    rounds: int = 10
    seed: int = 0
    evaluate: bool = True
    evaluate_every: int = 1
    round_timeout_s: float | None = 600.0
    wait_for_clients_s: float = 300.0
    min_fit_results: int = 1
    max_round_attempts: int = 3
    heartbeat_interval_s: float = 5.0
    liveness_timeout_s: float = 15.0
    max_payload_bytes: int = 8 << 30
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    max_workers: int = 1200
    max_calls_per_client: int = 4
    max_unauthenticated_calls: int = 32
    stream_idle_s: float = 60.0
    stream_total_s: float = 1800.0
    insecure: bool = False
    tls_cert: Path | None = None
    tls_key: Path | None = None
    client_ca: Path | None = None
    tokens_file: Path | None = None
    revoked: tuple[str, ...] = ()
    metrics_port: int | None = None
    metrics_address: str = DEFAULT_METRICS_ADDRESS
    linger_s: float = 5.0
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(fraction_fit=1.0, min_fit_clients=2))
    train: FitConfig = field(default_factory=FitConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)

    def __post_init__(self) -> None:
        if self.privacy.enabled or self.privacy.dp_sgd:  # refused here, before the state directory is touched
            apply_dp(build_strategy(self.strategy, self.train, self.sampling), self.privacy)
        if self.task is None and self.initial is None:
            raise ConfigError("give the server a task (--task module:attr) or an initial model (--initial FILE)")
        if not self.insecure and (self.tls_cert is None or self.tls_key is None):
            raise ConfigError(
                "TLS is on by default: give --tls-cert and --tls-key (make them with `fedcore certs init`), "
                "or pass --insecure for plaintext on a trusted network"
            )
        if self.client_ca is not None and self.insecure:
            raise ConfigError("client_ca (mutual TLS) cannot be combined with --insecure")
        if self.max_workers < 8:
            raise ConfigError(f"max_workers must be >= 8, got {self.max_workers}")
        parse_address(self.address, what="address (--address)", allow_port_zero=True)
        parse_host(self.metrics_address, what="metrics_address (--metrics-address)")
        if self.metrics_port is not None:
            check_port(self.metrics_port, what="metrics_port (--metrics-port)", allow_zero=True)
        if not 0 <= self.linger_s < math.inf:  # NaN slept into a ValueError after the last round, inf forever
            raise ConfigError(f"linger_s must be a number of seconds >= 0, got {self.linger_s}")
        # the round loop's and the pool's own checks, now: before any side effect, not after the data loaded and
        # the server listens (nothing is created here)
        self.round_config()
        PoolConfig(spill_dir=self.state_dir / "spill", seed=self.seed, heartbeat_interval_s=self.heartbeat_interval_s,
                   liveness_timeout_s=self.liveness_timeout_s, max_payload_bytes=self.max_payload_bytes,
                   chunk_bytes=self.chunk_bytes)  # fmt: skip

    @property
    def listen_address(self) -> Address:
        """``address`` parsed (checked when the config was built)."""
        return parse_address(self.address, what="address (--address)", allow_port_zero=True)

    def round_config(self) -> RoundConfig:
        """The round loop's settings."""
        return RoundConfig(
            num_rounds=self.rounds,
            seed=self.seed,
            round_timeout_s=self.round_timeout_s,
            wait_for_clients_s=self.wait_for_clients_s,
            min_fit_results=self.min_fit_results,
            max_round_attempts=self.max_round_attempts,
            evaluate_every=self.evaluate_every,
        )


def load_server_config(path: str | os.PathLike[str] | None, overrides: list[str]) -> ServerConfig:
    """Build the config from an optional TOML file plus ``key=value`` overrides.

    Raises:
        ConfigError: unreadable file, unknown key, wrong type or invalid value.
    """
    data: dict[str, Any] = load_toml(Path(path)) if path is not None else {}
    return from_mapping(ServerConfig, apply_overrides(data, overrides))


def server_credentials(config: ServerConfig) -> Any:
    """gRPC server credentials from the config's PEM files (None with ``insecure``), checked first.

    Raises:
        ConfigError: a file is missing, unreadable, not PEM, swapped, encrypted, expired; the key is not the
            certificate's; the certificate is not a server certificate (see :func:`privacy.tls.load_identity`).
    """
    import grpc

    if config.insecure:
        return None
    if config.tls_cert is None or config.tls_key is None:
        raise ConfigError("give --tls-cert and --tls-key, or --insecure")
    identity = load_identity(config.tls_cert, config.tls_key, role="server", flags=SERVER_FLAGS)
    ca = load_ca_bundle(config.client_ca, flag=SERVER_FLAGS.ca)
    return grpc.ssl_server_credentials(
        [(identity.key_pem, identity.cert_pem)], root_certificates=ca, require_client_auth=ca is not None
    )


class _Stop(BaseException):
    """Raised in the main thread by the SIGTERM handler; a BaseException, so that no handler of failures in user
    code (``except Exception`` around the server's evaluation) can swallow a stop."""


def run_server(config: ServerConfig, *, echo: Callable[[str], None] = print) -> ServerState | None:
    """Run the coordinator until the last round (or SIGTERM). Returns the final state (None if stopped).

    Raises:
        ConfigError: bad files or address, or a state directory of another model or strategy.
        StateError: a damaged state directory, or one whose records and checkpoints disagree (before any round);
            a checkpoint or record that cannot be written (during the run).
        RoundFailed: a round missed its quorum too often, or too few clients.
    """
    if config.insecure:
        echo("WARNING: serving without TLS (--insecure): models, updates and tokens travel in plaintext")
    credentials = server_credentials(config)  # TLS files checked before anything is created
    tokens = load_tokens(config.tokens_file) if config.tokens_file is not None else {}  # so is the tokens file
    _return_large_blocks_to_the_os()
    store = StateStore(config.state_dir)
    try:
        strategy, server_task, initial = _open_run(config, store, echo)  # refusals come first, in a moment
    except BaseException:
        store.close()
        raise
    warm_up_kernels()
    _memory_line(echo, "with the model mapped from its file")

    evaluate_fn: EvaluateFn | None = None
    if server_task is not None and config.evaluate:
        evaluate_fn = central_evaluation(server_task, strategy.evaluate_batch_size)

    metrics = ServerMetrics()
    if config.metrics_port is not None:
        host = parse_host(config.metrics_address, what="metrics_address (--metrics-address)")  # "[::1]" -> "::1"
        try:
            metrics_host, metrics_port = metrics.serve(config.metrics_port, host)
        except OSError as exc:  # an unknown host name, a port in use
            raise ConfigError(
                f"cannot serve metrics on {Address(host, config.metrics_port)}: {exc.strerror or exc}; give "
                "--metrics-address an address of this machine and a free --metrics-port (0 picks one)"
            ) from exc
        echo(f"metrics on http://{Address(metrics_host, metrics_port)}/metrics")
    auth = AuthPolicy(
        tokens=tokens,
        require_client_cert=config.client_ca is not None,
        revoked=frozenset(config.revoked),
    )
    if auth.open:
        echo("WARNING: no tokens file and no client CA: any client id may join")
    pool = GrpcClientPool(
        PoolConfig(
            spill_dir=store.spill,
            seed=config.seed,
            heartbeat_interval_s=config.heartbeat_interval_s,
            liveness_timeout_s=config.liveness_timeout_s,
            max_payload_bytes=config.max_payload_bytes,
            chunk_bytes=config.chunk_bytes,
            max_calls_per_client=config.max_calls_per_client,
        ),
        metrics,
    )
    limits = ServiceLimits(
        max_unauthenticated_calls=config.max_unauthenticated_calls,
        stream_idle_s=config.stream_idle_s,
        stream_total_s=config.stream_total_s,
    )
    service = _RecordingService(pool, auth, metrics, store, limits)
    server, port = build_server(
        service,
        str(config.listen_address),  # the parsed address, written the one way gRPC reads as we do
        credentials=credentials,
        max_workers=config.max_workers,
        chunk_bytes=config.chunk_bytes,
    )
    server.start()
    # with port 0 the OS picked the port: this line is how a caller learns it
    echo(f"fedcore server listening on {config.listen_address.with_port(port)} "
         f"({'plaintext' if config.insecure else 'TLS'})")  # fmt: skip
    sys.stdout.flush()

    # A stop signal that arrives while a finished round is being saved waits until the checkpoint, the database
    # row and the log line are all written, so a clean stop never leaves them disagreeing.
    committing, stop_pending = False, False

    def on_round_end(record: RoundRecord, state: ServerState) -> ServerState | None:
        nonlocal committing
        committing = True
        try:
            mapped = commit_round(record, state)
        finally:
            committing = False
        if stop_pending:
            raise _Stop()
        return mapped

    def commit_round(record: RoundRecord, state: ServerState) -> ServerState | None:
        mapped: ServerState | None = None
        if record.round > 0:
            path = store.save_checkpoint(state)
            # continue from the checkpoint's clean file pages; the anonymous arrays of this round are freed
            mapped = load_checkpoint(path, mapped=True, verify=False)  # just written; verified when resumed
            metrics.rounds.inc()
            metrics.current_round.set(record.round)
            metrics.round_seconds.observe(record.seconds)
        store.record_round(record)
        row = record.as_row()
        acc = row.get("test_accuracy")
        memory = resident_mib()
        echo(
            f"round {record.round}: {len(record.accepted)} update(s), {len(record.failures)} failure(s)"
            + (f", test accuracy {acc:.4f}" if isinstance(acc, float) else "")
            + (f", epsilon {row['epsilon']:.4g}" if isinstance(row.get("epsilon"), float) else "")
            + f", {record.seconds:.2f} s"
            + (f", rss {memory[0]:.0f} MiB (peak {memory[1]:.0f} MiB)" if memory is not None else "")
        )
        sys.stdout.flush()
        return mapped

    previous = None
    if threading.current_thread() is threading.main_thread():

        def on_sigterm(signum: int, frame: FrameType | None) -> None:
            nonlocal stop_pending
            if committing:
                stop_pending = True  # on_round_end raises once the round is saved
            else:
                raise _Stop()

        previous = signal.signal(signal.SIGTERM, on_sigterm)
    final: ServerState | None = None
    try:
        final, _ = run_rounds(
            pool,
            strategy,
            initial,
            config.round_config(),
            evaluate_fn=evaluate_fn,
            on_round_end=on_round_end,
            keep_records=False,
        )
        echo(f"finished {final.round} rounds; checkpoints and history in {config.state_dir}")
        pool.finish()
        time.sleep(config.linger_s)
    except (_Stop, KeyboardInterrupt):
        echo(f"stopping (signal); restart with the same state directory to resume ({config.state_dir})")
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        server.stop(grace=1.0).wait(5)
        pool.close()
        metrics.close()
        store.close()
    return final


def _open_run(
    config: ServerConfig, store: StateStore, echo: Callable[[str], None]
) -> tuple[Strategy, Task | None, ServerState]:
    """The strategy, the server's task and the state to start from: resumed from the state directory, refused if
    that holds a run of another strategy or model, or fresh."""
    strategy = apply_dp(build_strategy(config.strategy, config.train, config.sampling), config.privacy)
    store.check_strategy(config.strategy)
    server_task = None
    if config.task is not None:
        factory = load_task_factory(config.task)
        server_task = factory(
            TaskContext(role="server", seed=config.seed, data_dir=config.data_dir, options=dict(config.task_options))
        )
    _memory_line(echo, "before the model")
    resumed = store.resume(mapped=True)
    if resumed is None:
        return strategy, server_task, _fresh_state(config, server_task, strategy, store, echo)
    if server_task is not None:
        with torch.random.fork_rng(devices=[]):
            model = server_task.build_model()
        expected, trainable = state_spec(model.state_dict()), trainable_names(model)
        del model
        resumed = replace(resumed, trainable=trainable)  # not in the checkpoint: a property of the model
        try:
            check_spec(resumed.parameters, expected)
        except PayloadError as exc:
            raise ConfigError(
                f"the checkpoint in {str(config.state_dir)!r} (round {resumed.round}) is of another model than "
                f"the task builds ({exc.message}); use a new --state-dir for a new run, or the task options "
                "of the run being resumed"
            ) from None
    echo(f"resuming after round {resumed.round} from {config.state_dir}")
    return strategy, server_task, resumed


def _fresh_state(
    config: ServerConfig, server_task: Task | None, strategy: Strategy, store: StateStore, echo: Callable[[str], None]
) -> ServerState:
    """A fresh run's round-0 state (the task's initial model or ``config.initial``), held mapped from a file."""
    if config.initial is not None:
        loaded = load_checkpoint(config.initial)
        parameters, optimizer_state = loaded.parameters, loaded.optimizer_state
        del loaded
    else:
        assert server_task is not None  # guaranteed by ServerConfig validation
        parameters, optimizer_state = initial_parameters(server_task.build_model, config.seed), {}
    trainable = trainable_names(server_task.build_model) if server_task is not None else None
    state = initial_state(parameters, strategy, trainable=trainable, optimizer_state=optimizer_state)
    _memory_line(echo, "with the model in memory")
    # held as clean file pages, like every later round's model (mapped from its checkpoint)
    return replace(store.map_initial(state), trainable=trainable)


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number


def _return_large_blocks_to_the_os() -> None:
    """Make glibc serve every allocation of 1 MiB or more with its own mapping, returned to the OS when freed.

    The server allocates and frees many 4 MiB payload chunks on many gRPC threads; by default glibc raises its
    mmap threshold after the first such free and then keeps those chunks in per-thread heaps, where they pile up
    (measured: ~2x a 256 MiB model of freed-but-resident memory after 20 pushes). No-op without glibc.
    """
    mallopt = glibc_function("mallopt")
    if mallopt is not None:
        mallopt(_M_MMAP_THRESHOLD, 1 << 20)


def _memory_line(echo: Callable[[str], None], stage: str) -> None:
    memory = resident_mib()
    if memory is not None:
        echo(f"memory {stage}: rss {memory[0]:.0f} MiB (peak {memory[1]:.0f} MiB)")


class _RecordingService(CoordinatorService):
    """The service, also noting joins in the state database."""

    def __init__(
        self, pool: GrpcClientPool, auth: AuthPolicy, metrics: ServerMetrics, store: StateStore, limits: ServiceLimits
    ) -> None:
        super().__init__(pool, auth, metrics, limits)
        self._store = store

    def Join(self, request: Any, context: Any) -> Any:  # noqa: N802 - name fixed by the gRPC service
        reply = super().Join(request, context)
        try:
            self._store.record_join(request.client_id)
        except StateError as exc:  # the join itself stands; the round's record will stop the server with this error
            log.error("%s", exc)
        return reply
