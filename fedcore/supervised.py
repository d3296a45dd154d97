"""A ready-made :class:`~fedcore.task.Task` for supervised learning on in-memory tensors.

Most users need no Task class of their own: give :class:`SupervisedTask` a model constructor and the client's
``(x, y)`` tensors. It trains with :func:`fedcore.training.train_supervised` (FedProx-aware) and declares its
model, data and loss to the parallel engine (:mod:`fedcore.engine`) through ``model_fn``, ``training_data()``
and ``loss_fn``: it is an :class:`~fedcore.task.EngineTask`, so every parallel plan trains it. A subclass that
overrides ``train`` has its own loop, which runs on one device and is refused under a parallel plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from fedcore.errors import ClientTaskError, ConfigError
from fedcore.task import EvalResult, FitConfig, TrainContext, TrainResult
from fedcore.training import LossFn, evaluate_supervised, train_supervised


@dataclass(frozen=True, kw_only=True, eq=False)
class SupervisedTask:
    """Supervised learning on tensors held in memory.

    Raises:
        ConfigError: ``train_data`` or ``test_data`` is not None or a pair ``(x, y)`` of torch tensors (numpy arrays,
            for instance: convert them with ``torch.from_numpy``).

    Attributes:
        model_fn: builds a freshly initialized model (same architecture everywhere).
        train_data: ``(x, y)``: inputs ``(N, ...)`` float32 and targets ``(N,)`` int64, or None (server side).
        test_data: held-out ``(x, y)`` for :meth:`evaluate`, or None (then evaluation falls back to train_data).
        loss_fn: ``loss_fn(output, target, reduction=...)``; cross-entropy by default.
        fit_metric_names, eval_metric_names: the metrics :meth:`train` and :meth:`evaluate` report
            (:class:`fedcore.task.DeclaredMetrics`).
    """

    fit_metric_names: ClassVar[tuple[str, ...]] = ("train_loss",)
    eval_metric_names: ClassVar[tuple[str, ...]] = ("accuracy",)

    model_fn: Callable[[], nn.Module]
    train_data: tuple[torch.Tensor, torch.Tensor] | None = None
    test_data: tuple[torch.Tensor, torch.Tensor] | None = None
    loss_fn: LossFn = field(default=nn.functional.cross_entropy)

    def __post_init__(self) -> None:
        for name in ("train_data", "test_data"):
            data = getattr(self, name)
            if data is None:
                continue
            kinds = [type(part).__name__ for part in data] if isinstance(data, tuple | list) else []
            if len(kinds) != 2 or not all(isinstance(part, torch.Tensor) for part in data):
                got = f"({', '.join(kinds)})" if kinds else type(data).__name__
                raise ConfigError(
                    f"SupervisedTask's {name} must be a pair (x, y) of torch tensors, got {got}; convert numpy arrays "
                    "with torch.from_numpy(x), torch.from_numpy(y)"
                )

    def build_model(self) -> nn.Module:
        """Return ``model_fn()``."""
        return self.model_fn()

    def training_data(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The local training tensors ``(x, y)``.

        Raises:
            ClientTaskError: this task holds no training data (a server-side task).
        """
        if self.train_data is None:
            raise ClientTaskError(
                "this task has no training data (was it made for the server role?); give it train_data to train"
            )
        return self.train_data

    def train(self, model: nn.Module, config: FitConfig, context: TrainContext) -> TrainResult:
        """One round of local SGD (with the FedProx term when ``config.mu > 0``)."""
        x, y = self.training_data()
        return train_supervised(
            model,
            x,
            y,
            config,
            generator=context.generator,
            global_parameters=context.global_parameters,
            loss_fn=self.loss_fn,
        )

    def evaluate(self, model: nn.Module, batch_size: int) -> EvalResult:
        """Loss and accuracy on ``test_data`` (or ``train_data`` when there is no test split)."""
        data = self.test_data if self.test_data is not None else self.train_data
        if data is None:
            raise ClientTaskError("this task has neither test nor training data to evaluate on; give it test_data")
        x, y = data
        return evaluate_supervised(model, x, y, batch_size=batch_size, loss_fn=self.loss_fn)
