"""Local training on one device: the loop the built-in tasks use and users may reuse.

:func:`train_task` is the one way a task's own ``train`` is called for a round (by the client runner, and by
the engine for a plan of all ones): the generators keyed by (seed, round, client) and the round's global
parameters, handed over without a copy unless the task reads them. :func:`train_supervised` runs mini-batch SGD
for ``config.local_epochs`` epochs with the FedProx proximal term
(Li et al. 2020, "Federated Optimization in Heterogeneous Networks") when ``config.mu > 0``;
:func:`evaluate_supervised` computes the mean loss and accuracy. Both take plain tensors ``(x, y)`` so that a
shard of a dataset is just an index view, with no DataLoader worker processes.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping

import numpy as np
import torch
from torch import nn

from fedcore.errors import ClientTaskError
from fedcore.seeding import derive_seed
from fedcore.task import EvalResult, FitConfig, LossFn, Task, TrainContext, TrainResult

__all__ = ["GlobalParameters", "LossFn", "evaluate_supervised", "proximal_term", "train_supervised", "train_task"]


class GlobalParameters(Mapping[str, torch.Tensor]):
    """The round's global parameters as ``name -> tensor`` (:attr:`fedcore.task.TrainContext.global_parameters`).

    Keyed by ``model.named_parameters()``. A tensor is made from the received array the first time it is read,
    on the device and in the dtype its parameter has then, and kept; a task that never reads them (FedAvg,
    ``mu = 0``) costs no copy of the model. Each tensor is a copy: writing to it cannot reach the global model
    shared by other clients.

    Args:
        model: the model being trained (read for names, devices and dtypes).
        arrays: the global model received this round, ``state_dict`` name -> array (not modified).
    """

    def __init__(self, model: nn.Module, arrays: Mapping[str, np.ndarray]) -> None:
        self._params = dict(model.named_parameters())
        self._arrays = arrays
        self._tensors: dict[str, torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self._tensors.get(name)
        if tensor is None:
            param = self._params[name]
            with warnings.catch_warnings():  # a read-only (mapped) array is copied here, never written
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                source = torch.from_numpy(np.asarray(self._arrays[name]))
            tensor = source.to(device=param.device, dtype=param.dtype, copy=True)
            self._tensors[name] = tensor
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)


def train_task(
    task: Task,
    model: nn.Module,
    config: FitConfig,
    global_parameters: Mapping[str, np.ndarray],
    *,
    seed: int,
    round: int,
    client_id: str,
) -> TrainResult:
    """Run ``task.train`` on ``model`` (already holding ``global_parameters``) for one round, on one device.

    The shuffling generator is seeded with ``derive_seed(seed, round, client_id)`` and the global torch RNG
    (dropout, random augmentation) with ``derive_seed(that, "torch")`` inside a forked RNG state, so the same
    (seed, round, client) gives the same training wherever it runs, and the caller's CPU RNG state is untouched.
    The CUDA generators are seeded alike when CUDA is initialized when the round starts (not restored after).

    Args:
        task: the client's task; its ``train`` runs as written (any :class:`~fedcore.task.Task`).
        model: the model, holding the round's global parameters; trained in place.
        config: the round's local training settings.
        global_parameters: the global model received, ``state_dict`` name -> array (see :class:`GlobalParameters`).
        seed, round, client_id: key the random streams.

    Returns:
        What ``task.train`` returned (not validated here).
    """
    client_seed = derive_seed(seed, round, client_id)
    context = TrainContext(
        round=round,
        client_id=client_id,
        generator=torch.Generator().manual_seed(client_seed),
        global_parameters=GlobalParameters(model, global_parameters),
    )
    torch_seed = derive_seed(client_seed, "torch")
    with torch.random.fork_rng(devices=[]):
        # the CPU generator (and CUDA's once CUDA is in use) rather than torch.manual_seed, which costs about a
        # millisecond per call queueing lazy seeds (with a stack trace) for every accelerator backend
        torch.default_generator.manual_seed(torch_seed)
        if torch.cuda.is_initialized():
            torch.cuda.manual_seed_all(torch_seed)
        return task.train(model, config, context)


def proximal_term(model: nn.Module, global_parameters: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Return ``sum_i ||w_i - w_global_i||^2`` over the model's trainable parameters (a scalar tensor).

    FedProx adds ``mu / 2`` times this to the local loss (Li et al. 2020, eq. 2).
    """
    total = torch.zeros((), dtype=torch.float32)  # 0-dim: adds to a parameter's sum on any device
    for name, param in model.named_parameters():
        if param.requires_grad:
            total = total + (param - global_parameters[name].detach()).pow(2).sum()
    return total


def train_supervised(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    config: FitConfig,
    *,
    generator: torch.Generator,
    global_parameters: Mapping[str, torch.Tensor] | None = None,
    loss_fn: LossFn | None = None,
) -> TrainResult:
    """Train ``model`` in place with SGD on ``(x, y)``.

    Args:
        model: the model, already holding the global parameters.
        x: inputs, shape ``(N, ...)``, on the model's device.
        y: targets, shape ``(N,)`` (class indices, int64) or whatever ``loss_fn`` takes.
        config: epochs, batch size, lr, momentum, weight decay, FedProx ``mu``, optional step cap.
        generator: seeds the per-epoch shuffles (keyed by seed, round and client by the runner).
        global_parameters: the round's global parameters; required when ``config.mu > 0``.
        loss_fn: defaults to cross-entropy (mean over the batch).

    A model of at least :data:`STEP_IN_BACKWARD_MIN_ELEMENTS` trainable elements is stepped inside ``backward``,
    one parameter at a time, so that its gradients never all exist at once (the same numbers, less memory).

    Returns:
        ``TrainResult(num_examples=N, metrics={"train_loss": mean loss over the last epoch})``. The proximal
        term is not included in ``train_loss``, so losses stay comparable across mu.

    Raises:
        ClientTaskError: ``x`` and ``y`` lengths differ, or ``mu > 0`` without ``global_parameters``.
    """
    if len(x) != len(y):
        raise ClientTaskError(f"x has {len(x)} samples but y has {len(y)}; give inputs and labels of the same length")
    if config.mu > 0 and global_parameters is None:
        raise ClientTaskError(
            "FedProx (mu > 0) needs the round's global parameters: pass global_parameters=context.global_parameters"
        )
    loss_fn = loss_fn or nn.functional.cross_entropy
    n = len(x)
    if n == 0:
        return TrainResult(num_examples=0, metrics={})
    params = [p for p in model.parameters() if p.requires_grad]
    fused = sum(p.numel() for p in params) >= STEP_IN_BACKWARD_MIN_ELEMENTS
    # fused: one SGD per parameter, stepped by a hook as soon as the parameter's gradient is complete, which then
    # drops it, so that at most one parameter's gradient exists at a time rather than the whole model's
    optimizers = [
        torch.optim.SGD(group, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)
        for group in ([[p] for p in params] if fused else [list(model.parameters())])
    ]
    hooks = []
    if fused:
        hooks = [p.register_post_accumulate_grad_hook(_stepper(o)) for p, o in zip(params, optimizers, strict=True)]
    try:
        return _sgd_epochs(model, x, y, config, generator, global_parameters, loss_fn, optimizers[0], fused)
    finally:
        for hook in hooks:
            hook.remove()


STEP_IN_BACKWARD_MIN_ELEMENTS = 1 << 22
"""Models with at least this many trainable elements (4M: 16 MiB of float32) take each parameter's SGD step
inside ``backward``, as soon as its gradient is complete, and drop that gradient (PyTorch's recipe "How to save
memory by fusing the optimizer step into the backward pass"): the gradients never all exist at once, so local
training holds the model plus one parameter's gradient rather than two copies of the model. The steps are the
same per-tensor arithmetic as one ``torch.optim.SGD`` over all parameters (bit for bit, ``tests/fedcore/
test_training.py``); below the threshold, where a gradient costs little, one optimizer steps them all, avoiding a
step call per parameter."""


def _stepper(optimizer: torch.optim.Optimizer) -> Callable[[torch.Tensor], None]:
    """A post-accumulate-grad hook: step ``optimizer`` (one parameter's SGD) and drop the gradient."""

    def step(param: torch.Tensor) -> None:
        optimizer.step()
        param.grad = None

    return step


CLASS_LOSSES: tuple[LossFn, ...] = (nn.functional.cross_entropy, nn.functional.nll_loss)
"""Losses whose integer targets index the model's classes (the default loss is the first)."""
IGNORE_INDEX = -100
"""The target both losses skip by default (their ``ignore_index``)."""


def label_problem(y: torch.Tensor, num_classes: int) -> str | None:
    """What makes integer class labels ``y`` (any shape, any device) unusable with ``num_classes`` classes: values
    outside ``0..num_classes-1`` other than :data:`IGNORE_INDEX` (the first three named), or None. Costs one pass
    over ``y`` and one device-to-host read of its smallest and largest label.

    On a GPU such a label is not an error one client can fail with: cross-entropy's index is a device-side assert
    that leaves the process's CUDA context unusable, so the trainers check before the loss reads the labels."""
    if not y.numel():
        return None
    low, high = torch.stack(torch.aminmax(y)).tolist()  # one device-to-host read: 4 us for 60 labels on the CPU
    if low >= 0 and high < num_classes:
        return None
    bad = ((y < 0) | (y >= num_classes)) & (y != IGNORE_INDEX)
    if not bool(bad.any()):  # only the ignored -100 below 0
        return None
    values = sorted({int(v) for v in y[bad].flatten()[:1000].tolist()})
    shown = ", ".join(str(v) for v in values[:3]) + (" ..." if len(values) > 3 else "")
    return (
        f"labels {shown} lie outside the model's {num_classes} classes; give labels in 0..{num_classes - 1} (or "
        f"{IGNORE_INDEX} to skip a sample), or a model with more outputs"
    )


LABEL_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
"""Integer dtypes whose labels :func:`check_labels` reads (torch.aminmax has no kernel for the wider unsigned ones,
which the losses refuse anyway)."""


def reads_class_labels(loss_fn: LossFn, y: torch.Tensor) -> bool:
    """Whether ``loss_fn`` indexes the model's classes with ``y``, whose labels can then be checked
    (:func:`label_problem`): torch's cross-entropy or NLL loss, integer labels of :data:`LABEL_DTYPES`, not on the
    meta device (which holds no values). Other losses and targets are left to the loss, which says what it makes of
    them."""
    return loss_fn in CLASS_LOSSES and y.dtype in LABEL_DTYPES and not y.is_meta


def check_labels(output: torch.Tensor, y: torch.Tensor, loss_fn: LossFn) -> None:
    """Refuse labels ``y`` that ``loss_fn`` (torch's cross-entropy or NLL; other losses are not checked) would index
    outside the model's classes, the size of dimension 1 of ``output`` ``(N, C, ...)`` (:func:`label_problem`).

    Raises:
        ClientTaskError: the labels out of range, named.
    """
    if not reads_class_labels(loss_fn, y) or output.dim() < 2:
        return
    problem = label_problem(y, int(output.shape[1]))
    if problem is not None:
        raise ClientTaskError(problem)


def _sgd_epochs(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    config: FitConfig,
    generator: torch.Generator,
    global_parameters: Mapping[str, torch.Tensor] | None,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer,
    fused: bool,
) -> TrainResult:
    """``train_supervised``'s loop; ``fused``: the parameters' hooks step them during ``backward``."""
    n = len(x)
    model.train()
    steps = 0
    epoch_loss = 0.0
    on_cpu = x.device.type == "cpu"
    for _ in range(config.local_epochs):
        order = torch.randperm(n, generator=generator).to(x.device)
        loss_sum: float | torch.Tensor = 0.0
        seen = 0
        for start in range(0, n, config.batch_size):
            idx = order[start : start + config.batch_size]
            # index_select, not x[idx]: the same rows, without advanced indexing's cost (0.5 ms a batch of 10
            # Fashion-MNIST images on one thread, more than the step itself)
            xb, yb = x.index_select(0, idx), y.index_select(0, idx.to(y.device))
            if not fused:
                optimizer.zero_grad(set_to_none=True)
            output = model(xb)
            if not steps:  # all the client's labels, once, before a loss reads them
                check_labels(output, y, loss_fn)
            loss = loss_fn(output, yb)
            total = loss
            if config.mu > 0 and global_parameters is not None:
                total = loss + 0.5 * config.mu * proximal_term(model, global_parameters)
            total.backward()
            if not fused:
                optimizer.step()
            loss_sum = _add(loss_sum, loss.detach(), len(idx), on_cpu)
            seen += len(idx)
            steps += 1
            if config.max_steps is not None and steps >= config.max_steps:
                break
        epoch_loss = float(loss_sum) / max(seen, 1)
        if config.max_steps is not None and steps >= config.max_steps:
            break
    return TrainResult(num_examples=n, metrics={"train_loss": epoch_loss})


@torch.no_grad()
def evaluate_supervised(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    batch_size: int = 256,
    loss_fn: LossFn | None = None,
) -> EvalResult:
    """Mean loss and accuracy of a classifier on ``(x, y)``.

    Args:
        x: inputs ``(N, ...)``; y: class indices ``(N,)`` int64, or ``(N, T...)`` for outputs ``(N, C, T...)`` (a
            label per position, as torch's cross-entropy takes them); :data:`IGNORE_INDEX` marks a label to skip.

    Returns:
        ``EvalResult(loss=mean loss per label, num_examples=N, metrics={"accuracy": fraction of labels correct})``,
        both over the labels not ignored, as torch's mean reduction counts them (one label per example for ``(N,)``
        labels: the mean per example). Targets that are not class indices (floating point) are averaged per example.
    """
    loss_fn = loss_fn or nn.functional.cross_entropy
    model.eval()
    n = len(x)
    if n == 0:
        return EvalResult(loss=float("nan"), num_examples=0, metrics={})
    on_cpu = x.device.type == "cpu"
    loss_sum: float | torch.Tensor = 0.0
    correct: float | torch.Tensor = 0.0  # counts, exact in float64
    labelled: float | torch.Tensor = 0.0
    indices = not (y.is_floating_point() or y.is_complex())
    for start in range(0, n, batch_size):
        xb, yb = x[start : start + batch_size], y[start : start + batch_size]
        out = model(xb)
        if not start:
            check_labels(out, y, loss_fn)
        loss_sum = _add(loss_sum, loss_fn(out, yb, reduction="sum"), 1, on_cpu)
        hits = out.argmax(dim=1) == yb
        if indices:  # the labels the loss counts: all but the ignored ones, at every position
            kept = yb != IGNORE_INDEX
            hits &= kept
            labelled = _add(labelled, kept.sum(), 1, on_cpu)
        correct = _add(correct, hits.sum(), 1, on_cpu)
    count = float(labelled) if indices else float(n)
    if count == 0:  # every label ignored: nothing to measure
        return EvalResult(loss=float("nan"), num_examples=n, metrics={})
    return EvalResult(loss=float(loss_sum) / count, num_examples=n, metrics={"accuracy": float(correct) / count})


def _add(total: float | torch.Tensor, value: torch.Tensor, scale: int, on_cpu: bool) -> float | torch.Tensor:
    """``total + value * scale`` in float64, ``value`` a scalar tensor: on the CPU as a Python float; on an
    accelerator as a tensor there, the same float64 arithmetic, so that a loop reads its sum once at the end
    rather than waiting for the device at every step."""
    if on_cpu:
        return total + float(value) * scale
    return total + value.double() * scale
