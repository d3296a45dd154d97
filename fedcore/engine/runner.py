"""The local training loop one rank runs, the same at world size 1 and in every worker process.

It mirrors :func:`fedcore.training.train_supervised` step for step: the same ``torch.randperm`` shuffle from a
generator seeded with ``derive_seed(seed, round, client_id)``, the same batches, SGD with the same momentum and
weight decay, and the FedProx proximal term (Li et al. 2020), applied as its gradient ``mu * (w - w_global)``
so that it also works on sharded parameters. Only how a batch's gradient is computed differs (data parallel,
sharded, pipeline), and each executor computes exactly the batch mean.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from fedcore.engine.data_parallel import DataParallelExecutor
from fedcore.engine.pipeline import PipelineExecutor
from fedcore.engine.plan import ParallelPlan
from fedcore.engine.runtime import RankEnv
from fedcore.errors import ClientTaskError
from fedcore.seeding import derive_seed
from fedcore.task import EngineTask, FitConfig
from fedcore.tensors import to_state_dict


class Executor(Protocol):
    """What the loop needs from a way of computing gradients."""

    def trained_parameters(self) -> list[tuple[str, nn.Parameter]]: ...

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, int]: ...

    def finish_gradients(self) -> None: ...

    def full_state(self) -> dict[str, torch.Tensor] | None: ...


@dataclass(frozen=True, kw_only=True)
class RankResult:
    """What a rank hands back.

    Attributes:
        state: the full updated model state in global names (CPU tensors) on rank 0, None on other ranks.
        num_examples: local training examples.
        train_loss: mean per-sample loss over the last epoch (all ranks agree), nan when there were no steps.
    """

    state: dict[str, torch.Tensor] | None
    num_examples: int
    train_loss: float


def train_rank(
    task: EngineTask,
    global_parameters: Mapping[str, np.ndarray],
    config: FitConfig,
    plan: ParallelPlan,
    env: RankEnv,
    *,
    seed: int,
    round: int,
    client_id: str,
) -> RankResult:
    """Train this rank's part of the model for one round under ``plan``.

    Every rank of the world must call it with the same arguments (except ``env``). The task declares what is
    trained (:class:`~fedcore.task.EngineTask`: model, data, loss); its ``train`` is not called.

    Returns:
        A :class:`RankResult`; ``state`` is set on rank 0 only.
    """
    x, y = task.training_data()
    loss_fn = task.loss_fn
    if len(x) != len(y):
        raise ClientTaskError(
            f"the task's training_data() has {len(x)} inputs but {len(y)} targets; give x and y of the same length",
            round=round,
        )
    model = task.build_model()
    model.load_state_dict(to_state_dict(global_parameters), strict=True)
    model.to(env.device)
    executor: Executor
    if plan.pp_enabled:
        executor = PipelineExecutor(model, plan, env, loss_fn)
    else:
        executor = DataParallelExecutor(model, plan, env, loss_fn)
    trained = executor.trained_parameters()
    optimizer = torch.optim.SGD(
        [p for _, p in trained], lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
    )
    anchors = _proximal_anchors(trained, global_parameters, env) if config.mu > 0 else []
    generator = torch.Generator().manual_seed(derive_seed(seed, round, client_id))
    n = len(x)
    model.train()
    steps = 0
    train_loss = float("nan")
    for _ in range(config.local_epochs if n else 0):
        order = torch.randperm(n, generator=generator)
        loss_sum, seen = 0.0, 0
        for start in range(0, n, config.batch_size):
            idx = order[start : start + config.batch_size]
            optimizer.zero_grad(set_to_none=True)
            batch_loss, batch_seen = executor.forward_backward(x.index_select(0, idx), y.index_select(0, idx))
            executor.finish_gradients()
            for param, anchor in anchors:
                prox = (param.detach() - anchor) * config.mu
                if param.grad is None:
                    param.grad = prox
                else:
                    param.grad.add_(prox)
            optimizer.step()
            loss_sum += batch_loss
            seen += batch_seen
            steps += 1
            if config.max_steps is not None and steps >= config.max_steps:
                break
        train_loss = _global_mean(loss_sum, seen, env)
        if config.max_steps is not None and steps >= config.max_steps:
            break
    state = executor.full_state()
    return RankResult(state=state, num_examples=n, train_loss=train_loss)


def _proximal_anchors(
    trained: list[tuple[str, nn.Parameter]], global_parameters: Mapping[str, np.ndarray], env: RankEnv
) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """Pair each trained parameter with its global value, laid out like the parameter (sharded or not)."""
    anchors = []
    for name, param in trained:
        anchor = torch.as_tensor(np.asarray(global_parameters[name])).to(env.device, param.dtype)
        if isinstance(param, DTensor):
            anchor = distribute_tensor(anchor, param.device_mesh, param.placements, src_data_rank=None)
        anchors.append((param, anchor))
    return anchors


def _global_mean(loss_sum: float, seen: int, env: RankEnv) -> float:
    """Mean per-sample loss over all ranks' contributions (each sample counted once)."""
    if env.distributed:
        totals = torch.tensor([loss_sum, float(seen)], dtype=torch.float64, device=env.device)
        dist.all_reduce(totals)
        loss_sum, seen = float(totals[0]), int(totals[1])
    return loss_sum / seen if seen else float("nan")
