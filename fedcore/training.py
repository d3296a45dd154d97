"""Local training on one device: the loop the built-in tasks use and users may reuse.

:func:`train_supervised` runs mini-batch SGD for ``config.local_epochs`` epochs with the FedProx proximal term
(Li et al. 2020, "Federated Optimization in Heterogeneous Networks") when ``config.mu > 0``;
:func:`evaluate_supervised` computes the mean loss and accuracy. Both take plain tensors ``(x, y)`` so that a
shard of a dataset is just an index view, with no DataLoader worker processes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from fedcore.errors import ClientTaskError
from fedcore.task import EvalResult, FitConfig, TrainResult

LossFn = Callable[..., torch.Tensor]
"""``loss_fn(output, target, reduction="mean" | "sum") -> scalar tensor``, like ``nn.functional.cross_entropy``."""


def proximal_term(model: nn.Module, global_parameters: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Return ``sum_i ||w_i - w_global_i||^2`` over the model's trainable parameters (a scalar tensor).

    FedProx adds ``mu / 2`` times this to the local loss (Li et al. 2020, eq. 2).
    """
    total = torch.zeros((), dtype=torch.float32)
    for name, param in model.named_parameters():
        if param.requires_grad:
            total = total + (param - global_parameters[name].detach()).pow(2).sum()
    return total


def train_supervised(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    config: FitConfig,
    *,
    generator: torch.Generator,
    global_parameters: Mapping[str, torch.Tensor] | None = None,
    loss_fn: LossFn | None = None,
) -> TrainResult:
    """Train ``model`` in place with SGD on ``(x, y)``.

    Args:
        model: the model, already holding the global parameters.
        x: inputs, shape ``(N, ...)``, on the model's device.
        y: targets, shape ``(N,)`` (class indices, int64) or whatever ``loss_fn`` takes.
        config: epochs, batch size, lr, momentum, weight decay, FedProx ``mu``, optional step cap.
        generator: seeds the per-epoch shuffles (keyed by seed, round and client by the runner).
        global_parameters: the round's global parameters; required when ``config.mu > 0``.
        loss_fn: defaults to cross-entropy (mean over the batch).

    Returns:
        ``TrainResult(num_examples=N, metrics={"train_loss": mean loss over the last epoch})``. The proximal
        term is not included in ``train_loss``, so losses stay comparable across mu.

    Raises:
        ClientTaskError: ``x`` and ``y`` lengths differ, or ``mu > 0`` without ``global_parameters``.
    """
    if len(x) != len(y):
        raise ClientTaskError(f"x has {len(x)} samples but y has {len(y)}; give inputs and labels of the same length")
    if config.mu > 0 and global_parameters is None:
        raise ClientTaskError(
            "FedProx (mu > 0) needs the round's global parameters: pass global_parameters=context.global_parameters"
        )
    loss_fn = loss_fn or nn.functional.cross_entropy
    n = len(x)
    if n == 0:
        return TrainResult(num_examples=0, metrics={})
    optimizer = torch.optim.SGD(
        model.parameters(), lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
    )
    model.train()
    steps = 0
    epoch_loss = 0.0
    for _ in range(config.local_epochs):
        order = torch.randperm(n, generator=generator)
        loss_sum, seen = 0.0, 0
        for start in range(0, n, config.batch_size):
            idx = order[start : start + config.batch_size]
            xb, yb = x[idx], y[idx]
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(xb), yb)
            total = loss
            if config.mu > 0 and global_parameters is not None:
                total = loss + 0.5 * config.mu * proximal_term(model, global_parameters)
            total.backward()
            optimizer.step()
            loss_sum += float(loss.detach()) * len(idx)
            seen += len(idx)
            steps += 1
            if config.max_steps is not None and steps >= config.max_steps:
                break
        epoch_loss = loss_sum / max(seen, 1)
        if config.max_steps is not None and steps >= config.max_steps:
            break
    return TrainResult(num_examples=n, metrics={"train_loss": epoch_loss})


@torch.no_grad()
def evaluate_supervised(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    batch_size: int = 256,
    loss_fn: LossFn | None = None,
) -> EvalResult:
    """Mean loss and accuracy of a classifier on ``(x, y)``.

    Args:
        x: inputs ``(N, ...)``; y: class indices ``(N,)`` int64.

    Returns:
        ``EvalResult(loss=mean loss per example, num_examples=N, metrics={"accuracy": fraction correct})``.
    """
    loss_fn = loss_fn or nn.functional.cross_entropy
    model.eval()
    n = len(x)
    if n == 0:
        return EvalResult(loss=float("nan"), num_examples=0, metrics={})
    loss_sum, correct = 0.0, 0
    for start in range(0, n, batch_size):
        xb, yb = x[start : start + batch_size], y[start : start + batch_size]
        out = model(xb)
        loss_sum += float(loss_fn(out, yb, reduction="sum"))
        correct += int((out.argmax(dim=1) == yb).sum())
    return EvalResult(loss=loss_sum / n, num_examples=n, metrics={"accuracy": correct / n})
