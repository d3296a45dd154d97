"""bench/engine_gpu.py's figures: computed by hand, and impossible ones refused before anything is printed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch


def _bench() -> ModuleType:
    path = Path(__file__).parents[2] / "bench" / "engine_gpu.py"
    spec = importlib.util.spec_from_file_location("engine_gpu_bench", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


bench = _bench()


def test_figures_by_hand() -> None:
    shape = bench.STANDARD  # 16 x 1024 tokens a step
    fig = bench.figures("engine", 2.0, 40, shape, 1e9, 989.0, 1, 10.0)
    assert fig.ms_per_step == pytest.approx(50.0)
    assert fig.tokens_per_s == pytest.approx(16 * 1024 / 0.05)  # 327,680
    assert fig.tflops == pytest.approx(327_680 * 1e9 / 1e12)
    assert fig.mfu == pytest.approx(327.68 / 989.0)
    assert bench.figures("dp2", 2.0, 40, shape, 1e9, 989.0, 2, None).mfu == pytest.approx(327.68 / 1978.0)


@pytest.mark.parametrize(
    ("seconds", "timed", "flops", "message"),
    [
        (-0.11, 20, 1e9, "must be positive"),  # the old bench's "long run minus short run"
        (0.0, 20, 1e9, "must be positive"),
        (float("nan"), 20, 1e9, "must be positive"),
        (1.0, 0, 1e9, "must be positive"),
        (0.001, 40, 1e9, r"of the peak 989.0 x 1"),  # 655 PFLOP/s: impossible on one GPU
    ],
)
def test_impossible_figures_are_refused(seconds: float, timed: int, flops: float, message: str) -> None:
    with pytest.raises(bench.BenchError, match=message):
        bench.figures("engine", seconds, timed, bench.STANDARD, flops, 989.0, 1, 10.0)


def test_clock_times_only_the_steps_after_the_warm_up() -> None:
    clock = bench.StepClock(torch.device("cpu"), warmup=2)
    clock(1)
    with pytest.raises(bench.BenchError, match="none after the 2 warm-up steps"):
        clock.seconds()
    for step in (2, 3, 4, 5):
        clock(step)
    seconds, timed = clock.seconds()
    assert timed == 3 and seconds > 0
