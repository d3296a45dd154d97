"""Steady-state training throughput of the engine, next to a plain PyTorch loop on the same model, in one run.

The standard case is a GPT-2-small-style model (124M parameters: 12 layers, d_model 768, 12 heads, sequence
1024, vocabulary 50304) in bf16 autocast with fp32 master weights, batch 16 x 1024 tokens, on CUDA. Each case
runs ``--warmup`` steps (CUDA start-up, cuDNN/cuBLAS autotuning, ``torch.compile``) that are not timed, then
``--steps`` timed steps: on CUDA between two CUDA events recorded after the warm-up step and after the last
step (one synchronization at the end), on the CPU with a wall clock. Printed per case: ms/step, tokens/s,
achieved TFLOP/s (``6 N + 12 L d T`` FLOPs per token, :func:`fedcore.engine.transformer.flops_per_token`), MFU
against the device's dense bf16 peak per rank, peak memory (``torch.cuda.max_memory_allocated``), and the ratio
to the plain loop. Every figure is checked before it is printed (positive, finite, under the peak); a failed
check ends the run with status 1.

Cases:

- ``plain`` / ``plain+compile``: a hand-written loop (zero_grad, forward under autocast, backward, fused SGD
  step), the whole model compiled with ``torch.compile`` in the second;
- ``engine`` / ``engine+compile``: :func:`fedcore.engine.runner.train_rank` in this process (a plan of all ones,
  ``compile=true``: layer by layer), the path a client with one GPU takes;
- multi-rank plans (``--plans dp2,tp2``): one process per rank started by this script (``--worker``), through
  the engine's own rendezvous and executors; skipped with a note when fewer devices than ranks are visible.

Both loops use SGD with momentum (the engine's local optimizer), fused on CUDA. The data are random tokens
(throughput does not depend on them).

    .venv/bin/python bench/engine_gpu.py                           # CUDA, the 124M model
    .venv/bin/python bench/engine_gpu.py --device cpu --tiny --plans dp2,tp2   # a small check on the CPU
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from fedcore.engine.plan import Device, ParallelPlan
from fedcore.engine.runner import make_optimizer, train_rank
from fedcore.engine.runtime import init_distributed, shutdown_distributed, single_process_env
from fedcore.engine.transformer import flops_per_token, gpt, lm_loss
from fedcore.supervised import SupervisedTask
from fedcore.task import FitConfig
from fedcore.tensors import from_state_dict

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "4090": 165.0}
"""Dense bf16 tensor-core peaks from the vendors' data sheets (TFLOP/s per GPU)."""

MULTI_RANK_PLANS = {
    "dp2": {"data_parallel": 2},
    "tp2": {"tensor_parallel": 2},
    "pp2": {"pipeline": 2, "split_points": ["blocks.{half}"], "microbatches": 4, "schedule": "1f1b"},
}
"""Plans ``--plans`` may name; ``{half}`` is replaced by half the number of layers."""


@dataclass(frozen=True)
class Shape:
    """The model and batch of one bench run."""

    vocab: int
    d_model: int
    layers: int
    heads: int
    seq_len: int
    batch: int
    tied: bool = True


STANDARD = Shape(vocab=50304, d_model=768, layers=12, heads=12, seq_len=1024, batch=16)
TINY = Shape(vocab=256, d_model=64, layers=2, heads=4, seq_len=64, batch=8)


class BenchError(Exception):
    """A figure that cannot be true (negative, not finite, above the peak): the measurement is broken."""


def build_model(shape: Shape) -> nn.Sequential:
    """The bench model (tied embeddings as in GPT-2, unless a pipeline splits them), seeded with 0."""
    torch.manual_seed(0)
    return gpt(
        vocab=shape.vocab,
        d_model=shape.d_model,
        layers=shape.layers,
        heads=shape.heads,
        seq_len=shape.seq_len,
        tie_embeddings=shape.tied,
    )


def tokens(shape: Shape, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``steps`` batches of random token windows: inputs and next-token targets, int64 ``(steps * B, T)``."""
    gen = torch.Generator().manual_seed(1)
    text = torch.randint(0, shape.vocab, (steps * shape.batch, shape.seq_len + 1), generator=gen)
    return text[:, :-1].contiguous(), text[:, 1:].contiguous()


class StepClock:
    """Times the steps after the first ``warmup``: CUDA events on CUDA (no synchronization until :meth:`seconds`),
    a wall clock on the CPU."""

    def __init__(self, device: torch.device, warmup: int) -> None:
        self.device = device
        self.warmup = warmup
        self.steps = 0
        self._start: torch.cuda.Event | float | None = None
        self._end: torch.cuda.Event | float | None = None

    def __call__(self, step: int) -> None:
        """Mark the end of optimizer step ``step`` (1-based)."""
        self.steps = step
        if step == self.warmup:
            self._start = self._mark()
        elif step > self.warmup:
            self._end = self._mark()

    def _mark(self) -> torch.cuda.Event | float:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self) -> tuple[float, int]:
        """``(seconds over the timed steps, number of timed steps)``; waits for the device once."""
        if self._start is None or self._end is None:
            raise BenchError(f"only {self.steps} steps ran, none after the {self.warmup} warm-up steps")
        timed = self.steps - self.warmup
        if isinstance(self._start, torch.cuda.Event) and isinstance(self._end, torch.cuda.Event):
            self._end.synchronize()
            return self._start.elapsed_time(self._end) / 1e3, timed
        return float(self._end) - float(self._start), timed  # type: ignore[arg-type]


def plain_loop(shape: Shape, device: torch.device, bf16: bool, compiled: bool, clock: StepClock, steps: int) -> None:
    """The reference: the loop a user writes by hand for this model."""
    model = build_model(shape).to(device)
    if compiled:
        model.compile()
    optimizer = make_optimizer(list(model.parameters()), FitConfig(lr=1e-3, momentum=0.9), device)
    x, y = (t.to(device) for t in tokens(shape, steps))
    model.train()
    for step in range(steps):
        xb, yb = x[step * shape.batch : (step + 1) * shape.batch], y[step * shape.batch : (step + 1) * shape.batch]
        optimizer.zero_grad(set_to_none=True)
        with _autocast(device, bf16):
            loss = lm_loss(model(xb), yb)
        loss.backward()
        optimizer.step()
        clock(step + 1)


def _autocast(device: torch.device, bf16: bool) -> contextlib.AbstractContextManager[object]:
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def engine_run(
    shape: Shape, plan: ParallelPlan, env_factory: Callable[[], object], clock: StepClock, steps: int
) -> float:
    """One round of the engine's loop (:func:`train_rank`) over ``steps`` batches; returns the round's loss."""
    x, y = tokens(shape, steps)
    task = SupervisedTask(model_fn=lambda: build_model(shape), train_data=(x, y), loss_fn=lm_loss)
    global_parameters = from_state_dict(build_model(shape).state_dict())
    config = FitConfig(local_epochs=1, batch_size=shape.batch, lr=1e-3, momentum=0.9)
    result = train_rank(
        task,
        global_parameters,
        config,
        plan,
        env_factory(),  # type: ignore[arg-type]
        seed=0,
        round=1,
        client_id="bench",
        on_step=clock,
    )
    return result.train_loss


@dataclass(frozen=True)
class Figures:
    """What one case measured."""

    label: str
    ranks: int
    ms_per_step: float
    tokens_per_s: float
    tflops: float
    mfu: float | None
    peak_gib: float | None

    def row(self, reference: Figures | None) -> str:
        mfu = f"{100 * self.mfu:5.1f} %" if self.mfu is not None else "  n/a  "
        mem = f"{self.peak_gib:6.2f} GiB" if self.peak_gib is not None else "     n/a  "
        ratio = f"{self.tokens_per_s / reference.tokens_per_s:5.2f}x" if reference else "   - "
        return (
            f"{self.label:>16} {self.ranks:>5} {self.ms_per_step:9.2f} {self.tokens_per_s:13,.0f} "
            f"{self.tflops:9.3g} {mfu:>8} {mem:>10} {ratio:>7}"
        )


def figures(
    label: str,
    seconds: float,
    timed: int,
    shape: Shape,
    flops: float,
    peak: float | None,
    ranks: int,
    peak_gib: float | None,
) -> Figures:
    """Turn a timing into figures, refusing any that cannot be true.

    Raises:
        BenchError: a time that is not positive and finite, or an achieved rate above the ranks' peak.
    """
    if not (math.isfinite(seconds) and seconds > 0 and timed > 0):
        raise BenchError(f"{label}: {timed} steps took {seconds!r} s; a steady-state time must be positive")
    per_step = seconds / timed
    tokens_per_s = shape.batch * shape.seq_len / per_step  # the global batch, whatever the plan
    tflops = tokens_per_s * flops / 1e12
    mfu = tflops / (peak * ranks) if peak else None
    if mfu is not None and not 0 < mfu <= 1:
        raise BenchError(f"{label}: {tflops:.1f} TFLOP/s is {100 * mfu:.1f} % of the peak {peak} x {ranks}")
    if peak_gib is not None and not peak_gib > 0:
        raise BenchError(f"{label}: peak memory {peak_gib} GiB")
    return Figures(label, ranks, per_step * 1e3, tokens_per_s, tflops, mfu, peak_gib)


@contextlib.contextmanager
def measured_memory(device: torch.device) -> Iterator[list[float | None]]:
    """Yields a one-item list that holds the peak GiB allocated on ``device`` during the block (None on CPU)."""
    out: list[float | None] = [None]
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    yield out
    if device.type == "cuda":
        out[0] = torch.cuda.max_memory_allocated(device) / 2**30


def run_worker(spec_path: Path, rank: int) -> None:
    """One rank of a multi-rank plan (``--worker``): rank 0 writes its step timing next to the spec."""
    spec = json.loads(spec_path.read_text())
    shape = Shape(**spec["shape"])
    plan = ParallelPlan.from_mapping(spec["plan"])
    device = Device(spec["device"])
    env = init_distributed(plan, device, rank=rank, init_method=spec["init_method"])
    try:
        clock = StepClock(env.device, spec["warmup"])
        with measured_memory(env.device) as peak:
            engine_run(shape, plan, lambda: env, clock, spec["warmup"] + spec["steps"])
            seconds, timed = clock.seconds()
        if rank == 0:
            out = {"seconds": seconds, "timed": timed, "peak_gib": peak[0]}
            spec_path.with_name("timing.json").write_text(json.dumps(out))
    finally:
        shutdown_distributed()


def run_plan_in_workers(
    name: str, plan: ParallelPlan, shape: Shape, device: Device, warmup: int, steps: int
) -> tuple[float, int, float | None]:
    """Start one ``--worker`` process per rank and return rank 0's ``(seconds, timed steps, peak GiB)``."""
    with tempfile.TemporaryDirectory(prefix="fedcore-bench-") as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec = {
            "shape": shape.__dict__,
            "plan": plan.to_mapping(),
            "device": device.value,
            "warmup": warmup,
            "steps": steps,
            "init_method": (Path(tmp) / "rendezvous").as_uri(),
        }
        spec_path.write_text(json.dumps(spec))
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // plan.total_ranks))}
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--worker", str(spec_path), str(rank)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            for rank in range(plan.total_ranks)
        ]
        outputs = [p.communicate(timeout=1800)[0].decode(errors="replace") for p in procs]
        failed = [(r, out) for r, (p, out) in enumerate(zip(procs, outputs, strict=True)) if p.returncode]
        if failed:
            rank, out = failed[0]
            raise BenchError(f"{name}: rank {rank} failed:\n{out[-3000:]}")
        timing = json.loads((Path(tmp) / "timing.json").read_text())
        return float(timing["seconds"]), int(timing["timed"]), timing["peak_gib"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer d=64 model with 8 x 64 tokens (CPU checks)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps (default 10 on CUDA, 2 on CPU)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 30 on CUDA, 5 on CPU)")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (default 16; tiny 8)")
    parser.add_argument("--precision", choices=["bf16", "fp32"], default=None, help="default bf16 on CUDA")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile cases")
    parser.add_argument(
        "--plans", default="", help=f"multi-rank plans to add, comma-separated: {list(MULTI_RANK_PLANS)}"
    )
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's dense peak, per rank")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    parser.add_argument("--worker", nargs=2, metavar=("SPEC", "RANK"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(Path(args.worker[0]), int(args.worker[1]))
        return 0
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("engine_gpu: no CUDA device is visible; run with --device cpu --tiny for a CPU check")
        return 0
    cpu = device.type == "cpu"
    shape = TINY if args.tiny else STANDARD
    if args.batch:
        shape = Shape(**{**shape.__dict__, "batch": args.batch})
    warmup = args.warmup if args.warmup is not None else (2 if cpu else 10)
    steps = args.steps if args.steps is not None else (5 if cpu else 30)
    if warmup < 1 or steps < 1:
        parser.error("--warmup and --steps must be >= 1")
    precision = args.precision or ("fp32" if cpu else "bf16")
    bf16 = precision == "bf16"
    if cpu and bf16:
        parser.error("bf16 autocast is measured on CUDA only; use --precision fp32 on the CPU")
    name = torch.cuda.get_device_name(0) if not cpu else "CPU"
    peak = args.peak_tflops or (next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None) if bf16 else None)
    devices = torch.cuda.device_count() if not cpu else (os.cpu_count() or 1)
    with torch.device("meta"):
        flops = flops_per_token(build_model(shape), seq_len=shape.seq_len)
        params = sum(p.numel() for p in build_model(shape).parameters())
    print(
        f"{name} x{devices if not cpu else 1}; GPT {params / 1e6:.1f} M params ({shape.layers} layers, "
        f"d {shape.d_model}, {shape.heads} heads), batch {shape.batch} x {shape.seq_len} tokens, {precision}; "
        f"{flops / 1e6:.0f} MFLOP/token; peak {peak or 'unknown'} TFLOP/s per rank; "
        f"{warmup} warm-up + {steps} timed steps; torch {torch.__version__}"
    )
    cases: list[tuple[str, Callable[[StepClock], None], int]] = []
    single_env = single_process_env(Device(device.type))
    for compiled in (False, True) if not args.no_compile else (False,):
        suffix = "+compile" if compiled else ""
        cases.append((f"plain{suffix}", lambda c, k=compiled: plain_loop(shape, device, bf16, k, c, warmup + steps), 1))
        plan = ParallelPlan(precision=precision, compile=compiled, device=device.type)  # type: ignore[arg-type]
        cases.append(
            (
                f"engine{suffix}",
                lambda c, p=plan: _checked_loss(engine_run(shape, p, lambda: single_env, c, warmup + steps)),
                1,
            )
        )
    rows: list[Figures] = []
    reference: dict[bool, Figures] = {}
    for label, run, ranks in cases:
        clock = StepClock(device, warmup)
        with measured_memory(device) as peak_mem:
            run(clock)
            seconds, timed = clock.seconds()
        fig = figures(label, seconds, timed, shape, flops, peak, ranks, peak_mem[0])
        compiled = label.endswith("+compile")
        if label.startswith("plain"):
            reference[compiled] = fig
        rows.append(fig)
    for name_ in [p for p in args.plans.split(",") if p]:
        if name_ not in MULTI_RANK_PLANS:
            parser.error(f"unknown plan {name_!r}; known: {list(MULTI_RANK_PLANS)}")
        table = {
            k: [v.format(half=shape.layers // 2) for v in val] if isinstance(val, list) else val
            for k, val in MULTI_RANK_PLANS[name_].items()
        }
        plan = ParallelPlan.from_mapping({**table, "precision": precision, "device": device.type})
        if not cpu and plan.total_ranks > devices:
            print(f"{name_:>16}: skipped: needs {plan.total_ranks} GPUs, {devices} visible")
            continue
        plan_shape = Shape(**{**shape.__dict__, "tied": not plan.pp_enabled})  # stages cannot share a weight
        seconds, timed, peak_gib = run_plan_in_workers(name_, plan, plan_shape, Device(device.type), warmup, steps)
        rows.append(figures(f"engine {name_}", seconds, timed, shape, flops, peak, plan.total_ranks, peak_gib))
    print(
        f"{'case':>16} {'ranks':>5} {'ms/step':>9} {'tokens/s':>13} {'TFLOP/s':>9} {'MFU':>8} "
        f"{'peak mem':>10} {'vs plain':>7}"
    )
    for fig in rows:
        ref = reference.get(fig.label.endswith("+compile"), reference.get(False))
        print(fig.row(None if fig.label.startswith("plain") else ref))
    if args.json:
        args.json.write_text(json.dumps([fig.__dict__ for fig in rows], indent=1))
    return 0


def _checked_loss(loss: float) -> None:
    if not np.isfinite(loss):
        raise BenchError(f"the engine's training loss is {loss}")


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as exc:
        print(f"engine_gpu: FAILED: {exc}", file=sys.stderr)
        sys.exit(1)
