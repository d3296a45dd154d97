"""The simulation recipe: one root config whose tables are the components' configs.

A recipe TOML has the tables ``[data]``, ``[model]``, ``[strategy]``, ``[sampling]``, ``[train]``, ``[attack]``,
``[devices]`` and ``[output]`` plus top-level ``seed``, ``rounds``, ``evaluate_every`` and the stop rules
(``target_accuracy``, ``patience``, ``min_delta``); any value can be overridden from the CLI as
``--set train.lr=0.1``. See ``simulations/recipes/*.toml``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from fedcore.config import apply_overrides, from_mapping, load_toml
from fedcore.convergence import StopRules
from fedcore.errors import ConfigError
from fedcore.selection import SIZE_ATTRIBUTE, check_private_selection
from fedcore.strategy import SamplingConfig, StrategyConfig
from fedcore.task import FitConfig
from privacy.dp.config import PrivacyConfig
from simulations.attacks import AttackConfig
from simulations.devices import DevicesConfig

DATASET_NAMES = ("fashion-mnist", "mnist-5k", "digits", "synthetic")
PARTITION_NAMES = ("iid", "dirichlet", "dirichlet-client", "shards", "quantity", "natural")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Which dataset, and how it is split over the virtual clients.

    Attributes:
        dataset: fashion-mnist, mnist-5k, digits, or synthetic (FedProx Synthetic(alpha, beta)).
        data_dir: where fashion-mnist's ``*-ubyte.gz`` files are (default: $FEDCORE_DATA, then the Debian
            package's /usr/share/datasets/fashion-mnist).
        num_clients: number of virtual clients (for synthetic: the number of devices).
        partition: iid, dirichlet (class-centric label skew), dirichlet-client (Hsu et al. 2019), shards
            (McMahan et al. 2017), quantity (lognormal sizes), natural (synthetic's own devices).
        alpha: Dirichlet concentration for the dirichlet partitions (small = more skew), > 0.
        shards_per_client: shards per client for ``partition = "shards"``.
        min_partition_size: smallest client allowed by the class-centric Dirichlet partition (redraws).
        max_redraws: how many times the Dirichlet partition may redraw before giving up with an error.
        sigma: lognormal sigma of client sizes for ``partition = "quantity"``.
        normalize: standardize inputs with the training set's mean and standard deviation.
        synthetic_alpha, synthetic_beta: Synthetic(alpha, beta) heterogeneity (model, features).
    """

    dataset: str = "fashion-mnist"
    data_dir: Path | None = None
    num_clients: int = 100
    partition: str = "dirichlet"
    alpha: float = 0.5
    shards_per_client: int = 2
    min_partition_size: int = 10
    max_redraws: int = 100
    sigma: float = 1.0
    normalize: bool = True
    synthetic_alpha: float = 1.0
    synthetic_beta: float = 1.0

    def __post_init__(self) -> None:
        if self.dataset not in DATASET_NAMES:
            raise ConfigError(f"unknown dataset {self.dataset!r}; choose one of {', '.join(DATASET_NAMES)}")
        if self.partition not in PARTITION_NAMES:
            raise ConfigError(f"unknown partition {self.partition!r}; choose one of {', '.join(PARTITION_NAMES)}")
        if self.num_clients < 1:
            raise ConfigError(f"num_clients must be >= 1, got {self.num_clients}")
        if self.data_dir is not None and str(self.data_dir).strip() in ("", "."):
            raise ConfigError("data_dir is empty; give the directory that holds the dataset files, or leave it unset")
        if not (0 < self.alpha < math.inf):
            raise ConfigError(f"alpha must be a finite number > 0, got {self.alpha}")
        if self.shards_per_client < 1:
            raise ConfigError(f"shards_per_client must be >= 1, got {self.shards_per_client}")
        if self.min_partition_size < 0:
            raise ConfigError(f"min_partition_size must be >= 0, got {self.min_partition_size}")
        if not 1 <= self.max_redraws <= 10_000:
            raise ConfigError(f"max_redraws must be in 1..10000, got {self.max_redraws}")
        if not 0 < self.sigma <= 50:
            raise ConfigError(f"sigma must be in (0, 50] (lognormal shape of client sizes), got {self.sigma}")
        if (self.dataset == "synthetic") != (self.partition == "natural"):
            raise ConfigError(
                "the synthetic dataset comes split by device: use partition = 'natural' with it, and only with it"
            )
        for name in ("synthetic_alpha", "synthetic_beta"):
            value = getattr(self, name)
            if not 0 <= value <= 1000:
                raise ConfigError(f"{name} is a standard deviation and must be in [0, 1000], got {value}")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Which model the demo task trains.

    Attributes:
        name: cnn (McMahan et al. 2017 CNN), 2nn (their MLP), logreg (multinomial logistic regression).
    """

    name: str = "cnn"

    def __post_init__(self) -> None:
        from simulations.models import MODEL_NAMES

        if self.name not in MODEL_NAMES:
            raise ConfigError(f"unknown model {self.name!r}; choose one of {', '.join(MODEL_NAMES)}")


DEMO_TASK = "simulations.tasks:demo_task"


@dataclass(frozen=True, kw_only=True)
class TaskConfig:
    """Which task the virtual clients run.

    Attributes:
        factory: ``module:attr`` of a task factory (:data:`fedcore.task.TaskFactory`). The default, the built-in
            demo task, takes its settings from ``[data]`` and ``[model]``. Any other factory is called once per
            virtual client with ``TaskContext(role="client", client_id, partition_id=i, num_partitions=N,
            data_dir, seed, options)`` and once with ``role="server"`` (initial model, centralized evaluation),
            exactly as ``fedcore client`` and ``fedcore server`` call it.
        options: string options handed to a custom factory (``--task-option key=value``).
        server_evaluation: evaluate the global model with the server-role task after each evaluated round (its
            ``evaluate`` must then have held-out data).
    """

    factory: str = DEMO_TASK
    options: dict[str, str] = field(default_factory=dict)
    server_evaluation: bool = True

    def __post_init__(self) -> None:
        module, sep, attr = self.factory.partition(":")
        if not (module and sep and attr):
            raise ConfigError(f"task.factory must look like module:attr, got {self.factory!r}")
        if self.factory == DEMO_TASK and self.options:
            raise ConfigError("the demo task takes its settings from [data] and [model], not task.options")


@dataclass(frozen=True, kw_only=True)
class OutputConfig:
    """Where and how results are written.

    Attributes:
        dir: the run's output directory (history.csv, history.png, model.safetensors, config.json).
        progress: show a progress bar and the per-round table on the console.
        plot: write the PNG plot of accuracy and loss per round.
    """

    dir: Path = Path("runs/latest")
    progress: bool = True
    plot: bool = True

    def __post_init__(self) -> None:
        if str(self.dir).strip() in ("", "."):
            raise ConfigError("output.dir is empty; give a directory for the run's results (e.g. runs/my-run)")


BackendName = Literal["inprocess", "batched", "process"]


@dataclass(frozen=True, kw_only=True)
class BackendConfig:
    """How the virtual clients are run (``[simulation]``).

    Attributes:
        backend: inprocess (one client after another in this process, the default; the same model as a
            deployment bit for bit), batched (the round's sampled clients trained together as one batched
            computation with torch.func, :mod:`simulations.batched`: plain or FedProx SGD of a SupervisedTask whose
            model has no buffers and no randomness; the same history as inprocess up to float rounding, within
            1e-5; other recipes are refused before the first round) or process (worker processes fed from one
            queue, :mod:`simulations.procpool`; the same history as inprocess bit for bit when each trains on as
            many torch threads, 1 per worker).
        batch_clients: batched: at most this many clients are trained together (memory grows with it: the
            stacked parameters, gradients and momentum of that many models); 0 chooses: on the CPU as many as keep
            the largest stacked parameter within 16 MiB (the 2NN: 26), on a GPU all of a round's clients.
        workers: process: the number of worker processes (default: the cores this process may use).
    """

    backend: BackendName = "inprocess"
    batch_clients: int = 0
    workers: int | None = None

    def __post_init__(self) -> None:
        if self.backend not in ("inprocess", "batched", "process"):
            raise ConfigError(f"unknown simulation backend {self.backend!r}; choose inprocess, batched or process")
        if self.batch_clients < 0:
            raise ConfigError(f"batch_clients must be >= 0 (0: all of a round's clients), got {self.batch_clients}")
        if self.workers is not None and not 1 <= self.workers <= 4096:
            raise ConfigError(f"workers must be in 1..4096 (or unset: one per core), got {self.workers}")
        if self.workers is not None and self.backend != "process":
            raise ConfigError("workers sets the process backend's worker count; add backend = 'process' to use it")
        if self.batch_clients and self.backend != "batched":
            raise ConfigError(
                "batch_clients caps the batched backend's clients trained together; add backend = 'batched' to use "
                "it, or leave it out"
            )


@dataclass(frozen=True, kw_only=True)
class SimulationConfig:
    """A whole simulation recipe.

    Attributes:
        seed: the run's seed (partition, initial model, client selection, every client's randomness).
        rounds: number of federated rounds.
        evaluate_every: evaluate the global model on the test set every this many rounds (and after the last).
        target_accuracy: stop after the first evaluated round whose test accuracy reaches this value, in (0, 1];
            the run reports the rounds and seconds it took (unset: no target).
        patience: stop after this many evaluated rounds in a row without a gain of more than min_delta in test
            accuracy (unset: no plateau rule).
        min_delta: the smallest gain in accuracy that counts as one for patience.
        data, model, task, strategy, sampling, train, output: the component configs.
        attack: Byzantine clients (:class:`simulations.attacks.AttackConfig`; default none).
        privacy: differential privacy (``[privacy]``, :class:`privacy.dp.config.PrivacyConfig`; off by default).
        devices: simulated device speeds and availability (``[devices]``,
            :class:`simulations.devices.DevicesConfig`): slow clients, a trace of when clients are online.
        simulation: how the virtual clients run (``[simulation]``, :class:`BackendConfig`; in-process by default).
    """

    seed: int = 0
    rounds: int = 30
    evaluate_every: int = 5
    target_accuracy: float | None = None
    patience: int | None = None
    min_delta: float = 0.0
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    strategy: StrategyConfig = field(default_factory=lambda: StrategyConfig(name="fedavgm", server_momentum=0.7))
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(fraction_fit=0.1, min_fit_clients=2))
    train: FitConfig = field(default_factory=lambda: FitConfig(local_epochs=1, batch_size=32, lr=0.05))
    output: OutputConfig = field(default_factory=OutputConfig)
    attack: AttackConfig = field(default_factory=AttackConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    devices: DevicesConfig = field(default_factory=DevicesConfig)
    simulation: BackendConfig = field(default_factory=BackendConfig)

    def __post_init__(self) -> None:
        if not 1 <= self.rounds <= 1_000_000:
            raise ConfigError(f"rounds must be in 1..1000000, got {self.rounds}")
        if self.train.local_epochs > 10_000:
            raise ConfigError(f"train.local_epochs must be <= 10000, got {self.train.local_epochs}")
        if self.evaluate_every < 1:
            raise ConfigError(f"evaluate_every must be >= 1, got {self.evaluate_every}")
        check_private_selection(
            self.strategy.selection, client_dp=self.privacy.enabled, trace=self.devices.availability != "always"
        )
        stratify_by = self.strategy.selector.stratify_by
        if self.strategy.selection == "stratified" and stratify_by != SIZE_ATTRIBUTE:
            # virtual clients declare no attributes: every client would land in one stratum (uniform selection)
            raise ConfigError(
                f"strategy.selector.stratify_by = {stratify_by!r}: in simulation the clients' only attribute is "
                f"{SIZE_ATTRIBUTE!r} (their dataset-size bucket); stratify by {SIZE_ATTRIBUTE!r}, or deploy daemons "
                f"that declare {stratify_by!r} (fedcore client start --attribute {stratify_by}=VALUE)"
            )
        self.stop_rules().check_measurable(  # their own checks, now, and whether any round has an accuracy
            evaluated=self.task.server_evaluation or self.sampling.fraction_evaluate > 0,
            remedy="turn the server's evaluation back on (drop --no-server-evaluation) or let clients evaluate "
            "(sampling.fraction_evaluate > 0, --fraction-evaluate)",
        )
        if self.sampling.min_fit_clients > self.data.num_clients:
            raise ConfigError(
                f"sampling.min_fit_clients={self.sampling.min_fit_clients} exceeds data.num_clients="
                f"{self.data.num_clients}"
            )

    def stop_rules(self) -> StopRules:
        """When the run stops before its last round (:class:`fedcore.convergence.StopRules`).

        Raises:
            ConfigError: a value out of range.
        """
        return StopRules(target_accuracy=self.target_accuracy, patience=self.patience, min_delta=self.min_delta)


def load_recipe(path: str | Path | None = None, overrides: list[str] | None = None) -> SimulationConfig:
    """Build a :class:`SimulationConfig` from a TOML recipe (or the defaults) plus ``key=value`` overrides.

    Raises:
        ConfigError: unreadable file, unknown key, wrong type or invalid value.
    """
    data: dict[str, Any] = load_toml(path) if path is not None else {}
    return from_mapping(SimulationConfig, apply_overrides(data, overrides or []))
