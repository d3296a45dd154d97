"""Built-in demo tasks: a shard of a built-in dataset with one of the papers' models.

:func:`demo_task` is a task factory (``--task simulations.tasks:demo_task``): given a
:class:`~fedcore.task.TaskContext` with ``partition_id``/``num_partitions`` and options naming the dataset,
partition and model (the fields of :class:`~simulations.config.DataConfig` plus ``model``), it returns a
:class:`~fedcore.supervised.SupervisedTask` over that client's shard; for the server role, over the test set.
The simulation harness calls the same factory for its virtual clients, so a client daemon given the same
options trains on exactly the same shard.

Normalization, when on, uses the mean and standard deviation of the whole training set; this is the usual
benchmark convention (a real deployment would fix these constants in advance).

The synthetic dataset is never held whole: a client's device is generated when its task is built
(:func:`simulations.datasets.synthetic_device`, keyed by (seed, device), so the numbers do not depend on which
clients are sampled first), and the server's test set and the normalization statistics come from the first
:data:`REFERENCE_DEVICES` devices. Memory therefore stays flat in the number of devices (100,000 of them would
take about 10 GB held at once).

Shakespeare (:class:`ShakespeareRoles`) holds only its chosen roles' text, one byte per character; a client's
80-character samples are views of its text made when its task is built, and it evaluates on its own test split.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np
import torch

from fedcore.config import from_mapping
from fedcore.errors import ConfigError, PartitionError
from fedcore.seeding import numpy_rng
from fedcore.supervised import SupervisedTask
from fedcore.task import TaskContext
from simulations.config import APPLIES_TO, DataConfig, check_model_for_dataset
from simulations.datasets import (
    SHAKESPEARE_SEQ_LEN,
    SHAKESPEARE_VOCAB,
    Dataset,
    encode_characters,
    leaf_split,
    load_dataset,
    load_shakespeare_roles,
    next_char_windows,
    normalization_stats,
    num_next_char_samples,
    synthetic_device,
    synthetic_train_size,
)
from simulations.models import build_model
from simulations.partition import partition

REFERENCE_DEVICES = 200
"""Synthetic data: the server's test set is the test split of the first this many devices (all of them when there
are fewer), and normalization uses the mean and standard deviation of their training splits."""


@dataclass(frozen=True)
class PreparedData:
    """A dataset as torch tensors plus its partition over clients, the training rows laid out client by client.

    Attributes:
        x_train, y_train: the training rows of every client, client ``k``'s (in the order of its partition) at
            ``offsets[k]:offsets[k + 1]``; ``(R, *input_shape)`` and ``(R,)``, ``R`` the partitions' total size
            (a row in no partition is not held).
        x_test, y_test: the test split.
        partitions: each client's rows of the dataset's training split (indices into ``labels``).
        labels: the training split's labels, in the dataset's order.
        offsets: int64 ``(K + 1,)``, the cumulative partition sizes.
    """

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    input_shape: tuple[int, ...]
    partitions: tuple[np.ndarray, ...]
    labels: np.ndarray
    offsets: np.ndarray

    @classmethod
    def laid_out(
        cls,
        x_train: np.ndarray,
        y_train: np.ndarray,
        partitions: tuple[np.ndarray, ...],
        *,
        x_test: torch.Tensor,
        y_test: torch.Tensor,
        num_classes: int,
        input_shape: tuple[int, ...],
    ) -> PreparedData:
        """The dataset with its training split ``(x_train, y_train)`` (in the dataset's order) copied into client
        order: one copy of the rows the partitions take, of which the clients' shards are views."""
        offsets = np.concatenate([[0], np.cumsum([len(part) for part in partitions], dtype=np.int64)])
        rows = torch.from_numpy(np.concatenate([np.zeros(0, dtype=np.int64), *partitions]).astype(np.int64))
        return cls(
            x_train=torch.from_numpy(np.ascontiguousarray(x_train)).index_select(0, rows),  # not x[rows]: 100x slower
            y_train=torch.from_numpy(np.ascontiguousarray(y_train)).index_select(0, rows),
            x_test=x_test,
            y_test=y_test,
            num_classes=num_classes,
            input_shape=input_shape,
            partitions=partitions,
            labels=y_train,
            offsets=offsets.astype(np.int64),
        )

    @property
    def num_clients(self) -> int:
        """The number of clients (partitions)."""
        return len(self.partitions)

    def shard(self, client: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Client ``client``'s training data ``(x, y)``: views of its rows of ``x_train``/``y_train``, one
        contiguous run each (the batched backend trains clients of one such layout without copying their data
        together, :func:`simulations.batched.train_stack`).

        Raises:
            ConfigError: ``client`` is not in ``0..num_clients - 1``.
        """
        if not 0 <= client < self.num_clients:
            raise ConfigError(
                f"client {client} is not one of the {self.num_clients} clients (0..{self.num_clients - 1})"
            )
        start, stop = int(self.offsets[client]), int(self.offsets[client + 1])
        return self.x_train[start:stop], self.y_train[start:stop]

    def client_labels(self) -> Iterator[np.ndarray]:
        """Each client's training labels, in client order."""
        return (self.labels[part] for part in self.partitions)

    def client_sizes(self) -> list[int]:
        """Each client's number of training examples, in client order."""
        return [len(part) for part in self.partitions]


@dataclass(frozen=True)
class SyntheticDevices:
    """FedProx Synthetic(alpha, beta) devices, each generated when a client asks for its data (see the module
    docstring); the same members as :class:`PreparedData` that a task and the partition report use."""

    config: DataConfig
    seed: int
    x_test: torch.Tensor
    y_test: torch.Tensor
    normalization: tuple[float, float] | None
    num_classes: int = 10
    input_shape: tuple[int, ...] = (60,)

    @property
    def num_clients(self) -> int:
        """The number of devices."""
        return self.config.num_clients

    def device(self, client: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Device ``client``'s ``(x_train, y_train, x_test, y_test)``, generated now."""
        c = self.config
        return synthetic_device(
            c.synthetic_alpha, c.synthetic_beta, client, num_classes=self.num_classes, seed=self.seed
        )

    def shard(self, client: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Client ``client``'s training data ``(x, y)`` (normalized when the config says so)."""
        x, y, _, _ = self.device(client)
        if self.normalization is not None:
            mean, std = self.normalization
            x = ((x - mean) / std).astype(np.float32)
        return torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(y)

    def client_labels(self) -> Iterator[np.ndarray]:
        """Each device's training labels, in device order (each device generated in turn, none kept)."""
        return (self.device(k)[1] for k in range(self.num_clients))

    def client_sizes(self) -> list[int]:
        """Each device's number of training examples, in device order (no data generated)."""
        return [synthetic_train_size(k, seed=self.seed) for k in range(self.num_clients)]


@dataclass(frozen=True, eq=False)
class ShakespeareRoles:
    """Shakespeare by speaking role (LEAF; Caldas et al. 2018): client ``k`` is the ``k``-th chosen (play, role) and
    its samples are the 80-character windows of its text with the next character as label, split into train and
    test per role as LEAF does (:func:`simulations.datasets.leaf_split`). The same members as
    :class:`PreparedData` that a task and the partition report use.

    Only the chosen roles' encoded text is held (one byte per character, about 4.4 MB for every role); a client's
    samples are made when its task is built, as views of its text (:func:`simulations.datasets.next_char_windows`),
    so they take the memory of its text, not 80 times it.

    Attributes:
        roles: the chosen roles' names ``"<play>/<ROLE>"``, in sorted order; client ``k`` is ``roles[k]``.
        text: the chosen roles' texts encoded (:func:`simulations.datasets.encode_characters`) and concatenated,
            uint8 ``(characters,)``.
        offsets: int64 ``(K + 1,)``: role ``k``'s text is ``text[offsets[k]:offsets[k + 1]]``.
        stride, train_fraction: the sampling and split (``DataConfig.shakespeare_*``).
        x_test, y_test: the server's test samples, int64 ``(M, 80)`` and ``(M,)``, drawn from the union of the
            clients' test sets (``DataConfig.shakespeare_test_samples``).
    """

    roles: tuple[str, ...]
    text: np.ndarray
    offsets: np.ndarray
    stride: int
    train_fraction: float
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int = len(SHAKESPEARE_VOCAB)
    input_shape: tuple[int, ...] = (SHAKESPEARE_SEQ_LEN,)

    @property
    def num_clients(self) -> int:
        """The number of clients (chosen roles)."""
        return len(self.roles)

    def _split(self, client: int) -> tuple[int, int, int]:
        """``(num_samples, num_train, test_start)`` of client ``client``."""
        length = int(self.offsets[client + 1] - self.offsets[client])
        n = num_next_char_samples(length, SHAKESPEARE_SEQ_LEN, self.stride)
        return (n, *leaf_split(n, self.train_fraction, SHAKESPEARE_SEQ_LEN, self.stride))

    def samples(self, client: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All of client ``client``'s samples ``(x, y)``: int64 ``(N, 80)`` (a view of its text) and ``(N,)``."""
        ids = torch.from_numpy(self.text[self.offsets[client] : self.offsets[client + 1]].astype(np.int64))
        return next_char_windows(ids, SHAKESPEARE_SEQ_LEN, self.stride)

    def shard(self, client: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Client ``client``'s training samples ``(x, y)``: the first ones of its text (views of it)."""
        _, num_train, _ = self._split(client)
        x, y = self.samples(client)
        return x[:num_train], y[:num_train]

    def test_shard(self, client: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Client ``client``'s test samples ``(x, y)``: the last ones of its text, after LEAF's gap (views)."""
        _, _, test_start = self._split(client)
        x, y = self.samples(client)
        return x[test_start:], y[test_start:]

    def client_labels(self) -> Iterator[np.ndarray]:
        """Each client's training labels (the characters that follow its train windows), in client order."""
        for k in range(self.num_clients):
            _, num_train, _ = self._split(k)
            start = int(self.offsets[k]) + SHAKESPEARE_SEQ_LEN
            yield self.text[start : start + num_train * self.stride : self.stride].astype(np.int64)

    def client_sizes(self) -> list[int]:
        """Each client's number of training samples, in client order."""
        return [self._split(k)[1] for k in range(self.num_clients)]


def _shakespeare(config: DataConfig, seed: int) -> ShakespeareRoles:
    """Choose the roles (those with at least ``shakespeare_min_samples`` samples and a train and a test sample,
    then ``num_clients`` of them at random, keyed by (seed, "shakespeare-roles")) and draw the server's test set
    (keyed by (seed, "shakespeare-test")).

    Raises:
        PartitionError: fewer eligible roles than ``num_clients``.
    """
    roles = load_shakespeare_roles(config.data_dir)
    stride, fraction = config.shakespeare_stride, config.shakespeare_train_fraction
    eligible = []
    for name, text in roles.items():
        n = num_next_char_samples(len(text), SHAKESPEARE_SEQ_LEN, stride)
        num_train, test_start = leaf_split(n, fraction, SHAKESPEARE_SEQ_LEN, stride)
        if n >= config.shakespeare_min_samples and num_train >= 1 and test_start < n:
            eligible.append(name)
    if config.num_clients > len(eligible):
        least = config.shakespeare_min_samples
        raise PartitionError(
            f"dataset shakespeare has {len(eligible)} roles (of {len(roles)}) with "
            + (f"at least {least} samples and " if least else "")
            + f"a train and a test sample at stride {stride} and train fraction {fraction}, fewer than num_clients="
            f"{config.num_clients}; "
            + (f"use num_clients <= {len(eligible)}" if eligible else "no role qualifies")
            + (" or a lower shakespeare_min_samples" if least and eligible else "")
            + ("; lower shakespeare_min_samples" if least and not eligible else "")
        )
    if config.num_clients < len(eligible):
        chosen = numpy_rng(seed, "shakespeare-roles").choice(len(eligible), size=config.num_clients, replace=False)
        eligible = [eligible[i] for i in np.sort(chosen)]
    encoded = [encode_characters(roles[name]) for name in eligible]
    offsets = np.cumsum([0] + [len(e) for e in encoded]).astype(np.int64)
    data = ShakespeareRoles(
        roles=tuple(eligible),
        text=np.concatenate(encoded),
        offsets=offsets,
        stride=stride,
        train_fraction=fraction,
        x_test=torch.empty(0, SHAKESPEARE_SEQ_LEN, dtype=torch.int64),
        y_test=torch.empty(0, dtype=torch.int64),
    )
    # The test windows' first characters in ``text``, for every client; then the server's sample of them.
    starts = []
    for k in range(data.num_clients):
        n, _, test_start = data._split(k)
        starts.append(offsets[k] + stride * np.arange(test_start, n, dtype=np.int64))
    every = np.concatenate(starts)
    if 0 < config.shakespeare_test_samples < len(every):
        chosen = numpy_rng(seed, "shakespeare-test").choice(len(every), config.shakespeare_test_samples, replace=False)
        every = every[np.sort(chosen)]
    ids = torch.from_numpy(data.text.astype(np.int64))
    first = torch.from_numpy(every)
    x_test = ids[first[:, None] + torch.arange(SHAKESPEARE_SEQ_LEN)[None, :]]
    return replace(data, x_test=x_test, y_test=ids[first + SHAKESPEARE_SEQ_LEN])


def data_config_from_options(options: Mapping[str, str]) -> tuple[DataConfig, str]:
    """Split task options into a :class:`DataConfig` and the model name (option ``model``, default ``cnn``)."""
    known = {f.name for f in fields(DataConfig)}
    unknown = sorted(set(options) - known - {"model"})
    if unknown:
        raise ConfigError(f"unknown task option(s) {unknown}; known: model, {', '.join(sorted(known))}")
    data = from_mapping(DataConfig, {k: v for k, v in options.items() if k in known}, where="task options")
    model = options.get("model", "cnn")
    check_model_for_dataset(data.dataset, model)
    return data, model


@functools.lru_cache(maxsize=16)
def _parsed_options(options: tuple[tuple[str, str], ...]) -> tuple[DataConfig, str]:
    """:func:`data_config_from_options`, parsed once per set of options (every virtual client has the same)."""
    return data_config_from_options(dict(options))


def _synthetic(config: DataConfig, seed: int) -> SyntheticDevices:
    reference = [
        synthetic_device(config.synthetic_alpha, config.synthetic_beta, k, seed=seed)
        for k in range(min(config.num_clients, REFERENCE_DEVICES))
    ]
    x_test = np.concatenate([d[2] for d in reference])
    y_test = np.concatenate([d[3] for d in reference])
    normalization = None
    if config.normalize:
        normalization = normalization_stats(np.concatenate([d[0] for d in reference]))
        x_test = ((x_test - normalization[0]) / normalization[1]).astype(np.float32)
    return SyntheticDevices(
        config=config,
        seed=seed,
        x_test=torch.from_numpy(np.ascontiguousarray(x_test)),
        y_test=torch.from_numpy(y_test),
        normalization=normalization,
    )


@functools.lru_cache(maxsize=4)
def prepare_data(config: DataConfig, seed: int) -> PreparedData | SyntheticDevices | ShakespeareRoles:
    """Load, normalize and partition the dataset ``config`` names (cached per process); for synthetic, the
    devices to generate on demand (:class:`SyntheticDevices`); for shakespeare, the chosen roles' text
    (:class:`ShakespeareRoles`).

    Raises:
        DatasetNotFoundError, PartitionError, ConfigError: from the loader and the partitioner.
    """
    if config.dataset == "synthetic":
        return _synthetic(config, seed)
    if config.dataset == "shakespeare":
        return _shakespeare(config, seed)
    dataset: Dataset = load_dataset(config.dataset, data_dir=config.data_dir, seed=seed)
    params: dict[str, object] = {
        key: getattr(config, key)
        for key, (setting, readers) in APPLIES_TO.items()
        if setting == "partition" and config.partition in readers
    }
    parts = partition(dataset.y_train, config.partition, config.num_clients, seed, **params)
    x_train, x_test = dataset.x_train, dataset.x_test
    if config.normalize:
        mean, std = normalization_stats(x_train)
        x_train = ((x_train - mean) / std).astype(np.float32)
        x_test = ((x_test - mean) / std).astype(np.float32)
    return PreparedData.laid_out(
        x_train,
        dataset.y_train,
        tuple(parts),
        x_test=torch.from_numpy(np.ascontiguousarray(x_test)),
        y_test=torch.from_numpy(np.ascontiguousarray(dataset.y_test)),
        num_classes=dataset.num_classes,
        input_shape=tuple(dataset.input_shape),
    )


@dataclass(frozen=True)
class ModelConstructor:
    """Builds one of the built-in models; equal constructors build the same architecture (so clients may share
    one model object, :class:`client.runner.ModelCache`)."""

    name: str
    input_shape: tuple[int, ...]
    num_classes: int

    def __call__(self) -> torch.nn.Module:
        return build_model(self.name, self.input_shape, self.num_classes)


@functools.lru_cache(maxsize=16)
def _model_constructor(name: str, input_shape: tuple[int, ...], num_classes: int) -> ModelConstructor:
    """A checked constructor: the name and shape are validated once (by building the model), not mid-run."""
    constructor = ModelConstructor(name, input_shape, num_classes)
    with torch.random.fork_rng(devices=[]):
        constructor()
    return constructor


def demo_task(context: TaskContext) -> SupervisedTask:
    """Task factory for the built-in datasets and models.

    Client role: needs ``partition_id`` in ``0..num_partitions-1``; ``num_partitions`` overrides the
    ``num_clients`` option. Server role: evaluates on the test set.

    Raises:
        ConfigError: missing or out-of-range partition id, unknown option, dataset or model.
    """
    data_config, model_name = _parsed_options(tuple(sorted(context.options.items())))
    if context.data_dir is not None:
        data_config = replace(data_config, data_dir=Path(context.data_dir))
    if context.num_partitions is not None and context.num_partitions != data_config.num_clients:
        data_config = replace(data_config, num_clients=context.num_partitions)
    prepared = prepare_data(data_config, context.seed)
    model_fn = _model_constructor(model_name, prepared.input_shape, prepared.num_classes)

    test = (prepared.x_test, prepared.y_test)
    if context.role == "server":
        return SupervisedTask(model_fn=model_fn, train_data=None, test_data=test)
    pid = context.partition_id
    if pid is None or not 0 <= pid < prepared.num_clients:
        raise ConfigError(
            f"client {context.client_id!r} needs a partition id in 0..{prepared.num_clients - 1}, got {pid}"
        )
    if isinstance(prepared, ShakespeareRoles):  # a role evaluates on its own test split, as in LEAF
        test = prepared.test_shard(pid)
    return SupervisedTask(model_fn=model_fn, train_data=prepared.shard(pid), test_data=test)
