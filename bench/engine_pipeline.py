"""Pipeline bubble on CPU processes: measured idle fraction against GPipe's (p-1)/(m+p-1).

Each of ``p`` stages is a uniform synthetic layer whose forward takes ``t`` seconds and whose backward takes
``2t`` (a sleep, so the measurement shows the schedule, not how many cores the machine has). With ``m``
micro-batches, a rank is busy ``3 t m`` per step; the measured bubble is ``1 - busy / step time``.

    .venv/bin/python bench/engine_pipeline.py [--stages 2] [--micro 1,2,4,8] [--t-ms 20] [--schedule gpipe]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from fedcore.engine.schedules import bubble_fraction


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor, seconds: float) -> torch.Tensor:
        time.sleep(seconds)
        ctx.seconds = seconds  # type: ignore[attr-defined]
        return x * 1.0

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(2 * ctx.seconds)  # type: ignore[attr-defined]
        return grad, None


class UniformStage(nn.Module):
    """A stage that costs ``seconds`` forward and ``2 * seconds`` backward per micro-batch."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x * self.scale, self.seconds)


def _worker(rank: int, p: int, rendezvous: str, micro: list[int], seconds: float, schedule: str, steps: int) -> None:
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=p)
    module = UniformStage(seconds)
    for m in micro:
        stage = PipelineStage(module, rank, p, torch.device("cpu"))
        kind = Schedule1F1B if schedule == "1f1b" and m >= p else ScheduleGPipe
        sched = kind(stage, m, loss_fn=lambda out, tgt: ((out - tgt) ** 2).sum())
        x, y = torch.ones(m, 4), torch.zeros(m, 4)
        times = []
        for i in range(steps + 1):
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                sched.step(x)
            elif rank == p - 1:
                sched.step(target=y, losses=[])
            else:
                sched.step()
            dist.barrier()
            if i:  # the first step infers shapes
                times.append(time.perf_counter() - start)
        if rank == 0:
            step = min(times)
            busy = 3 * seconds * m
            measured = 1 - busy / step
            theory = bubble_fraction(p, m)
            print(
                f"{kind.__name__:>14}  p={p}  m={m:<3d} step={step * 1e3:7.1f} ms  busy={busy * 1e3:7.1f} ms  "
                f"bubble measured={measured:6.3f}  theory (p-1)/(m+p-1)={theory:6.3f}  "
                f"diff={100 * (measured - theory):+5.1f} pp",
                flush=True,
            )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--micro", default="1,2,4,8")
    parser.add_argument("--t-ms", type=float, default=20.0, help="forward time per stage per micro-batch")
    parser.add_argument("--schedule", choices=["gpipe", "1f1b"], default="gpipe")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    micro = [int(m) for m in args.micro.split(",")]
    with tempfile.TemporaryDirectory() as tmp:  # a file rendezvous: no free port to pick (and race for)
        mp.spawn(
            _worker,
            args=(args.stages, (Path(tmp) / "rendezvous").as_uri(), micro, args.t_ms / 1e3, args.schedule, args.steps),
            nprocs=args.stages,
        )


if __name__ == "__main__":
    main()
