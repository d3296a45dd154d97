"""Client selection: which of the available clients train in a round.

One option picks the policy (``[strategy] selection``), its parameters sit in ``[strategy.selector]``
(:class:`SelectionConfig`):

===================  ==========================================================================================
``uniform``          ``num`` distinct clients uniformly at random (:func:`sample_clients`; FedAvg, McMahan et al.
                     2017). The default; the same clients for the same seed as before this module existed.
``stratified``       proportional allocation over the strata of one client attribute (largest remainders), then
                     uniform within each stratum (:func:`stratified_sample`).
``power-of-choice``  sample ``d`` candidates, keep the ``num`` with the highest local loss (Cho, Wang and Joshi
                     2020, "Client Selection in Federated Learning: Convergence Analysis and Power-of-Choice
                     Selection Strategies"), from each client's *last reported* training loss: the paper's
                     rpow-d variant (:func:`power_of_choice`).
``oort``             statistical utility from reported losses, a penalty for clients slower than the preferred
                     round duration, a staleness bonus, and an exploration share for clients never seen (Lai et
                     al. 2021, "Oort: Efficient Federated Learning via Guided Participant Selection";
                     :func:`oort_select`).
===================  ==========================================================================================

Every choice is a function of (seed, round, stage), the candidates and the feedback of earlier rounds: the
generators come from :func:`fedcore.seeding.numpy_rng`, keyed by the seed, the policy, the stage and the round,
and the candidates are sorted first, so a simulation and a deployment with the same clients pick the same ones.

The :class:`Selector` holds what the policies learn from finished rounds (each client's last reported loss,
example count, duration and round), fed once per round by the round loop through :meth:`Selector.observe`.
That state is *rebuilt*, not checkpointed: the server stores each round's observations in its state database
with the round's record, and a restarted server replays them (:meth:`Selector.restore`), so it selects exactly
as an uninterrupted run would.

Evaluation: the ``evaluate`` stage is selected uniformly by ``power-of-choice`` and ``oort`` (a loss- or
speed-biased evaluation would misreport the model), stratified by ``stratified``.
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from fedcore.aggregation.metrics import metric_value
from fedcore.errors import ConfigError
from fedcore.seeding import numpy_rng

SELECTION_NAMES = ("uniform", "stratified", "power-of-choice", "oort")
SIZE_ATTRIBUTE = "size"
"""The attribute the simulation derives from each client's partition: its dataset-size bucket (``"0"`` holds the
smallest clients), see :func:`size_buckets`."""
DURATION_METRICS = ("simulated_seconds", "fit_seconds")
"""Reply metrics read as a client's round duration, the first present wins: a simulation's simulated device time
(deterministic), else the time the client measured for its fit."""
_MAX_ATTRIBUTE_TEXT = 64

Availability = Callable[[str, int], bool]
"""``(client id, round) -> whether the client is online`` (a simulation's availability trace)."""


def sample_clients(available: Sequence[str], num: int, *, seed: int, round: int, stage: str = "fit") -> list[str]:
    """Select ``num`` distinct clients uniformly at random, keyed by (seed, round, stage).

    The choice depends only on the set of available ids (they are sorted first), so the same seed picks the
    same clients in simulation and deployment.

    Raises:
        ConfigError: ``num`` is negative or more than the clients available.
    """
    pool = sorted(available)
    _check_num(num, len(pool))
    rng = numpy_rng(seed, "sample", stage, round)
    chosen = rng.choice(len(pool), size=num, replace=False)
    return [pool[i] for i in sorted(int(c) for c in chosen)]


def _check_num(num: int, available: int) -> None:
    if not 0 <= num <= available:
        raise ConfigError(f"cannot select {num} clients from {available} available")


MAX_ATTRIBUTES = 16


def check_attributes(attributes: Mapping[str, str]) -> dict[str, str]:
    """Check the attributes a client declares about itself (``--attribute KEY=VALUE``, sent at join): at most
    :data:`MAX_ATTRIBUTES`, each key and value 1..64 printable characters (client input, bounded before it is kept).

    Returns:
        A plain copy.

    Raises:
        ConfigError: too many, or a key or value empty, too long or not printable (the message says which).
    """
    if len(attributes) > MAX_ATTRIBUTES:
        raise ConfigError(f"a client may declare at most {MAX_ATTRIBUTES} attributes, got {len(attributes)}")
    for key, value in attributes.items():
        for what, text in (("key", key), ("value", value)):
            if not isinstance(text, str) or not 0 < len(text) <= _MAX_ATTRIBUTE_TEXT or not text.isprintable():
                raise ConfigError(
                    f"client attribute {what} {str(text)[:_MAX_ATTRIBUTE_TEXT]!r} must be 1..{_MAX_ATTRIBUTE_TEXT} "
                    "printable characters"
                )
    return dict(attributes)


@dataclass(frozen=True, kw_only=True)
class SelectionConfig:
    """The ``[strategy.selector]`` table: the parameters of the selection policies. Each policy reads its own and
    ignores the others', so one recipe can be run with another policy (``--selection uniform``) to compare.

    Attributes:
        stratify_by: ``stratified``: the client attribute whose value is a client's stratum. In simulation
            ``size`` (the dataset-size bucket of the client's partition); in deployment any attribute the daemons
            declare at join (``fedcore client start --attribute region=eu``). Clients without it form one
            stratum of their own (the empty label).
        size_buckets: ``stratified`` by ``size`` in simulation: the number of dataset-size buckets (quantiles of
            the clients' example counts), >= 1.
        candidates: ``power-of-choice``: d, the candidates sampled uniformly before the ``num`` with the highest
            last reported loss are kept; unset: ``2 * num`` (never more than are available). d = num is uniform
            selection; d = all available is pure highest-loss selection.
        exploration: ``oort``: the share of each round's selection given to clients never seen (epsilon), in
            [0, 1]; it decays by ``exploration_decay`` per round down to ``exploration_min`` (Oort's defaults
            0.9, 0.98, 0.3).
        exploration_decay: ``oort``: the factor epsilon is multiplied by each round, in (0, 1].
        exploration_min: ``oort``: the floor of epsilon, in [0, exploration].
        cutoff: ``oort``: c, the clients whose score is at least c times the score of the last one that fits are
            the exploitation pool, sampled in proportion to their scores; in (0, 1] (1: the top scores only).
        speed_penalty: ``oort``: alpha, a client whose last duration t exceeds the preferred duration T has its
            score multiplied by (T / t) ** alpha; >= 0 (0: speed is ignored).
        preferred_seconds: ``oort``: T, the preferred round duration in seconds; unset: the median of the
            candidates' last durations.
        staleness: ``oort``: the weight of the staleness bonus sqrt(staleness * ln(round) / last round seen),
            which lifts clients not selected for a while; >= 0.
    """

    stratify_by: str = SIZE_ATTRIBUTE
    size_buckets: int = 4
    candidates: int | None = None
    exploration: float = 0.9
    exploration_decay: float = 0.98
    exploration_min: float = 0.3
    cutoff: float = 0.95
    speed_penalty: float = 2.0
    preferred_seconds: float | None = None
    staleness: float = 0.1

    def __post_init__(self) -> None:
        if not self.stratify_by or len(self.stratify_by) > _MAX_ATTRIBUTE_TEXT:
            raise ConfigError(f"selector.stratify_by must name a client attribute (1..{_MAX_ATTRIBUTE_TEXT} chars)")
        if self.size_buckets < 1:
            raise ConfigError(f"selector.size_buckets must be >= 1, got {self.size_buckets}")
        if self.candidates is not None and self.candidates < 1:
            raise ConfigError(f"selector.candidates (d) must be >= 1 or unset (2 x clients), got {self.candidates}")
        if not 0 <= self.exploration <= 1:
            raise ConfigError(f"selector.exploration must be in [0, 1], got {self.exploration}")
        if not 0 < self.exploration_decay <= 1:
            raise ConfigError(f"selector.exploration_decay must be in (0, 1], got {self.exploration_decay}")
        if not 0 <= self.exploration_min <= self.exploration:
            raise ConfigError(
                f"selector.exploration_min (--exploration-min, the floor epsilon decays to; default 0.3) must be in "
                f"[0, exploration], and exploration (--exploration) is {self.exploration}: got {self.exploration_min}; "
                "give both"
            )
        if not 0 < self.cutoff <= 1:
            raise ConfigError(f"selector.cutoff must be in (0, 1], got {self.cutoff}")
        if not 0 <= self.speed_penalty < math.inf:
            raise ConfigError(f"selector.speed_penalty must be a number >= 0, got {self.speed_penalty}")
        if self.preferred_seconds is not None and not 0 < self.preferred_seconds < math.inf:
            raise ConfigError(f"selector.preferred_seconds must be > 0 seconds or unset, got {self.preferred_seconds}")
        if not 0 <= self.staleness < math.inf:
            raise ConfigError(f"selector.staleness must be a number >= 0, got {self.staleness}")


class ClientObservation(NamedTuple):
    """What one accepted update of a finished round tells the selector about its client (an immutable named tuple:
    one is made for every accepted client of every round, at a third of a frozen dataclass's cost).

    Attributes:
        client_id: the client.
        num_examples: its training examples that round (>= 0).
        loss: its reported training loss (``train_loss``), None when it reported no finite one.
        seconds: its round duration in seconds (:data:`DURATION_METRICS`), None when unknown.
    """

    client_id: str
    num_examples: int
    loss: float | None = None
    seconds: float | None = None


def observation(client_id: str, num_examples: int, metrics: Mapping[str, object]) -> ClientObservation:
    """The :class:`ClientObservation` of an accepted reply: its ``train_loss`` and duration when they are finite
    numbers (a duration also >= 0); anything else a client reports is left out (client input is not trusted)."""
    loss = _finite(metrics.get("train_loss"))
    seconds = None
    for key in DURATION_METRICS:  # a loop, not a generator: this runs for every accepted client of every round
        duration = _finite(metrics.get(key))
        if duration is not None and duration >= 0:
            seconds = duration
            break
    return ClientObservation(client_id=client_id, num_examples=int(num_examples), loss=loss, seconds=seconds)


def batch_observations(
    client_ids: Sequence[str], num_examples: np.ndarray, metrics: Mapping[str, np.ndarray]
) -> list[ClientObservation]:
    """:func:`observation` of each client of a batch given as columns (:class:`~fedcore.messages.FitBatchRes`:
    int64 ``num_examples`` and float64 metric columns, one entry per client, NaN where a client reports none), read
    a column at a time: the same observations as of each client's reply on its own."""
    count = len(client_ids)
    nothing = np.full(count, np.nan)
    loss = metrics.get("train_loss", nothing)
    seconds = nothing.copy()
    for key in reversed(DURATION_METRICS):  # the first present wins: written last
        column = metrics.get(key, nothing)
        usable = np.isfinite(column) & (column >= 0)
        seconds[usable] = column[usable]
    loss_values = np.where(np.isfinite(loss), loss, np.nan).tolist()
    return [
        ClientObservation(cid, n, None if lo != lo else lo, None if se != se else se)  # NaN: none reported
        for cid, n, lo, se in zip(client_ids, num_examples.tolist(), loss_values, seconds.tolist(), strict=True)
    ]


def _finite(value: object) -> float | None:
    if type(value) is float:  # the common case first (x - x is 0.0 exactly for a finite x, NaN otherwise)
        return value if value - value == 0.0 else None
    number = metric_value(value)  # the reading every reported metric gets (bool as 0/1, numpy scalars, ...)
    return number if number is not None and math.isfinite(number) else None


class ClientStats(NamedTuple):
    """A client's last observation, and the round it came from (:class:`Selector` keeps one per client seen; an
    immutable named tuple, made for every accepted client of every round).

    Attributes:
        num_examples: its example count in that round.
        loss: its training loss then (None: not reported).
        seconds: its duration then, in seconds (None: unknown).
        round: the round of the observation (>= 1).
    """

    num_examples: int
    loss: float | None
    seconds: float | None
    round: int


def check_private_selection(policy: str, *, client_dp: bool, trace: bool = False) -> None:
    """Refuse client-level DP with a selection that is not uniform over all clients: the accountant's privacy
    amplification by sampling assumes each client is selected with the same probability m / N each round, which a
    loss-, speed- or stratum-driven policy, or an availability trace, breaks (the epsilon reported would be wrong).

    Raises:
        ConfigError: ``client_dp`` with a policy other than uniform, or with an availability trace.
    """
    if client_dp and (policy != "uniform" or trace):
        other = f"selection {policy!r}, which chooses by other rules,"
        breaks = "an availability trace" if policy == "uniform" else other
        raise ConfigError(
            "client-level differential privacy accounts for uniform sampling of the clients (rate m / N); "
            f"{breaks} would make its epsilon wrong: use selection = 'uniform' (and no trace) with [privacy], or turn "
            "DP off"
        )


# ------------------------------------------------------------------------------------------------ pure policies
def largest_remainder(sizes: Mapping[str, int], num: int) -> dict[str, int]:
    """Split ``num`` selections over strata in proportion to their sizes (Hamilton's largest-remainder method).

    Each stratum h of size N_h (out of N) first gets floor(num * N_h / N); the selections left go one each to the
    strata with the largest fractional parts, ties broken by the larger stratum, then by label order. No stratum
    gets more than its size.

    Args:
        sizes: stratum label -> number of candidates in it (> 0).
        num: selections to split, 0 <= num <= sum of sizes.

    Returns:
        label -> selections, summing to ``num``.
    """
    total = sum(sizes.values())
    _check_num(num, total)
    if num == 0:
        return {label: 0 for label in sizes}
    quota = {label: num * size // total for label, size in sizes.items()}  # integers: exact remainders
    remainder = {label: num * size % total for label, size in sizes.items()}
    order = sorted(sizes, key=lambda label: (-remainder[label], -sizes[label], label))
    for label in order[: num - sum(quota.values())]:
        quota[label] += 1
    return quota


def stratified_sample(
    available: Sequence[str], strata: Mapping[str, str], num: int, *, seed: int, round: int, stage: str = "fit"
) -> list[str]:
    """Stratified selection: :func:`largest_remainder` allocation, then a uniform draw within each stratum with a
    generator keyed by (seed, round, stage, stratum), so each stratum's draw is independent of the others'.

    Args:
        available: the candidates.
        strata: client id -> stratum label (a client missing here is in the stratum ``""``).
        num: how many to select.

    Returns:
        The selected ids, sorted.

    Raises:
        ConfigError: ``num`` is negative or more than the clients available.
    """
    pool = sorted(available)
    _check_num(num, len(pool))
    members: dict[str, list[str]] = {}
    for cid in pool:
        members.setdefault(strata.get(cid, ""), []).append(cid)
    quota = largest_remainder({label: len(ids) for label, ids in members.items()}, num)
    chosen: list[str] = []
    for label, ids in members.items():
        rng = numpy_rng(seed, "select", "stratified", stage, round, label)
        chosen += [ids[int(i)] for i in rng.choice(len(ids), size=quota[label], replace=False)]
    return sorted(chosen)


def power_of_choice(
    available: Sequence[str],
    losses: Mapping[str, float],
    num: int,
    *,
    candidates: int | None,
    seed: int,
    round: int,
    stage: str = "fit",
) -> list[str]:
    """Power-of-choice selection (Cho, Wang and Joshi 2020), rpow-d: draw ``d`` candidates uniformly without
    replacement, keep the ``num`` with the highest loss.

    The loss is each client's last reported training loss (the paper's rpow-d: no extra exchange with the
    candidates); a client never seen counts as +inf, so it is tried before any seen one. Ties keep the order in
    which the candidates were drawn. The paper draws candidates in proportion to the clients' data fractions p_k
    and then averages the selected updates uniformly; here the draw is uniform and the strategy's weighting
    (examples, by default) weights the updates, the same expectation without knowing p_k before a client reports.

    Args:
        available: the candidates' pool.
        losses: client id -> last reported loss (finite).
        num: how many to select (m).
        candidates: d, in [num, len(available)] after clipping; None: 2 * num.

    Returns:
        The selected ids, sorted.

    Raises:
        ConfigError: ``num`` is negative or more than the clients available.
    """
    pool = sorted(available)
    _check_num(num, len(pool))
    d = min(len(pool), max(num, 2 * num if candidates is None else candidates))
    rng = numpy_rng(seed, "select", "power-of-choice", stage, round)
    drawn = [pool[int(i)] for i in rng.choice(len(pool), size=d, replace=False)]
    ranked = sorted(range(d), key=lambda k: (-losses.get(drawn[k], math.inf), k))
    return sorted(drawn[k] for k in ranked[:num])


def exploration_share(config: SelectionConfig, round: int) -> float:
    """Oort's epsilon in round ``round`` (1-based): ``max(exploration_min, exploration * decay ** (round - 1))``."""
    return max(config.exploration_min, config.exploration * config.exploration_decay ** max(0, round - 1))


def oort_scores(stats: Mapping[str, ClientStats], *, round: int, config: SelectionConfig) -> dict[str, float]:
    """Oort's score of each explored client (Lai et al. 2021, section 4, and its released selector).

    1. Statistical utility U = n * loss (the paper's |B| * sqrt(mean of squared sample losses), with the mean
       loss a client reports in place of the root mean square), min-max normalized over the clients scored
       (all 0 when they are equal); a client that reported no loss counts as the smallest utility.
    2. Plus the staleness bonus sqrt(staleness * ln(round) / r), r the round of the client's last observation.
    3. Times (T / t) ** speed_penalty when its last duration t exceeds the preferred duration T
       (``preferred_seconds``, else the median of the known durations).

    Oort clips utilities at their 95th percentile and adapts T with a pacer; neither is done here.

    Returns:
        client id -> score (>= 0).
    """
    if not stats:
        return {}
    utility = {
        cid: min(s.num_examples * s.loss, sys.float_info.max) if s.loss is not None else -math.inf
        for cid, s in stats.items()
    }
    known = [u for u in utility.values() if u != -math.inf]
    low, high = (min(known), max(known)) if known else (0.0, 0.0)
    durations = sorted(s.seconds for s in stats.values() if s.seconds is not None)
    preferred = config.preferred_seconds
    if preferred is None and durations:
        preferred = float(np.median(durations))
    scores: dict[str, float] = {}
    for cid, s in stats.items():
        u = utility[cid]
        base = 0.0 if u == -math.inf or high == low else (u - low) / (high - low)
        score = base + math.sqrt(config.staleness * math.log(max(round, 1)) / s.round)
        if preferred is not None and preferred > 0 and s.seconds is not None and s.seconds > preferred:
            score *= (preferred / s.seconds) ** config.speed_penalty
        scores[cid] = score if math.isfinite(score) else 0.0  # n * loss overflowing to inf makes (u - low) NaN
    return scores


def oort_select(
    available: Sequence[str],
    stats: Mapping[str, ClientStats],
    num: int,
    *,
    config: SelectionConfig,
    seed: int,
    round: int,
    stage: str = "fit",
) -> list[str]:
    """Oort's participant selection (Lai et al. 2021, Algorithm 1) over ``available``.

    The candidates split into explored ones (in ``stats``) and unexplored ones. Exploration takes
    ``max(floor(epsilon * num), num - explored)`` of the slots (:func:`exploration_share`), at most the number of
    unexplored candidates, drawn uniformly (Oort prefers faster unexplored clients when it knows their speed;
    here it does not). Exploitation fills the other k slots: the explored candidates are ranked by
    :func:`oort_scores`; those scoring at least ``cutoff`` times the k-th best score form the pool, from which k
    are drawn without replacement in proportion to their scores; when fewer than k score above 0 (a staleness of
    0 leaves the least useful client at 0, a large speed penalty underflows), all of those are taken and the rest
    drawn uniformly from the ones scoring 0.

    Returns:
        The selected ids, sorted.

    Raises:
        ConfigError: ``num`` is negative or more than the clients available.
    """
    pool = sorted(available)
    _check_num(num, len(pool))
    explored = [cid for cid in pool if cid in stats]
    unexplored = [cid for cid in pool if cid not in stats]
    share = exploration_share(config, round)
    explore = min(len(unexplored), max(math.floor(share * num + 1e-9), num - len(explored)))
    exploit = num - explore
    chosen: list[str] = []
    if explore:
        rng = numpy_rng(seed, "select", "oort", "explore", stage, round)
        chosen += [unexplored[int(i)] for i in rng.choice(len(unexplored), size=explore, replace=False)]
    if exploit:
        scores = oort_scores({cid: stats[cid] for cid in explored}, round=round, config=config)
        ranked = sorted(explored, key=lambda cid: (-scores[cid], cid))
        threshold = config.cutoff * scores[ranked[exploit - 1]]
        top = [cid for cid in ranked if scores[cid] >= threshold]
        rng = numpy_rng(seed, "select", "oort", "exploit", stage, round)
        positive = [cid for cid in top if scores[cid] > 0]
        if len(positive) >= exploit:
            weights = np.array([scores[cid] for cid in top], dtype=np.float64)
            chosen += [
                top[int(i)] for i in rng.choice(len(top), size=exploit, replace=False, p=weights / weights.sum())
            ]
        else:  # fewer scores above 0 than slots (staleness 0, or a speed penalty that underflows): all of those,
            # the rest drawn uniformly from the ones scoring 0
            zero = [cid for cid in top if scores[cid] <= 0]
            chosen += positive + [
                zero[int(i)] for i in rng.choice(len(zero), size=exploit - len(positive), replace=False)
            ]
    return sorted(chosen)


def size_buckets(sizes: Mapping[str, int], buckets: int) -> dict[str, str]:
    """Each client's dataset-size bucket, ``"0"`` (smallest) to ``str(buckets - 1)``: clients ranked by size
    (ties by id) and cut into ``buckets`` groups as equal as possible (the first ``N % buckets`` one larger).

    Args:
        sizes: client id -> example count.
        buckets: number of buckets, >= 1 (more than the clients: one client per bucket).
    """
    ranked = sorted(sizes, key=lambda cid: (sizes[cid], cid))
    count = min(buckets, len(ranked)) or 1
    base, extra = divmod(len(ranked), count)
    labels: dict[str, str] = {}
    start = 0
    for b in range(count):
        end = start + base + (b < extra)
        labels.update({cid: str(b) for cid in ranked[start:end]})
        start = end
    return labels


# ------------------------------------------------------------------------------------------------ the selector
class Selector:
    """A strategy's client selection: the policy, its parameters, and what it learned from finished rounds.

    Thread-safe: daemons declare their attributes from the gRPC service's threads while the round loop selects.

    Args:
        policy: one of :data:`SELECTION_NAMES`.
        config: the policies' parameters.
        attributes: client id -> attribute name -> value, known in advance (a simulation's partition sizes);
            deployment adds each daemon's at join (:meth:`declare`).
        availability: an availability trace (simulation): a client for which it answers False in a round is
            never a candidate of that round. None: every available client is a candidate.

    Raises:
        ConfigError: an unknown policy.
    """

    def __init__(
        self,
        policy: str = "uniform",
        config: SelectionConfig | None = None,
        *,
        attributes: Mapping[str, Mapping[str, str]] | None = None,
        availability: Availability | None = None,
    ) -> None:
        if policy not in SELECTION_NAMES:
            raise ConfigError(f"unknown selection {policy!r}; choose one of {', '.join(SELECTION_NAMES)}")
        self.policy = policy
        self.config = config if config is not None else SelectionConfig()
        self.availability = availability
        self._attributes = {cid: dict(values) for cid, values in (attributes or {}).items()}
        self._stats: dict[str, ClientStats] = {}
        self._lock = threading.Lock()

    def declare(self, client_id: str, attributes: Mapping[str, str]) -> None:
        """Record the attributes ``client_id`` declares (at join), replacing what it declared before."""
        with self._lock:
            self._attributes[client_id] = dict(attributes)

    def candidates(self, available: Sequence[str], *, round: int) -> list[str]:
        """The clients of ``available`` that may be selected in ``round``: those the availability trace has
        online (all of them without a trace), sorted."""
        if self.availability is None:
            return sorted(available)
        return sorted(cid for cid in available if self.availability(cid, round))

    def select(self, available: Sequence[str], num: int, *, seed: int, round: int, stage: str = "fit") -> list[str]:
        """Select ``num`` of the :meth:`candidates` among ``available`` for ``stage`` of ``round``.

        Returns:
            The selected ids, sorted.

        Raises:
            ConfigError: ``num`` is negative or more than the candidates.
        """
        pool = self.candidates(available, round=round)
        fit = not stage.startswith("evaluate")
        with self._lock:
            if self.policy == "stratified":
                key = self.config.stratify_by
                strata = {cid: self._attributes.get(cid, {}).get(key, "") for cid in pool}
                return stratified_sample(pool, strata, num, seed=seed, round=round, stage=stage)
            if self.policy == "power-of-choice" and fit:
                losses = {cid: s.loss for cid, s in self._stats.items() if s.loss is not None}
                return power_of_choice(
                    pool, losses, num, candidates=self.config.candidates, seed=seed, round=round, stage=stage
                )
            if self.policy == "oort" and fit:
                return oort_select(pool, self._stats, num, config=self.config, seed=seed, round=round, stage=stage)
        return sample_clients(pool, num, seed=seed, round=round, stage=stage)

    def observe(self, round: int, observations: Iterable[ClientObservation]) -> None:
        """Take in the feedback of finished round ``round``: each client's last loss, example count, duration.
        A value a client did not report keeps the one it reported before."""
        with self._lock:
            stats = self._stats
            for client_id, num_examples, loss, seconds in observations:
                if loss is None or seconds is None:  # what it left out now, it keeps from before
                    before = stats.get(client_id)
                    if before is not None:
                        loss = before.loss if loss is None else loss
                        seconds = before.seconds if seconds is None else seconds
                stats[client_id] = ClientStats(num_examples, loss, seconds, round)

    def restore(self, history: Iterable[tuple[int, Sequence[ClientObservation]]]) -> None:
        """Rebuild the learned state from stored rounds ``(round, observations)`` in ascending order (a restarted
        server's state database), forgetting what was learned before."""
        with self._lock:
            self._stats.clear()
        for rnd, observations in history:
            self.observe(rnd, observations)

    def stats(self) -> dict[str, ClientStats]:
        """A copy of what the selector knows of each client seen."""
        with self._lock:
            return dict(self._stats)
