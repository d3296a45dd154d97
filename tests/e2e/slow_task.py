"""A demo task whose training also sleeps (option ``sleep_s``; from round ``sleep_from_round`` on, default 1), and
whose clients' evaluation sleeps ``eval_sleep_s`` (default 0), so a test can act while a round is in flight."""

from __future__ import annotations

import dataclasses
import time

import torch

from fedcore.task import FitConfig, Task, TaskContext, TrainContext, TrainResult
from simulations.tasks import demo_task


class _Slow:
    def __init__(self, inner: Task, sleep_s: float, from_round: int, eval_sleep_s: float = 0.0) -> None:
        self._inner = inner
        self._sleep_s = sleep_s
        self._from_round = from_round
        self._eval_sleep_s = eval_sleep_s

    def build_model(self) -> torch.nn.Module:
        return self._inner.build_model()

    def train(self, model: torch.nn.Module, config: FitConfig, context: TrainContext) -> TrainResult:
        if context.round >= self._from_round:
            time.sleep(self._sleep_s)
        return self._inner.train(model, config, context)

    def evaluate(self, model: torch.nn.Module, batch_size: int):  # type: ignore[no-untyped-def]
        time.sleep(self._eval_sleep_s)
        return self._inner.evaluate(model, batch_size)


def slow_demo_task(context: TaskContext) -> Task:
    options = dict(context.options)
    sleep_s = float(options.pop("sleep_s", "0"))
    from_round = int(options.pop("sleep_from_round", "1"))
    eval_sleep_s = float(options.pop("eval_sleep_s", "0")) if context.role == "client" else 0.0
    options.pop("eval_sleep_s", None)
    return _Slow(demo_task(dataclasses.replace(context, options=options)), sleep_s, from_round, eval_sleep_s)
