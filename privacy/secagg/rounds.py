"""SecAgg+ in federated rounds: its state machines behind fedcore's round protocol, aggregator and mod seams.

:func:`secure_aggregation` turns a strategy into its securely aggregated form; the round loop knows nothing of it.
A round runs (Bell et al. 2020 on Bonawitz et al. 2017's four stages):

1. before fit, ``advertise_keys``: the server sends the round's parameters, participants, graph seed and the
   model's spec; each client answers with two X25519 public keys;
2. before fit, ``share_keys``: each client gets its neighbours' keys and answers with their encrypted shares;
3. before fit, ``collect_masked_input``: each client gets the ciphertexts addressed to it and acknowledges them;
4. the fit exchange: the ``secagg`` client mod (:class:`SecAggMod`) masks the trained update ``y - x`` with the
   round's client machine (reached through :meth:`client.stages.ClientStages.machine`), so the fit result holds
   only the masked upload (:data:`~privacy.secagg.codec.MASKED`, ``D + 1`` elements of the field's dtype: uint32
   for b = 32); the strategy's aggregator (:class:`SecAggAggregator`) hands each upload to the server machine,
   which keeps the running modular sum and never an individual upload;
5. after fit, ``unmask``: the survivors reveal the shares that remove the masks (of dropouts too); the
   aggregator's result is then the global model plus the dequantized weighted mean of the updates.

A client that drops out at any stage is recovered as the server machine allows (up to ``k - t`` of any client's
neighbours after key sharing); too many dropouts stop the round attempt, which is retried with a fresh selection.
The stochastic rounding is keyed by the run's seed (with round and client id), so a run is reproducible and the
simulation and gRPC paths give the same model bit for bit; the masks, keys and Shamir coefficients come from the
OS CSPRNG and cancel exactly.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from fedcore.aggregation import MeanAggregator
from fedcore.errors import (
    AggregationError,
    ClientTaskError,
    ConfigError,
    ProtocolError,
    RoundFailed,
    UpdateRejected,
)
from fedcore.messages import DP_NOISE_WORDS, FitIns, FitRes, ModSpec, StageIns, StageRes, bound_text
from fedcore.mods import CallNext, ModContext
from fedcore.stages import Exchange, Phase
from fedcore.strategy import Strategy
from fedcore.tensors import NamedArrays, TensorSpec, check_finite
from privacy.dp.ddgauss import CLIPPING_SETTING, COUNT_TENSOR, count_share, discrete_gaussian, integer_noise_stddev
from privacy.dp.mechanism import clip_update
from privacy.secagg import codec
from privacy.secagg.client import SecAggClient
from privacy.secagg.config import RoundParams, SecAggConfig, weak_points
from privacy.secagg.messages import (
    AdvertiseKeysIns,
    MaskedInputIns,
    MaskedInputRes,
    ServerMessage,
    ShareKeysIns,
    Stage,
)
from privacy.secagg.quantize import check_quantizable
from privacy.secagg.server import SecAggServer

log = logging.getLogger("fedcore.privacy")
MOD = "secagg"
"""The client mod's name (:class:`SecAggMod`)."""


def _seed_bytes(seed: int, *keys: int | str) -> bytes:
    return hashlib.sha256("/".join(["secagg", str(int(seed)), *(str(k) for k in keys)]).encode()).digest()


# -- server ---------------------------------------------------------------------------------------------------------


@dataclass(eq=False)
class SecAggAccumulator:
    """One round's secure sum: masked uploads go to the round's :class:`~privacy.secagg.server.SecAggServer`.

    Attributes:
        spec: the model's tensors (all floating).
        round: the round.
        reference: the global model the clients started from; the result is it plus the mean update.
        server: the round's server machine, set when the protocol starts the round.
        settings: round settings announced to the clients with the keys (stage 1; distributed DP's adaptive
            clipping norm, :mod:`privacy.dp.secure`), set before the protocol starts the round.
    """

    spec: tuple[TensorSpec, ...]
    round: int
    reference: Mapping[str, np.ndarray]
    server: SecAggServer | None = None
    settings: dict[str, float] = field(default_factory=dict)
    _count: int = 0

    @property
    def count(self) -> int:
        """Masked uploads taken so far."""
        return self._count

    def add(
        self, update: Mapping[str, np.ndarray], weight: float, *, client_id: str | None = None, round: int | None = None
    ) -> None:
        """Hand one masked upload (``{MASKED: vector}``) to the server machine. ``weight`` is not used: the client
        folded its integer weight into the upload, and the total weight comes out of the unmasked sum.

        Raises:
            UpdateRejected: anything else than one masked upload of the round's length and dtype, a second one
                from the client, or one from a client that is not in the round's masked-input stage.
        """
        if self.server is None or client_id is None:
            raise UpdateRejected("secure aggregation: a masked upload arrived outside a secure round", round=self.round)
        if set(update) != {codec.MASKED}:
            raise UpdateRejected(
                f"secure aggregation: the fit result must hold only the masked upload {codec.MASKED!r}; was the "
                "client started without the secagg mod?",
                round=self.round,
                client_id=client_id,
            )
        reply = MaskedInputRes(round=self.round, client_id=client_id, masked=np.asarray(update[codec.MASKED]))
        self.server.receive(reply)
        self._count += 1

    def result(self, *, release: bool = False) -> NamedArrays:
        """``reference + Σ w_k·Δ_k / Σ w_k`` over the survivors, computed in float64, in the spec's dtypes.

        Raises:
            RoundFailed: the unmask stage has not completed.
            AggregationError: the survivors' weights sum to 0.
        """
        if self.server is None:
            raise AggregationError("secure aggregation: the round protocol never started", round=self.round)
        outcome = self.server.result
        if outcome.total_weight <= 0:
            raise AggregationError("secure aggregation: the survivors' weights sum to 0", round=self.round)
        total = outcome.total_weight
        return {
            s.name: (
                np.asarray(self.reference[s.name], dtype=np.float64) + outcome.weighted_sum[s.name] / total
            ).astype(s.dtype)
            for s in self.spec
        }


@dataclass(eq=False)
class _Link:
    """The round's accumulator, started by the aggregator and joined by the protocol."""

    accumulator: SecAggAccumulator | None = None


@dataclass(frozen=True, eq=False)
class SecAggAggregator:
    """The aggregator of a securely aggregated strategy (made by :class:`SecureAggregation`, not by hand)."""

    config: SecAggConfig
    link: _Link

    @property
    def name(self) -> str:
        """``"secagg"``."""
        return MOD

    def check(self, num_clients: int) -> None:
        """Refuse a round of ``num_clients`` that SecAgg+ cannot run (graph, threshold, bit budget).

        Raises:
            ConfigError: what :meth:`SecAggConfig.resolve` refuses.
        """
        self.config.check(num_clients)

    def preflight(self, smallest: int, spec: Sequence[TensorSpec] | None) -> None:
        """Refuse before the first round a graph, threshold or bit budget that a round of ``smallest`` clients (the
        strategy's min_fit_clients, the fewest a round selects) cannot run (:class:`server.round_loop.Preflighted`).

        Raises:
            ConfigError: what :meth:`SecAggConfig.resolve` refuses, and that rounds may be that small. Settings
                that run but protect less are logged (:func:`~privacy.secagg.config.weak_points`).
        """
        try:
            params = self.config.resolve(smallest)
        except ConfigError as exc:
            raise ConfigError(
                f"{exc.message} (a round may select as few as min_fit_clients = {smallest}); raise "
                "--min-fit-clients or change the secure aggregation settings"
            ) from None
        for warning in weak_points(params):
            log.warning("%s", warning)

    def start(
        self, spec: Sequence[TensorSpec], *, round: int, reference: Mapping[str, np.ndarray] | None = None
    ) -> SecAggAccumulator:
        """The round's accumulator; the protocol joins it when it starts the round.

        Raises:
            ConfigError: a non-floating tensor in ``spec``, or no ``reference``.
        """
        check_quantizable(spec)
        if reference is None:
            raise ConfigError("secure aggregation needs the global model as the reference of the clients' updates")
        accumulator = SecAggAccumulator(spec=tuple(spec), round=round, reference=reference)
        self.link.accumulator = accumulator
        return accumulator


@dataclass(eq=False)
class SecAggStages:
    """The server side of one round attempt, as fedcore's :class:`~fedcore.stages.ServerStages`."""

    server: SecAggServer
    rounding_seed: bytes
    deadline_s: float | None
    minimum_inputs: int = 0
    settings: Mapping[str, float] = field(default_factory=dict)
    _outbox: Mapping[str, ServerMessage] = field(default_factory=dict)
    _sent: set[str] = field(default_factory=set)

    def next_exchange(self, phase: Phase) -> Exchange | None:
        """advertise, share, deliver the shares (before fit); unmask (after fit); see the module docstring."""
        stage = self.server.stage
        if phase is Phase.BEFORE_FIT:
            if not self._sent:
                self._outbox, name = self.server.start(), Stage.ADVERTISE_KEYS.value
            elif stage is Stage.SHARE_KEYS and stage.value not in self._sent:
                name = stage.value
            elif stage is Stage.COLLECT_MASKED_INPUT and codec.DELIVER_SHARES not in self._sent:
                name = codec.DELIVER_SHARES
            else:
                return None
        elif stage is Stage.UNMASK and stage.value not in self._sent:
            name = stage.value
        else:
            return None
        self._sent.add(name)
        encoded: dict[int, StageIns] = {}  # stage 1 sends one message to everyone: encode it once
        instructions = {}
        for cid, message in self._outbox.items():
            if id(message) not in encoded:
                encoded[id(message)] = codec.server_stage(
                    message, attempt=self.server.attempt, rounding_seed=self.rounding_seed, settings=self.settings
                )
            instructions[cid] = encoded[id(message)]
        return Exchange(name=name, instructions=instructions, deadline_s=self.deadline_s)

    def receive(self, stage: str, replies: Mapping[str, StageRes], dropped: Mapping[str, str]) -> Mapping[str, str]:
        """Hand the replies to the server machine (those it refuses are returned), then close the stage (the
        acknowledgements of the shares' delivery close nothing: the masked inputs come with the fit exchange).

        Raises:
            RoundFailed: too few clients or neighbours remain.
        """
        refused: dict[str, str] = {}
        for cid, reply in replies.items():
            try:
                message = codec.read_client_stage(reply)
                if message is not None:
                    self.server.receive(message)
            except (ProtocolError, UpdateRejected) as exc:
                refused[cid] = bound_text(exc.message, 300)
        if stage != codec.DELIVER_SHARES:
            self._outbox = self.server.advance()
        return refused

    def fit_done(self, accepted: Sequence[str], dropped: Mapping[str, str]) -> None:
        """Close the masked-input stage: whoever's upload the aggregator took survived.

        Raises:
            RoundFailed: too few survivors (fewer than ``minimum_inputs``: nothing is unmasked), or a client left
                with fewer than ``t`` surviving neighbours.
        """
        if len(accepted) < self.minimum_inputs:
            self.server.abort(
                f"only {len(accepted)} masked inputs arrived but the round needs {self.minimum_inputs} (distributed "
                "DP: fewer noise shares than accounted); nothing is unmasked"
            )
        self._outbox = self.server.advance()


@dataclass(eq=False)
class SecureAggregation:
    """SecAgg+ as a :class:`~fedcore.stages.RoundProtocol`, with its paired :attr:`aggregator`.

    Attributes:
        config: the SecAgg+ parameters, resolved for each round's selection.
        deadline_s: seconds each stage waits for its replies; None: ``config.stage_deadline_s``, and when that is
            unset too, the round's deadline.
        minimum_inputs: the fewest masked inputs a round may unmask (distributed DP's ``n_min``); with fewer
            after the fit exchange the attempt fails before any share is asked for.
    """

    config: SecAggConfig
    deadline_s: float | None = None
    minimum_inputs: int = 0
    link: _Link = field(default_factory=_Link)
    name: str = codec.PROTOCOL

    @property
    def aggregator(self) -> SecAggAggregator:
        """The aggregator whose accumulator this protocol's rounds feed."""
        return SecAggAggregator(self.config, self.link)

    def check(self, num_clients: int) -> None:
        """As :meth:`SecAggAggregator.check`."""
        self.config.check(num_clients)

    def start(self, *, round: int, attempt: int, clients: Sequence[str], seed: int) -> SecAggStages:
        """The server machine of ``round``'s ``attempt``, joined to the accumulator the aggregator started for it;
        the graph seed and the rounding seed are derived from the run's ``seed``.

        Raises:
            RoundFailed: the round's accumulator was not started by this protocol's aggregator.
            ConfigError: what :class:`~privacy.secagg.server.SecAggServer` refuses (client ids, parameters).
        """
        accumulator = self.link.accumulator
        if accumulator is None or accumulator.round != round or accumulator.server is not None:
            raise RoundFailed(
                "secure aggregation: the strategy's aggregator is not this protocol's, or was not started for the "
                "round; build the strategy with privacy.secagg.rounds.secure_aggregation",
                round=round,
            )
        accumulator.server = SecAggServer(
            self.config,
            round=round,
            attempt=attempt,
            clients=clients,
            spec=accumulator.spec,
            graph_seed=_seed_bytes(seed, "graph", round, attempt),
        )
        deadline = self.deadline_s if self.deadline_s is not None else self.config.stage_deadline_s
        return SecAggStages(
            server=accumulator.server,
            rounding_seed=_seed_bytes(seed, "rounding"),
            deadline_s=deadline,
            minimum_inputs=self.minimum_inputs,
            settings=dict(accumulator.settings),
        )


def secure_aggregation(strategy: Strategy, config: SecAggConfig, *, deadline_s: float | None = None) -> Strategy:
    """``strategy`` with its updates securely aggregated: the SecAgg+ protocol, its aggregator, and the ``secagg``
    client mod (outermost, so it masks what the other mods return). ``deadline_s`` overrides
    ``config.stage_deadline_s`` (seconds each protocol stage waits for its replies).

    Raises:
        ConfigError: the strategy carries tensor groups (they would travel in plain), another round protocol, or
            an aggregator other than the mean (robust rules need the individual updates the server must not see).
    """
    if strategy.groups:
        raise ConfigError(
            f"secure aggregation cannot protect the tensor groups of strategy {strategy.name!r} "
            f"({', '.join(strategy.groups)}); use it with fedavg, fedprox or the adaptive optimizers"
        )
    if strategy.protocol is not None:
        raise ConfigError(f"strategy {strategy.name!r} already runs the round protocol {strategy.protocol.name!r}")
    if not isinstance(strategy.aggregator, MeanAggregator):
        raise ConfigError(
            f"secure aggregation sums the updates; the {strategy.aggregator.name!r} aggregator needs each update "
            "in plain. Use aggregator = 'mean'"
        )
    protocol = SecureAggregation(config, deadline_s=deadline_s)
    return replace(
        strategy,
        aggregator=protocol.aggregator,
        protocol=protocol,
        mods=(ModSpec(MOD, {"weighting": strategy.weighting}), *strategy.mods),
    )


# -- client ---------------------------------------------------------------------------------------------------------


class SecAggClientMachine:
    """One client's SecAgg+ round as fedcore's :class:`~fedcore.stages.ClientStageMachine`; the ``secagg`` mod
    masks the trained update with it (:meth:`mask`)."""

    def __init__(self, client_id: str) -> None:
        self.client_id = client_id
        self._client: SecAggClient | None = None
        self.spec: tuple[TensorSpec, ...] = ()
        self.settings: dict[str, float] = {}
        self.ready = False

    def handle(self, instruction: StageIns) -> StageRes:
        """Answer one stage (see the module docstring).

        Raises:
            ProtocolError: a malformed message, or one the SecAgg+ client refuses.
        """
        message, rounding_seed = codec.read_server_stage(instruction)
        if isinstance(message, AdvertiseKeysIns):
            if self._client is not None:
                raise ProtocolError("secure aggregation: the round's keys were advertised already")
            try:
                self._client = SecAggClient(self.client_id, rounding_seed=rounding_seed)
            except ConfigError as exc:
                raise ProtocolError(exc.message) from None
            reply = self._client.advertise_keys(message)
            self.spec = message.spec
            self.settings = codec.read_settings(instruction)
            return codec.client_stage(reply, instruction, self.client_id)
        client = self._started()
        if isinstance(message, MaskedInputIns):
            client.receive_shares(message)
            self.ready = True
            return codec.client_stage(None, instruction, self.client_id)
        if isinstance(message, ShareKeysIns):
            return codec.client_stage(client.share_keys(message), instruction, self.client_id)
        return codec.client_stage(client.unmask(message), instruction, self.client_id)

    @property
    def params(self) -> RoundParams:
        """The round's parameters (after the keys were advertised).

        Raises:
            ProtocolError: the round has not started.
        """
        return self._started()._state()[0]

    def mask(self, update: Mapping[str, np.ndarray], weight: int, noise: np.ndarray | None = None) -> np.ndarray:
        """The masked upload of ``update`` (the round's spec) with integer ``weight`` folded in and the integer
        ``noise`` added (:meth:`privacy.secagg.client.SecAggClient.mask`).

        Raises:
            ProtocolError: the shares have not arrived, or the update was masked already.
            PayloadError, NonFiniteError, ConfigError: the update, weight or noise cannot be used.
        """
        return self._started().mask(update, weight, noise).masked

    def _started(self) -> SecAggClient:
        if self._client is None:
            raise ProtocolError("secure aggregation: a stage arrived before the round's keys were advertised")
        return self._client


@dataclass(frozen=True)
class SecAggClientProtocol:
    """The client side of :class:`SecureAggregation` (registered by :mod:`client.stages` for its name)."""

    name: str = codec.PROTOCOL

    def start(self, *, round: int, attempt: int, client_id: str) -> SecAggClientMachine:
        """A fresh machine for ``client_id`` in ``round``'s ``attempt``."""
        return SecAggClientMachine(client_id)


CLIENT_PROTOCOL = SecAggClientProtocol()


@dataclass(frozen=True)
class SecAggMod:
    """The ``secagg`` client mod: trains, then replaces the fit result's parameters with the masked upload of the
    update ``y - x`` (trained minus global model) with the client's weight folded in, so the plain update never
    leaves the client.

    Args:
        weighting: ``"examples"`` (the weight is the example count, at most the config's ``max_weight``) or
            ``"uniform"`` (weight 1), as the strategy's.
        clipping_norm: distributed DP (:mod:`privacy.dp.ddgauss`): C > 0 clips the update to L2 norm C before it
            is quantized; 0: no DP.
        noise_multiplier: distributed DP: this client's share ``z / sqrt(n_min)`` of the update's noise multiplier
            (``z_delta / sqrt(n_min)`` with adaptive clipping); the discrete Gaussian noise of ``noise_multiplier *
            Delta`` field units is added after quantization (:func:`~privacy.dp.ddgauss.integer_noise_stddev`),
            drawn from the OS's entropy. Needs ``clipping_norm > 0`` and weighting ``"uniform"``.
        count_scale: adaptive clipping under secure aggregation (:mod:`privacy.dp.secure`): S >= 1, the field
            units of one unclipped update on the count coordinate (:func:`~privacy.dp.ddgauss.count_scale`); the
            round's clipping norm then comes with the keys (the ``dp_clipping_norm`` setting) and
            ``clipping_norm`` is not used; 0: no count.
        count_noise: with ``count_scale``: this client's discrete Gaussian sigma on the count coordinate, in field
            units (``S sigma_b / sqrt(n_min)``), > 0.

    Raises (from the call):
        ClientTaskError: this client holds no SecAgg+ state for the round (the key stages did not reach it), or an
            adaptive round whose spec or clipping norm is missing or malformed.
        ProtocolError, ConfigError, PayloadError: the update cannot be masked (e.g. more examples than
            ``max_weight``).
    """

    weighting: str = "examples"
    clipping_norm: float = 0.0
    noise_multiplier: float = 0.0
    count_scale: int = 0
    count_noise: float = 0.0

    def __post_init__(self) -> None:
        if self.weighting not in ("examples", "uniform"):
            raise ConfigError(f"weighting must be 'examples' or 'uniform', got {bound_text(str(self.weighting), 40)!r}")
        for name in ("clipping_norm", "noise_multiplier", "count_noise"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not (math.isfinite(value) and value >= 0)
            ):
                raise ConfigError(f"{name} must be a finite number >= 0, got {bound_text(repr(value), 40)}")
        if isinstance(self.count_scale, bool) or not isinstance(self.count_scale, int) or self.count_scale < 0:
            raise ConfigError(f"count_scale must be an integer >= 0, got {bound_text(repr(self.count_scale), 40)}")
        if self.noise_multiplier and not (self.clipping_norm and self.weighting == "uniform"):
            raise ConfigError("distributed DP noise needs clipping_norm > 0 and weighting 'uniform'")
        if self.count_scale and not (self.noise_multiplier and self.count_noise > 0):
            raise ConfigError("the clipped count (adaptive clipping) needs noise_multiplier > 0 and count_noise > 0")

    def __call__(self, instruction: FitIns, context: ModContext, call_next: CallNext) -> FitRes:
        """Train with ``call_next``, then mask; see the class docstring."""
        stages = context.stages
        machine = stages.machine(instruction.round, context.client_id, codec.PROTOCOL) if stages is not None else None
        if not isinstance(machine, SecAggClientMachine) or not machine.ready:
            raise ClientTaskError(
                "secure aggregation: this client holds no keys and shares for the round (its key stages did not "
                "reach it); it cannot send its update",
                round=instruction.round,
                client_id=context.client_id,
                stage="fit",
            )
        spec, clipping_norm = self._round_spec(machine, instruction, context)
        reply = call_next(instruction)
        weight = reply.num_examples if self.weighting == "examples" else 1
        try:
            delta = {
                s.name: np.asarray(reply.parameters[s.name], dtype=np.float64)
                - np.asarray(instruction.parameters[s.name], dtype=np.float64)
                for s in spec
            }
        except KeyError as exc:
            raise ClientTaskError(
                f"secure aggregation: the trained model lacks tensor {bound_text(str(exc), 80)}",
                round=instruction.round,
                client_id=context.client_id,
            ) from None
        if self.noise_multiplier and instruction.round > 1:  # before the clip, which would spread a NaN
            check_finite(
                delta,
                round=instruction.round,
                client_id=context.client_id,
                advice=self._nonfinite_advice(machine.params, clipping_norm, sum(a.size for a in delta.values())),
            )
        noise = None
        norm = 0.0
        if clipping_norm:
            delta, norm = clip_update(delta, clipping_norm)
        update = {s.name: delta[s.name].astype(s.dtype) for s in spec}
        if self.noise_multiplier:
            params = machine.params
            size = sum(a.size for a in delta.values())
            sigma = integer_noise_stddev(self.noise_multiplier, clipping_norm, params.clip, params.levels, size)
            rng = np.random.default_rng()  # OS entropy, never the run's seed
            noise = discrete_gaussian(size, sigma, rng)
            if self.count_scale:
                # the count coordinate quantizes -clip to exactly 0 and carries S b_i + g_i in the added integers
                update[COUNT_TENSOR] = np.full(1, -params.clip, dtype=np.float64)
                count = count_share(norm <= clipping_norm, self.count_scale, self.count_noise, rng)
                noise = np.concatenate([noise, count])
        masked = machine.mask(update, weight, noise)
        return replace(reply, parameters={codec.MASKED: masked})

    def _nonfinite_advice(self, params: RoundParams, clipping_norm: float, size: int) -> str:
        """What a non-finite update means under distributed DP (from round 2): the global model it was trained from
        carries the noise of the shares of the rounds before; each client's share has standard deviation ``s`` (in
        update units), so the average of ``n`` clients' updates carries ``s / sqrt(n)`` per coordinate."""
        share = integer_noise_stddev(self.noise_multiplier, clipping_norm, params.clip, params.levels, size)
        s = share * params.step
        return (
            f"the update is not sent. The global model it was trained from {DP_NOISE_WORDS}: each "
            f"client's share has standard deviation {s:.3g} per coordinate (noise multiplier share "
            f"{self.noise_multiplier:.3g} times clipping norm {clipping_norm:g}, plus the field's rounding), so a "
            f"round of n clients adds {s:.3g} / sqrt(n). If many clients' updates are not finite, that noise is too "
            "large for this model: select more clients a round (--min-fit-clients, --fraction-fit), or lower "
            "--clipping-norm or --noise-multiplier (epsilon rises with a lower noise multiplier). Otherwise check "
            "the client's learning rate and input data."
        )

    def _round_spec(
        self, machine: SecAggClientMachine, instruction: FitIns, context: ModContext
    ) -> tuple[tuple[TensorSpec, ...], float]:
        """The model's tensors of the round's spec and the clipping norm the round clips with."""
        if not self.count_scale:
            return machine.spec, self.clipping_norm
        spec = machine.spec
        norm = machine.settings.get(CLIPPING_SETTING, math.nan)
        if not spec or spec[-1] != TensorSpec(COUNT_TENSOR, (1,), "float64") or not (math.isfinite(norm) and norm > 0):
            raise ClientTaskError(
                "secure aggregation with adaptive clipping: the round's keys did not announce a clipping norm > 0 "
                f"and the {COUNT_TENSOR!r} coordinate; is the server's privacy configuration the same as this mod's?",
                round=instruction.round,
                client_id=context.client_id,
            )
        return spec[:-1], norm
