"""The server's settings: :class:`ServerConfig`, nested in its parts (``[round]``, ``[pool]``, ``[tls]``,
``[auth]``, ``[strategy]``, ``[sampling]``, ``[train]``), and the one check of all of them before the server
listens (:func:`check_server_config`).

Each part validates its own values when it is built (the round loop's, the pool's and the service's own configs
are built from it then, so their checks run too); :func:`check_server_config` then opens everything the settings
name on disk (TLS files, tokens file, initial model, the task factory, the state directory's place) so that a
bad value of any kind is a :class:`~fedcore.errors.ConfigError` before the state directory is created or a port
is bound. A TOML file and the command line (:mod:`fedcore.options`) share these keys.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedcore.config import (
    Address,
    apply_overrides,
    check_creatable_dir,
    check_port,
    from_mapping,
    load_toml,
    merge_mappings,
    parse_address,
    parse_host,
)
from fedcore.convergence import StopRules
from fedcore.errors import ConfigError, PayloadError
from fedcore.payload import DEFAULT_CHUNK_BYTES
from fedcore.selection import check_private_selection
from fedcore.strategy import SamplingConfig, StrategyConfig, build_strategy
from fedcore.task import FitConfig
from privacy.dp.config import PrivacyConfig, apply_dp
from server.grpc_pool import PoolConfig
from server.limits import ServiceLimits
from server.metrics import DEFAULT_METRICS_ADDRESS
from server.round_loop import RoundConfig

log = logging.getLogger("fedcore.server")


MAX_ROUNDS = 1_000_000
"""The most rounds a server run may ask for, as a simulation (a run of a round a second would take 11 days)."""


@dataclass(frozen=True, kw_only=True)
class RoundSettings:
    """The ``[round]`` table: how many rounds, and how patient each is (see :class:`server.round_loop.RoundConfig`).

    Attributes:
        rounds: number of federated rounds.
        evaluate: evaluate the global model with the server's task (its held-out data) after rounds.
        evaluate_every: evaluate the global model every this many rounds.
        round_timeout_s: round deadline in seconds: close with the results in hand if the quorum reported.
        wait_for_clients_s: how long to wait for enough clients before a round, in seconds.
        min_fit_results: quorum: accepted updates a round needs.
        max_round_attempts: selections tried per round before the run fails.
        target_accuracy: stop after the first evaluated round whose accuracy (the server's evaluation, else the
            clients') reaches this value, in (0, 1]; the run reports the rounds and seconds it took.
        patience: stop after this many evaluated rounds in a row without a gain of more than min_delta in accuracy.
        min_delta: the smallest gain in accuracy that counts as one for patience.
    """

    rounds: int = 10
    evaluate: bool = True
    evaluate_every: int = 1
    round_timeout_s: float | None = 600.0
    wait_for_clients_s: float = 300.0
    min_fit_results: int = 1
    max_round_attempts: int = 3
    target_accuracy: float | None = None
    patience: int | None = None
    min_delta: float = 0.0

    def __post_init__(self) -> None:
        if not 1 <= self.rounds <= MAX_ROUNDS:  # named as the file and the flag name it (the loop's num_rounds)
            raise ConfigError(f"rounds (--rounds) must be in 1..{MAX_ROUNDS:,}, got {self.rounds}")
        self.round_config(seed=0)  # the round loop's own checks, now

    def round_config(self, *, seed: int) -> RoundConfig:
        """The round loop's settings for a run of seed ``seed``."""
        return RoundConfig(
            num_rounds=self.rounds,
            seed=seed,
            round_timeout_s=self.round_timeout_s,
            wait_for_clients_s=self.wait_for_clients_s,
            min_fit_results=self.min_fit_results,
            max_round_attempts=self.max_round_attempts,
            evaluate_every=self.evaluate_every,
            stop=StopRules(target_accuracy=self.target_accuracy, patience=self.patience, min_delta=self.min_delta),
        )


MAX_WORKERS = 100_000
"""The most gRPC server threads ``--max-workers`` may ask for (90,000 daemons; 35 GiB of thread memory)."""


@dataclass(frozen=True, kw_only=True)
class PoolSettings:
    """The ``[pool]`` table: the client pool, the gRPC threads and the per-call limits (see
    :class:`server.grpc_pool.PoolConfig` and :class:`server.limits.ServiceLimits`).

    Attributes:
        heartbeat_interval_s: how often clients send heartbeats, in seconds.
        liveness_timeout_s: a client silent this long (seconds) is dropped and its task failed.
        max_payload_bytes: largest update accepted from a client, in bytes.
        chunk_bytes: payload chunk size on the wire, in bytes.
        max_workers: gRPC server threads: about 1.1x the number of daemons + 40 (default 1200 holds 1,000
            daemons); each daemon's waiting long-poll holds one, a tenth (at least 40) are kept for heartbeats.
        max_calls_per_client: calls one client may have in progress at once (a daemon uses up to 3).
        max_unauthenticated_calls: joins being read or checked at once; more are refused and retried.
        stream_idle_s: cut off a request, upload or download that makes no progress this long (seconds).
        stream_total_s: cut off an upload or download that takes longer than this (seconds).
    """

    heartbeat_interval_s: float = 5.0
    liveness_timeout_s: float = 15.0
    max_payload_bytes: int = 8 << 30
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    max_workers: int = 1200
    max_calls_per_client: int = 4
    max_unauthenticated_calls: int = 32
    stream_idle_s: float = 60.0
    stream_total_s: float = 1800.0

    def __post_init__(self) -> None:
        if self.max_workers < 8:
            raise ConfigError(f"max_workers must be >= 8, got {self.max_workers}")
        if self.max_workers > MAX_WORKERS:
            raise ConfigError(
                f"max_workers must be <= {MAX_WORKERS:,} (about 1.1x the daemons + 40; each waiting long-poll holds "
                f"a thread of about 0.35 MiB), got {self.max_workers}"
            )
        self.pool_config(spill_dir=Path("spill"), seed=0)  # the pool's and the service's own checks, now
        self.service_limits()

    def pool_config(self, *, spill_dir: Path, seed: int) -> PoolConfig:
        """The gRPC pool's settings, spilling updates under ``spill_dir``."""
        return PoolConfig(
            spill_dir=spill_dir,
            seed=seed,
            heartbeat_interval_s=self.heartbeat_interval_s,
            liveness_timeout_s=self.liveness_timeout_s,
            max_payload_bytes=self.max_payload_bytes,
            chunk_bytes=self.chunk_bytes,
            max_calls_per_client=self.max_calls_per_client,
        )

    def service_limits(self) -> ServiceLimits:
        """The service's per-call limits."""
        return ServiceLimits(
            max_unauthenticated_calls=self.max_unauthenticated_calls,
            stream_idle_s=self.stream_idle_s,
            stream_total_s=self.stream_total_s,
        )


@dataclass(frozen=True, kw_only=True)
class TlsSettings:
    """The ``[tls]`` table: transport security.

    Attributes:
        insecure: plaintext gRPC, no TLS (prints a warning); for tests and trusted networks only.
        cert: server certificate chain (PEM); required unless ``insecure``.
        key: server private key (PEM); required unless ``insecure``.
        client_ca: CA certificate (PEM) that signs client certificates: turns on mutual TLS (a certificate's common
            name must equal its client id).
    """

    insecure: bool = False
    cert: Path | None = None
    key: Path | None = None
    client_ca: Path | None = None

    def __post_init__(self) -> None:
        if self.insecure:
            given = [flag for flag, v in (("--tls-cert", self.cert), ("--tls-key", self.key),
                                          ("--client-ca", self.client_ca)) if v is not None]  # fmt: skip
            if given:
                raise ConfigError(
                    f"{', '.join(given)} cannot be combined with --insecure (plaintext): leave out --insecure to "
                    "serve TLS, or the TLS files to serve plaintext"
                )
        elif (self.cert is None) != (self.key is None):
            present, missing = ("--tls-cert", "--tls-key") if self.key is None else ("--tls-key", "--tls-cert")
            raise ConfigError(
                f"{present} was given without {missing}: TLS needs both the server's certificate (--tls-cert) and its "
                "private key (--tls-key), as `fedcore certs init` writes them (server.pem, server.key)"
            )
        elif self.cert is None or self.key is None:
            raise ConfigError(
                "TLS is on by default: give --tls-cert and --tls-key (make them with `fedcore certs init`), "
                "or pass --insecure for plaintext on a trusted network"
            )


@dataclass(frozen=True, kw_only=True)
class AuthSettings:
    """The ``[auth]`` table: who may join.

    Attributes:
        tokens_file: file of 'client_id token' lines: only these clients may join, each with its token.
        revoked: client ids refused at join (the flag is repeatable).
    """

    tokens_file: Path | None = None
    revoked: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for client_id in self.revoked:
            if not client_id:
                raise ConfigError("an empty client id cannot be revoked; give the id to refuse (--revoke ID)")


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """Everything ``fedcore server start`` needs: a TOML file with these keys and tables, each field also a flag
    (:mod:`fedcore.options`; e.g. ``[round] rounds`` is ``--rounds``).

    Attributes:
        address: HOST:PORT to listen on ([::]:8443 for IPv6; default 0.0.0.0:8443); port 0 lets the OS pick one,
            and the 'listening on' line says which.
        state_dir: SQLite state, checkpoints, history.csv and spill files; restarting on it resumes the run.
        task: task factory module:attr: the initial model and server-side evaluation (e.g.
            simulations.tasks:demo_task).
        task_options: string options for the task factory (the demo task: dataset, partition, model, ...).
        data_dir: data directory handed to the server-side task (its held-out data).
        initial: start from this safetensors model instead of the task's freshly initialized one.
        seed: run seed: client selection and every client's randomness derive from it.
        metrics_port: serve Prometheus metrics on this port (0: the OS picks one, printed at start; unset: off).
        metrics_address: interface for the metrics endpoint (default 127.0.0.1; 0.0.0.0 for remote scraping).
        linger_s: keep serving this long (seconds) after the last round so that clients learn the run is over.
        round: rounds and their deadlines (:class:`RoundSettings`).
        pool: client pool, threads and per-call limits (:class:`PoolSettings`).
        tls: transport security (:class:`TlsSettings`).
        auth: who may join (:class:`AuthSettings`).
        strategy: the strategy and its server-side hyper-parameters.
        sampling: client selection.
        train: local training settings sent to the clients.
        privacy: differential privacy (:class:`privacy.dp.config.PrivacyConfig`; off by default; client-level DP
            on a server needs privacy.population, the number of clients rounds sample from).
    """

    address: str = "0.0.0.0:8443"
    state_dir: Path = Path("fedcore-state")
    task: str | None = None
    task_options: Mapping[str, str] = field(default_factory=dict)
    data_dir: Path | None = None
    initial: Path | None = None
    seed: int = 0
    metrics_port: int | None = None
    metrics_address: str = DEFAULT_METRICS_ADDRESS
    linger_s: float = 5.0
    round: RoundSettings = field(default_factory=RoundSettings)
    pool: PoolSettings = field(default_factory=PoolSettings)
    tls: TlsSettings = field(default_factory=TlsSettings)
    auth: AuthSettings = field(default_factory=AuthSettings)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(fraction_fit=1.0, min_fit_clients=2))
    train: FitConfig = field(default_factory=FitConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)

    def __post_init__(self) -> None:
        check_private_selection(self.strategy.selection, client_dp=self.privacy.enabled)
        if self.privacy.enabled or self.privacy.dp_sgd:  # refused here, before the state directory is touched
            apply_dp(build_strategy(self.strategy, self.train, self.sampling), self.privacy)
        if self.task is None and self.initial is None:
            raise ConfigError("give the server a task (--task module:attr) or an initial model (--initial FILE)")
        self.round.round_config(seed=self.seed).stop.check_measurable(
            evaluated=(self.round.evaluate and self.task is not None) or self.sampling.fraction_evaluate > 0,
            remedy="evaluate on the server (a --task with held-out data, without --no-evaluate) or on the clients "
            "(sampling.fraction_evaluate > 0, --fraction-evaluate)",
        )
        if self.strategy.weighting == "server" and self.task is None:
            raise ConfigError(
                "weighting 'server' weighs each update by the server's evaluation of it on held-out data: give the "
                "server a task whose evaluate has such data (--task module:attr), or choose another weighting"
            )
        parse_address(self.address, what="address (--address)", allow_port_zero=True)
        parse_host(self.metrics_address, what="metrics_address (--metrics-address)")
        if self.metrics_port is not None:
            check_port(self.metrics_port, what="metrics_port (--metrics-port)", allow_zero=True)
            if self.metrics_port != 0 and self.metrics_port == self.listen_address.port:
                raise ConfigError(
                    f"metrics_port (--metrics-port) {self.metrics_port} is the port the server listens on "
                    "(--address); give the metrics another port (0 picks a free one)"
                )
        if not 0 <= self.linger_s < math.inf:  # NaN slept into a ValueError after the last round, inf forever
            raise ConfigError(f"linger_s must be a number of seconds >= 0, got {self.linger_s}")

    @property
    def listen_address(self) -> Address:
        """``address`` parsed (checked when the config was built)."""
        return parse_address(self.address, what="address (--address)", allow_port_zero=True)

    def round_config(self) -> RoundConfig:
        """The round loop's settings."""
        return self.round.round_config(seed=self.seed)


def check_server_config(config: ServerConfig) -> None:
    """Check what the settings name outside themselves, before anything is created or bound: the state
    directory's place, the initial model and data directory, the task factory (importable), the tokens file and
    the TLS material (loaded and checked as the server will use them).

    Raises:
        ConfigError: a path that does not exist or is of the wrong kind, a task factory that cannot be imported,
            a tokens file or TLS file that does not load; the message names the setting and what to do.
    """
    from fedcore.task import load_task_factory
    from privacy.tls import SERVER_FLAGS, load_ca_bundle, load_identity
    from server.service import load_tokens
    from server.state import load_checkpoint

    check_creatable_dir(config.state_dir, what="state_dir (--state-dir)")
    if config.initial is not None:
        if not config.initial.is_file():
            raise ConfigError(
                f"initial (--initial) {str(config.initial)!r} is not a file; give the safetensors model to start from"
            )
        try:
            load_checkpoint(config.initial, mapped=True, verify=False)  # header and layout; no read of the tensors
        except PayloadError as exc:
            raise ConfigError(
                f"initial (--initial) {str(config.initial)!r} is not a usable safetensors model: {exc.message}"
            ) from None
    if config.data_dir is not None and not config.data_dir.is_dir():
        raise ConfigError(f"data_dir (--data-dir) {str(config.data_dir)!r} is not a directory")
    if config.task is not None:
        load_task_factory(config.task)
    if config.auth.tokens_file is not None:
        load_tokens(config.auth.tokens_file)
    if config.tls.cert is not None and config.tls.key is not None:  # both given unless insecure (TlsSettings)
        load_identity(config.tls.cert, config.tls.key, role="server", flags=SERVER_FLAGS)
        load_ca_bundle(config.tls.client_ca, flag=SERVER_FLAGS.ca)


#: the nested tables of ServerConfig whose keys older (flat) files wrote at the top level
_FLAT_SECTIONS = ("round", "pool", "tls", "auth")
#: the old top-level names of keys whose name in their table differs
_RENAMED = {"tls_cert": ("tls", "cert"), "tls_key": ("tls", "key")}


def nest_flat_keys(data: Mapping[str, Any]) -> dict[str, Any]:
    """Move top-level keys of the flat layout used before the tables (``rounds = 3``, ``tls_cert = ...``) into
    their tables (``[round] rounds``, ``[tls] cert``), derived from the tables' fields.

    Raises:
        ConfigError: a key is given both flat and in its table.
    """
    homes: dict[str, tuple[str, str]] = dict(_RENAMED)
    tables = {"round": RoundSettings, "pool": PoolSettings, "tls": TlsSettings, "auth": AuthSettings}
    for section in _FLAT_SECTIONS:
        for f in dataclasses.fields(tables[section]):
            homes.setdefault(f.name, (section, f.name))
    top = {f.name for f in dataclasses.fields(ServerConfig)}
    out = merge_mappings(data, {})
    for key in [k for k in out if k not in top and k in homes]:
        section, name = homes[key]
        table = out.setdefault(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"[{section}] must be a table, got {table!r}")
        if name in table:
            raise ConfigError(f"{key!r} is given both at the top level and as [{section}] {name}; keep one")
        table[name] = out.pop(key)
        log.warning("config key %r belongs in its table now: write it as [%s] %s", key, section, name)
    return out


def load_server_config(
    path: str | os.PathLike[str] | None, overrides: list[str], flags: Mapping[str, Any] | None = None
) -> ServerConfig:
    """Build the config from an optional TOML file, then ``section.key=value`` overrides, then ``flags`` (a nested
    mapping, as :func:`fedcore.options.given_values` makes), each winning over the one before. The file's and the
    overrides' keys of the flat layout (:func:`nest_flat_keys`) are moved into their tables each on its own, so
    that ``--set round.rounds=4`` wins over a file's flat ``rounds = 3`` as over its ``[round] rounds``.

    Raises:
        ConfigError: unreadable file, unknown key, wrong type or invalid value.
    """
    data: dict[str, Any] = nest_flat_keys(load_toml(Path(path))) if path is not None else {}
    data = merge_mappings(data, nest_flat_keys(apply_overrides({}, overrides)))
    return from_mapping(ServerConfig, merge_mappings(data, flags or {}))
