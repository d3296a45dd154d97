"""Tokens/s and model FLOPs utilization (MFU) of the shakespeare transformer under one device, DDP and pipeline.

For CUDA machines; without CUDA it prints why and exits 0. Plans that need more GPUs than are visible are
skipped with a note. Each plan runs the full engine path (``train_with_plan``) twice, with ``S`` and ``2S``
optimizer steps; the difference removes process start-up and shape inference, so the figures are steady state.
MFU = model FLOPs per second / peak (``6 * params * seq_len + 12 * layers * d * seq_len^2`` per sample, the
PaLM-paper approximation; peak from ``--peak-tflops`` or a small table of dense bf16 peaks).

    .venv/bin/python bench/engine_gpu.py [--steps 20] [--batch 64] [--d-model 256] [--layers 8]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from fedcore.engine import ParallelPlan, train_with_plan
from fedcore.task import FitConfig, TaskContext
from fedcore.tensors import from_state_dict
from simulations.shakespeare import SEQ_LEN, char_transformer, model_flops_per_sample

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "4090": 165.0}
"""Dense bf16 tensor-core peaks from the vendors' data sheets (TFLOP/s)."""


def _peak(name: str, given: float | None) -> float | None:
    if given:
        return given
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--peak-tflops", type=float, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("engine_gpu: skipped: no CUDA device is visible (this benchmark measures GPU throughput)")
        return 0
    gpus = torch.cuda.device_count()
    name = torch.cuda.get_device_name(0)
    peak = _peak(name, args.peak_tflops)
    half = args.layers // 2
    plans = {
        "one device": ParallelPlan(precision=args.precision, device="cuda"),  # type: ignore[arg-type]
        "DDP x2": ParallelPlan(data_parallel=2, precision=args.precision, device="cuda"),  # type: ignore[arg-type]
        "pipeline x2 1F1B m=4": ParallelPlan(
            pipeline=2,
            split_points=(f"blocks.{half}",),
            microbatches=4,
            schedule="1f1b",  # type: ignore[arg-type]
            precision=args.precision,
            device="cuda",  # type: ignore[arg-type]
        ),
    }
    options = {
        "stride": "1",
        "max_samples": str(args.batch * args.steps * 2),
        "d_model": str(args.d_model),
        "layers": str(args.layers),
    }
    ctx = TaskContext(client_id="hamlet/HAMLET", options=options)
    torch.manual_seed(0)
    model = char_transformer(args.d_model, args.layers)
    flops = model_flops_per_sample(model, d_model=args.d_model, layers=args.layers)
    global_parameters = from_state_dict(model.state_dict())
    print(
        f"{name} x{gpus}; model {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M params, "
        f"{flops / 1e9:.2f} GFLOP per sample; peak {peak or 'unknown'} TFLOP/s ({args.precision})"
    )
    for label, plan in plans.items():
        if plan.total_ranks > gpus:
            print(f"{label:>22}: skipped: needs {plan.total_ranks} GPUs, {gpus} visible")
            continue
        timings = []
        for steps in (args.steps, 2 * args.steps):
            config = FitConfig(local_epochs=1, batch_size=args.batch, lr=0.1, max_steps=steps)
            start = time.perf_counter()
            train_with_plan(
                "simulations.shakespeare:shakespeare_task",
                ctx,
                global_parameters,
                config,
                plan,
                seed=0,
                round=1,
                client_id="bench",
            )
            timings.append(time.perf_counter() - start)
        per_step = (timings[1] - timings[0]) / args.steps
        samples_s = args.batch / per_step
        tokens_s = samples_s * SEQ_LEN
        achieved = samples_s * flops / 1e12
        mfu = f"{100 * achieved / (peak * plan.total_ranks):5.1f} %" if peak else "n/a"
        print(
            f"{label:>22}: {per_step * 1e3:8.2f} ms/step  {tokens_s:12,.0f} tokens/s  "
            f"{achieved:7.2f} TFLOP/s  MFU {mfu}  (wall {timings[0]:.1f}s / {timings[1]:.1f}s)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
