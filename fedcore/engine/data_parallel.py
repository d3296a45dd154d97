"""Data-parallel execution: replicated (DDP) or sharded (FSDP2 ``fully_shard``), with or without tensor
parallelism, and plain at world size 1.

Under FSDP2 and tensor parallelism the model arrives built on the meta device and is split and sharded there;
each rank then creates only its shards, filled from the global model (:mod:`fedcore.engine.materialize`).

Each optimizer step takes the global batch (``config.batch_size`` samples, in the single-device order), cut into
``data_parallel`` contiguous shards (``torch.tensor_split``'s cut, so shards differ by at most one sample); each
rank's loader (:mod:`fedcore.engine.loader`) gathers only its own shard, and the rank cuts it into ``grad_accum``
sequential micro-steps. Every micro-step's loss is the *sum* of per-sample losses scaled by ``data_parallel /
len(batch)``; DDP and FSDP2 average gradients over the ranks, so the gradient is exactly the batch mean that a
single device computes, whatever the shard sizes. BatchNorm layers compute their statistics over the global batch
(:func:`~fedcore.engine.batch_stats.synchronize_batch_norm`).

With tensor parallelism (:mod:`fedcore.engine.tensor_parallel`) the plan's layers are split over the ``tp`` mesh
dimension first; every rank of a tensor-parallel group processes the same shard of the batch. Sharded data
parallelism then shards the DTensors over ``dp`` too (FSDP2 on the 2D mesh, as torchtitan does); replicated
data parallelism sums the gradients over the ``dp`` group after the backward pass in one flat all-reduce
(:func:`sum_gradients`; DDP does not take DTensor parameters), with losses scaled by ``1 / len(batch)``.

Losses are accumulated on the device: the step has no host-device synchronization (no ``.item()``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from fedcore.engine.batch_stats import check_buffers_agree, synchronize_batch_norm
from fedcore.engine.layers import LayerChain, compile_layers, model_layers
from fedcore.engine.loader import Batch, Rows, part
from fedcore.engine.materialize import has_meta_tensors, materialize_local
from fedcore.engine.plan import ParallelPlan
from fedcore.engine.runtime import RankEnv, autocast
from fedcore.engine.tensor_parallel import TensorParallelPlan, apply_plan
from fedcore.errors import ConfigError, EngineError
from fedcore.training import LossFn


class DataParallelExecutor:
    """Runs forward/backward for one rank of a data-parallel (or single-process) plan.

    Args:
        model: the full model on ``env.device`` holding the global parameters, or, under FSDP2 or tensor
            parallelism, the model built on the meta device (:mod:`fedcore.engine.materialize`): it is split and
            sharded there, and each rank's shards are then created on ``env.device`` from ``global_parameters``.
        plan: the parallel plan (``pipeline == 1``).
        env: this rank's place in the world.
        loss_fn: ``loss_fn(output, target, reduction="sum")``.
        tp_plan: the layers to split when ``plan.tensor_parallel > 1``
            (:func:`~fedcore.engine.tensor_parallel.resolve_plan`).
        global_parameters: the round's global model in ``state_dict`` names; needed when ``model`` is on the meta
            device.

    Raises:
        EngineError: the mesh or plan the parallelism needs is missing, or ``model`` is on the meta device and
            ``global_parameters`` is not given.
    """

    def __init__(
        self,
        model: nn.Module,
        plan: ParallelPlan,
        env: RankEnv,
        loss_fn: LossFn,
        tp_plan: TensorParallelPlan | None = None,
        *,
        global_parameters: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        self.model = model
        self.plan = plan
        self.env = env
        self.loss_fn = loss_fn
        module: nn.Module = model
        if env.world_size > 1 and env.dp_group is not None and plan.dp_enabled:
            synchronize_batch_norm(model, env.dp_group)  # statistics over the global batch, as on one device
        if plan.tp_enabled:
            if env.tp_mesh is None or tp_plan is None:
                raise EngineError("tensor parallelism needs the tp mesh and a tensor-parallel plan", rank=env.rank)
            apply_plan(model, tp_plan, env.tp_mesh)
        if plan.compile:
            compile_layers(model)
        if plan.activation_checkpointing:
            module = LayerChain(model_layers(model), checkpointing=True)
        self._fsdp: FSDPModule | None = None
        self._ddp: DistributedDataParallel | None = None
        # replicated data parallelism over DTensors: gradients summed after the backward pass (sum_gradients)
        self._sum_over_dp = plan.dp_enabled and not plan.sharded and plan.tp_enabled
        if plan.dp_enabled and plan.sharded:
            if env.dp_mesh is None:
                raise EngineError(
                    "sharded data parallelism (FSDP2) needs the data-parallel device mesh, and the runtime built none",
                    rank=env.rank,
                )
            try:
                layers = model_layers(model)
            except ConfigError:
                layers = []  # no layer structure: shard the model as one unit
            for _, layer in layers:
                if any(p.requires_grad for p in layer.parameters()):
                    fully_shard(layer, mesh=env.dp_mesh)
            self._fsdp = fully_shard(module, mesh=env.dp_mesh)
        if has_meta_tensors(model):  # built on the meta device: storage for this rank's shards only, now
            if global_parameters is None:
                raise EngineError("the model is on the meta device and no global parameters were given", rank=env.rank)
            materialize_local(model, global_parameters, env.device)
        if plan.dp_enabled and not plan.sharded and not self._sum_over_dp:
            device_ids = [env.device.index] if env.device.type == "cuda" else None
            self._ddp = DistributedDataParallel(
                module,
                device_ids=device_ids,
                process_group=env.dp_group,
                find_unused_parameters=plan.find_unused_parameters,
            )
            module = self._ddp
        self.module = module

    def trained_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """``(global name, parameter)`` for the parameters this rank updates (sharded ones as DTensors)."""
        return [(name, p) for name, p in self.model.named_parameters() if p.requires_grad]

    def batch_rows(self, size: int) -> Rows:
        """The rows of a global batch of ``size`` samples this rank reads: its data-parallel shard (contiguous,
        ``torch.tensor_split``'s cut); the ranks of a tensor-parallel group read the same shard."""
        return Rows(*part(size, self.plan.data_parallel, self.env.dp_index))

    def forward_backward(self, batch: Batch) -> tuple[torch.Tensor, int]:
        """Accumulate this rank's gradients for one global batch, of which ``batch`` holds this rank's shard
        (:meth:`batch_rows`) on the device.

        Returns:
            ``(sum of per-sample losses over the samples this rank processed, a float32 scalar on the device;
            their number)``.
        """
        x, y = batch.x, batch.y
        if x is None or y is None:
            raise EngineError("a data-parallel rank needs the inputs and the targets of its shard", rank=self.env.rank)
        # DDP and FSDP2 average the ranks' gradients; sum_gradients adds them
        scale = (1.0 if self._sum_over_dp else self.plan.data_parallel) / batch.size
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.env.device)
        for i in range(self.plan.grad_accum):
            last = i == self.plan.grad_accum - 1
            start, stop = part(batch.rows, self.plan.grad_accum, i)  # contiguous: views of the shard
            xb, yb = x[start:stop], y[start:stop]
            try:
                with self._sync(last), autocast(self.plan, self.env.device):
                    loss = self.loss_fn(self.module(xb), yb, reduction="sum")
            except RuntimeError as exc:
                if "Expected to have finished reduction" in str(exc):
                    raise _unused_parameters_error("some parameters got no gradient in the previous step") from exc
                raise
            (loss * scale).backward()
            loss_sum += loss.detach().float()
        if self._ddp is not None and not self.plan.find_unused_parameters:
            unused = [name for name, p in self.trained_parameters() if p.grad is None]
            if unused:
                raise _unused_parameters_error(f"parameters {unused[:10]} got no gradient")
        return loss_sum, batch.rows

    def _sync(self, sync: bool) -> contextlib.AbstractContextManager[None]:
        """Skip the gradient reduction on all but the last micro-step of a batch."""
        if self._fsdp is not None:
            self._fsdp.set_requires_gradient_sync(sync)
        if self._ddp is not None and not sync:
            return self._ddp.no_sync()
        return contextlib.nullcontext()

    def finish_gradients(self) -> None:
        """Sum the gradients over the data-parallel group under tensor parallelism; DDP and FSDP2 have reduced
        them in the backward pass of the last micro-step already."""
        if self._sum_over_dp and self.env.dp_group is not None:
            sum_gradients([p for _, p in self.trained_parameters()], self.env.dp_group)

    def full_state(self) -> dict[str, torch.Tensor] | None:
        """The full model state in global names on rank 0 (CPU tensors), None elsewhere.

        Every rank must call it: sharded parameters are all-gathered.

        Raises:
            ConfigError: a buffer differs between the ranks (:func:`~fedcore.engine.batch_stats.check_buffers_agree`).
        """
        if self.env.world_size > 1 and self.env.dp_group is not None:
            check_buffers_agree(list(self.model.named_buffers()), self.env.dp_group)
        state: dict[str, torch.Tensor] = {}
        for name, tensor in _state_items(self.model):
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            if self.env.rank == 0:
                state[name] = full.detach().to("cpu", copy=True)
        return state if self.env.rank == 0 else None


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's local shard (sharing its storage), a plain tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def sum_gradients(params: list[nn.Parameter], group: dist.ProcessGroup) -> None:
    """Replace each gradient by its sum over the ranks of ``group`` (each holds a part of the batch).

    A parameter that got no gradient on any rank keeps none, as on one device (the optimizer then skips it: no
    weight decay, no momentum step); one that got a gradient somewhere gets zeros where it had none. DTensor
    gradients are summed shard by shard (the ranks of ``group`` hold the same shard). Two collectives: which
    parameters have gradients, then one flat all-reduce per dtype.
    """
    has_grad = torch.tensor([p.grad is not None for p in params], dtype=torch.int32)
    device = next((_local(p).device for p in params), torch.device("cpu"))
    has_grad = has_grad.to(device)
    dist.all_reduce(has_grad, op=dist.ReduceOp.MAX, group=group)
    grads: dict[torch.dtype, list[torch.Tensor]] = {}
    for param, any_grad in zip(params, has_grad.tolist(), strict=True):
        if not any_grad:
            continue
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        local = _local(param.grad)
        grads.setdefault(local.dtype, []).append(local)
    for tensors in grads.values():
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def _unused_parameters_error(what: str) -> ConfigError:
    return ConfigError(
        f"DDP: {what} (a module unused in forward, or used only for some inputs); DDP cannot finish its gradient "
        "reduction then. Set find_unused_parameters=true in the parallel plan, or remove the unused module"
    )


def _state_items(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.state_dict().items()
