"""One rank's place in the world: its coordinates, device, process groups; and its setup and teardown.

Ranks are laid out data-parallel outer, tensor-parallel inner
(``rank = (dp_index * pipeline + pp_index) * tensor_parallel + tp_index``), as a ``DeviceMesh`` of shape
``(data_parallel, pipeline, tensor_parallel)`` with dimensions ``("dp", "pp", "tp")``: the ranks of one
tensor-parallel group, which talk at every layer, are neighbours (one machine's NVLink). At world size 1 there
is no process group and no mesh.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fedcore.engine.plan import Device, ParallelPlan, Precision
from fedcore.errors import EngineError


@dataclass(frozen=True, kw_only=True)
class RankEnv:
    """Where one rank sits.

    Attributes:
        rank: global rank in ``[0, world_size)``.
        world_size: ``data_parallel * pipeline * tensor_parallel``.
        dp_index: data-parallel coordinate (which replica / shard).
        pp_index: pipeline coordinate (which pipeline rank).
        device: the rank's device (``cpu`` or ``cuda:<local rank>``).
        dp_group: process group of the ranks with the same ``pp_index`` and ``tp_index`` (None at world size 1).
        pp_group: process group of the ranks with the same ``dp_index`` and ``tp_index`` (None at world size 1).
        dp_mesh: one-dimensional data-parallel mesh for FSDP2 (None at world size 1).
        tp_index: tensor-parallel coordinate (which slice of the split layers).
        tp_mesh: one-dimensional tensor-parallel mesh (None at world size 1).
    """

    rank: int
    world_size: int
    dp_index: int
    pp_index: int
    device: torch.device
    dp_group: dist.ProcessGroup | None = None
    pp_group: dist.ProcessGroup | None = None
    dp_mesh: DeviceMesh | None = None
    tp_index: int = 0
    tp_mesh: DeviceMesh | None = None

    @property
    def distributed(self) -> bool:
        """True when a process group exists."""
        return self.world_size > 1


def single_process_env(device: Device) -> RankEnv:
    """The environment of a plan of all ones: rank 0 of 1, no process group."""
    return RankEnv(
        rank=0,
        world_size=1,
        dp_index=0,
        pp_index=0,
        device=torch.device("cuda", 0) if device is Device.CUDA else torch.device("cpu"),
    )


def init_distributed(plan: ParallelPlan, device: Device, *, rank: int, init_method: str) -> RankEnv:
    """Join the process group (gloo on CPU, NCCL on CUDA) and build the ``(dp, pp, tp)`` mesh.

    Args:
        plan: the plan; ``plan.total_ranks`` processes take part.
        device: the resolved device kind.
        rank: this process's global rank.
        init_method: rendezvous URL, e.g. ``file:///tmp/fedcore-engine-123-x/rendezvous`` (the launcher's choice:
            a file in the call's own directory, so no port is picked) or ``tcp://127.0.0.1:29500``.
    """
    world_size = plan.total_ranks
    if device is Device.CUDA:
        torch.cuda.set_device(rank % torch.cuda.device_count())
        torch_device = torch.device("cuda", torch.cuda.current_device())
        backend = "nccl"
    else:
        torch_device = torch.device("cpu")
        backend = "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    mesh = init_device_mesh(
        torch_device.type,
        (plan.data_parallel, plan.pipeline, plan.tensor_parallel),
        mesh_dim_names=("dp", "pp", "tp"),
    )
    coordinates = mesh.get_coordinate()
    if coordinates is None:
        raise EngineError(f"rank {rank} is not in the engine's device mesh", rank=rank)
    dp_index, pp_index, tp_index = coordinates
    return RankEnv(
        rank=rank,
        world_size=world_size,
        dp_index=dp_index,
        pp_index=pp_index,
        device=torch_device,
        dp_group=mesh.get_group("dp"),
        pp_group=mesh.get_group("pp"),
        dp_mesh=mesh["dp"],
        tp_index=tp_index,
        tp_mesh=mesh["tp"],
    )


def shutdown_distributed() -> None:
    """Leave the process group if one was joined."""
    if dist.is_initialized():
        dist.destroy_process_group()


def autocast(plan: ParallelPlan, device: torch.device) -> contextlib.AbstractContextManager[object]:
    """bf16 autocast on CUDA when the plan asks for it, else a no-op context."""
    if plan.precision is Precision.BF16 and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()
