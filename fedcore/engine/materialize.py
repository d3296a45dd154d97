"""Build the model on the meta device and give storage only to the parameters and buffers a rank trains.

A pipeline rank holds only its stages, so it need not hold the rest of the model: the model is built under
``torch.device("meta")`` (shapes and dtypes, no storage, no initialization cost) and only the tensors of its own
stages (and any tensor that belongs to no stage) are created on the rank's device, filled from the round's
global parameters. A model larger than one device then trains over a pipeline whose stages each fit.

Tied weights stay tied (one new tensor per original tensor). A module with a non-persistent buffer cannot be
built this way, since the buffer's value is made in ``__init__`` and is not in the global parameters:
:func:`can_build_on_meta` says so, and the engine then builds the whole model as before.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

import numpy as np
import torch
from torch import nn


def can_build_on_meta(model: nn.Module) -> bool:
    """True when every buffer of ``model`` is persistent (in ``state_dict``), so the global parameters hold every
    value the model needs."""
    return not any(module._non_persistent_buffers_set for module in model.modules())


def build_on_meta(build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` under ``torch.device("meta")``: the module tree with shapes and dtypes, no storage."""
    with torch.device("meta"):
        return build()


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
