"""Pipeline-parallel execution with ``torch.distributed.pipelining`` (GPipe, 1F1B, interleaved 1F1B).

The model is cut into stages by module names (:mod:`fedcore.engine.layers`); pipeline rank ``r`` holds stages
``r, r + p, ...``. Each stage is a :class:`~torch.distributed.pipelining.PipelineStage` whose shapes are
inferred at run time from the first micro-batch (on torch 2.13 CPU, static shapes gave wrong gradients).

Because a stage fixes its micro-batch shape when it first runs, every micro-batch a schedule sees has the same
size. A chunk of ``c`` samples therefore runs as one schedule step of ``m`` micro-batches of ``c // m`` samples,
followed, when ``c % m != 0``, by a step of ``c % m`` single-sample micro-batches (GPipe-style); each distinct
(schedule, micro-batches, micro-batch size) gets its own cached stages and schedule. Losses are per-sample sums
scaled by ``1 / len(batch)`` and schedules run with ``scale_grads=False``, so gradients add up to exactly the
batch mean whatever the split. With data parallelism on top, gradients are summed over the ``dp`` group, and
BatchNorm statistics are computed over the replicas' parts of the batch. Shape inference leaves no trace in the
model's buffers (:class:`_Stage`); BatchNorm needs ``microbatches=1`` (:mod:`fedcore.engine.batch_stats`).

With tensor parallelism each rank splits the plan's layers of its own stages over its ``tp`` group; the stages
pass plain (replicated) activations, so a pipeline rank talks to the rank with the same ``tp_index`` in the
next stage, and the update is gathered per stage (``DTensor.full_tensor``) before it reaches rank 0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)
from torch.distributed.pipelining.schedules import _PipelineSchedule
from torch.distributed.pipelining.stage import _PipelineStageBase
from torch.distributed.tensor import DTensor

from fedcore.engine.batch_stats import check_buffers_agree, preserved_buffers, synchronize_batch_norm
from fedcore.engine.data_parallel import sum_gradients
from fedcore.engine.layers import LayerChain, compile_layers, split_stages, stage_state_names
from fedcore.engine.loader import Batch, Rows, part
from fedcore.engine.plan import ParallelPlan
from fedcore.engine.runtime import RankEnv, autocast
from fedcore.engine.schedules import Schedule, rank_of_stage, stages_of_rank
from fedcore.engine.tensor_parallel import TensorParallelPlan, apply_plan
from fedcore.errors import EngineError
from fedcore.training import LossFn


class _AutocastChain(nn.Module):
    """A stage's layer chain under the plan's autocast."""

    def __init__(self, chain: LayerChain, plan: ParallelPlan, device: torch.device) -> None:
        super().__init__()
        self.chain = chain
        self._plan = plan
        self._device = device

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with autocast(self._plan, self._device):
            return self.chain(x)


class _Stage(PipelineStage):
    """A ``PipelineStage`` whose shape inference leaves no trace in the model.

    Shape inference runs the stage's forward (and backward) on the first micro-batch, or on an uninitialized
    tensor of the received shape on later stages. It runs here in eval mode with every buffer restored
    afterwards, so BatchNorm does not count it in ``num_batches_tracked`` nor fold garbage into ``running_var``,
    and dropout draws no random numbers. (``_forward_metadata_inference`` and ``_backward_metadata_inference``
    are the hooks of torch 2.13's ``PipelineStage``.)
    """

    def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        with preserved_buffers(self.submod, eval_mode=True):
            return super()._forward_metadata_inference(*args, **kwargs)

    def _backward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        with preserved_buffers(self.submod, eval_mode=True):
            return super()._backward_metadata_inference(*args, **kwargs)


def other_ranks_state_names(model: nn.Module, plan: ParallelPlan, pp_index: int) -> set[str]:
    """``state_dict`` names of the stages that pipeline rank ``pp_index`` does not hold."""
    stages = split_stages(
        model, num_stages=plan.num_stages, split_points=plan.split_points, stage_modules=plan.stage_modules
    )
    mine = set(stages_of_rank(pp_index, plan.pipeline, plan.stages_per_rank))
    return {name for s, stage in enumerate(stages) if s not in mine for name in stage_state_names(model, stage)}


class PipelineExecutor:
    """Runs the pipeline stages of one rank.

    Args:
        model: the model holding the global parameters on ``env.device``, at least in this rank's stages (the
            others may be on the meta device: :mod:`fedcore.engine.materialize`); each rank trains only its
            stages' parameters.
        plan: the parallel plan (``pipeline >= 2``).
        env: this rank's place in the world (``pp_group`` and ``dp_group`` set).
        loss_fn: ``loss_fn(output, target, reduction="sum")``.
        tp_plan: the layers to split when ``plan.tensor_parallel > 1`` (this rank splits those of its stages).
    """

    def __init__(
        self,
        model: nn.Module,
        plan: ParallelPlan,
        env: RankEnv,
        loss_fn: LossFn,
        tp_plan: TensorParallelPlan | None = None,
    ) -> None:
        self.model = model
        self.plan = plan
        self.env = env
        self.loss_fn = loss_fn
        if plan.data_parallel > 1 and env.dp_group is not None:
            synchronize_batch_norm(model, env.dp_group)  # a stage's replicas hold the parts of one batch
        self.stages = split_stages(
            model, num_stages=plan.num_stages, split_points=plan.split_points, stage_modules=plan.stage_modules
        )
        self.my_stages = stages_of_rank(env.pp_index, plan.pipeline, plan.stages_per_rank)
        my_layers = [layer for s in self.my_stages for layer in self.stages[s]]
        if plan.tp_enabled:
            if env.tp_mesh is None or tp_plan is None:
                raise EngineError("tensor parallelism needs the tp mesh and a tensor-parallel plan", rank=env.rank)
            apply_plan(model, tp_plan, env.tp_mesh, only={name for name, _ in my_layers})
        if plan.compile:
            compile_layers(model, layers=my_layers)
        self.modules = [
            _AutocastChain(LayerChain(self.stages[s], checkpointing=plan.activation_checkpointing), plan, env.device)
            for s in self.my_stages
        ]
        self.first = 0 in self.my_stages
        self.last = plan.num_stages - 1 in self.my_stages
        names: set[str] = set()
        for s in self.my_stages:
            names.update(stage_state_names(model, self.stages[s]))
        self._names = names
        self._scale = 1.0
        self._schedules: dict[tuple[str, int, int], _PipelineSchedule] = {}

    def trained_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """``(global name, parameter)`` of this rank's stages."""
        return [(n, p) for n, p in self.model.named_parameters() if n in self._names and p.requires_grad]

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(output, target, reduction="sum") * self._scale

    def _schedule(self, kind: Schedule, microbatches: int, size: int) -> _PipelineSchedule:
        key = (kind.value, microbatches, size)
        if key not in self._schedules:
            stages: list[_PipelineStageBase] = [
                _Stage(module, s, self.plan.num_stages, self.env.device, group=self.env.pp_group)
                for module, s in zip(self.modules, self.my_stages, strict=True)
            ]
            loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = self._loss
            schedule: _PipelineSchedule
            if kind is Schedule.INTERLEAVED_1F1B:
                schedule = ScheduleInterleaved1F1B(stages, microbatches, loss_fn=loss, scale_grads=False)
            elif len(stages) > 1:
                schedule = ScheduleLoopedBFS(stages, microbatches, loss_fn=loss, scale_grads=False)
            elif kind is Schedule.ONE_F_ONE_B:
                schedule = Schedule1F1B(stages[0], microbatches, loss_fn=loss, scale_grads=False)
            else:
                schedule = ScheduleGPipe(stages[0], microbatches, loss_fn=loss, scale_grads=False)
            self._schedules[key] = schedule
        return self._schedules[key]

    def _steps(self, count: int) -> list[tuple[Schedule, int, int, int]]:
        """Split ``count`` samples into schedule steps ``(schedule, microbatches, size, samples)``."""
        m = self.plan.microbatches
        steps = []
        if count // m:
            steps.append((self.plan.schedule, m, count // m, (count // m) * m))
        tail = count % m
        if tail:
            kind = self.plan.schedule
            if kind is Schedule.ONE_F_ONE_B and tail < self.plan.pipeline:
                kind = Schedule.GPIPE
            if kind is Schedule.INTERLEAVED_1F1B and (tail < self.plan.pipeline or tail % self.plan.pipeline):
                kind = Schedule.GPIPE  # runs as looped BFS with several stages per rank
            steps.append((kind, tail, 1, tail))
        return steps

    def batch_rows(self, size: int) -> Rows:
        """The rows of a global batch of ``size`` samples this rank reads: its replica's shard, the inputs only
        when it holds the first stage and the targets only when it holds the last."""
        start, stop = part(size, self.plan.data_parallel, self.env.dp_index)
        return Rows(start, stop, inputs=self.first, targets=self.last)

    def forward_backward(self, batch: Batch) -> tuple[torch.Tensor, int]:
        """Accumulate this rank's stage gradients for one global batch, of which ``batch`` holds this replica's
        shard (:meth:`batch_rows`) on the device.

        Returns:
            ``(sum of per-sample losses as a float32 scalar on the device, samples)`` on the rank holding the last
            stage; ``(0, 0)`` elsewhere.
        """
        n = batch.size
        self._scale = 1.0 / n
        if (self.first and batch.x is None) or (self.last and batch.y is None):
            raise EngineError("a pipeline rank got no inputs for its first stage or no targets for its last",
                              rank=self.env.rank)  # fmt: skip
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.env.device)
        seen = 0
        for i in range(self.plan.grad_accum):
            start, stop = part(batch.rows, self.plan.grad_accum, i)
            for kind, microbatches, size, samples in self._steps(stop - start):
                rows = slice(start, start + samples)
                start += samples
                schedule = self._schedule(kind, microbatches, size)
                args = (batch.x[rows],) if batch.x is not None and self.first else ()
                if self.last and batch.y is not None:
                    losses: list[torch.Tensor] = []
                    schedule.step(*args, target=batch.y[rows], losses=losses, return_outputs=False)
                    loss_sum += torch.stack([loss.detach().float() for loss in losses]).sum() * n
                    seen += samples
                else:
                    schedule.step(*args, return_outputs=False)
        return loss_sum, seen

    def finish_gradients(self) -> None:
        """Sum the stage gradients over the data-parallel replicas (each holds a part of the batch).

        A parameter that got no gradient on any replica keeps none, as on one device (the optimizer then skips
        it: no weight decay, no momentum step).
        """
        if self.plan.data_parallel == 1 or self.env.dp_group is None:
            return
        sum_gradients([param for _, param in self.trained_parameters()], self.env.dp_group)

    def full_state(self) -> dict[str, torch.Tensor] | None:
        """The full model state in global names on rank 0 (CPU tensors), None elsewhere.

        Split tensors are gathered within each tensor-parallel group first; then the pipeline ranks of replica 0
        with ``tp_index == 0`` send their stages' tensors to rank 0 (plain tensor point-to-point, in
        ``state_dict`` order, which every rank knows: every rank built the whole module tree, on the meta device
        outside its own stages).

        Raises:
            ConfigError: a buffer of this rank's stages differs between the data-parallel replicas
                (:func:`~fedcore.engine.batch_stats.check_buffers_agree`).
        """
        if self.plan.data_parallel > 1 and self.env.dp_group is not None:
            mine = [(n, b) for n, b in self.model.named_buffers() if n in self._names]
            check_buffers_agree(mine, self.env.dp_group)
        state = {
            name: tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            for name, tensor in self.model.state_dict().items()
            if name in self._names or not isinstance(tensor, DTensor)
        }
        if self.env.dp_index != 0 or self.env.tp_index != 0:
            return None
        if self.env.rank != 0:
            for name in state:
                if name in self._names:
                    dist.send(state[name].detach().contiguous(), dst=0)
            return None
        owner: dict[str, int] = {}
        for stage_index, stage in enumerate(self.stages):
            for name in stage_state_names(self.model, stage):
                # global rank of (dp 0, pp rank_of_stage, tp 0)
                owner[name] = rank_of_stage(stage_index, self.plan.pipeline) * self.plan.tensor_parallel
        out: dict[str, torch.Tensor] = {}
        received: dict[str, torch.Tensor] = {}
        for source in range(
            self.plan.tensor_parallel, self.plan.total_ranks // self.plan.data_parallel, self.plan.tensor_parallel
        ):
            for name in state:
                if owner.get(name) == source:
                    buffer = torch.empty_like(state[name], device=self.env.device).contiguous()
                    dist.recv(buffer, src=source)
                    received[name] = buffer
        for name, tensor in state.items():
            out[name] = received.get(name, tensor).detach().to("cpu", copy=True)
        return out
