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
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from types import FrameType
from typing import Any

from fedcore.aggregation.weights import check_weight_metric
from fedcore.config import Address, parse_host
from fedcore.convergence import Convergence
from fedcore.errors import ConfigError, StateError
from fedcore.kernels import warm_up as warm_up_kernels
from fedcore.strategy import Strategy, build_strategy
from fedcore.task import (
    Task,
    TaskContext,
    build_server_task,
    central_evaluation,
    declared_metrics,
    initial_parameters,
    load_task_factory,
    trainable_names,
)
from privacy.dp.config import accounting_identity, apply_dp, weak_delta
from privacy.tls import SERVER_FLAGS, exposure_warning, load_ca_bundle, load_identity
from server.config import ServerConfig, check_server_config
from server.grpc_pool import GrpcClientPool
from server.limits import ServiceLimits
from server.metrics import ServerMetrics
from server.round_loop import (
    EvaluateFn,
    RoundRecord,
    ServerState,
    initial_state,
    preflight,
    resident_mib,
    return_large_blocks_to_the_os,
    run_rounds,
)
from server.service import AuthPolicy, CoordinatorService, build_server, check_listen_address, load_tokens
from server.state import StateStore, load_checkpoint, release_hook, restore_strategy, resumed_for_model

log = logging.getLogger("fedcore.server")


def server_credentials(config: ServerConfig) -> Any:
    """gRPC server credentials from the config's PEM files (None with ``insecure``), checked first.

    Raises:
        ConfigError: a file is missing, unreadable, not PEM, swapped, encrypted, expired; the key is not the
            certificate's; the certificate is not a server certificate (see :func:`privacy.tls.load_identity`).
    """
    import grpc

    tls = config.tls
    if tls.insecure:
        return None
    if tls.cert is None or tls.key is None:
        raise ConfigError("give --tls-cert and --tls-key, or --insecure")
    identity = load_identity(tls.cert, tls.key, role="server", flags=SERVER_FLAGS)
    ca = load_ca_bundle(tls.client_ca, flag=SERVER_FLAGS.ca)
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
    check_server_config(config)  # every setting, files included, before anything is created or bound
    for path, what in ((config.auth.tokens_file, "the tokens file (--tokens-file)"), (config.tls.key, "--tls-key")):
        warning = exposure_warning(path, what) if path is not None else None
        if warning is not None:
            echo(f"WARNING: {warning}")
    if config.tls.insecure:
        echo("WARNING: serving without TLS (--insecure): models, updates and tokens travel in plaintext")
    credentials = server_credentials(config)  # TLS files checked before anything is created
    tokens = load_tokens(config.auth.tokens_file) if config.auth.tokens_file is not None else {}
    return_large_blocks_to_the_os()
    metrics = _serve_metrics(config, echo)  # before the state directory: a port in use leaves nothing behind
    try:
        check_listen_address(config.listen_address)  # so does the gRPC address's
    except BaseException:
        metrics.close()
        raise
    store: StateStore | None = None
    try:
        if (config.state_dir / "state.db").exists():  # a run to resume: its refusals (damaged, of another run)
            store = StateStore(config.state_dir)  # come before the task's setup, which may load a dataset
        strategy, server_task = _build_run(config, echo)
        if store is None:  # a new run's directory is made once its task is built: a bad --task leaves none behind
            store = StateStore(config.state_dir)
        initial = _open_run(config, store, strategy, server_task, echo)  # refusals come first, in a moment
    except BaseException:
        if store is not None:
            store.close()
        metrics.close()
        raise
    # the selection's learned state (losses, durations) is rebuilt from the stored rounds, not checkpointed
    restore_strategy(strategy, store, initial.round)
    metrics.current_round.set(initial.round)  # a resumed run's last completed round, not 0 until the next one ends
    warm_up_kernels()
    _memory_line(echo, "with the model mapped from its file")

    evaluate_fn: EvaluateFn | None = None
    if server_task is not None and config.round.evaluate:
        evaluate_fn = central_evaluation(server_task, strategy.evaluate_batch_size)
    validate_fn: EvaluateFn | None = None  # weighting "server": each update on the task's held-out data
    if server_task is not None and strategy.weighting == "server":
        validate_fn = central_evaluation(server_task, strategy.evaluate_batch_size)

    auth = AuthPolicy(
        tokens=tokens,
        require_client_cert=config.tls.client_ca is not None,
        revoked=frozenset(config.auth.revoked),
    )
    if auth.open:
        echo("WARNING: no tokens file and no client CA: any client id may join")
    pool = GrpcClientPool(config.pool.pool_config(spill_dir=store.spill, seed=config.seed), metrics)
    limits = config.pool.service_limits()
    service = _RecordingService(pool, auth, metrics, store, limits, on_join=strategy.selection.declare)
    server, port = build_server(
        service,
        str(config.listen_address),  # the parsed address, written the one way gRPC reads as we do
        credentials=credentials,
        max_workers=config.pool.max_workers,
        chunk_bytes=config.pool.chunk_bytes,
    )
    server.start()
    # with port 0 the OS picked the port: this line is how a caller learns it
    echo(f"fedcore server listening on {config.listen_address.with_port(port)} "
         f"({'plaintext' if config.tls.insecure else 'TLS'})")  # fmt: skip
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
            path = store.save_checkpoint(state, record)  # the record too: a stop before its row loses nothing
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
    round_config = config.round_config()
    try:
        final, _ = run_rounds(
            pool,
            strategy,
            initial,
            round_config,
            evaluate_fn=evaluate_fn,
            on_round_end=on_round_end,
            keep_records=False,
            history=store.history() if initial.round > 0 else (),  # a resumed run's stop rules count on
            validate_fn=validate_fn,
            on_release=release_hook(strategy, store),
        )
        echo(f"finished {final.round} rounds; checkpoints and history in {config.state_dir}")
        if line := Convergence.replay(round_config.stop, store.history()).summary(final.round):
            echo(line)
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


def _serve_metrics(config: ServerConfig, echo: Callable[[str], None]) -> ServerMetrics:
    """The server's metrics, served on ``metrics_port`` when one is set.

    Raises:
        ConfigError: the endpoint cannot listen there (an unknown host name, a port in use).
    """
    metrics = ServerMetrics()
    if config.metrics_port is not None:
        host = parse_host(config.metrics_address, what="metrics_address (--metrics-address)")  # "[::1]" -> "::1"
        try:
            metrics_host, metrics_port = metrics.serve(config.metrics_port, host)
        except OSError as exc:
            metrics.close()
            raise ConfigError(
                f"cannot serve metrics on {Address(host, config.metrics_port)}: {exc.strerror or exc}; give "
                "--metrics-address an address of this machine and a free --metrics-port (0 picks one)"
            ) from exc
        echo(f"metrics on http://{Address(metrics_host, metrics_port)}/metrics")
    return metrics


def _build_run(config: ServerConfig, echo: Callable[[str], None]) -> tuple[Strategy, Task | None]:
    """The strategy and the server's task (None without ``--task``), built before anything is created on disk.

    Raises:
        ConfigError: the task factory fails or returns no task; weighting ``server`` names a value the task's
            evaluation does not give (:func:`fedcore.aggregation.weights.check_weight_metric`).
    """
    strategy = apply_dp(build_strategy(config.strategy, config.train, config.sampling), config.privacy)
    if (weak := weak_delta(config.privacy, config.privacy.population)) is not None:
        log.warning("%s", weak)
    server_task = None
    if config.task is not None:
        factory = load_task_factory(config.task)
        server_task = build_server_task(
            factory,
            TaskContext(role="server", seed=config.seed, data_dir=config.data_dir, options=dict(config.task_options)),
            spec=config.task,
        )
        if config.strategy.weighting == "server":  # the server's own evaluation: known now. The clients' metrics
            # (weighting "metric") come from their own tasks, which only their updates show.
            check_weight_metric(
                "server", config.strategy.weight_metric, declared_metrics(server_task), report_validation=False
            )
        if config.round.evaluate and config.sampling.fraction_evaluate == 0:  # the one source of accuracy
            stop = config.round.round_config(seed=config.seed).stop
            stop.check_task_reports_accuracy(server_task, name=repr(config.task))
    # a round starts once min_fit_clients (and min_fit_results) are connected, and may select only that many; the
    # model's size counts for SecAgg+'s field under DP noise
    smallest = max(strategy.sampling.min_fit_clients, config.round.min_fit_results)
    preflight(strategy, smallest, server_task.build_model if server_task else None)
    _memory_line(echo, "before the model")
    return strategy, server_task


def _open_run(
    config: ServerConfig,
    store: StateStore,
    strategy: Strategy,
    server_task: Task | None,
    echo: Callable[[str], None],
) -> ServerState:
    """The state to start from: resumed from the state directory, refused if that holds a run of another strategy
    or model, or fresh."""
    store.check_strategy(config.strategy)
    store.check_seed(config.seed)
    store.check_privacy(accounting_identity(config.privacy, strategy))
    resumed = store.resume(mapped=True, rounds=config.round.rounds)
    if resumed is None:
        return _fresh_state(config, server_task, strategy, store, echo)
    if server_task is not None:
        resumed = resumed_for_model(
            resumed,
            server_task.build_model,
            where=str(config.state_dir),
            advice="use a new --state-dir for a new run, or the task options of the run being resumed",
        )
    echo(f"resuming after round {resumed.round} from {config.state_dir}")
    if config.initial is not None:
        echo(
            f"WARNING: --initial {config.initial} is not used: it sets a new run's starting model, and this run "
            f"resumes from its round-{resumed.round} checkpoint; use a new --state-dir to start from it"
        )
    return resumed


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


def _memory_line(echo: Callable[[str], None], stage: str) -> None:
    memory = resident_mib()
    if memory is not None:
        echo(f"memory {stage}: rss {memory[0]:.0f} MiB (peak {memory[1]:.0f} MiB)")


class _RecordingService(CoordinatorService):
    """The service, also noting joins in the state database."""

    def __init__(
        self,
        pool: GrpcClientPool,
        auth: AuthPolicy,
        metrics: ServerMetrics,
        store: StateStore,
        limits: ServiceLimits,
        on_join: Callable[[str, Mapping[str, str]], None],
    ) -> None:
        super().__init__(pool, auth, metrics, limits, on_join=on_join)
        self._store = store

    def Join(self, request: Any, context: Any) -> Any:  # noqa: N802 - name fixed by the gRPC service
        reply = super().Join(request, context)
        try:
            self._store.record_join(request.client_id)
        except StateError as exc:  # the join itself stands; the round's record will stop the server with this error
            log.error("%s", exc)
        return reply
