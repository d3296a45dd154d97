"""A tiny task for the process-pool tests: a linear model on 20 generated examples per partition.

Options name clients that misbehave: ``crash`` (the worker process kills itself with SIGKILL while training),
``slow`` (training sleeps ``slow_s`` seconds first). ``dtype=float64`` makes the model and data float64. Every fit
reports the worker's process id as metric ``pid``, and when its training began and ended (``time.time()``, seconds)
as ``started`` and ``ended``.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

import torch

from fedcore.supervised import SupervisedTask
from fedcore.task import FitConfig, TaskContext, TrainContext, TrainResult


def linear() -> torch.nn.Module:
    return torch.nn.Linear(4, 2)


def linear64() -> torch.nn.Module:
    return torch.nn.Linear(4, 2).double()


@dataclass(frozen=True, kw_only=True, eq=False)
class TinyTask(SupervisedTask):
    behaviour: str = ""
    slow_s: float = 0.0

    def train(self, model: torch.nn.Module, config: FitConfig, context: TrainContext) -> TrainResult:
        started = time.time()
        if self.behaviour == "crash":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.behaviour == "slow":
            time.sleep(self.slow_s)
        result = super().train(model, config, context)
        times = {"started": started, "ended": time.time()}
        return TrainResult(num_examples=result.num_examples, metrics={**result.metrics, "pid": os.getpid(), **times})


def tiny_task(context: TaskContext) -> TinyTask:
    pid = context.partition_id if context.partition_id is not None else 0
    generator = torch.Generator().manual_seed(1000 + pid)
    x = torch.randn(20, 4, generator=generator)
    y = (x.sum(dim=1) > 0).long()
    behaviour = next((k for k in ("crash", "slow") if context.client_id in context.options.get(k, "").split(",")), "")
    double = context.options.get("dtype") == "float64"
    return TinyTask(
        model_fn=linear64 if double else linear,
        train_data=(x.double() if double else x, y),
        behaviour=behaviour,
        slow_s=float(context.options.get("slow_s", "0")),
    )
