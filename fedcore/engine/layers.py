"""A model as an ordered chain of layers, and how the chain is cut into pipeline stages.

The engine splits a model by module names rather than by tracing it: a model is pipelined as the sequence of
its *layers*, each mapping one tensor to one tensor. The layers are

- ``model.pipeline_layers()`` when the model defines it (a list of ``(qualified name, module)`` whose chained
  application equals ``model(x)``), else
- the leaves of an ``nn.Sequential`` model, nested ``nn.Sequential`` containers flattened (so
  ``Sequential(embed, Sequential(block0, block1), head)`` has layers ``0``, ``1.0``, ``1.1``, ``2``).

A split point names the module where a new stage begins (like ``SplitPoint.BEGINNING`` in
``torch.distributed.pipelining``); it must name a layer or a ``Sequential`` group of layers. Stage modules are
the original submodules (parameters shared, not copied), so a stage's state keeps the global model's names.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fedcore.engine.batch_stats import preserved_buffers
from fedcore.errors import ConfigError

Layer = tuple[str, nn.Module]
"""``(qualified name in the model, module)``."""


def model_layers(model: nn.Module) -> list[Layer]:
    """The model's layers in execution order (see the module docstring).

    Raises:
        ConfigError: the model is neither an ``nn.Sequential`` nor defines ``pipeline_layers()``.
    """
    custom = getattr(model, "pipeline_layers", None)
    if callable(custom):
        layers = [(str(name), module) for name, module in custom()]
        if not layers:
            raise ConfigError(f"{type(model).__name__}.pipeline_layers() returned no layers")
        return layers
    if isinstance(model, nn.Sequential):
        return list(_flatten(model, ""))
    raise ConfigError(
        f"{type(model).__name__} cannot be cut into stages: make it an nn.Sequential or give it a "
        "pipeline_layers() method returning [(qualified name, module), ...] whose chain equals forward()"
    )


def _flatten(seq: nn.Sequential, prefix: str) -> list[Layer]:
    layers: list[Layer] = []
    # every entry, as Sequential.forward runs them: named_children() would skip a module that appears twice
    # (one layer applied at two depths, its weights shared), leaving it out of the chain
    for name, child in seq._modules.items():
        if child is None:
            continue
        qualified = f"{prefix}{name}"
        if isinstance(child, nn.Sequential):
            layers.extend(_flatten(child, qualified + "."))
        else:
            layers.append((qualified, child))
    return layers


def _first_layer_under(name: str, layers: Sequence[Layer], model: nn.Module) -> int:
    """Index of the first layer at or under module ``name``; ConfigError if ``name`` is no layer boundary."""
    for i, (qualified, _) in enumerate(layers):
        if qualified == name or qualified.startswith(name + "."):
            return i
    known = dict(model.named_modules())
    names = [q for q, _ in layers]
    if name not in known:
        raise ConfigError(f"split point {name!r} names no module of {type(model).__name__}; its layers are {names}")
    raise ConfigError(
        f"split point {name!r} names a module inside a layer, not a layer boundary; split points must be "
        f"one of the layers {names} (or a Sequential group of them)"
    )


def split_stages(
    model: nn.Module,
    *,
    num_stages: int,
    split_points: Sequence[str] = (),
    stage_modules: Sequence[Sequence[str]] = (),
) -> list[list[Layer]]:
    """Cut the model's layers into ``num_stages`` contiguous stages.

    Args:
        model: the full model.
        num_stages: the number of pipeline stages (>= 1).
        split_points: ``num_stages - 1`` module names, each the first module of a new stage, in order.
        stage_modules: alternatively, for each stage the module names it holds, in order; together they must
            cover the layers in order.

    Returns:
        For each stage its layers ``[(qualified name, module), ...]``.

    Raises:
        ConfigError: a name is not a module or not a layer boundary, the split points are out of order or
            leave a stage empty, the stage lists do not cover the layers in order, or a parameter is shared by
            two stages (tied weights cannot be split).
    """
    layers = model_layers(model)
    if num_stages == 1 and not split_points and not stage_modules:
        return [layers]
    if stage_modules:
        stages = _stages_from_lists(model, layers, stage_modules)
    else:
        if len(split_points) != num_stages - 1:
            raise ConfigError(f"{num_stages} stages need {num_stages - 1} split points, got {len(split_points)}")
        starts = [0] + [_first_layer_under(name, layers, model) for name in split_points]
        for (a, prev), b in zip(zip(starts, ["<start>", *split_points], strict=True), starts[1:], strict=False):
            if b <= a:
                raise ConfigError(
                    f"split points must be in model order and leave no stage empty: {list(split_points)} "
                    f"(after {prev!r}); layers are {[q for q, _ in layers]}"
                )
        bounds = [*starts, len(layers)]
        stages = [layers[bounds[i] : bounds[i + 1]] for i in range(num_stages)]
    if len(stages) != num_stages:
        raise ConfigError(f"the plan has {num_stages} stages but stage_modules lists {len(stages)}")
    _check_no_shared_parameters(stages)
    return stages


def _stages_from_lists(
    model: nn.Module, layers: list[Layer], stage_modules: Sequence[Sequence[str]]
) -> list[list[Layer]]:
    stages: list[list[Layer]] = []
    cursor = 0
    for stage_index, names in enumerate(stage_modules):
        stage: list[Layer] = []
        for name in names:
            start = _first_layer_under(name, layers, model)
            if start != cursor:
                raise ConfigError(
                    f"stage_modules must list the layers in model order: stage {stage_index} names {name!r}, but "
                    f"the next layer is {layers[cursor][0] if cursor < len(layers) else '<end>'}"
                )
            while cursor < len(layers) and (layers[cursor][0] == name or layers[cursor][0].startswith(name + ".")):
                stage.append(layers[cursor])
                cursor += 1
        if not stage:
            raise ConfigError(f"stage_modules leaves stage {stage_index} empty")
        stages.append(stage)
    if cursor != len(layers):
        raise ConfigError(f"stage_modules does not cover the layers {[q for q, _ in layers[cursor:]]}")
    return stages


def _check_no_shared_parameters(stages: Sequence[Sequence[Layer]]) -> None:
    owner: dict[int, tuple[int, str]] = {}
    for index, stage in enumerate(stages):
        for qualified, module in stage:
            for name, param in module.named_parameters():
                full_name = f"{qualified}.{name}"
                previous, first_name = owner.setdefault(id(param), (index, full_name))
                if previous != index:
                    raise ConfigError(
                        f"parameter {first_name!r} of stage {previous} is also {full_name!r} of stage {index} "
                        "(tied weights); put the tied modules in the same stage or untie them"
                    )


def tied_parameters(model: nn.Module) -> list[list[str]]:
    """Groups of parameter names that are one tensor (tied weights), e.g. ``[["embed.weight", "head.weight"]]``."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def stage_state_names(model: nn.Module, stage: Sequence[Layer]) -> list[str]:
    """Names (in ``model.state_dict()`` order) of the parameters and buffers that belong to ``stage``."""
    prefixes = tuple(q + "." for q, _ in stage)
    return [name for name in model.state_dict() if name.startswith(prefixes)]


def compile_layers(model: nn.Module, *, layers: Sequence[Layer] | None = None) -> None:
    """``torch.compile`` each of the model's layers in place (``nn.Module.compile``: names and parameters stay).

    Compiling layer by layer (as torchtitan compiles transformer blocks) keeps the graphs small, lets pipeline
    stages and activation checkpointing cut between layers, and lets identical blocks share one compiled graph.
    A model without layers (:func:`model_layers`) is compiled whole.

    Args:
        model: the model, after tensor parallelism and before data-parallel wrapping.
        layers: the layers to compile (a pipeline rank's own); default all of the model's.
    """
    if layers is None:
        try:
            layers = model_layers(model)
        except ConfigError:
            model.compile()
            return
    for _, layer in layers:
        layer.compile()


class LayerChain(nn.Module):
    """Runs a list of layers one after the other, optionally with activation checkpointing per layer.

    The layers are the model's own submodules, so training a chain trains the model. Input and output are one
    tensor each, shape ``(batch, ...)``.

    Args:
        layers: ``[(qualified name, module), ...]`` in execution order.
        checkpointing: recompute each layer's activations in the backward pass
            (``torch.utils.checkpoint``, non-reentrant) instead of keeping them. The recomputation leaves the
            layer's buffers as the first forward left them (BatchNorm's running statistics count once).
    """

    def __init__(self, layers: Sequence[Layer], *, checkpointing: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList([module for _, module in layers])
        self.names = [name for name, _ in layers]
        self.checkpointing = checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.checkpointing and torch.is_grad_enabled():
                x = checkpoint(layer, x, use_reentrant=False, context_fn=_recompute_context(layer))
            else:
                x = layer(x)
        return x


def _recompute_context(
    layer: nn.Module,
) -> Callable[[], tuple[contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]]]:
    """``context_fn`` for ``checkpoint``: the recomputation runs with the layer's buffers restored afterwards."""
    return lambda: (contextlib.nullcontext(), preserved_buffers(layer))
