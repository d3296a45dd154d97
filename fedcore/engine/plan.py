"""The parallel plan: how one client's local training is spread over processes and devices.

One frozen value object holds every degree and option (the ``ParallelDims`` idea from torchtitan): data
parallel degree (replicated or sharded with FSDP2), tensor-parallel degree, pipeline degree and how the model is
cut into stages, micro-batches and schedule, gradient accumulation, precision, activation checkpointing and
compilation. It is
validated on construction; :meth:`ParallelPlan.check_model` and :meth:`ParallelPlan.check_runtime` finish the
validation that needs the model or the machine, and the engine calls both before any worker starts.

Ranks are laid out data-parallel outer, tensor-parallel inner (the ranks of one tensor-parallel group are
neighbours, on one machine's fast links): ``rank = (dp_index * pipeline + pp_index) * tensor_parallel + tp_index``.

Example (TOML ``[parallel]`` table or ``--parallel key=value`` flags)::

    ParallelPlan.from_mapping({"data_parallel": 2, "pipeline": 2, "split_points": ["blocks.2"],
                               "microbatches": 4, "schedule": "1f1b"})
    ParallelPlan.from_cli(["dp=2", "pp=2", "split_points=blocks.2", "microbatches=4", "schedule=1f1b"])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch
from torch import nn

from fedcore.engine.batch_stats import check_batch_statistics
from fedcore.engine.layers import model_layers, split_stages, tied_parameters
from fedcore.engine.schedules import Schedule, check_schedule
from fedcore.errors import ConfigError

RANK_BASE_MIB = 145
"""Memory one worker rank holds of its own before it builds its model or loads data: a fresh interpreter with torch
and fedcore's engine imported (measured 146 MiB of private dirty pages, of 221 MiB resident; the rest are library
file pages every rank shares; torch 2.13 on Linux x86-64). A CPU plan of more ranks than the memory available holds
at this much each is refused before any process starts (:meth:`ParallelPlan.check_runtime`)."""


def available_memory_mib() -> float | None:
    """The memory new processes may take without swapping, in MiB: the kernel's ``MemAvailable`` (/proc/meminfo),
    or less where this process's cgroup (a container's memory limit; v2 ``memory.max``, v1
    ``memory.limit_in_bytes``) leaves less. None where there is no procfs (then nothing is checked against it)."""
    try:
        with open("/proc/meminfo") as fh:
            available = next(int(line.split()[1]) / 1024 for line in fh if line.startswith("MemAvailable:"))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    for limit, usage in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            with open(limit) as fh_limit, open(usage) as fh_usage:
                cap, used = fh_limit.read().strip(), int(fh_usage.read().strip())
        except (OSError, ValueError):
            continue
        if cap.isdigit():  # "max": no limit
            available = min(available, max(int(cap) - used, 0) / (1 << 20))
        break
    return available
    return None


class Precision(StrEnum):
    """Compute precision. Master weights and the returned update stay in the global model's dtype."""

    FP32 = "fp32"
    BF16 = "bf16"  # autocast to bfloat16; CUDA only


class Device(StrEnum):
    """Where the ranks run: ``auto`` picks CUDA when enough GPUs are visible, else CPU."""

    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"


_ALIASES = {
    "dp": "data_parallel",
    "pp": "pipeline",
    "fsdp": "sharded",
    "shard": "sharded",
    "virtual_stages": "stages_per_rank",
    "microbatch": "microbatches",
    "gradient_accumulation": "grad_accum",
    "checkpointing": "activation_checkpointing",
    "unused_parameters": "find_unused_parameters",
    "tp": "tensor_parallel",
}


@dataclass(frozen=True, kw_only=True)
class ParallelPlan:
    """Degrees and options of local parallel training. The default (all ones) trains in-process on one device.

    Attributes:
        data_parallel: data-parallel degree (replicas of the model, or shards with ``sharded``). >= 1.
        sharded: shard parameters, gradients and optimizer state over the data-parallel ranks with FSDP2
            (``torch.distributed.fsdp.fully_shard``) instead of replicating them with DDP. Needs
            ``data_parallel >= 2`` and ``pipeline == 1``.
        tensor_parallel: tensor-parallel degree (Megatron-LM column/row-parallel layers through
            ``torch.distributed.tensor.parallel``; see :mod:`fedcore.engine.tensor_parallel`). >= 1. Composes with
            data parallelism (replicated or sharded: a 2D mesh) and with the pipeline.
        pipeline: pipeline-parallel degree (ranks per pipeline). >= 1.
        stages_per_rank: pipeline stages each pipeline rank holds (``v``; > 1 only for interleaved 1F1B).
        split_points: module names where a new stage begins, ``pipeline * stages_per_rank - 1`` of them in
            model order (see :mod:`fedcore.engine.layers`).
        stage_modules: alternatively, for each stage the module names it holds.
        microbatches: micro-batches each pipeline step splits its batch into (``m``). 1 without a pipeline.
        schedule: pipeline schedule: ``gpipe``, ``1f1b`` (needs ``microbatches >= pipeline``) or
            ``interleaved-1f1b`` (needs ``stages_per_rank >= 2``).
        grad_accum: sequential micro-steps per optimizer step; each processes ``1/grad_accum`` of the batch
            and their gradients add up, so the step equals one step on the full batch. >= 1.
        precision: ``fp32``, or ``bf16`` autocast (CUDA only).
        activation_checkpointing: recompute each layer's activations in the backward pass (needs a model
            with layers: ``nn.Sequential`` or ``pipeline_layers()``); buffers are restored after recomputation.
        find_unused_parameters: let DDP train a model with parameters that get no gradient in some step
            (a module unused in ``forward``); costs a graph traversal per step. Without it such a model fails
            at its first step, naming the unused parameters.
        compile: ``torch.compile`` each layer (each pipeline layer, or the whole model when it has none) before
            training; the first steps pay for the compilation.
        device: ``auto``, ``cpu`` (gloo) or ``cuda`` (NCCL, one GPU per rank).
        world_size: the number of processes the caller expects (e.g. GPUs on the machine), or None; when
            given, ``data_parallel * pipeline * tensor_parallel`` must equal it.
    """

    data_parallel: int = 1
    sharded: bool = False
    pipeline: int = 1
    stages_per_rank: int = 1
    split_points: tuple[str, ...] = ()
    stage_modules: tuple[tuple[str, ...], ...] = ()
    microbatches: int = 1
    schedule: Schedule = Schedule.GPIPE
    grad_accum: int = 1
    precision: Precision = Precision.FP32
    activation_checkpointing: bool = False
    find_unused_parameters: bool = False
    tensor_parallel: int = 1
    compile: bool = False
    device: Device = Device.AUTO
    world_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("data_parallel", "pipeline", "tensor_parallel", "stages_per_rank", "microbatches", "grad_accum"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"parallel plan: {name} must be an integer >= 1, got {value!r}")
        object.__setattr__(self, "schedule", _enum(Schedule, self.schedule, "schedule"))
        object.__setattr__(self, "precision", _enum(Precision, self.precision, "precision"))
        object.__setattr__(self, "device", _enum(Device, self.device, "device"))
        object.__setattr__(self, "split_points", _module_names(self.split_points, "split_points"))
        object.__setattr__(self, "stage_modules", _stage_lists(self.stage_modules))
        if self.world_size is not None and self.total_ranks != self.world_size:
            raise ConfigError(
                f"parallel plan: data_parallel ({self.data_parallel}) x pipeline ({self.pipeline}) x "
                f"tensor_parallel ({self.tensor_parallel}) = {self.total_ranks}, but the world size is "
                f"{self.world_size}; the degrees must multiply to the number of processes"
            )
        if self.sharded and self.data_parallel < 2:
            raise ConfigError("parallel plan: sharded (FSDP2) needs data_parallel >= 2")
        if self.sharded and self.pipeline > 1:
            raise ConfigError("parallel plan: sharded data parallel with a pipeline is not supported; use DDP")
        if self.find_unused_parameters and (
            self.data_parallel < 2 or self.sharded or self.pipeline > 1 or self.tensor_parallel > 1
        ):
            raise ConfigError(
                "parallel plan: find_unused_parameters applies to DDP only (data_parallel >= 2, not sharded, no "
                "pipeline, no tensor parallelism); the other plans train unused parameters without it"
            )
        if self.pipeline == 1:
            if self.stages_per_rank > 1 or self.split_points or self.stage_modules or self.microbatches > 1:
                raise ConfigError(
                    "parallel plan: stages_per_rank, split_points, stage_modules and microbatches need "
                    "pipeline >= 2; without a pipeline use grad_accum to split a batch"
                )
        else:
            if self.split_points and self.stage_modules:
                raise ConfigError("parallel plan: give split_points or stage_modules, not both")
            if not self.split_points and not self.stage_modules:
                raise ConfigError(
                    f"parallel plan: a {self.num_stages}-stage pipeline needs {self.num_stages - 1} split points "
                    "(module names where a stage begins) or stage_modules"
                )
            if self.split_points and len(self.split_points) != self.num_stages - 1:
                raise ConfigError(
                    f"parallel plan: pipeline={self.pipeline} x stages_per_rank={self.stages_per_rank} = "
                    f"{self.num_stages} stages need {self.num_stages - 1} split points, got {len(self.split_points)}"
                )
            if len(set(self.split_points)) != len(self.split_points):
                raise ConfigError(f"parallel plan: split points repeat: {list(self.split_points)}")
            if self.stage_modules and len(self.stage_modules) != self.num_stages:
                raise ConfigError(
                    f"parallel plan: {self.num_stages} stages but stage_modules lists {len(self.stage_modules)}"
                )
            check_schedule(
                self.schedule,
                pipeline=self.pipeline,
                stages_per_rank=self.stages_per_rank,
                microbatches=self.microbatches,
            )
        if self.precision is Precision.BF16 and self.device is Device.CPU:
            raise ConfigError("parallel plan: bf16 autocast needs CUDA; use precision='fp32' on CPU")

    # ----------------------------------------------------------------------------------------------- derived
    @property
    def total_ranks(self) -> int:
        """Processes the plan needs: ``data_parallel * pipeline * tensor_parallel``."""
        return self.data_parallel * self.pipeline * self.tensor_parallel

    @property
    def num_stages(self) -> int:
        """Pipeline stages: ``pipeline * stages_per_rank``."""
        return self.pipeline * self.stages_per_rank

    @property
    def dp_enabled(self) -> bool:
        """More than one data-parallel replica or shard."""
        return self.data_parallel > 1

    @property
    def fsdp_enabled(self) -> bool:
        """Data parallelism is sharded (FSDP2)."""
        return self.sharded and self.data_parallel > 1

    @property
    def pp_enabled(self) -> bool:
        """More than one pipeline rank."""
        return self.pipeline > 1

    @property
    def tp_enabled(self) -> bool:
        """More than one tensor-parallel rank."""
        return self.tensor_parallel > 1

    @property
    def is_single_process(self) -> bool:
        """The plan runs in the caller's process with no process group."""
        return self.total_ranks == 1

    # ------------------------------------------------------------------------------------------- validation
    def check_model(self, model: nn.Module) -> None:
        """Validate the plan against the model: split points name layer boundaries, stages are non-empty and
        share no parameters, activation checkpointing finds layers, FSDP2 gets no tied weights, and modules with
        batch statistics (BatchNorm) train as on one device (:mod:`fedcore.engine.batch_stats`).

        Raises:
            ConfigError: with the model's layer names, so the user can fix the split points; naming the tied
                parameters under FSDP2; naming the BatchNorm modules a plan would train differently.
        """
        if self.pp_enabled:
            split_stages(
                model,
                num_stages=self.num_stages,
                split_points=self.split_points,
                stage_modules=self.stage_modules,
            )
        elif self.activation_checkpointing:
            model_layers(model)
        if self.fsdp_enabled:
            tied = tied_parameters(model)
            if tied:
                groups = "; ".join(" = ".join(group) for group in tied)
                raise ConfigError(
                    f"parallel plan: sharded (FSDP2) cannot train tied weights: {groups}; use DDP (sharded=false) "
                    "or untie them"
                )
        check_batch_statistics(self, model)
        for name, tensor in model.state_dict().items():
            if tensor.dtype == torch.bfloat16:
                raise ConfigError(f"parameter {name!r} has dtype {tensor.dtype}; keep master weights in float32")

    def check_runtime(self) -> Device:
        """Resolve ``device`` on this machine and check the plan fits it; returns ``cpu`` or ``cuda``.

        Raises:
            ConfigError: bf16 without CUDA, ``device='cuda'`` with fewer GPUs than ranks, or more CPU ranks than
                this machine's available memory holds at :data:`RANK_BASE_MIB` each (a lower bound: the
                model and data come on top).
        """
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        device = self.device
        if device is Device.AUTO:
            device = Device.CUDA if gpus >= self.total_ranks else Device.CPU
        if device is Device.CUDA and gpus < self.total_ranks:
            raise ConfigError(f"parallel plan needs {self.total_ranks} GPUs (one per rank) but {gpus} are visible")
        if self.precision is Precision.BF16 and device is not Device.CUDA:
            raise ConfigError("parallel plan: bf16 autocast needs CUDA, and training runs on the CPU here")
        available = available_memory_mib()
        if device is Device.CPU and available is not None and self.total_ranks * RANK_BASE_MIB > available:
            raise ConfigError(
                f"parallel plan: {self.total_ranks} ranks on the CPU are {self.total_ranks} processes, each a Python "
                f"interpreter with torch (about {RANK_BASE_MIB} MiB of its own before its model and data), at least "
                f"{self.total_ranks * RANK_BASE_MIB:,} MiB in all, and this machine has {available:,.0f} MiB "
                f"available; lower the degrees (data_parallel x pipeline x tensor_parallel) to at most "
                f"{int(available // RANK_BASE_MIB)} ranks"
            )
        return device

    # -------------------------------------------------------------------------------------------- loading
    def to_mapping(self) -> dict[str, Any]:
        """The plan as a JSON/TOML-ready mapping (inverse of :meth:`from_mapping`)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, StrEnum):
                value = value.value
            elif f.name == "split_points":
                value = list(value)
            elif f.name == "stage_modules":
                value = [list(s) for s in value]
            elif value is None:
                continue  # TOML has no null: an unset option is left out
            out[f.name] = value
        return out

    @classmethod
    def from_mapping(cls, table: Mapping[str, Any]) -> ParallelPlan:
        """Build a plan from a TOML ``[parallel]`` table (or any mapping).

        Keys are the field names; ``dp``, ``pp``, ``fsdp`` and a few others are accepted as aliases, and
        ``-`` may stand for ``_``. Values may be native (int, bool, list) or strings as on a command line:
        ``split_points="a,b"``, ``stage_modules="a,b;c,d"``, ``sharded="true"``.

        Raises:
            ConfigError: an unknown key, an option given twice (also as a field name and an alias), or a value of
                the wrong type or range.
        """
        return cls._build(_canonical_options(table, "the [parallel] table"))

    @classmethod
    def from_cli(cls, items: Sequence[str], table: Mapping[str, Any] | None = None) -> ParallelPlan:
        """Build a plan from ``--parallel key=value`` flags, e.g. ``["dp=2", "pp=2", "split_points=blocks.2"]``.

        Args:
            items: the flags' ``key=value`` strings; keys as in :meth:`from_mapping`.
            table: a ``[parallel]`` table from a file; the flags win over its options, alias or not (the file's
                ``data_parallel = 2`` and ``dp=3`` give 3).

        Raises:
            ConfigError: an item is not ``key=value``, an option is given twice among the flags (``dp=2 dp=3``, or
                ``dp=2 data_parallel=3``) or twice in ``table``, or as :meth:`from_mapping`.
        """
        pairs: list[tuple[str, str]] = []
        for item in items:
            key, sep, value = item.partition("=")
            if not sep or not key.strip():
                raise ConfigError(f"--parallel expects key=value, got {item!r}")
            pairs.append((key.strip(), value.strip()))
        merged = _canonical_options(table or {}, "the [parallel] table")
        merged.update(_canonical_options(pairs, "--parallel"))
        return cls._build(merged)

    @classmethod
    def _build(cls, options: Mapping[str, Any]) -> ParallelPlan:
        return cls(**{key: _coerce(key, value) for key, value in options.items()})


def refine_options(base: Mapping[str, Any], top: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``base``'s plan options with ``top``'s laid over them, under their field names: ``top``'s
    ``data_parallel = 3`` replaces ``base``'s ``dp = 2`` (``where`` names ``top``'s source for errors).

    Raises:
        ConfigError: an unknown key, or an option given twice within one of the two tables.
    """
    return {**_canonical_options(base, "the [parallel] table"), **_canonical_options(top, where)}


def _canonical_options(table: Mapping[str, Any] | Sequence[tuple[str, Any]], where: str) -> dict[str, Any]:
    """``table``'s options under their field names (aliases and ``-`` resolved), in order.

    Raises:
        ConfigError: an unknown key, or one option given twice (under any of its names); ``where`` names the source.
    """
    fields = {f.name for f in dataclasses.fields(ParallelPlan)}
    out: dict[str, Any] = {}
    named: dict[str, str] = {}
    for raw_key, value in table.items() if isinstance(table, Mapping) else table:
        key = str(raw_key).strip().replace("-", "_").lower()
        key = _ALIASES.get(key, key)
        if key not in fields:
            raise ConfigError(
                f"unknown parallel plan option {raw_key!r} in {where}; valid: {sorted(fields)} "
                f"(aliases {sorted(_ALIASES)})"
            )
        if key in out:
            names = f"as {named[key]!r} and {raw_key!r}" if named[key] != raw_key else f"as {raw_key!r}"
            raise ConfigError(f"parallel plan option {key!r} is given twice in {where} ({names}); give it once")
        out[key] = value
        named[key] = str(raw_key)
    return out


def _enum(kind: type[StrEnum], value: object, name: str) -> Any:
    try:
        return kind(str(value).strip().lower())
    except ValueError:
        raise ConfigError(f"parallel plan: {name} must be one of {[k.value for k in kind]}, got {value!r}") from None


_INT_FIELDS = {
    "data_parallel",
    "pipeline",
    "tensor_parallel",
    "stages_per_rank",
    "microbatches",
    "grad_accum",
    "world_size",
}
_BOOL_FIELDS = {"sharded", "activation_checkpointing", "find_unused_parameters", "compile"}


def _coerce(key: str, value: Any) -> Any:
    if key in _INT_FIELDS:
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                raise ConfigError(f"parallel plan: {key} must be an integer, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"parallel plan: {key} must be an integer, got {value!r}")
        return value
    if key in _BOOL_FIELDS:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("true", "1", "yes", "on"):
            return True
        if text in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"parallel plan: {key} must be true or false, got {value!r}")
    return value  # split_points and stage_modules: ParallelPlan reads strings and lists (_module_names)


def _module_names(value: object, name: str) -> tuple[str, ...]:
    """Module names from ``"a,b"`` (a command line) or a list of names (TOML; integers name ``Sequential``
    children, ``2`` for ``"2"``, also alone).

    Raises:
        ConfigError: ``value`` is neither, or a list holds something other than a name (a nested list, a float).
    """
    if isinstance(value, str):
        return tuple(part.strip() for part in value.split(",") if part.strip())
    if _is_name(value):  # one Sequential child, as --set parallel.split_points=2 reads it
        return (str(value),)
    if isinstance(value, list | tuple) and all(_is_name(item) for item in value):
        return tuple(str(item) for item in value)
    raise ConfigError(
        f'parallel plan: {name} must be module names, as a list (["blocks.2", "blocks.4"]) or a comma-separated '
        f'string ("blocks.2,blocks.4"), got {value!r}'
    )


def _stage_lists(value: object) -> tuple[tuple[str, ...], ...]:
    """Each stage's module names from ``"a,b;c,d"`` (a command line) or a list with one entry per stage, each a
    list of names or a comma-separated string (TOML: ``[["a", "b"], ["c", "d"]]`` or ``["a,b", "c,d"]``).

    Raises:
        ConfigError: ``value`` is neither, or a stage is not module names.
    """
    if isinstance(value, str):
        return tuple(_module_names(stage, "stage_modules") for stage in value.split(";") if stage.strip())
    if isinstance(value, list | tuple):
        return tuple(_module_names(stage, "each stage of stage_modules") for stage in value)
    raise ConfigError(
        "parallel plan: stage_modules must list each stage's module names, as a list of lists "
        f'([["embed", "blocks.0"], ["blocks.1", "head"]]) or a string ("embed,blocks.0;blocks.1,head"), got {value!r}'
    )


def _is_name(item: object) -> bool:
    return isinstance(item, str) or (isinstance(item, int) and not isinstance(item, bool))
