"""The local training engine for large models: data parallel (DDP), sharded (FSDP2), pipeline parallel.

A client hands :func:`train_with_plan` its task factory, the global model and a :class:`ParallelPlan`, and gets
back the updated model (global names and dtypes) and the training result. A plan of all ones trains
in-process; any other plan runs ``data_parallel * pipeline`` worker processes on torch.distributed (gloo on
CPU, NCCL on CUDA). See ``docs/engine.md``.
"""

from fedcore.engine.plan import Device, ParallelPlan, Precision
from fedcore.engine.schedules import Schedule, bubble_fraction
from fedcore.engine.train import train_with_plan

__all__ = ["Device", "ParallelPlan", "Precision", "Schedule", "bubble_fraction", "train_with_plan"]
