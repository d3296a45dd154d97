"""Modules whose training step depends on the batch (BatchNorm and others with running buffers), per plan.

A BatchNorm layer in training mode normalizes with the statistics of the samples it sees and folds them into
its running buffers (``running_mean``, ``running_var``, ``num_batches_tracked``). A plan that shows a layer
other samples than single-device training does, or runs it more often, gives a different model. The engine
makes every plan equal to single-device training or refuses it before any worker starts:

- data parallel (DDP and FSDP2): each BatchNorm computes its statistics over the whole global batch, summed
  over the data-parallel ranks (:func:`synchronize_batch_norm`, like ``nn.SyncBatchNorm``, which is CUDA-only);
  every batch must give each rank at least one sample (:func:`check_batches`);
- gradient accumulation (``grad_accum > 1``) and pipeline micro-batches (``microbatches > 1``): refused, since a
  micro-step's statistics are those of a part of the batch (:func:`check_batch_statistics`);
- pipeline shape inference and activation checkpointing recomputation: run the layers again, so they run with
  every buffer restored afterwards (:func:`preserved_buffers`), shape inference also in eval mode, so it never
  counts in ``num_batches_tracked`` nor reads an uninitialized inference input into ``running_var``;
- ``InstanceNorm`` with ``track_running_stats=True``: per-sample normalization, but running statistics averaged
  over the batch; refused with data parallelism, gradient accumulation or micro-batches.

Restoring buffers around recomputation and shape inference covers any module with buffers, not only these.
Any other buffer a module updates from its rank's samples (a custom running statistic) ends the round with a
ConfigError naming it, since it cannot be known before training: after training, the data-parallel ranks
compare their buffers (:func:`check_buffers_agree`), rather than return rank 0's; and under ``grad_accum > 1``
or ``microbatches > 1``, where such a module runs once per micro-step on a part of the batch, a persistent buffer
that the first step changes ends it too (:func:`BufferWatch`).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

from fedcore.errors import ConfigError

if TYPE_CHECKING:
    from fedcore.engine.plan import ParallelPlan

_ADVICE = "or use a per-sample normalization (GroupNorm, LayerNorm)"


def batch_statistics_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of the modules whose training-mode step depends on which samples share a batch.

    These are every ``_BatchNorm`` (``BatchNorm1d/2d/3d``, ``SyncBatchNorm``, lazy variants) and every
    ``_InstanceNorm`` that tracks running statistics.
    """
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if isinstance(module, _BatchNorm) or (isinstance(module, _InstanceNorm) and module.track_running_stats):
            found.append((name or "<model>", module))
    return found


def check_batch_statistics(plan: ParallelPlan, model: nn.Module) -> None:
    """Refuse the plans under which a batch-statistics module would train differently from a single device.

    Raises:
        ConfigError: ``grad_accum > 1`` or ``microbatches > 1`` with any such module, or data parallelism with
            an ``InstanceNorm`` that tracks running statistics. The message names the modules and what to change.
    """
    found = batch_statistics_modules(model)
    if not found:
        return
    names = ", ".join(f"{name!r} ({type(module).__name__})" for name, module in found[:5])
    if len(found) > 5:
        names += f" and {len(found) - 5} more"
    if plan.grad_accum > 1:
        raise ConfigError(
            f"parallel plan: grad_accum={plan.grad_accum} with {names}: each micro-step would normalize with the "
            "statistics of a part of the batch and update the running statistics once per micro-step, unlike "
            f"single-device training; set grad_accum=1 (use data_parallel to split a batch), {_ADVICE}"
        )
    if plan.microbatches > 1:
        raise ConfigError(
            f"parallel plan: microbatches={plan.microbatches} with {names}: each pipeline micro-batch would be "
            "normalized with its own statistics, unlike single-device training; set microbatches=1 with "
            f"schedule='gpipe' (or a smaller batch_size), {_ADVICE}"
        )
    instance = [name for name, module in found if isinstance(module, _InstanceNorm)]
    if instance and plan.dp_enabled:
        raise ConfigError(
            f"parallel plan: data_parallel={plan.data_parallel} with InstanceNorm modules that track running "
            f"statistics ({instance[:5]}): their running statistics are not synchronized over the ranks; set "
            "track_running_stats=False or data_parallel=1"
        )


def check_batches(plan: ParallelPlan, model: nn.Module, num_examples: int, batch_size: int) -> None:
    """Refuse data that gives a data-parallel rank an empty part of a batch when BatchNorm is synchronized.

    Every rank must take part in each synchronized normalization, and a pipeline replica with no samples runs no
    schedule step. The smallest batch is ``num_examples % batch_size`` (or ``batch_size``).

    Raises:
        ConfigError: the smallest batch has fewer samples than ``plan.data_parallel``.
    """
    if not plan.dp_enabled or num_examples == 0 or not batch_statistics_modules(model):
        return
    smallest = min(batch_size, num_examples) if num_examples % batch_size == 0 else num_examples % batch_size
    if smallest < plan.data_parallel:
        raise ConfigError(
            f"a batch of {smallest} samples ({num_examples} examples in batches of {batch_size}) cannot be split "
            f"over data_parallel={plan.data_parallel} ranks for BatchNorm statistics; choose a batch_size that "
            f"leaves at least {plan.data_parallel} samples in the last batch, or a smaller data_parallel"
        )


def synchronize_batch_norm(model: nn.Module, group: dist.ProcessGroup) -> int:
    """Make every ``_BatchNorm`` of ``model`` normalize over the batch held by all ranks of ``group``.

    In training mode each such module computes the per-channel mean and (biased) variance over the samples of
    every rank (two all-reduces, differentiable: the gradient is that of the loss summed over the ranks, which
    data parallelism then averages), normalizes with them, and updates its running statistics as
    ``nn.BatchNorm`` does on one device (unbiased variance, ``momentum``, or the cumulative average when
    ``momentum`` is None), so every rank holds the same buffers. In eval mode it is the unchanged module. The
    modules keep their names, parameters and buffers; only their ``forward`` is replaced.

    Returns:
        The number of modules synchronized.
    """
    count = 0
    for _, module in batch_statistics_modules(model):
        if isinstance(module, _BatchNorm):
            module._fedcore_group = group  # type: ignore[assignment]
            module.forward = types.MethodType(_synchronized_forward, module)  # type: ignore[method-assign]
            count += 1
    return count


def _synchronized_forward(self: _BatchNorm, x: torch.Tensor) -> torch.Tensor:
    if not self.training:
        return type(self).forward(self, x)
    self._check_input_dim(x)
    group: dist.ProcessGroup = self._fedcore_group  # type: ignore[assignment]
    dims = [d for d in range(x.dim()) if d != 1]
    channels = x.shape[1]
    shape = [1, channels] + [1] * (x.dim() - 2)
    local_count = torch.full((1,), float(x.numel() // channels if channels else 0), dtype=x.dtype, device=x.device)
    totals = dist_fn.all_reduce(torch.cat([x.sum(dim=dims), local_count]), group=group)
    count = float(totals[-1].detach())
    if count <= 1:
        raise ConfigError(
            f"BatchNorm got {count:.0f} value per channel over all ranks in training mode (as on one device, it "
            "needs more than 1); use a batch_size that leaves at least 2 samples in every batch"
        )
    mean = totals[:-1] / count
    centered = x - mean.reshape(shape)
    var = dist_fn.all_reduce((centered * centered).sum(dim=dims), group=group) / count
    if self.training and self.track_running_stats and self.num_batches_tracked is not None:
        self.num_batches_tracked.add_(1)
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        with torch.no_grad():
            if self.running_mean is not None and self.running_var is not None:
                self.running_mean.mul_(1 - factor).add_(mean.detach(), alpha=factor)
                self.running_var.mul_(1 - factor).add_(var.detach() * (count / (count - 1)), alpha=factor)
    out = centered * torch.rsqrt(var + self.eps).reshape(shape)
    if self.weight is not None:
        out = out * self.weight.reshape(shape)
    if self.bias is not None:
        out = out + self.bias.reshape(shape)
    return out


@contextlib.contextmanager
def preserved_buffers(module: nn.Module, *, eval_mode: bool = False) -> Iterator[None]:
    """Run a block that must leave no trace in ``module``'s buffers: they are restored on exit.

    Used around activation-checkpointing recomputation (a layer's forward runs a second time in the backward
    pass) and around pipeline shape inference. With ``eval_mode`` the block also runs with every submodule in
    eval mode (no batch statistics, no dropout draws), and the training flags are restored on exit.
    """
    saved = [(buffer, buffer.detach().clone()) for buffer in module.buffers()]
    modes = [(m, m.training) for m in module.modules()] if eval_mode else []
    if eval_mode:
        module.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training
        with torch.no_grad():
            for buffer, value in saved:
                if not torch.equal(buffer, value):
                    # through .data: no version bump, so a graph that saved the buffer (eval-mode BatchNorm saves
                    # running_var for its backward) stays usable
                    buffer.data.copy_(value)


def check_buffers_agree(buffers: list[tuple[str, torch.Tensor]], group: dist.ProcessGroup) -> None:
    """After training, check that every data-parallel rank holds the same buffers; call it on every rank.

    Buffers that a module updates from the samples it sees (a custom running average, say) would differ: each
    rank saw its own part of the batch, and the returned model would hold rank 0's values, unlike single-device
    training. BatchNorm statistics are synchronized (:func:`synchronize_batch_norm`) and pass; so do buffers
    every rank updates alike (counters). Two all-reduces (max and min of all buffers), whatever their number.

    Raises:
        ConfigError: on every rank, naming the buffers that differ.
    """
    if not buffers:
        return
    values = torch.cat([t.detach().reshape(-1).to(torch.float64) for _, t in buffers])
    nan = values.isnan()
    # a NaN compared unequal to itself, so a buffer holding one (a "not set" marker) was named on every rank: the
    # values go with the NaN replaced, beside a mask of where the NaN are, which must agree too
    flat = torch.cat([values.masked_fill(nan, 0.0), nan.to(torch.float64)])
    high, low = flat.clone(), flat.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    count = values.numel()
    differs = ((high[:count] != low[:count]) | (high[count:] != low[count:])).tolist()
    names, start = [], 0
    for name, tensor in buffers:
        if any(differs[start : start + tensor.numel()]):
            names.append(name)
        start += tensor.numel()
    if names:
        raise ConfigError(
            f"buffers {names[:10]} differ between the data-parallel ranks after training: their modules update "
            "them from each rank's part of the batch, so the model would differ from single-device training (only "
            "BatchNorm statistics are synchronized); train this model with data_parallel=1"
        )


class BufferWatch:
    """Refuse a model whose training step changes a persistent buffer when a plan cuts the batch into micro-steps.

    Under ``grad_accum > 1`` or pipeline ``microbatches > 1`` each module runs once per micro-step on a part of the
    batch; a module that updates a buffer from what it sees (a custom running statistic, a step counter) then
    updates it more often and from other samples than single-device training does, and the returned model would
    differ. Batch-statistics modules are refused before start (:func:`check_batch_statistics`); for any other
    module this cannot be known before it runs, so :meth:`check` compares the persistent buffers (those returned
    in the update) after the first step with their values before it. Non-persistent buffers (caches) are not
    returned and are not watched.
    """

    def __init__(self, model: nn.Module) -> None:
        persistent = set(model.state_dict(keep_vars=True))
        self._saved = [
            (name, buffer, buffer.detach().clone())
            for name, buffer in model.named_buffers()
            if name in persistent and not buffer.is_meta  # meta: another pipeline rank's stage
        ]

    def check(self, plan: ParallelPlan) -> None:
        """Call once, after the first step.

        Raises:
            ConfigError: naming the buffers the step changed, and the plan options that split the batch.
        """
        changed = [name for name, buffer, before in self._saved if not _same(buffer.detach(), before)]
        self._saved = []
        if changed:
            splits = [
                f"{key}={value}"
                for key, value in (("grad_accum", plan.grad_accum), ("microbatches", plan.microbatches))
                if value > 1
            ]
            raise ConfigError(
                f"buffers {changed[:10]} change in training: with {' and '.join(splits)} their modules run once per "
                "micro-step on a part of the batch, so they would be updated more often and from other samples than "
                "in single-device training; set grad_accum=1 and microbatches=1 (use data_parallel to split a "
                "batch), or keep the statistic out of the model's persistent buffers"
            )


def _same(now: torch.Tensor, before: torch.Tensor) -> bool:
    """Whether a buffer holds what it held: equal values, a NaN where there was a NaN (``torch.equal`` alone calls a
    constant buffer holding a NaN, e.g. a "not set yet" marker, changed)."""
    if torch.equal(now, before):
        return True
    if not now.is_floating_point() or now.shape != before.shape or now.dtype != before.dtype:
        return False
    nan = now.isnan()
    return torch.equal(nan, before.isnan()) and torch.equal(now[~nan], before[~nan])
