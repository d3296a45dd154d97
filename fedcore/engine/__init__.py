"""The local training engine for large models: data parallel (DDP), sharded (FSDP2), tensor parallel, pipeline.

A client hands :func:`train_with_plan` its task factory, the global model and a :class:`ParallelPlan`, and gets
back the updated model (global names and dtypes) and the training result. A plan of all ones trains
in-process; any other plan runs ``data_parallel * pipeline * tensor_parallel`` worker processes on
torch.distributed (gloo on CPU, NCCL on CUDA). Tensor parallelism: :mod:`fedcore.engine.tensor_parallel`; the
transformer blocks that declare their splits: :mod:`fedcore.engine.transformer`. Ranks build the model on the
meta device and create only the stages or shards they hold (:mod:`fedcore.engine.materialize`); batches come
from a prefetching loader that overlaps host work and copies with GPU work (:mod:`fedcore.engine.loader`). See
the README section "Training large models on a client".

Every plan trains the model that single-device training gives, or is refused with a ``ConfigError`` before any
worker starts; never a silently different model. For modules with batch statistics (BatchNorm; InstanceNorm
that tracks running statistics), see :mod:`fedcore.engine.batch_stats`:

==========================================  ==============================================================
plan                                        BatchNorm (parameters and running buffers)
==========================================  ==============================================================
all ones (in-process)                       as single-device training
DDP, FSDP2 (``data_parallel >= 2``)         statistics over the global batch (synchronized over the
                                            ranks); refused when a batch has fewer samples than ranks
pipeline, ``microbatches == 1`` (GPipe)     as single-device; shape inference leaves the buffers alone
pipeline x data parallel, ``m == 1``        statistics synchronized over the replicas of each stage
``microbatches > 1``, ``grad_accum > 1``    refused: a micro-batch's statistics are not the batch's
activation checkpointing                    as single-device: recomputation restores the buffers
InstanceNorm(track_running_stats) x DP      refused: running statistics are not synchronized
other buffers that differ between DP ranks  the round fails (EngineError) naming them
==========================================  ==============================================================

Also refused before start: tied weights under FSDP2 (use DDP), a pipeline split between tied weights, a
tensor-parallel degree without a declared plan or that does not divide the split layers (or heads). DDP with
a module unused in ``forward`` fails at its first step (``EngineError`` with the worker's ``ConfigError``) naming
the parameters, unless the plan sets ``find_unused_parameters``. Workers are bounded by ``timeout_s`` and die
with their caller.
"""

from typing import TYPE_CHECKING

from fedcore.engine.plan import Device, ParallelPlan, Precision
from fedcore.engine.schedules import Schedule, bubble_fraction

if TYPE_CHECKING:
    from fedcore.engine.train import train_with_plan


def __getattr__(name: str) -> object:
    # train_with_plan on first use: it imports torch.distributed's tensor and pipelining modules (seconds of CPU),
    # which a daemon or server that only reads a plan (fedcore.engine.plan) does not need
    if name == "train_with_plan":
        from fedcore.engine.train import train_with_plan

        return train_with_plan
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Device", "ParallelPlan", "Precision", "Schedule", "bubble_fraction", "train_with_plan"]
