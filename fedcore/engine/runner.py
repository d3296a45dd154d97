"""The local training loop one rank runs, the same at world size 1 and in every worker process.

It mirrors :func:`fedcore.training.train_supervised` step for step: the same ``torch.randperm`` shuffle from a
generator seeded with ``derive_seed(seed, round, client_id)``, the same batches, SGD with the same momentum and
weight decay, and the FedProx proximal term (Li et al. 2020), applied as its gradient ``mu * (w - w_global)``
so that it also works on sharded parameters. Only how a batch's gradient is computed differs (data parallel,
sharded, pipeline, tensor parallel), and each executor computes exactly the batch mean.

On CUDA the optimizer step is fused (``torch.optim.SGD(fused=True)``: one kernel for every parameter) unless
parameters are DTensors (tensor parallel, FSDP2), which take the multi-tensor (``foreach``) path; losses stay on
the device, so a step has no host-device synchronization: the epoch's loss is read once, at its end. Batches
come from :class:`~fedcore.engine.loader.BatchLoader`: each rank gathers only the rows its executor reads; small
training data move to the device once, larger data are gathered into pinned memory and copied on a side stream,
the next batch prepared while the current step computes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from fedcore.engine.batch_stats import BufferWatch
from fedcore.engine.data_parallel import DataParallelExecutor
from fedcore.engine.loader import DEVICE_DATA_BYTES, Batch, BatchLoader, Rows
from fedcore.engine.materialize import materialize, meta_model
from fedcore.engine.pipeline import PipelineExecutor, other_ranks_state_names
from fedcore.engine.plan import ParallelPlan
from fedcore.engine.runtime import RankEnv
from fedcore.engine.tensor_parallel import resolve_plan
from fedcore.errors import ClientTaskError
from fedcore.seeding import derive_seed
from fedcore.task import EngineTask, FitConfig
from fedcore.tensors import to_state_dict


class Executor(Protocol):
    """What the loop needs from a way of computing gradients."""

    def trained_parameters(self) -> list[tuple[str, nn.Parameter]]: ...

    def batch_rows(self, size: int) -> Rows: ...

    def forward_backward(self, batch: Batch) -> tuple[torch.Tensor, int]: ...

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
    on_step: Callable[[int], None] | None = None,
    prefetch: bool = True,
    device_data_bytes: int = DEVICE_DATA_BYTES,
) -> RankResult:
    """Train this rank's part of the model for one round under ``plan``.

    Every rank of the world must call it with the same arguments (except ``env``). The task declares what is
    trained (:class:`~fedcore.task.EngineTask`: model, data, loss); its ``train`` is not called.

    Args:
        on_step: called with the number of optimizer steps taken after each step has been queued (the device
            may still be running it); a benchmark records CUDA events there. It must not synchronize.
        prefetch: prepare the next batch while a step computes (:class:`~fedcore.engine.loader.BatchLoader`); the
            batches, and so the result, are the same without it.
        device_data_bytes: on CUDA, training data up to this size move to the device once; larger data are
            copied batch by batch from pinned memory on a side stream.

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
    model = _build_model(task, global_parameters, plan, env)
    tp_plan = resolve_plan(task, model, plan.tensor_parallel) if plan.tp_enabled else None
    executor: Executor
    if plan.pp_enabled:
        executor = PipelineExecutor(model, plan, env, loss_fn, tp_plan)
    else:
        executor = DataParallelExecutor(model, plan, env, loss_fn, tp_plan, global_parameters=global_parameters)
    trained = executor.trained_parameters()
    # a pipeline stage of parameter-free layers (an activation, a reshape) trains nothing: it only relays
    # activations and gradients, so it has no optimizer (torch.optim refuses an empty parameter list)
    optimizer = make_optimizer([p for _, p in trained], config, env.device) if trained else None
    loader = BatchLoader(x, y, env.device, rows=executor.batch_rows, prefetch=prefetch, device_bytes=device_data_bytes)
    anchors = _proximal_anchors(trained, global_parameters, env) if config.mu > 0 else []
    generator = torch.Generator().manual_seed(derive_seed(seed, round, client_id))
    buffer_watch = BufferWatch(model) if plan.grad_accum > 1 or plan.microbatches > 1 else None
    n = len(x)
    model.train()
    steps = 0
    train_loss = float("nan")
    for _ in range(config.local_epochs if n else 0):
        order = torch.randperm(n, generator=generator)
        loss_sum = torch.zeros((), dtype=torch.float64, device=env.device)
        seen = 0
        for batch in loader.epoch(order, config.batch_size):
            if optimizer is not None:
                optimizer.zero_grad(set_to_none=True)
            batch_loss, batch_seen = executor.forward_backward(batch)
            if buffer_watch is not None:
                buffer_watch.check(plan)
                buffer_watch = None
            executor.finish_gradients()
            for param, anchor in anchors:
                prox = (param.detach() - anchor) * config.mu
                if param.grad is None:
                    param.grad = prox
                else:
                    param.grad.add_(prox)
            if optimizer is not None:
                optimizer.step()
            if env.tp_index == 0:  # the ranks of a tensor-parallel group computed the same loss: count it once
                loss_sum += batch_loss
                seen += batch_seen
            steps += 1
            if on_step is not None:
                on_step(steps)
            if config.max_steps is not None and steps >= config.max_steps:
                break
        train_loss = _global_mean(loss_sum, seen, env)
        if config.max_steps is not None and steps >= config.max_steps:
            break
    state = executor.full_state()
    return RankResult(state=state, num_examples=n, train_loss=train_loss)


def _build_model(
    task: EngineTask, global_parameters: Mapping[str, np.ndarray], plan: ParallelPlan, env: RankEnv
) -> nn.Module:
    """The model for this rank (:mod:`fedcore.engine.materialize`).

    A rank of a parallel plan builds it on the meta device (no storage, no random initialization): a pipeline rank
    gives storage only to the tensors that are not another rank's, a DDP rank to the whole replica, both filled
    from the global parameters; under FSDP2 or tensor parallelism the model is returned still on the meta device,
    and the executor gives storage to each rank's shards once it has split the model. A plan of all ones, or a
    model that cannot be built on the meta device (:func:`~fedcore.engine.materialize.meta_model`), is built with
    real storage and loaded with the global parameters.
    """
    model = None if plan.is_single_process else meta_model(task.build_model)
    if model is not None:
        if plan.pp_enabled:
            skip = other_ranks_state_names(model, plan, env.pp_index)
            materialize(model, global_parameters, env.device, skip=skip)
        elif not (plan.fsdp_enabled or plan.tp_enabled):
            materialize(model, global_parameters, env.device)
        return model
    model = task.build_model()
    model.load_state_dict(to_state_dict(global_parameters), strict=True)
    return model.to(env.device)


def make_optimizer(params: list[nn.Parameter], config: FitConfig, device: torch.device) -> torch.optim.SGD:
    """The local optimizer: SGD with the round's lr, momentum and weight decay, as ``train_supervised`` uses.

    Fused (one kernel for all parameters) on CUDA when no parameter is a DTensor; the multi-tensor path
    otherwise (torch picks ``foreach`` on CUDA, a loop on the CPU).
    """
    fused = device.type == "cuda" and not any(isinstance(p, DTensor) for p in params)
    return torch.optim.SGD(
        params,
        lr=config.lr,
        momentum=config.momentum,
        weight_decay=config.weight_decay,
        fused=fused or None,
    )


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


def _global_mean(loss_sum: torch.Tensor, seen: int, env: RankEnv) -> float:
    """Mean per-sample loss over all ranks' contributions (each sample counted once); reads the device once."""
    count = torch.tensor(float(seen), dtype=torch.float64, device=env.device)
    totals = torch.stack([loss_sum.to(torch.float64), count])
    if env.distributed:
        dist.all_reduce(totals)
    total_loss, total_seen = totals.tolist()
    return total_loss / total_seen if total_seen else float("nan")
