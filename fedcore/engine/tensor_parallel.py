"""Tensor parallelism: which layers are split over the tensor-parallel ranks, checked before any worker starts.

Built on ``torch.distributed.tensor.parallel``: a parallelization plan maps module names to parallel styles
(``ColwiseParallel``: the weight's output features are split, each rank computes its slice of the output;
``RowwiseParallel``: the input features are split, the ranks' partial outputs are all-reduced), and
``parallelize_module`` turns those modules' weights into DTensors sharded over the ``tp`` mesh dimension. A
column-parallel layer followed by a row-parallel one (attention's heads and output projection, an MLP's two
layers) costs one all-reduce forward and one backward (Megatron-LM, Shoeybi et al. 2019). Every other module
stays replicated: its weights are plain tensors, identical on the ranks of a tensor-parallel group, as are its
gradients (the inputs of a split layer are all-reduced in the backward pass).

Where the plan comes from, first match wins:

1. the task: ``task.tensor_parallel_plan(model, degree)`` returning ``{module name: ParallelStyle}``;
2. the model's own modules: every submodule with a ``tensor_parallel_plan(degree)`` method contributes its entries
   (or raises ``ConfigError`` when ``degree`` does not fit it, e.g. does not divide its attention heads),
   prefixed with its name (the blocks of :mod:`fedcore.engine.transformer`, and so the Shakespeare example's,
   declare theirs).

Parameter names do not change, so the update gathered from the shards (``DTensor.full_tensor``) is the full
model in the global names.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from fedcore.engine.layers import tied_parameters
from fedcore.errors import ConfigError

TensorParallelPlan = dict[str, ParallelStyle]
"""``{qualified module name: parallel style}``, as ``parallelize_module`` takes it."""


def model_plan(model: nn.Module, degree: int) -> TensorParallelPlan:
    """The plan the model's modules declare for ``degree`` ranks: each ``tensor_parallel_plan(degree)`` entry
    under its module's name (the model's own entries unprefixed)."""
    plan: TensorParallelPlan = {}
    for prefix, module in model.named_modules():
        declare = getattr(module, "tensor_parallel_plan", None)
        if module is model or not callable(declare):
            continue
        for name, style in declare(degree).items():
            plan[f"{prefix}.{name}" if prefix else name] = style
    own = getattr(model, "tensor_parallel_plan", None)
    if callable(own):
        plan.update(own(degree))
    return plan


def resolve_plan(task: object, model: nn.Module, degree: int) -> TensorParallelPlan:
    """The tensor-parallel plan for ``model`` (the task's, else the model's modules'), checked for ``degree``.

    Args:
        task: the client's task; may define ``tensor_parallel_plan(model, degree)``.
        model: the full model, not yet parallelized.
        degree: the tensor-parallel degree (>= 2).

    Returns:
        ``{module name: style}``; every name is an ``nn.Linear`` of the model whose split dimension ``degree``
        divides.

    Raises:
        ConfigError: no plan is declared; a name is not a module or not an ``nn.Linear``; a style is not column-
            or row-wise; ``degree`` does not divide the split features; a split layer holds a tied weight.
    """
    declare = getattr(task, "tensor_parallel_plan", None)
    plan = dict(declare(model, degree)) if callable(declare) else model_plan(model, degree)
    if not plan:
        raise ConfigError(
            f"tensor_parallel={degree}, but {type(model).__name__} declares no tensor-parallel plan: give the task a "
            "tensor_parallel_plan(model, degree) method returning {module name: ColwiseParallel() | "
            "RowwiseParallel()}, or give the model's blocks a tensor_parallel_plan(degree) method (see "
            "fedcore.engine.transformer)"
        )
    check_plan(model, plan, degree)
    return plan


def check_plan(model: nn.Module, plan: Mapping[str, ParallelStyle], degree: int) -> None:
    """Check that ``plan`` can split ``model`` over ``degree`` ranks (see :func:`resolve_plan` for the rules).

    Raises:
        ConfigError: naming the module and the numbers involved.
    """
    modules = dict(model.named_modules())
    tied = {name for group in tied_parameters(model) for name in group}
    for name, style in plan.items():
        module = modules.get(name)
        if module is None:
            layers = [n for n, m in modules.items() if isinstance(m, nn.Linear)][:12]
            raise ConfigError(
                f"tensor-parallel plan names {name!r}, which is no module of the model; its linear "
                f"layers include {layers}"
            )
        if not isinstance(module, nn.Linear):
            raise ConfigError(
                f"tensor-parallel plan splits {name!r}, a {type(module).__name__}; the engine splits nn.Linear "
                "layers only (column- or row-wise)"
            )
        if isinstance(style, ColwiseParallel):
            features, what = module.out_features, "output features"
        elif isinstance(style, RowwiseParallel):
            features, what = module.in_features, "input features"
        else:
            raise ConfigError(
                f"tensor-parallel plan gives {name!r} a {type(style).__name__}; the engine takes ColwiseParallel "
                "or RowwiseParallel"
            )
        if features % degree:
            raise ConfigError(
                f"tensor_parallel={degree} does not divide the {features} {what} of {name!r}; choose a degree that "
                "divides the model's width (and its number of attention heads)"
            )
        shared = sorted(n for n in tied if n.startswith(name + "."))
        if shared:
            raise ConfigError(
                f"tensor-parallel plan splits {name!r}, whose weight is tied to another module ({shared}); keep tied "
                "layers replicated (leave them out of the plan) or untie them"
            )


def apply_plan(model: nn.Module, plan: TensorParallelPlan, mesh: DeviceMesh, *, only: set[str] | None = None) -> None:
    """Split the plan's layers over the one-dimensional tensor-parallel ``mesh``, in place.

    Args:
        model: the model holding the global parameters on this rank's device.
        plan: from :func:`resolve_plan`.
        mesh: the ``tp`` dimension of the engine's mesh.
        only: when given, split only the modules at or under these names (a pipeline rank's stages).
    """
    if only is not None:
        plan = {n: s for n, s in plan.items() if any(n == o or n.startswith(o + ".") for o in only)}
    if plan:
        parallelize_module(model, mesh, plan, src_data_rank=None)  # every rank holds the same global weights
