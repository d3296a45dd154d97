"""The round loop: select clients, send the global model, fold updates as they arrive, step, evaluate.

It lives here once and serves simulation and deployment alike through :class:`server.pool.ClientPool`.
Aggregation is streaming (:class:`fedcore.aggregation.WeightedMean`): each update is validated and folded into a
running sum the moment it arrives, so server memory stays near the model size whatever the number of clients.
A bad update (wrong names/shapes/dtypes, NaN/Inf, negative example count) is rejected with its reason and never
touches the global model; failures are returned next to results in each :class:`RoundRecord`.

Memory (FedAvg, float32 model of size M): the running sum is 2M (float64); an update mapped from a spill file is
unmapped block by block as it is folded; the sum becomes the average in place (``result(release=True)``), so a
round peaks near 2M on top of the global model. A deployment's ``on_round_end`` may hand back the state mapped
read-only from its checkpoint file (clean file pages instead of anonymous memory); nothing of a finished round
is kept (``keep_records=False``), and after each round freed memory is returned to the OS (``gc`` and glibc's
``malloc_trim``). Debug logs give the resident set at each stage (logger ``fedcore.server.memory``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import logging
import math
import numbers
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, cast, runtime_checkable

import numpy as np

from fedcore.aggregation import (
    Accumulator,
    CountsRejections,
    MetricColumns,
    SumAccumulator,
    example_weight,
    metric_value,
    weighted_metrics,
)
from fedcore.convergence import Convergence, Stop, StopRules, parameter_norm, stop_columns, update_norm
from fedcore.errors import (
    BudgetExhausted,
    ClientTaskError,
    ConfigError,
    FedcoreError,
    PayloadError,
    RoundFailed,
    UpdateRejected,
)
from fedcore.messages import (
    DP_NOISE_WORDS,
    MAX_EXAMPLES,
    EvaluateIns,
    EvaluateRes,
    Failure,
    FitBatchRes,
    FitIns,
    FitRes,
    Instruction,
    Stage,
    bound_text,
    bounded_repr,
    missed_deadline,
    non_finite_update,
)
from fedcore.mods import decode_reply, server_inverses
from fedcore.selection import ClientObservation, batch_observations, observation
from fedcore.stages import Phase
from fedcore.strategy import Strategy
from fedcore.task import EvalResult
from fedcore.tensors import NamedArrays, TensorSpec, check_finite, check_spec, spec_of, state_spec
from server.pool import ClientPool, received_bytes, sent_bytes
from server.stages import ProtocolRun, start_protocol

log = logging.getLogger("fedcore.server")
mem_log = logging.getLogger("fedcore.server.memory")

EvaluateFn = Callable[[NamedArrays, int], EvalResult]
"""Centralized evaluation: ``(global parameters, round) -> EvalResult`` on the server's held-out data."""


@dataclass(frozen=True, kw_only=True)
class RoundConfig:
    """How many rounds to run and how patient to be.

    Attributes:
        num_rounds: total rounds (a resumed run continues up to this number). >= 1.
        seed: the run's seed; client selection and every client's randomness derive from it.
        round_timeout_s: deadline for replies in a round (None: wait for every selected client).
        wait_for_clients_s: how long to wait for enough clients to be connected before a round.
        min_fit_results: the quorum: a round closes successfully only with at least this many accepted updates.
        max_round_attempts: a round that misses its quorum is retried with a fresh selection this many times in
            all, then the run stops with :class:`RoundFailed` (the global model stays the last good one).
        evaluate_every: run evaluation every this many rounds (and always after the last).
        stop: when the run stops before ``num_rounds`` (:class:`fedcore.convergence.StopRules`: a target accuracy,
            a plateau's patience in evaluated rounds); by default never.
    """

    num_rounds: int
    seed: int = 0
    round_timeout_s: float | None = None
    wait_for_clients_s: float = 300.0
    min_fit_results: int = 1
    max_round_attempts: int = 3
    evaluate_every: int = 1
    stop: StopRules = field(default_factory=StopRules)

    def __post_init__(self) -> None:
        if self.num_rounds < 1:
            raise ConfigError(f"num_rounds must be >= 1, got {self.num_rounds}")
        if self.round_timeout_s is not None and not 0 < self.round_timeout_s < math.inf:
            raise ConfigError(
                f"round_timeout_s must be a finite number of seconds > 0, or unset for no deadline, got "
                f"{self.round_timeout_s}"
            )
        if not 0 < self.wait_for_clients_s < math.inf:
            raise ConfigError(
                f"wait_for_clients_s must be a finite number of seconds > 0, got {self.wait_for_clients_s}"
            )
        if self.min_fit_results < 1:
            raise ConfigError(f"min_fit_results must be >= 1, got {self.min_fit_results}")
        if self.max_round_attempts < 1:
            raise ConfigError(f"max_round_attempts must be >= 1, got {self.max_round_attempts}")
        if self.evaluate_every < 1:
            raise ConfigError(f"evaluate_every must be >= 1, got {self.evaluate_every}")


@dataclass(frozen=True, kw_only=True, eq=False)
class ServerState:
    """Everything needed to continue a run: the last completed round, the global model, the optimizer state.

    Attributes:
        round: the last completed round (0 before the first).
        parameters: the global model after that round.
        optimizer_state: the server optimizer's state (momentum buffers, second moments), may be empty.
        trainable: the names of the model's trainable parameters, which the server optimizer steps; the other
            tensors (buffers such as BatchNorm running statistics) take the clients' average
            (:func:`fedcore.task.trainable_names`). None: every floating tensor is stepped. Not stored in
            checkpoints: whoever loads one derives it again from the task's model (a property of the model,
            not of the round), and the round loop keeps the initial state's value for the whole run.
        groups: the server-side state of each tensor group the strategy declares (``group -> name -> array``,
            e.g. SCAFFOLD's server control variate), sent with every fit instruction and stored in checkpoints.
        aggregator_state: what a :class:`Stateful` aggregator carries from round to round (e.g. adaptive
            clipping's norm), stored in checkpoints and handed back to the aggregator when a run resumes.
    """

    round: int
    parameters: NamedArrays
    optimizer_state: NamedArrays
    trainable: frozenset[str] | None = None
    groups: Mapping[str, NamedArrays] = field(default_factory=dict)
    aggregator_state: NamedArrays = field(default_factory=dict)


def initial_state(
    parameters: NamedArrays,
    strategy: Strategy,
    *,
    trainable: frozenset[str] | None = None,
    optimizer_state: NamedArrays | None = None,
) -> ServerState:
    """A fresh run's round-0 state: the initial model, the strategy's initial optimizer state (unless one is given,
    non-empty), the trainable names (see :class:`ServerState`) and each tensor group's initial state
    (:meth:`fedcore.strategy.GroupRule.init`).

    Raises:
        ConfigError: the initial model has no tensors (nothing to train or aggregate).
        NonFiniteError: the initial model holds NaN or Inf.
    """
    if not parameters:
        raise ConfigError(
            "the initial model has no tensors (its state_dict is empty): there is nothing to train or aggregate; the "
            "task's build_model must return a model with parameters"
        )
    check_finite(parameters)
    if not optimizer_state:
        optimizer_state = strategy.server_optimizer.init(parameters, trainable=trainable)
    groups = {name: rule.init(parameters, trainable=trainable) for name, rule in strategy.groups.items()}
    return ServerState(
        round=0, parameters=parameters, optimizer_state=optimizer_state, trainable=trainable, groups=groups
    )


@dataclass(frozen=True, kw_only=True)
class RoundRecord:
    """What happened in one round; failures sit next to results.

    Attributes:
        round: 1-based round number (0: evaluation of the initial model only).
        selected: clients sent a fit instruction.
        accepted: clients whose update was folded in.
        failures: clients that failed or whose update was rejected, with reasons.
        train_metrics: example-weighted average of the accepted clients' training metrics.
        eval_loss, eval_metrics: centralized evaluation of the new global model (None if not run).
        federated_eval_loss, federated_eval_metrics: example-weighted client-side evaluation (None if not run).
        seconds: wall time of the round, including evaluation.
        attempts: how many selections the round needed to reach its quorum.
        aggregation: what the strategy's accumulator reports about the round (:class:`Reporting`, e.g. the
            privacy spent: ``epsilon``), each a history column.
        metrics_left_out: how many reported metric values were left out of this round's averages (training and
            federated evaluation metrics, see :func:`fedcore.aggregation.weighted_metrics`: not a finite number,
            or from a client that reported 0 examples), plus the server's own evaluation values that were not
            numbers or came from 0 examples. A metric value never fails a round; this count says how many did not
            count.
        observations: what each accepted update told the client selection (loss, examples, duration), as fed to
            :meth:`fedcore.selection.Selector.observe`; the server stores them so that a restart rebuilds the
            selector's state.
        simulated_seconds: a simulation's simulated duration of the round (synchronous: each attempt lasts its
            slowest replying client's simulated device time, refused updates included, and a retried round all
            its attempts), the history column ``simulated_seconds``; None outside simulation.
        bytes_up: the payload bytes received in the round (:func:`server.pool.received_bytes`): the fit replies
            (every attempt; accepted and rejected updates alike), as the pool measured them
            (:attr:`fedcore.messages.FitRes.payload_bytes`, before any decoding), and a round protocol's stage
            replies that carry tensors (SecAgg+'s); evaluation results carry no payload.
        bytes_down: the payload bytes sent in the round (:func:`server.pool.sent_bytes`): each fit instruction's
            (the global model and the tensor groups; every attempt), each stage instruction of a round protocol
            (SecAgg+'s keys, shares and unmasking requests), and each federated evaluation instruction's (the
            model), as the pool measures them (:class:`server.pool.PayloadMeasure`: over gRPC the safetensors
            header and data; else :func:`fedcore.messages.packed_nbytes`, the tensors' bytes).
        update_norm: the L2 norm of the global model's change in the round, over the trainable parameters
            (:func:`fedcore.convergence.update_norm`); None for round 0.
        stop: the stop rule that ended the run after this round (:class:`fedcore.convergence.Stop`), else None;
            recorded in the history as ``stopped_<rule>`` = 1.
    """

    round: int
    selected: tuple[str, ...] = ()
    accepted: tuple[str, ...] = ()
    failures: tuple[Failure, ...] = ()
    train_metrics: Mapping[str, float] = field(default_factory=dict)
    eval_loss: float | None = None
    eval_metrics: Mapping[str, float] = field(default_factory=dict)
    federated_eval_loss: float | None = None
    federated_eval_metrics: Mapping[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    attempts: int = 1
    metrics_left_out: int = 0
    aggregation: Mapping[str, float] = field(default_factory=dict)
    observations: tuple[ClientObservation, ...] = ()
    simulated_seconds: float | None = None
    bytes_up: int = 0
    bytes_down: int = 0
    update_norm: float | None = None
    stop: Stop | None = None

    def as_row(self) -> dict[str, float | int | None]:
        """A flat row for the history table (CSV): the counts, ``train_loss``, every other training metric as
        ``train_<name>`` (except wall times, names ending in ``seconds``), the evaluations, :attr:`aggregation`,
        ``bytes_up``, ``bytes_down``, ``update_norm`` and, on the round a run stopped, ``stopped_<rule>`` = 1."""
        row: dict[str, float | int | None] = {
            "round": self.round,
            "clients": len(self.accepted),
            "failures": len(self.failures),
            "metrics_left_out": self.metrics_left_out,
            "train_loss": self.train_metrics.get("train_loss"),
            "test_loss": self.eval_loss,
            "test_accuracy": self.eval_metrics.get("accuracy"),
            "seconds": round(self.seconds, 4),
            "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down,
            "update_norm": self.update_norm,
        }
        for key, value in self.train_metrics.items():  # wall times stay out: the history's bytes repeat per seed
            if key != "train_loss" and not key.endswith("seconds"):
                row[f"train_{key}"] = value
        for key, value in self.eval_metrics.items():
            if key != "accuracy":
                row[f"test_{key}"] = value
        row.update(self.aggregation)
        if self.simulated_seconds is not None:
            row["simulated_seconds"] = self.simulated_seconds
        if self.federated_eval_loss is not None:
            row["federated_loss"] = self.federated_eval_loss
            for key, value in self.federated_eval_metrics.items():
                row[f"federated_{key}"] = value
        row.update(stop_columns(self.stop))
        return row


@runtime_checkable
class Reporting(Protocol):
    """An accumulator that reports figures of its round once its result is taken (e.g. DP-FedAvg's epsilon); the
    round loop puts them into the round's record (:attr:`RoundRecord.aggregation`)."""

    def report(self) -> Mapping[str, float]:
        """``name -> value`` for the round's record (names distinct from the record's other columns)."""
        ...


@runtime_checkable
class Budgeted(Protocol):
    """An aggregator with a budget (e.g. DP-FedAvg's target epsilon): the round loop evaluates the model of the
    last round the budget allows and stops there; a round beyond it raises
    :class:`~fedcore.errors.BudgetExhausted` from ``start``."""

    def allows(self, round: int) -> bool:
        """Whether round ``round`` may be run within the budget."""
        ...


@runtime_checkable
class Stateful(Protocol):
    """An aggregator with state that outlives a round (e.g. adaptive clipping's norm): the round loop puts
    :meth:`state_dict` into each round's :class:`ServerState` (so checkpoints hold it) and hands a resumed
    state's back through :meth:`load_state` before the first round it runs."""

    def state_dict(self, round: int) -> NamedArrays:
        """The state after round ``round`` was aggregated (``name -> array``)."""
        ...

    def load_state(self, round: int, state: NamedArrays) -> None:
        """Continue after round ``round`` from ``state`` (empty: a checkpoint without it, start afresh)."""
        ...


@runtime_checkable
class PoolSampled(Protocol):
    """An aggregator whose guarantee depends on the number of clients a round samples from (DP-FedAvg's sampling
    rate): the round loop tells it, after each selection, how many it selected of how many it could."""

    def sampled_from(self, round: int, num_clients: int, available: int) -> None:
        """Round ``round`` selects ``num_clients`` of ``available`` candidates."""
        ...


@runtime_checkable
class Preflighted(Protocol):
    """An aggregator whose refusals of a round follow from settings known at start (SecAgg+'s neighbours against
    the clients a round selects, the field against the noise): a server checks them before it listens, not at
    round 1 once its clients joined."""

    def preflight(self, smallest: int, spec: Sequence[TensorSpec] | None) -> None:
        """Refuse what a round of ``smallest`` clients (min_fit_clients) of a model of ``spec`` (None: not known
        yet) would refuse."""
        ...


def preflight(strategy: Strategy, smallest: int, build_model: Callable[[], Any] | None = None) -> None:
    """Refuse before the first round what every round of ``strategy`` would refuse, when its aggregator can tell
    (:class:`Preflighted`: SecAgg+'s graph for rounds of ``smallest`` clients; with ``build_model``, the model's
    size against the field that carries distributed DP's noise).

    Args:
        strategy: the run's strategy.
        smallest: the fewest clients a round selects (a server's max(min_fit_clients, min_fit_results): a round
            may start with only that many connected; a simulation whose clients are always available, the number
            every round selects; one with an availability trace, the fewest its rounds select).
        build_model: the task's model factory (``Task.build_model``); None where the server has no task.

    Raises:
        ConfigError: what to change.
    """
    if isinstance(strategy.aggregator, Preflighted):
        spec = state_spec(build_model().state_dict()) if build_model is not None else None
        strategy.aggregator.preflight(smallest, spec)


@runtime_checkable
class Rereleased(Protocol):
    """An aggregator whose guarantee counts every release (DP-FedAvg's epsilon): told, when a run resumes, how many
    recorded rounds were superseded and run again (:meth:`server.state.StateStore.superseded_rounds`)."""

    def superseded_releases(self, count: int) -> None:
        """``count`` rounds were released and then superseded."""
        ...


RoundCallback = Callable[[RoundRecord, ServerState], "ServerState | None"]
"""Called after each round with its record and the new state; may return an equal state to continue from instead
(e.g. the same arrays mapped read-only from the checkpoint just written), or None to keep the state as is."""


def run_rounds(
    pool: ClientPool,
    strategy: Strategy,
    initial: ServerState | NamedArrays,
    config: RoundConfig,
    *,
    evaluate_fn: EvaluateFn | None = None,
    on_round_end: RoundCallback | None = None,
    keep_records: bool = True,
    history: Sequence[Mapping[str, object]] = (),
    validate_fn: EvaluateFn | None = None,
    on_release: Callable[[int], None] | None = None,
) -> tuple[ServerState, list[RoundRecord]]:
    """Run rounds ``initial.round + 1 .. config.num_rounds``.

    Args:
        pool: the clients (in-memory, Ray or gRPC).
        strategy: sampling, local training config, weighting and server optimizer.
        initial: the initial model (fresh run; every floating tensor then counts as trainable, see
            :func:`initial_state` to say which are) or a :class:`ServerState` (from :func:`initial_state`, or loaded
            from a checkpoint to resume, with ``trainable`` derived again from the model).
        config: number of rounds, seed, deadlines and quorum.
        evaluate_fn: optional centralized evaluation of the global model. If it raises, the error is logged and
            the round is recorded without it: an evaluation never costs a round its model.
        on_round_end: called after each completed round with its record and the new state (checkpointing,
            progress, CSV); it may return the state to continue from (the same values, e.g. mapped from the
            checkpoint it wrote). The loop keeps no other reference to a finished round's state.
        keep_records: collect the per-round records in the returned list; a long-running server that stores
            them elsewhere (on_round_end) passes False, so nothing per round accumulates in memory.
        history: the history rows of the rounds already run (a resumed server's, :meth:`RoundRecord.as_row`), from
            which the stop rules' state is rebuilt (:meth:`fedcore.convergence.Convergence.replay`): the plateau's
            patience counts on across a restart, and a run whose history records a stop runs no further round
            (a stop is final; a new run from its checkpoint needs a new state directory).
        validate_fn: the server's evaluation of one update on its held-out validation data, called with the update
            and the round, for ``strategy.weighting == "server"`` (:mod:`fedcore.aggregation.weights`); required
            by that rule, unused by the others.
        on_release: called with the round's number right before a round's new global model first leaves the
            server ahead of ``on_round_end``: to the clients of its federated evaluation. A process that dies
            between the two has released a model that its restart trains again (with fresh DP noise): the
            state directory counts such releases (:meth:`server.state.StateStore.record_release`).

    After each evaluated round the stop rules of ``config.stop`` look at its accuracy; the first that fires ends
    the run after that round, recorded in its record (:attr:`RoundRecord.stop`).

    Returns:
        The final state and the per-round records (round 0 holds the initial model's evaluation on a fresh run;
        empty with ``keep_records=False``).

    Raises:
        RoundFailed: a round missed its quorum ``max_round_attempts`` times, or too few clients connected.
        ConfigError: weighting ``server`` without ``validate_fn`` (before any client is contacted).
    """
    if strategy.weighting == "server" and validate_fn is None:
        raise ConfigError(
            "weighting 'server' weighs each update by the server's own evaluation of it, but the server has no "
            "validation data: give the server a task whose evaluate has held-out data (server: --task), or choose "
            "another weighting (examples, uniform, metric)"
        )
    state = initial if isinstance(initial, ServerState) else initial_state(initial, strategy)
    del initial  # a round's state is dropped once the next exists: the caller's own reference is its to drop
    trainable = state.trainable  # a property of the model: the same for the whole run
    _check_groups(strategy, state)
    if isinstance(strategy.aggregator, Stateful):
        strategy.aggregator.load_state(state.round, state.aggregator_state)

    def round_end(record: RoundRecord, state: ServerState) -> ServerState:
        returned = on_round_end(record, state) if on_round_end is not None else None
        if returned is None or returned.trainable == trainable:
            return returned or state
        return replace(returned, trainable=trainable)  # e.g. mapped back from a checkpoint, which does not hold it

    records: list[RoundRecord] = []
    convergence = Convergence.replay(config.stop, history)
    if convergence.stop is not None:
        log.warning(
            "the run stopped after round %d (%s: %s); no further round is run. To train on, start a new run in a new "
            "state directory from this run's model: fedcore server start --initial takes its checkpoint (a "
            "simulation starts only from its task's model)",
            convergence.stop.round,
            convergence.stop.rule,
            convergence.stop.detail,
        )
        return state, records
    evaluation_errors: set[str] = set()  # the server evaluation's errors logged with their traceback (once each)
    if state.round == 0 and evaluate_fn is not None:
        started = time.perf_counter()
        central = _central_evaluation(evaluate_fn, state, evaluation_errors)
        record = replace(central, seconds=time.perf_counter() - started)
        record = replace(record, stop=convergence.observe(record.as_row()))
        if keep_records:
            records.append(record)
        state = round_end(record, state)
    for rnd in range(state.round + 1, config.num_rounds + 1):
        if convergence.stop is not None:
            log.warning("stopping before round %d: %s (%s)", rnd, convergence.stop.rule, convergence.stop.detail)
            break
        started = time.perf_counter()
        try:
            state, record = _fit_round(pool, strategy, state, config, rnd, validate_fn)
        except BudgetExhausted as exc:  # raised before any client is contacted: the last round is kept
            log.warning("stopping before round %d: %s", rnd, exc)
            break
        last = rnd == config.num_rounds or (
            isinstance(strategy.aggregator, Budgeted) and not strategy.aggregator.allows(rnd + 1)
        )
        evaluate_now = rnd % config.evaluate_every == 0 or last
        if evaluate_now:
            record = _evaluate_round(
                pool, strategy, state, config, record, evaluate_fn, evaluation_errors, on_release=on_release
            )
        record = replace(record, seconds=time.perf_counter() - started)
        stop = convergence.observe(record.as_row())  # an unevaluated round's wall time counts towards the target's
        record = replace(record, stop=stop)
        if keep_records:
            records.append(record)
        state = round_end(record, state)
        del record
        release_memory()
        _trace(rnd, "round end")
        if last and rnd < config.num_rounds:
            log.warning(  # a WARNING so that it shows by default: the run ends short of the rounds asked for
                "round %d is the last within the privacy budget (target_epsilon); training stops there, %d round(s) "
                "before --rounds",
                rnd,
                config.num_rounds - rnd,
            )
            break
    return state, records


def _check_groups(strategy: Strategy, state: ServerState) -> None:
    """Refuse a state whose tensor groups are not the strategy's (a checkpoint of another algorithm).

    Raises:
        ConfigError: the groups differ (both sets are named).
    """
    if set(state.groups) != set(strategy.groups):
        raise ConfigError(
            f"the server state (round {state.round}) holds the tensor groups {sorted(state.groups)} but strategy "
            f"{strategy.name!r} declares {sorted(strategy.groups)}; start from a state of this strategy"
        )


def _check_reply_groups(reply: FitRes, specs: Mapping[str, tuple[TensorSpec, ...]], rnd: int) -> None:
    """Validate a reply's tensor groups completely before anything of the reply is folded.

    Raises:
        UpdateRejected: a declared group is missing or an undeclared one is present.
        PayloadError, NonFiniteError: a group's names, shapes or dtypes differ from the server's state of it, or it
            holds NaN or Inf.
    """
    groups = reply.groups if isinstance(reply.groups, Mapping) else {}
    missing, extra = sorted(set(specs) - set(groups)), sorted(set(groups) - set(specs), key=str)
    if missing or extra:
        raise UpdateRejected(
            "the reply's tensor groups differ from the strategy's: "
            + "; ".join(
                part
                for part in (
                    f"missing {', '.join(missing)}" if missing else "",
                    f"unexpected {bounded_repr(extra[:5])}" if extra else "",
                )
                if part
            )
        )
    for name, spec in specs.items():
        check_spec(groups[name], spec, round=rnd, client_id=reply.client_id)
        check_finite(groups[name], round=rnd, client_id=reply.client_id)


def release_memory() -> None:
    """Collect garbage and ask glibc to return freed heap memory to the OS (no-op elsewhere)."""
    gc.collect()
    _trim_heap()


class _FailureLog:
    """A round attempt's client failures (and rejected updates) in the log: the first :attr:`EACH` one by one as they
    come (the caller logs those), the rest in one line at the end of the replies, each reason once
    (:func:`failure_summary`): a batch of 1,000 clients failing for one reason reads as 6 lines, not 1,000."""

    EACH = 5

    def __init__(self) -> None:
        self.logged = 0
        self.held: list[Failure] = []

    def add(self, failure: Failure) -> bool:
        """Whether ``failure`` is held for the closing line (else the caller logs it now)."""
        if self.logged < self.EACH:
            self.logged += 1
            return False
        self.held.append(failure)
        return True

    def close(self, rnd: int) -> None:
        """Log the held failures in one line (nothing when none is held)."""
        if self.held:
            log.warning(
                "round %d: %d more client(s) failed or had their update rejected: %s",
                rnd,
                len(self.held),
                failure_summary(self.held),
            )


_TRIM_AFTER_BYTES = 1 << 20
"""Replies of at least this many bytes have the heap trimmed right after they are folded (``malloc_trim`` costs
about 0.1 ms, a fifth of folding a 200,000-parameter update; what smaller replies free is reused by the next one
and trimmed at the round's end)."""


def _trim_heap() -> None:
    trim = glibc_function("malloc_trim")
    if trim is not None:
        trim(0)


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number


def return_large_blocks_to_the_os() -> None:
    """Make glibc serve every allocation of 1 MiB or more with its own mapping, returned to the OS when freed.

    By default glibc raises its mmap threshold after the first large free (up to 32 MiB) and then serves such
    blocks from its heaps, where freed ones stay resident. The server allocates and frees many 4 MiB payload
    chunks on many gRPC threads (measured: ~2x a 256 MiB model of freed-but-resident memory after 20 pushes); a
    simulation frees model-sized tensors and arrays every client (measured with bench/simulation_memory.py's
    20M-parameter model: 14 MiB less peak). Process-wide and idempotent; no-op without glibc.
    """
    mallopt = glibc_function("mallopt")
    if mallopt is not None:
        mallopt(_M_MMAP_THRESHOLD, 1 << 20)


@functools.cache
def glibc_function(name: str) -> Callable[..., int] | None:
    """The C library's function ``name`` (glibc's ``malloc_trim``, ``mallopt``), or None where the C library
    cannot be loaded or lacks it (not glibc). Looked up once per name."""
    library = ctypes.util.find_library("c")
    if library is None:
        return None
    try:
        return cast(Callable[..., int], getattr(ctypes.CDLL(library), name))
    except (OSError, AttributeError):
        return None


def resident_mib() -> tuple[float, float] | None:
    """``(VmRSS, VmHWM)`` of this process in MiB from /proc/self/status, or None where there is no procfs."""
    try:
        with open("/proc/self/status") as fh:
            fields = dict(line.split(":", 1) for line in fh if line.startswith(("VmRSS", "VmHWM")))
        return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024
    except (OSError, KeyError, ValueError):
        return None


def _trace(rnd: int, stage: str) -> None:
    if mem_log.isEnabledFor(logging.DEBUG):
        got = resident_mib()
        if got is not None:
            mem_log.debug("round %d %s: rss %.1f MiB, peak %.1f MiB", rnd, stage, *got)


def _fit_round(
    pool: ClientPool,
    strategy: Strategy,
    state: ServerState,
    config: RoundConfig,
    rnd: int,
    validate_fn: EvaluateFn | None = None,
) -> tuple[ServerState, RoundRecord]:
    all_failures: list[Failure] = []
    bytes_up = bytes_down = 0
    waited: float | None = None  # simulated seconds of the attempts that failed: the round waited for them too
    for attempt in range(1, config.max_round_attempts + 1):
        needed = max(strategy.sampling.min_fit_clients, config.min_fit_results)
        available = _candidates(strategy, pool.wait_for(needed, config.wait_for_clients_s), needed, rnd)
        num = min(strategy.sampling.num_fit(len(available)), len(available))
        try:
            strategy.aggregator.check(num)
        except ConfigError as exc:  # too few clients this round for the rule: say which round
            raise ConfigError(exc.message, round=rnd) from None
        if isinstance(strategy.aggregator, PoolSampled):  # before start(), which spends the round's epsilon
            strategy.aggregator.sampled_from(rnd, num, len(available))
        stage = "fit" if attempt == 1 else f"fit-attempt-{attempt}"
        selected = strategy.selection.select(available, num, seed=config.seed, round=rnd, stage=stage)
        fit = FitIns(  # one instruction for all: it names no client (frozen; a stage that changes one replaces it)
            round=rnd,
            parameters=state.parameters,
            config=strategy.fit,
            seed=config.seed,
            groups=state.groups,
            mods=strategy.mods,
        )
        instructions: dict[str, Instruction] = dict.fromkeys(selected, fit)
        _trace(rnd, "round start")
        accumulator = strategy.aggregator.start(spec_of(state.parameters), round=rnd, reference=state.parameters)
        group_specs = {name: spec_of(state.groups[name]) for name in strategy.groups}
        group_sums = {
            name: rule.aggregator.start(group_specs[name], round=rnd) for name, rule in strategy.groups.items()
        }
        inverses = server_inverses(strategy.mods)  # e.g. decompression: undone below, before the aggregator
        accepted: list[str] = []
        failures: list[Failure] = []
        metric_rows: list[tuple[int, Mapping[str, object]] | MetricColumns] = []
        timed: list[tuple[int, Mapping[str, object]] | MetricColumns] = []  # every reply's metrics, refused too
        failure_log = _FailureLog()
        observations: list[ClientObservation] = []
        protocol_run, instructions = _stages_before_fit(pool, strategy, config, rnd, attempt, instructions, failures)
        if instructions:  # every fit instruction of a round carries the same payload (model and groups)
            bytes_down += len(instructions) * sent_bytes(pool, next(iter(instructions.values())))
        for reply in pool.run(instructions, timeout_s=config.round_timeout_s):
            if isinstance(reply, FitBatchRes):  # several clients' updates, already summed where they were trained
                bytes_up += received_bytes(pool, reply)
                timed.append(MetricColumns(reply.num_examples, reply.metrics))
                if _fold_batch(reply, accumulator, strategy, instructions, rnd, failures):  # read as columns
                    accepted.extend(reply.client_ids)
                    metric_rows.append(MetricColumns(reply.num_examples, reply.metrics))
                    observations.extend(batch_observations(reply.client_ids, reply.num_examples, reply.metrics))
                del reply
                continue
            if isinstance(reply, Failure):
                failures.append(reply)
                if not failure_log.add(reply):
                    log.warning("round %d: client %s failed: %s", rnd, reply.client_id, reply.reason)
                continue
            if not isinstance(reply, FitRes) or reply.round != rnd or reply.client_id not in instructions:
                log.warning("round %d: discarding an unexpected reply %r", rnd, type(reply).__name__)
                continue
            client_id, num_examples, fit_metrics = reply.client_id, reply.num_examples, reply.metrics
            timed.append((num_examples, fit_metrics))  # a synchronous round waits for a reply it then refuses
            reply_bytes = received_bytes(pool, reply)
            bytes_up += reply_bytes
            try:
                # the one place a reply is decoded to the model's spec: lazily, block by block as it is folded
                reply = decode_reply(inverses, reply, reference=state.parameters, round=rnd)
                _check_count(num_examples)
                _check_reply_groups(reply, group_specs, rnd)  # all of them before anything is folded
                weight = strategy.weight(reply, evaluate=_evaluation_of(validate_fn, reply, rnd))
                accumulator.add(reply.parameters, weight, client_id=client_id, round=rnd)
                for name, rule in strategy.groups.items():  # already checked: adding them cannot fail now
                    group_sums[name].add(reply.groups[name], rule.weight(num_examples), client_id=client_id, round=rnd)
            except FedcoreError as exc:
                for refusing in (accumulator, *group_sums.values()):  # a faulty client: one of a robust rule's f
                    if isinstance(refusing, CountsRejections):
                        refusing.rejected(client_id)
                failures.append(Failure(client_id=client_id, round=rnd, stage=Stage.FIT, reason=str(exc)))
                if not failure_log.add(failures[-1]):
                    log.warning("round %d: rejected the update of client %s: %s", rnd, client_id, exc)
                continue
            finally:
                del reply  # the update's file mapping goes with it
                if reply_bytes >= _TRIM_AFTER_BYTES:
                    _trim_heap()  # transfer buffers freed while it arrived: back to the OS now, not at round end
            accepted.append(client_id)
            metric_rows.append((num_examples, fit_metrics))
            observations.append(observation(client_id, num_examples, _mapping(fit_metrics)))
        failure_log.close(rnd)
        _trace(rnd, f"folded {len(accepted)} update(s)")
        all_failures.extend(failures)
        try:
            if len(accepted) < config.min_fit_results:
                raise RoundFailed(
                    f"only {len(accepted)} of {len(selected)} selected clients returned a valid update; the quorum "
                    f"is {config.min_fit_results}. Failures: "
                    + _with_model_hint(failure_summary(failures), state, selected, failures),
                    round=rnd,
                )
            _stages_after_fit(pool, protocol_run, config, accepted, all_failures)
            average = accumulator.result(release=True)  # the running sum becomes the average in place
            aggregation = dict(accumulator.report()) if isinstance(accumulator, Reporting) else {}
            del accumulator
            _trace(rnd, "average")
            with np.errstate(over="ignore", invalid="ignore"):  # a non-finite step is reported below, by tensor
                parameters, optimizer_state = strategy.server_optimizer.step(  # the new model in the average's memory
                    state.parameters, average, state.optimizer_state, trainable=state.trainable, reuse_average=True
                )
            del average
            optimizer = type(strategy.server_optimizer).__name__
            _check_step(
                f"the server optimizer's {optimizer}.step (the new parameters)", parameters, state.parameters, rnd
            )
            server_lr = getattr(strategy.server_optimizer, "lr", None)
            lower = f"Lower the server learning rate (--server-lr, now {server_lr})" if server_lr is not None else ""
            check_finite(  # block by block: no model-sized temporary
                parameters,
                round=rnd,
                advice="the server step made the new global model non-finite from a finite average of the "
                f"clients' updates, and it is not kept. {lower or 'Check the server optimizer'}",
            )
            norm = update_norm(parameters, state.parameters, state.trainable)
            groups = {
                name: rule.update(
                    state.groups[name],
                    group_sums.pop(name).result(release=True),
                    accepted=len(accepted),
                    available=len(available),
                )
                for name, rule in strategy.groups.items()
            }
            for name in groups:
                rule_name = type(strategy.groups[name]).__name__
                _check_step(f"the {rule_name}.update of tensor group {name!r}", groups[name], state.groups[name], rnd)
                check_finite(
                    groups[name],
                    round=rnd,
                    advice=f"the server's update of tensor group {name!r} is not finite, and it is not kept. "
                    f"{lower or 'Check the group rule'}",
                )
            _trace(rnd, "server step")
        except FedcoreError as exc:
            if attempt == config.max_round_attempts:
                advice = _quorum_advice(failures, accepted) if isinstance(exc, RoundFailed) else ""
                raise RoundFailed(
                    f"round failed after {attempt} attempt(s): {exc.message.rstrip('.')}. The global model stays at "
                    f"round {state.round}{advice}.",
                    round=rnd,
                ) from exc
            log.warning("round %d attempt %d failed (%s); retrying with a fresh selection", rnd, attempt, exc)
            waited = _after(waited, _simulated_duration(timed))
            continue
        finally:  # the attempt's stage traffic, whether it failed or not
            if protocol_run is not None:
                bytes_down += protocol_run.bytes_down
                bytes_up += protocol_run.bytes_up
        strategy.selection.observe(rnd, observations)  # the one feedback of a finished round to the selector
        train_metrics = weighted_metrics(metric_rows)
        _log_left_out(rnd, "fit", train_metrics.left_out)
        record = RoundRecord(
            round=rnd,
            selected=tuple(selected),
            accepted=tuple(accepted),
            failures=tuple(all_failures),
            train_metrics=train_metrics.values,
            attempts=attempt,
            metrics_left_out=train_metrics.left_out,
            aggregation=aggregation,
            observations=tuple(observations),
            simulated_seconds=_after(waited, _simulated_duration(timed)),
            bytes_up=bytes_up,
            bytes_down=bytes_down,
            update_norm=norm,
        )
        new_state = ServerState(
            round=rnd,
            parameters=parameters,
            optimizer_state=optimizer_state,
            trainable=state.trainable,
            groups=groups,
            aggregator_state=strategy.aggregator.state_dict(rnd) if isinstance(strategy.aggregator, Stateful) else {},
        )
        return new_state, record
    raise AssertionError("unreachable: the loop returns or raises")  # pragma: no cover


def _check_step(who: str, arrays: object, expected: NamedArrays, rnd: int) -> None:
    """Refuse new server-side tensors (the server optimizer's new global model, a group rule's new state) that are
    not ``expected``'s: other names, shapes or dtypes, or values that are not numpy arrays. A custom part's bug,
    which the clients would otherwise report next round as a model of another task (or which would end the run as
    the final model), or which would raise a KeyError or AttributeError in the loop.

    Args:
        who: the method that made ``arrays`` and what they are, e.g. ``"MyOpt.step (the new parameters)"``.

    Raises:
        PayloadError: what differs, naming ``who``.
    """
    rule = (
        "; it must return every tensor it was given, each a numpy array of the same shape and dtype (compute in "
        "float64 if needed and cast back), and its result is not kept"
    )
    if not isinstance(arrays, Mapping):
        raise PayloadError(f"{who} returned a {type(arrays).__name__}{rule}", round=rnd)
    odd = next(((n, a) for n, a in arrays.items() if not isinstance(a, np.ndarray)), None)
    if odd is not None:
        what = f"{odd[0]!r} as a {type(odd[1]).__name__}"
        raise PayloadError(f"{who} returned {what}, not a numpy array{rule}", round=rnd)
    missing, extra = sorted(set(expected) - set(arrays)), sorted(set(arrays) - set(expected), key=str)
    if missing or extra:
        raise PayloadError(
            f"{who} returned other tensors than it was given: missing {missing[:5]}, unexpected {extra[:5]}{rule}",
            round=rnd,
        )
    for name, x in expected.items():
        new = arrays[name]
        if new.shape != x.shape or new.dtype != x.dtype:
            raise PayloadError(
                f"{who} returned tensor {name!r} with shape {new.shape} and dtype {new.dtype}, where it was given "
                f"{x.shape} {x.dtype}{rule}",
                round=rnd,
            )


def _check_count(num_examples: object, *, client_id: str | None = None) -> None:
    """Refuse an example count that is not an integer in 0..:data:`~fedcore.messages.MAX_EXAMPLES` (a bool is not
    one).

    Raises:
        UpdateRejected: what the count was.
    """
    if (
        isinstance(num_examples, bool)
        or not isinstance(num_examples, numbers.Integral)
        or not 0 <= int(num_examples) <= MAX_EXAMPLES
    ):
        raise UpdateRejected(
            f"the example count {bounded_repr(num_examples)} is not an integer in 0..2**63-1", client_id=client_id
        )


def _fold_batch(
    batch: FitBatchRes,
    accumulator: Accumulator,
    strategy: Strategy,
    instructions: Mapping[str, Instruction],
    rnd: int,
    failures: list[Failure],
) -> bool:
    """Fold a pre-summed batch of updates (:class:`~fedcore.messages.FitBatchRes`) into ``accumulator``; return
    whether its clients count as accepted: False for a batch without clients, and for one rejected (its sum or a
    weight cannot be used: nothing of it is kept), with a failure for each of its clients.

    Raises:
        ConfigError: the round's aggregation cannot take a sum (not a :class:`~fedcore.aggregation.SumAccumulator`,
            or the strategy exchanges tensor groups): the pool must send each update on its own.
    """
    if not isinstance(accumulator, SumAccumulator) or strategy.groups:
        raise ConfigError(
            f"round {rnd}: the client pool sent {len(batch.client_ids)} updates already summed, but strategy "
            f"{strategy.name!r} aggregates with {type(accumulator).__name__}"
            + (f" and tensor groups ({', '.join(sorted(strategy.groups))})" if strategy.groups else "")
            + ", which needs each update on its own; run the pool without pre-summing (the batched simulation "
            "pre-sums only for a plain weighted mean)",
            round=rnd,
        )
    ids = batch.client_ids
    if not ids:  # every client of the batch was left out: their failures came on their own
        return False
    try:
        if batch.round != rnd:
            raise UpdateRejected(f"the batch belongs to round {batch.round}, not this round {rnd}")
        if unknown := [cid for cid in ids if cid not in instructions]:
            raise UpdateRejected(f"the batch holds clients that were not instructed: {bounded_repr(unknown)}")
        if len(set(ids)) != len(ids):
            raise UpdateRejected("the batch holds a client twice")
        if (negative := np.flatnonzero(batch.num_examples < 0)).size:
            first = int(negative[0])
            _check_count(int(batch.num_examples[first]), client_id=ids[first])  # raises: says which and what
        accumulator.add_sum(batch.weighted_sum, batch.weights.tolist(), client_ids=ids, round=rnd)
    except FedcoreError as exc:
        log.warning("round %d: rejected a batch of %d updates: %s", rnd, len(ids), exc)
        failures.extend(Failure(client_id=cid, round=rnd, stage=Stage.FIT, reason=str(exc)) for cid in ids)
        return False
    return True


def _quorum_advice(failures: Sequence[Failure], accepted: Sequence[str]) -> str:
    """What the operator can change when an attempt had too few valid updates (rather than a failed server step),
    from how its clients failed: a later deadline helps only clients that missed it."""
    if not failures or any(missed_deadline(failure) for failure in failures):
        return "; check the failing clients' logs, lower the quorum, or raise the deadline"
    lower = ", or lower the quorum" if accepted else ""
    return f"; no client missed the deadline, so a later one would not help: remove the cause the failures name{lower}"


EXTREME_UPDATE_ADVICE = (
    "a norm bound (--norm-bound) or a robust aggregator (--aggregator) keeps one client's extreme update out of "
    "the global model"
)


def _with_model_hint(summary: str, state: ServerState, selected: Sequence[str], failures: Sequence[Failure]) -> str:
    """``summary``, and when every one of two or more selected clients sent NaN/Inf from a trained global model, a
    sentence that the model is the likely cause (its L2 norm, and what keeps an extreme update out), not each
    client's learning rate and data, which each failure's own advice names."""
    failed = {f.client_id for f in failures if non_finite_update(f)}
    if state.round < 1 or len(selected) < 2 or not failed >= set(selected):
        return summary
    size = parameter_norm(state.parameters, state.trainable)
    noised = any(DP_NOISE_WORDS in f.reason for f in failures)  # the failures' own advice gives the noise
    return (
        f"{summary.rstrip('.')}. Every selected client's update from the global model of round {state.round} holds "
        f"NaN/Inf: that model is the likely cause (its L2 norm is {size:.3g}; see that round's update_norm and "
        "test_loss in history.csv), not each client's learning rate or data"
        + ("" if noised else f"; {EXTREME_UPDATE_ADVICE}")
    )


def failure_summary(failures: Sequence[Failure], *, reasons: int = 5, ids: int = 3) -> str:
    """The failures of a round attempt in one line: each distinct reason once (the first ``reasons`` of them, in
    order of first appearance; a client's own id in a reason's error context does not count), after the clients that
    gave it (the first ``ids``, then how many more), so that a cause every client shares (a weighting metric none
    reports) reads once, not once per client."""
    by_reason: dict[str, list[str]] = {}
    for failure in failures:
        by_reason.setdefault(_without_own_id(failure), []).append(failure.client_id)
    parts = []
    for reason, clients in list(by_reason.items())[:reasons]:
        more = f" and {len(clients) - ids} more" if len(clients) > ids else ""
        parts.append(f"{', '.join(clients[:ids])}{more}: {reason}")
    if len(by_reason) > reasons:
        parts.append(f"{len(by_reason) - reasons} other reason(s)")
    return "; ".join(parts) or "none reported"


def _without_own_id(failure: Failure) -> str:
    """A failure's reason without its own client's id in the error context (``[round 3, client 'c7', stage fit]``
    reads ``[round 3, stage fit]``), so that clients failing alike share one reason; the summary names them."""
    own = f"client {failure.client_id!r}"
    return (
        failure.reason.replace(f", {own}", "", 1)
        if f", {own}" in failure.reason
        else failure.reason.replace(f"[{own}, ", "[", 1)
    )


def _candidates(strategy: Strategy, available: list[str], needed: int, rnd: int) -> list[str]:
    """The connected clients that may be selected in round ``rnd`` (:meth:`fedcore.selection.Selector.candidates`:
    a simulation's availability trace leaves out the clients offline then).

    Raises:
        RoundFailed: fewer than ``needed`` are candidates (the trace has too few clients online in this round).
    """
    candidates = strategy.selection.candidates(available, round=rnd)
    if len(candidates) < needed:
        raise RoundFailed(
            f"only {len(candidates)} of {len(available)} clients are online in this round by the availability "
            f"trace, and a round needs {needed}; raise the trace's online share or lower the clients per round",
            round=rnd,
        )
    return candidates


def _mapping(metrics: object) -> Mapping[str, object]:
    return metrics if isinstance(metrics, Mapping) else {}


def _after(earlier: float | None, attempt: float | None) -> float | None:
    """Simulated seconds of the attempts before and of this one, in sequence (None where none was timed)."""
    return attempt if earlier is None else earlier + (attempt or 0.0)


def _simulated_duration(rows: Sequence[tuple[int, Mapping[str, object]] | MetricColumns]) -> float | None:
    """A synchronous attempt's simulated duration: the slowest replying client's ``simulated_seconds`` (a
    simulation's device model reports it with each update; the round waits for an update it then refuses as for
    any other); None when no client reported one (a real deployment). A round's is the sum over its attempts."""
    known: list[float] = []
    for row in rows:
        if isinstance(row, MetricColumns):
            column = row.metrics.get("simulated_seconds")
            if column is not None:  # every usable value, in order: max() then keeps the first of equal ones (0.0, -0.0)
                known.extend(column[(column >= 0) & (column < math.inf)].tolist())
            continue
        seconds = metric_value(_mapping(row[1]).get("simulated_seconds"))
        if seconds is not None and 0 <= seconds < math.inf:
            known.append(seconds)
    return max(known) if known else None


def _evaluation_of(validate_fn: EvaluateFn | None, reply: FitRes, rnd: int) -> Callable[[], EvalResult] | None:
    """The server's evaluation of ``reply``'s update, to be run when the weighting asks for it."""
    if validate_fn is None:
        return None
    return functools.partial(validate_fn, reply.parameters, rnd)


def _stages_before_fit(
    pool: ClientPool,
    strategy: Strategy,
    config: RoundConfig,
    rnd: int,
    attempt: int,
    instructions: dict[str, Instruction],
    failures: list[Failure],
) -> tuple[ProtocolRun | None, dict[str, Instruction]]:
    """Run the exchanges of the strategy's round protocol that come before the fit exchange (:mod:`server.stages`)
    with the selected clients; returns the protocol's run and the fit instructions of the clients still in the
    round. Dropouts go to ``failures``. A protocol that stops the round leaves no client to fit, so the attempt
    misses its quorum and is retried. Without a protocol nothing happens: the instructions come back as they are.

    Raises:
        ConfigError: the protocol cannot run with this selection (before any client is contacted).
    """
    if strategy.protocol is None:
        return None, instructions
    run = start_protocol(strategy.protocol, round=rnd, attempt=attempt, clients=list(instructions), seed=config.seed)
    try:
        failures.extend(run.run_phase(pool, Phase.BEFORE_FIT, config.round_timeout_s))
    except FedcoreError as exc:  # as the fit exchange's errors: this attempt fails, the next starts afresh
        log.warning("round %d: the round protocol %s stopped the round: %s", rnd, run.protocol, exc.message)
        failures.extend(run.stop(exc.message))
    return run, {cid: ins for cid, ins in instructions.items() if cid in run.alive}


def _stages_after_fit(
    pool: ClientPool, run: ProtocolRun | None, config: RoundConfig, accepted: list[str], failures: list[Failure]
) -> None:
    """Tell the round protocol which clients' updates were folded, then run its exchanges that come after the
    fit exchange with them (:mod:`server.stages`); dropouts go to ``failures``. No protocol: nothing happens.

    Raises:
        FedcoreError: the protocol stopped the round (RoundFailed) or failed otherwise; the attempt fails, and is
            retried.
    """
    if run is None:
        return
    run.fit_done(accepted, failures)
    failures.extend(run.run_phase(pool, Phase.AFTER_FIT, config.round_timeout_s))


def _log_left_out(rnd: int, stage: str, count: int) -> None:
    if count:
        log.warning(
            "round %d: %d %s metric value(s) left out of the averages (not a finite number, or from a client "
            "that reported 0 examples)",
            rnd,
            count,
            stage,
        )


def _central_evaluation(evaluate_fn: EvaluateFn, state: ServerState, logged: set[str]) -> RoundRecord:
    """The server's own evaluation of ``state``'s model as a record of round ``state.round``; ``logged``: the
    errors of the run's evaluations so far that were logged with their traceback (a repeat gets one line).

    Its values are taken as they come when they are numbers, NaN and Inf included (a NaN test loss on real
    examples is how a diverged model shows); a value that is not a number is left out and counted, and so is every
    value of an evaluation on 0 examples (an empty server test split, whose loss is NaN without meaning). If
    ``evaluate_fn`` raises or returns something else than an :class:`~fedcore.task.EvalResult`, the error is
    logged and the record has no central evaluation: the round and its model are kept.
    """
    try:
        result = evaluate_fn(state.parameters, state.round)
        if not isinstance(result, EvalResult):
            raise TypeError(f"evaluate_fn returned {type(result).__name__}, not an EvalResult")
        reported: dict[object, object] = {}
        reported.update(result.metrics)
        reported["loss"] = result.loss
    except ClientTaskError as exc:  # the server's task named what is wrong (labels of its test data): no traceback
        log.error(
            "round %d: the server's evaluation failed on the server's test data: %s; the round is recorded without it",
            state.round,
            exc.message,
        )
        return RoundRecord(round=state.round)
    except Exception as exc:
        error = f"{type(exc).__name__}: {bound_text(str(exc), 300)}"
        if error in logged:  # its traceback is in the log already: one line a round
            log.error(
                "round %d: the server's evaluation failed again (%s); the round is recorded without it",
                state.round,
                error,
            )
        else:
            logged.add(error)
            log.exception("round %d: the server's evaluation failed; the round is recorded without it", state.round)
        return RoundRecord(round=state.round)
    values = {k: v for k, raw in reported.items() if isinstance(k, str) and (v := metric_value(raw)) is not None}
    if example_weight(result.num_examples) is None:
        values = {}
    left_out = len(reported) - len(values)
    _log_left_out(state.round, "server evaluation", left_out)
    return RoundRecord(
        round=state.round, eval_loss=values.pop("loss", None), eval_metrics=values, metrics_left_out=left_out
    )


def _evaluate_round(
    pool: ClientPool,
    strategy: Strategy,
    state: ServerState,
    config: RoundConfig,
    record: RoundRecord,
    evaluate_fn: EvaluateFn | None,
    evaluation_errors: set[str],
    *,
    on_release: Callable[[int], None] | None = None,
) -> RoundRecord:
    """Add the server's and the clients' evaluation of the new global model to the round's ``record``
    (``evaluation_errors``: as :func:`_central_evaluation`'s; ``on_release``: as :func:`run_rounds`', called
    before the model is sent to the evaluation's clients).

    Neither can fail the round: see :func:`_central_evaluation`; a client's evaluation values are averaged with
    :func:`weighted_metrics`, which leaves out what cannot count; a transport error during federated evaluation
    is logged and the round keeps what arrived before it.
    """
    changes: dict[str, Any] = {}
    left_out = record.metrics_left_out
    if evaluate_fn is not None:
        central = _central_evaluation(evaluate_fn, state, evaluation_errors)
        changes["eval_loss"] = central.eval_loss
        if central.eval_loss is not None and not math.isfinite(central.eval_loss) and record.round > 0:
            log.warning(  # said now: the next round's clients all fail from this model, and look to blame
                "round %d: the new global model's test loss is %s (its parameters are finite, its update norm %.3g): "
                "an extreme update may have taken it where the loss overflows, or the evaluation itself returns a "
                "non-finite loss; %s",
                record.round,
                central.eval_loss,
                record.update_norm,
                EXTREME_UPDATE_ADVICE,
            )
        changes["eval_metrics"] = central.eval_metrics
        left_out += central.metrics_left_out
    available = strategy.selection.candidates(pool.available(), round=state.round)
    num = min(strategy.sampling.num_evaluate(len(available)), len(available))
    if num > 0:
        selected = strategy.selection.select(available, num, seed=config.seed, round=state.round, stage="evaluate")
        instructions: dict[str, Instruction] = {
            cid: EvaluateIns(round=state.round, parameters=state.parameters, batch_size=strategy.evaluate_batch_size)
            for cid in selected
        }
        if on_release is not None:
            on_release(state.round)
        rows: list[tuple[int, Mapping[str, object]]] = []
        failures = list(record.failures)
        changes["bytes_down"] = record.bytes_down + len(instructions) * sent_bytes(pool, instructions[selected[0]])
        bytes_up = record.bytes_up
        try:
            for reply in pool.run(instructions, timeout_s=config.round_timeout_s):
                bytes_up += received_bytes(pool, reply)
                if isinstance(reply, EvaluateRes) and reply.round == state.round:
                    reported = dict(reply.metrics) if isinstance(reply.metrics, Mapping) else {}
                    left_out += not isinstance(reply.metrics, Mapping)  # not a metrics dict: one report lost
                    reported["loss"] = reply.loss  # the reply's loss, never a metric of that name
                    rows.append((reply.num_examples, reported))
                elif isinstance(reply, Failure):
                    failures.append(reply)
        except FedcoreError as exc:
            log.warning("round %d: federated evaluation stopped early: %s", state.round, exc)
        merged = weighted_metrics(rows)
        _log_left_out(state.round, "evaluate", merged.left_out)
        left_out += merged.left_out
        values = dict(merged.values)
        if "loss" in values:
            changes["federated_eval_loss"] = values.pop("loss")
            changes["federated_eval_metrics"] = values
        changes["failures"] = tuple(failures)
        changes["bytes_up"] = bytes_up
    changes["metrics_left_out"] = left_out
    return replace(record, **changes)
