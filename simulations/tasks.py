"""Built-in demo tasks: a shard of a built-in dataset with one of the papers' models.

:func:`demo_task` is a task factory (``--task simulations.tasks:demo_task``): given a
:class:`~fedcore.task.TaskContext` with ``partition_id``/``num_partitions`` and options naming the dataset,
partition and model (the fields of :class:`~simulations.config.DataConfig` plus ``model``), it returns a
:class:`~fedcore.supervised.SupervisedTask` over that client's shard; for the server role, over the test set.
The simulation harness calls the same factory for its virtual clients, so a client daemon given the same
options trains on exactly the same shard.

Normalization, when on, uses the mean and standard deviation of the whole training set; this is the usual
benchmark convention (a real deployment would fix these constants in advance).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np
import torch

from fedcore.config import from_mapping
from fedcore.errors import ConfigError
from fedcore.supervised import SupervisedTask
from fedcore.task import TaskContext
from simulations.config import DataConfig
from simulations.datasets import Dataset, concat_devices, load_dataset, normalization_stats, synthetic_fedprox
from simulations.models import build_model
from simulations.partition import partition


@dataclass(frozen=True)
class PreparedData:
    """A dataset as torch tensors plus its partition over clients."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    input_shape: tuple[int, ...]
    partitions: tuple[np.ndarray, ...]
    labels: np.ndarray


def data_config_from_options(options: Mapping[str, str]) -> tuple[DataConfig, str]:
    """Split task options into a :class:`DataConfig` and the model name (option ``model``, default ``cnn``)."""
    known = {f.name for f in fields(DataConfig)}
    unknown = sorted(set(options) - known - {"model"})
    if unknown:
        raise ConfigError(f"unknown task option(s) {unknown}; known: model, {', '.join(sorted(known))}")
    data = from_mapping(DataConfig, {k: v for k, v in options.items() if k in known}, where="task options")
    return data, options.get("model", "cnn")


@functools.lru_cache(maxsize=16)
def _parsed_options(options: tuple[tuple[str, str], ...]) -> tuple[DataConfig, str]:
    """:func:`data_config_from_options`, parsed once per set of options (every virtual client has the same)."""
    return data_config_from_options(dict(options))


@functools.lru_cache(maxsize=4)
def prepare_data(config: DataConfig, seed: int) -> PreparedData:
    """Load, normalize and partition the dataset ``config`` names (cached per process).

    Raises:
        DatasetNotFoundError, PartitionError, ConfigError: from the loader and the partitioner.
    """
    dataset: Dataset
    if config.dataset == "synthetic":
        devices = synthetic_fedprox(
            config.synthetic_alpha, config.synthetic_beta, num_devices=config.num_clients, seed=seed
        )
        dataset, parts = concat_devices(devices)
    else:
        dataset = load_dataset(config.dataset, data_dir=config.data_dir, seed=seed)
        params: dict[str, object] = {}
        if config.partition in ("dirichlet", "dirichlet-client"):
            params["alpha"] = config.alpha
        if config.partition == "dirichlet":
            params["min_partition_size"] = config.min_partition_size
            params["max_redraws"] = config.max_redraws
        if config.partition == "shards":
            params["shards_per_client"] = config.shards_per_client
        if config.partition == "quantity":
            params["sigma"] = config.sigma
        parts = partition(dataset.y_train, config.partition, config.num_clients, seed, **params)
    x_train, x_test = dataset.x_train, dataset.x_test
    if config.normalize:
        mean, std = normalization_stats(x_train)
        x_train = ((x_train - mean) / std).astype(np.float32)
        x_test = ((x_test - mean) / std).astype(np.float32)
    return PreparedData(
        x_train=torch.from_numpy(np.ascontiguousarray(x_train)),
        y_train=torch.from_numpy(np.ascontiguousarray(dataset.y_train)),
        x_test=torch.from_numpy(np.ascontiguousarray(x_test)),
        y_test=torch.from_numpy(np.ascontiguousarray(dataset.y_test)),
        num_classes=dataset.num_classes,
        input_shape=tuple(dataset.input_shape),
        partitions=tuple(parts),
        labels=dataset.y_train,
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
    if pid is None or not 0 <= pid < len(prepared.partitions):
        raise ConfigError(
            f"client {context.client_id!r} needs a partition id in 0..{len(prepared.partitions) - 1}, got {pid}"
        )
    idx = torch.from_numpy(prepared.partitions[pid])
    shard = (prepared.x_train.index_select(0, idx), prepared.y_train.index_select(0, idx))  # not x[idx]: 100x slower
    return SupervisedTask(model_fn=model_fn, train_data=shard, test_data=test)
