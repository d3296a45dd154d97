"""Build the model on the meta device and give storage only to the parameters and buffers a rank holds.

A rank of a parallel plan (world size > 1) builds the model under ``torch.device("meta")``: shapes and dtypes,
no storage, and no random initialization (which the round's global parameters would overwrite anyway). What it
then creates on its device, filled from the global parameters, depends on the plan:

- pipeline: only the tensors of its own stages, and any tensor that belongs to no stage (:func:`materialize`
  with ``skip``, before the stages are cut);
- replicated data parallelism (DDP): the whole replica (:func:`materialize`), copied from the global values
  instead of initialized and then overwritten;
- sharded data parallelism (FSDP2) and tensor parallelism, alone or together: ``parallelize_module`` and
  ``fully_shard`` run on the meta model, which turns the split and sharded parameters into DTensors whose local
  tensors have their shard's shape; :func:`materialize_local` then gives storage to the local tensors only
  (``nn.Module.to_empty``, as torchtitan does) and copies into each the part of the global value it holds. A
  sharded rank therefore never holds a full-size copy of a sharded parameter on its device.

A model larger than one device then trains over shards or stages that each fit. Tied weights stay tied. A module
with a non-persistent buffer cannot be built this way, since the buffer's value is made in ``__init__`` and is not
in the global parameters (:func:`can_build_on_meta`), nor can one whose constructor needs real values
(:func:`meta_model`); the engine then builds the whole model with real storage, as a single device does. A plan of
all ones (in-process training) builds the model with real storage too, so that its use of the global random
generator is the single-device one.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from itertools import chain

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from fedcore.errors import EngineError


def can_build_on_meta(model: nn.Module) -> bool:
    """True when every buffer of ``model`` is persistent (in ``state_dict``), so the global parameters hold every
    value the model needs."""
    return not any(module._non_persistent_buffers_set for module in model.modules())


def build_on_meta(build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` under ``torch.device("meta")``: the module tree with shapes and dtypes, no storage."""
    with torch.device("meta"):
        return build()


def meta_model(build: Callable[[], nn.Module]) -> nn.Module | None:
    """``build()`` on the meta device (:func:`build_on_meta`), or None when the model cannot be built there: the
    constructor needs real values (it raises on meta tensors, e.g. at ``.item()``) or the model has a
    non-persistent buffer (:func:`can_build_on_meta`). The caller then builds it with real storage."""
    try:
        model = build_on_meta(build)
    except Exception:  # a constructor that needs real tensors; a real build raises its real error, if any
        return None
    return model if can_build_on_meta(model) else None


def materialize(
    model: nn.Module,
    arrays: Mapping[str, np.ndarray],
    device: torch.device,
    *,
    skip: Collection[str] = (),
) -> int:
    """Give every meta parameter and buffer of ``model`` whose ``state_dict`` name is not in ``skip`` storage on
    ``device``, holding a copy of ``arrays[name]`` in the tensor's dtype; returns the number of tensors created.

    Args:
        model: built by :func:`build_on_meta`.
        arrays: the global parameters, ``state_dict`` name -> array (every name not skipped must be there).
        device: where the tensors go.
        skip: names left on the meta device (another pipeline rank's stages).
    """
    created: dict[int, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        for kind in ("_parameters", "_buffers"):
            tensors: dict[str, torch.Tensor | None] = getattr(module, kind)
            for local, tensor in list(tensors.items()):
                name = f"{prefix}.{local}" if prefix else local
                if tensor is None or not tensor.is_meta or name in skip:
                    continue
                if id(tensor) not in created:
                    # a copy: the arrays (the round's global model) must not change as the model trains
                    value = torch.as_tensor(np.asarray(arrays[name])).to(device=device, dtype=tensor.dtype, copy=True)
                    if isinstance(tensor, nn.Parameter):
                        value = nn.Parameter(value, requires_grad=tensor.requires_grad)
                    created[id(tensor)] = value
                tensors[local] = created[id(tensor)]
    return len(created)


def has_meta_tensors(model: nn.Module) -> bool:
    """True when a parameter or buffer of ``model`` (or a DTensor's local tensor) is on the meta device."""
    return any(
        (t.to_local() if isinstance(t, DTensor) else t).is_meta for t in chain(model.parameters(), model.buffers())
    )


def materialize_local(model: nn.Module, arrays: Mapping[str, np.ndarray], device: torch.device) -> int:
    """Give every tensor of a meta-built, parallelized model storage on ``device`` for the part this rank holds,
    filled from the global parameters; returns the number of tensors filled.

    A DTensor (a tensor-parallel split, an FSDP2 shard, or both on a 2D mesh) gets storage for its local tensor
    only, and the local tensor gets the block of ``arrays[name]`` it holds
    (``compute_local_shape_and_global_offset``: the shard's shape and offset in the global tensor, for every
    placement ``fully_shard`` and ``parallelize_module`` make, uneven last shards included); a plain tensor (a
    replicated layer, a buffer) gets all of its value. The copy to the device is of the local block only.

    Call it after ``parallelize_module`` and ``fully_shard`` and before the first forward; FSDP2 re-pads its
    shards in ``nn.Module._apply`` (or at its lazy initialization) and keeps the values.

    Args:
        model: built by :func:`build_on_meta`, then parallelized; every tensor still on the meta device.
        arrays: the global parameters, ``state_dict`` name -> array of the global (unsharded) shape.
        device: the rank's device.

    Raises:
        EngineError: a local tensor's shape is not the shape of the block the placements give it (a placement
            this function does not know how to fill); training would otherwise start from wrong values.
    """
    ties = _tied_slots(model)
    model.to_empty(device=device)  # storage for local tensors only; it unties shared tensors, so tie them again
    for first, others in ties:
        tensor = getattr(*first)
        for module, attr in others:
            setattr(module, attr, tensor)
    count = 0
    with torch.no_grad():
        for name, tensor in chain(model.named_parameters(), model.named_buffers()):
            full = torch.as_tensor(np.asarray(arrays[name]))
            if isinstance(tensor, DTensor):
                local = tensor.to_local()
                shape, offset = compute_local_shape_and_global_offset(full.shape, tensor.device_mesh, tensor.placements)
                block = full[tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))]
                if tuple(local.shape) != tuple(block.shape):
                    raise EngineError(
                        f"cannot fill the local part of {name!r} (placements {tensor.placements}): its local shape "
                        f"is {tuple(local.shape)} but the global value's block is {tuple(block.shape)}; build the "
                        "model with real storage (a non-persistent buffer in the model does that) and report this"
                    )
                local.copy_(block)
            else:
                tensor.copy_(full)
            count += 1
    return count


def _tied_slots(model: nn.Module) -> list[tuple[tuple[nn.Module, str], list[tuple[nn.Module, str]]]]:
    """``((module, attribute) of a tensor's first occurrence, the other slots holding the same tensor)`` for every
    parameter or buffer that appears under more than one name."""
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for kind in ("_parameters", "_buffers"):
            for attr, tensor in getattr(module, kind).items():
                if tensor is not None:
                    slots.setdefault(id(tensor), []).append((module, attr))
    return [(group[0], group[1:]) for group in slots.values() if len(group) > 1]
