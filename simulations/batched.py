"""Batched clients: a round's sampled clients trained together as one computation (``[simulation] backend =
"batched"``).

One-by-one, a round of 100 small clients is 100 short training loops, each too small to keep a core busy. Here
the clients' models are stacked along a leading client dimension and trained together: every SGD step is one
``torch.func.vmap`` of ``torch.func.grad`` over ``functional_call(model, client_parameters, client_batch)``
(Horace He et al., functorch; the same transform as per-sample gradients, applied per client), so a Linear layer
becomes one batched matmul over all clients, and the optimizer update is one tensor operation over all of them.

A model made only of Flatten, Linear and ReLU modules run in order (the 2NN, logistic regression), trained with
cross-entropy and plain SGD (no momentum, weight decay or mu), takes a fused path instead: the forward and backward
written as batched matmuls, each stacked weight updated in place by one ``baddbmm_``, which halves a round on the
CPU (no stacked gradient is written and read again); the path is taken only when running those modules in order
reproduces the model's own output.

What it computes is what :func:`fedcore.training.train_supervised` computes for each client alone, step for step:

- the same shuffling: each client's ``torch.randperm`` per epoch from its generator seeded with
  ``derive_seed(seed, round, client)`` (:func:`fedcore.training.train_task`), batches of ``batch_size`` in that
  order, the last batch of an epoch partial, ``max_steps`` counted over epochs;
- the same loss (the task's ``loss_fn`` on the client's batch, mean reduction), the FedProx term
  ``mu/2 ||w - w_global||^2`` of trainable parameters (its gradient ``mu (w - w_global)``, added to the loss
  gradient as autograd would), and torch.optim.SGD's update (weight decay, momentum with dampening 0, no
  Nesterov), parameters that do not require grad left untouched;
- the same ``train_loss``: the mean loss over the last epoch's batches (without the proximal term).

Clients of unequal sizes take different numbers of steps and have partial batches at different steps. Clients are
ordered by size, largest first, so the clients still training at step ``t`` are a prefix of the stack and those
with the same size are neighbours; a step trains each run of neighbours with the same batch size as one ``vmap``
call on views of the stacked tensors (one call per step when the clients are of equal size; a few more at the
end of an epoch when they are not). No client ever sees a padded or masked sample, so the loss function is called
exactly as one-by-one.

Results match one-by-one training up to float rounding (batched matmuls sum in another order): the tests hold
parameters and losses to ``torch.testing.assert_close`` with ``rtol = atol = 1e-5`` after a round, so the history
differs from the in-process backend's in the last digits. What it cannot reproduce it refuses with a
:class:`~fedcore.errors.ConfigError` before the first round (:func:`check_batchable`): a task that is not a
:class:`~fedcore.supervised.SupervisedTask` with its own ``train`` (any other task trains with code this backend
cannot see), a model with buffers (BatchNorm's running statistics change during training) or randomness
(dropout: one-by-one draws it from each client's generator), client mods or tensor groups (SCAFFOLD, client-side
DP, compression run per client), ``train.report_validation`` (an evaluation of each trained model). Evaluation
and round protocol stages run in-process, one client after another.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from fedcore.errors import ClientTaskError, ConfigError, FedcoreError
from fedcore.messages import Failure, FitIns, FitRes, Reply, ServerMessage, Stage, packed_nbytes
from fedcore.seeding import derive_seed
from fedcore.strategy import Strategy
from fedcore.supervised import SupervisedTask
from fedcore.task import FitConfig, LossFn, Task
from fedcore.tensors import NamedArrays, check_spec, state_spec
from server.pool import PoolWrapper
from simulations.inmemory import InMemoryPool

log = logging.getLogger("fedcore.simulation")

__all__ = ["BatchedPool", "ClientShard", "ClientUpdate", "check_batchable", "train_clients"]

_RANDOM_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
CPU_STACK_BYTES = 16 << 20
"""On the CPU, clients are trained together by default only as many as keep their largest stacked parameter (and
so its gradient) within this many bytes: each step's gradients are fresh allocations, and blocks this small are
reused from glibc's heap, where larger ones are new mappings whose pages fault in at every step (measured on the
2NN, 100 clients of 60: 130,000 page faults a round at 100 together, 30,000 at 20; about 20% of the time)."""
GPU_STACK_FRACTION = 0.5
"""On a GPU, clients are trained together by default as many as keep their stacked models, three copies of each
(parameters, gradients, momentum), within this fraction of the GPU's free memory when the round starts (all of a
round's clients for a small model: 1,000 2NNs take 2.4 GB; 20M-parameter models, 240 MB each, about 290 at a time
on an empty H200); the rest of it is left to the activations and the data."""
_ADVICE = "; run it with [simulation] backend = 'inprocess' (--backend inprocess)"


@dataclass(frozen=True)
class ClientShard:
    """One client's training data.

    Attributes:
        client_id: keys the client's shuffling generator (with the seed and round).
        x: inputs ``(N, ...)`` (every client's of the same trailing shape and dtype).
        y: targets ``(N, ...)`` as the loss function takes them (class indices, int64, for cross-entropy).
    """

    client_id: str
    x: torch.Tensor
    y: torch.Tensor


@dataclass(frozen=True)
class ClientUpdate:
    """One client's result of a batched round.

    Attributes:
        parameters: the trained model, state-dict name -> tensor on the CPU (views into the stacked result; the
            tensors of parameters that do not require grad are the global ones).
        num_examples: the client's number of training samples.
        metrics: ``{"train_loss": mean loss over the last epoch}``, empty for a client without data.
    """

    parameters: dict[str, torch.Tensor]
    num_examples: int
    metrics: dict[str, float]


def check_model(model: nn.Module) -> None:
    """Refuse a model that batched training cannot train as one-by-one training would.

    Raises:
        ConfigError: the model has buffers (BatchNorm running statistics and the like), a dropout module with
            ``p > 0``, or a parameter that is not floating point.
    """
    name = type(model).__name__
    buffers = [n for n, _ in model.named_buffers()]
    if buffers:
        raise ConfigError(
            f"batched clients need a model without buffers, and {name} has {len(buffers)} (e.g. {buffers[0]!r}: "
            f"BatchNorm's running statistics change during training)" + _ADVICE
        )
    random = [type(m).__name__ for m in model.modules() if isinstance(m, _RANDOM_MODULES) and getattr(m, "p", 0) > 0]
    if random:
        raise ConfigError(
            f"batched clients need a model without randomness, and {name} has {random[0]} (each client draws its "
            "dropout masks from its own generator one-by-one)" + _ADVICE
        )
    for pname, param in model.named_parameters():
        if not param.is_floating_point():
            raise ConfigError(f"parameter {pname!r} of {name} is {param.dtype}, not floating point" + _ADVICE)


def check_batchable(task: Task, strategy: Strategy | None = None) -> None:
    """Refuse, before the first round, what batched clients cannot train exactly as the in-process backend.

    Builds the task's model (global RNG untouched) and runs one batched gradient on the task's first two samples,
    so that a model whose forward draws random numbers is refused here and not in a round.

    Args:
        task: a client's task (its model and data stand for every client's).
        strategy: the run's strategy, whose client mods and tensor groups are refused; None to check the task only.

    Raises:
        ConfigError: what is missing, and that ``backend = "inprocess"`` runs it.
    """
    if strategy is not None:
        if strategy.fit.report_validation:
            raise ConfigError(
                "batched clients do not evaluate each trained model on the client's held-out data; turn "
                "train.report_validation off" + _ADVICE
            )
        if strategy.mods:
            names = ", ".join(mod.name for mod in strategy.mods)
            raise ConfigError(
                f"batched clients train plain or FedProx SGD; strategy {strategy.name!r} declares client mods "
                f"({names}), which run per client" + _ADVICE
            )
        if strategy.groups:
            raise ConfigError(
                f"batched clients send the model only; strategy {strategy.name!r} declares tensor groups "
                f"({', '.join(sorted(strategy.groups))})" + _ADVICE
            )
    if not isinstance(task, SupervisedTask):
        raise ConfigError(
            f"batched clients need a fedcore.supervised.SupervisedTask, got {type(task).__name__}" + _ADVICE
        )
    if type(task).train is not SupervisedTask.train:
        raise ConfigError(
            f"{type(task).__name__} overrides SupervisedTask.train; batched clients train with the built-in loop "
            "only" + _ADVICE
        )
    if task.train_data is None:
        raise ConfigError("batched clients need the client task's train_data; this task has none" + _ADVICE)
    with torch.random.fork_rng(devices=[]):
        model = task.build_model()
    check_model(model)
    x, y = task.train_data
    if len(x) == 0:
        return
    trial = _Batched(model, task.loss_fn)
    params = {n: p.detach().unsqueeze(0) for n, p in trial.trainable.items()}
    try:
        trial.grad(params, x[None, :2].cpu(), y[None, :2].cpu())  # the trial model is on the CPU, x may not be
    except RuntimeError as exc:
        raise ConfigError(
            f"batched clients could not vmap the model's training step ({type(exc).__name__}: "
            f"{str(exc)[:300]}); a model whose forward draws random numbers or writes to its own tensors cannot be "
            "batched" + _ADVICE
        ) from None


class _Batched:
    """A model's loss gradient, vmapped over a leading client dimension of parameters and batches."""

    def __init__(self, model: nn.Module, loss_fn: LossFn) -> None:
        model.train()
        self.model = model
        named = dict(model.named_parameters(remove_duplicate=False))
        first: dict[int, str] = {}
        for name, param in named.items():
            first.setdefault(id(param), name)
        self.canonical = {name: first[id(param)] for name, param in named.items()}  # tied weights share one
        self.trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.frozen = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}

        def client_loss(
            params: dict[str, torch.Tensor], frozen: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            loss = loss_fn(functional_call(model, (params, frozen), (x,)), y)
            return loss, loss.detach()

        self._grad = vmap(grad(client_loss, has_aux=True), in_dims=(0, None, 0, 0), randomness="error")

    def to(self, device: torch.device) -> None:
        """Keep the frozen parameters on ``device``, where the stacked ones and the data are (the model itself
        stays where it was built: only its structure is called)."""
        self.frozen = {n: t.to(device) for n, t in self.frozen.items()}

    def grad(
        self, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Gradients ``(clients, *shape)`` of each client's mean loss, and the losses ``(clients,)``."""
        grads, losses = self._grad(params, self.frozen, x, y)
        return grads, losses


class _LinearChain:
    """The fused path for a multilayer perceptron (Flatten, Linear and ReLU modules run in order, e.g. the 2NN
    and logistic regression) under cross-entropy and plain SGD: forward and backward written out as batched
    matmuls, each weight updated in place by one ``baddbmm_`` (``W -= lr * delta^T h``), so no gradient of the
    stacked weights is ever materialized. The same mathematics as autograd's (mean cross-entropy's gradient
    ``(softmax - onehot) / batch``, ReLU's derivative 0 at 0), in another float order; it halves a round's time
    on the CPU, where the stacked weights do not fit in cache and every pass over them costs.

    Args:
        layers: the model's Linear and ReLU modules in the order the forward runs them.
        names: each Linear's parameter names in the model, ``(weight, bias or None)``.
    """

    def __init__(self, layers: Sequence[nn.Module], names: Sequence[tuple[str, str | None]]) -> None:
        self.layers = list(layers)
        self.names = list(names)

    @staticmethod
    def detect(model: nn.Module, sample: torch.Tensor) -> _LinearChain | None:
        """The chain of ``model``, when its modules are only Flatten, Linear and ReLU and running them in order on
        the flattened ``sample`` (a few inputs of the clients' shape) gives the model's own output; else None."""
        leaves = [(name, m) for name, m in model.named_modules() if not list(m.children())]
        if not leaves or not all(isinstance(m, (nn.Flatten, nn.Linear, nn.ReLU)) for _, m in leaves):
            return None
        if any(isinstance(m, nn.Flatten) and (m.start_dim, m.end_dim) != (1, -1) for _, m in leaves):
            return None
        canonical = dict(model.named_parameters())  # tied or frozen weights: the general path
        if len(canonical) != len(dict(model.named_parameters(remove_duplicate=False))):
            return None
        if any(not p.requires_grad for p in canonical.values()):
            return None
        layers = [m for _, m in leaves if not isinstance(m, nn.Flatten)]
        names = [
            (f"{name}.weight", f"{name}.bias" if m.bias is not None else None)
            for name, m in leaves
            if isinstance(m, nn.Linear)
        ]
        with torch.no_grad():
            h = sample.flatten(1)
            for layer in layers:
                if isinstance(layer, nn.Linear) and h.shape[-1] != layer.in_features:
                    return None
                h = layer(h)
            output = model(sample)
        same = isinstance(output, torch.Tensor) and output.shape == h.shape and torch.equal(output, h)
        return _LinearChain(layers, names) if same else None

    def step(self, params: Mapping[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, lr: float) -> torch.Tensor:
        """One SGD step of mean cross-entropy on clients' batches ``x (clients, batch, ...)``, ``y (clients,
        batch)`` int64, updating ``params`` (stacked views) in place; returns the losses ``(clients,)``."""
        h = x.flatten(2)
        inputs: list[torch.Tensor] = []
        linear = iter(self.names)
        for layer in self.layers:
            if isinstance(layer, nn.Linear):
                weight, bias = next(linear)
                inputs.append(h)
                w = params[weight].transpose(1, 2)
                h = torch.baddbmm(params[bias].unsqueeze(1), h, w) if bias is not None else torch.bmm(h, w)
            else:
                h = torch.relu(h)
                inputs.append(h)
        batch = y.shape[1]
        losses = (torch.logsumexp(h, -1) - h.gather(-1, y.unsqueeze(-1)).squeeze(-1)).mean(1)
        delta = torch.softmax(h, -1)
        delta.scatter_add_(-1, y.unsqueeze(-1), torch.full_like(delta[..., :1], -1.0)).div_(batch)
        linear_back = iter(reversed(self.names))
        for index in range(len(self.layers) - 1, -1, -1):
            layer, below = self.layers[index], inputs[index]
            if isinstance(layer, nn.Linear):
                weight, bias = next(linear_back)
                grad_in = torch.bmm(delta, params[weight]) if index > 0 else None
                params[weight].baddbmm_(delta.transpose(1, 2), below, alpha=-lr)
                if bias is not None:
                    params[bias].add_(delta.sum(1), alpha=-lr)
                if grad_in is None:
                    break
                delta = grad_in
            else:
                delta = delta.mul_(below > 0)
        return losses


def _schedule(n: int, config: FitConfig) -> tuple[int, int]:
    """``(batches per epoch, steps)`` of a client with ``n`` samples, as the one-by-one loop counts them."""
    per_epoch = math.ceil(n / config.batch_size)
    steps = per_epoch * config.local_epochs
    if config.max_steps is not None:
        steps = min(steps, config.max_steps)
    return per_epoch, steps


def _batch_size(n: int, per_epoch: int, step: int, batch_size: int) -> int:
    """The size of a client's batch at ``step`` (the last batch of an epoch holds the rest)."""
    within = step % per_epoch
    return batch_size if within < per_epoch - 1 else n - (per_epoch - 1) * batch_size


def train_clients(
    model: nn.Module,
    global_parameters: Mapping[str, torch.Tensor],
    clients: Sequence[ClientShard],
    config: FitConfig,
    *,
    seed: int,
    round: int,
    loss_fn: LossFn = nn.functional.cross_entropy,
    device: torch.device | str | None = None,
) -> list[ClientUpdate]:
    """Train ``clients`` together for one round, each from ``global_parameters``, as
    :func:`fedcore.training.train_supervised` trains each alone (see the module docstring).

    Args:
        model: a model of the clients' architecture (checked with :func:`check_model`); its parameter values are
            not used or changed, its train mode is set.
        global_parameters: the round's global model, state-dict name -> tensor (every parameter of ``model``).
        clients: the clients' data, in any order (results come back in this order).
        config: epochs, batch size, lr, momentum, weight decay, mu, max_steps.
        seed, round: with each client id, key the clients' shuffling (``derive_seed(seed, round, client_id)``).
        loss_fn: ``loss_fn(output, target)``, mean over the batch (the task's).
        device: where to train (default: the CPU); the results come back on the CPU.

    Returns:
        One :class:`ClientUpdate` per client, in the order of ``clients``.

    Raises:
        ClientTaskError: a client's ``x`` and ``y`` differ in length, or the clients' inputs differ in trailing
            shape or dtype.
        ConfigError: the model is not batchable (:func:`check_model`).
    """
    check_model(model)
    device = torch.device(device) if device is not None else torch.device("cpu")
    for shard in clients:
        if len(shard.x) != len(shard.y):
            raise ClientTaskError(
                f"x has {len(shard.x)} samples but y has {len(shard.y)}; give inputs and labels of the same length",
                client_id=shard.client_id,
                round=round,
            )
    # largest first: the clients still training at step t are a prefix, clients of one size are neighbours
    order = sorted(range(len(clients)), key=lambda i: -len(clients[i].x))
    shards = [clients[i] for i in order]
    sizes = [len(s.x) for s in shards]
    plans = [_schedule(n, config) for n in sizes]
    num_steps = max((steps for _, steps in plans), default=0)
    batched = _Batched(model, loss_fn)
    batched.to(device)
    names = list(batched.trainable)
    count = len(shards)
    params = {n: global_parameters[n].to(device).expand(count, *global_parameters[n].shape).clone() for n in names}
    losses = torch.zeros(count, max(num_steps, 1), dtype=torch.float32, device=device)
    if num_steps:
        x_all = torch.cat([s.x for s in shards if len(s.x)]).to(device)
        y_all = torch.cat([s.y for s in shards if len(s.y)]).to(device)
        index = _batch_index(shards, plans, config, seed=seed, round=round).to(device)
        reference = {n: global_parameters[n].to(device) for n in names} if config.mu > 0 else {}
        momentum = {n: torch.zeros_like(params[n]) for n in names} if config.momentum != 0 else {}
        fused = None
        plain_sgd = config.momentum == 0 and config.weight_decay == 0 and config.mu == 0
        if plain_sgd and loss_fn is nn.functional.cross_entropy and y_all.dtype == torch.int64 and y_all.dim() == 1:
            fused = _LinearChain.detect(model, x_all[:2].cpu())
        for step in range(num_steps):
            active = sum(1 for _, steps in plans if steps > step)
            start = 0
            while start < active:
                (per_epoch, _), n = plans[start], sizes[start]
                size = _batch_size(n, per_epoch, step, config.batch_size)
                end = start + 1
                while end < active and _batch_size(sizes[end], plans[end][0], step, config.batch_size) == size:
                    end += 1
                rows = index[start:end, step, :size].reshape(-1)
                xb = x_all.index_select(0, rows).view(end - start, size, *x_all.shape[1:])
                yb = y_all.index_select(0, rows).view(end - start, size, *y_all.shape[1:])
                views = {n: params[n][start:end] for n in names}
                if fused is not None:
                    step_losses = fused.step(views, xb, yb, config.lr)
                else:
                    grads, step_losses = batched.grad(views, xb, yb)
                    buffers = {n: buf[start:end] for n, buf in momentum.items()}
                    _sgd_step(views, grads, buffers, reference, config, first=step == 0)
                losses[start:end, step] = step_losses
                start = end
    return _updates(clients, order, params, global_parameters, batched, losses.cpu(), sizes, plans, config)


def _batch_index(
    shards: Sequence[ClientShard], plans: Sequence[tuple[int, int]], config: FitConfig, *, seed: int, round: int
) -> torch.Tensor:
    """``(clients, steps, batch_size)`` int64: the rows of the concatenated data each client's batch takes at each
    step (a partial batch padded with row 0, never read), drawn as :func:`fedcore.training.train_supervised`
    draws them: one ``randperm`` per epoch begun, from the client's generator."""
    num_steps = max((steps for _, steps in plans), default=0)
    batch = config.batch_size
    index = torch.zeros(len(shards), num_steps, batch, dtype=torch.int64)
    offset = 0
    for row, (shard, (per_epoch, steps)) in enumerate(zip(shards, plans, strict=True)):
        n = len(shard.x)
        if n == 0:
            continue
        generator = torch.Generator().manual_seed(derive_seed(seed, round, shard.client_id))
        epochs = math.ceil(steps / per_epoch)
        padded = torch.zeros(epochs, per_epoch * batch, dtype=torch.int64)
        for epoch in range(epochs):
            padded[epoch, :n] = torch.randperm(n, generator=generator) + offset
        index[row, :steps] = padded.view(epochs * per_epoch, batch)[:steps]
        offset += n
    return index


def _sgd_step(
    params: Mapping[str, torch.Tensor],
    grads: Mapping[str, torch.Tensor],
    momentum: Mapping[str, torch.Tensor],
    reference: Mapping[str, torch.Tensor],
    config: FitConfig,
    *,
    first: bool,
) -> None:
    """torch.optim.SGD's step (``_single_tensor_sgd``: dampening 0, no Nesterov) on a run of stacked clients, in
    place, after the FedProx term's gradient ``mu/2 * 2 (w - w_global)`` (as autograd forms it) is added."""
    for name, param in params.items():
        g = grads[name]
        if config.mu > 0:
            g = g + (param - reference[name]).mul(2).mul(0.5 * config.mu)
        if config.weight_decay != 0:
            g = g.add(param, alpha=config.weight_decay)
        if config.momentum != 0:
            buf = momentum[name]
            if first:
                buf.copy_(g)
            else:
                buf.mul_(config.momentum).add_(g)
            g = buf
        param.add_(g, alpha=-config.lr)


def _updates(
    clients: Sequence[ClientShard],
    order: Sequence[int],
    params: Mapping[str, torch.Tensor],
    global_parameters: Mapping[str, torch.Tensor],
    batched: _Batched,
    losses: torch.Tensor,
    sizes: Sequence[int],
    plans: Sequence[tuple[int, int]],
    config: FitConfig,
) -> list[ClientUpdate]:
    """The clients' results in the order they were given; ``train_loss`` summed in float64 step by step as the
    one-by-one loop sums it (``loss * batch`` over the last epoch begun, over the samples seen in it)."""
    cpu = {n: p.cpu() for n, p in params.items()}
    values = losses.double().numpy()
    updates: list[ClientUpdate | None] = [None] * len(clients)
    for row, position in enumerate(order):
        n, (per_epoch, steps) = sizes[row], plans[row]
        state = {}
        for name, canonical in batched.canonical.items():
            state[name] = cpu[canonical][row] if canonical in cpu else global_parameters[canonical].cpu()
        metrics: dict[str, float] = {}
        if n:
            last_epoch_start = ((steps - 1) // per_epoch) * per_epoch
            loss_sum, seen = 0.0, 0
            for step in range(last_epoch_start, steps):
                size = _batch_size(n, per_epoch, step, config.batch_size)
                loss_sum += float(values[row, step]) * size
                seen += size
            metrics["train_loss"] = loss_sum / max(seen, 1)
        updates[position] = ClientUpdate(parameters=state, num_examples=n, metrics=metrics)
    return [u for u in updates if u is not None]


Key = tuple[Any, ...]


class BatchedPool(PoolWrapper):
    """A :class:`server.pool.ClientPool` that trains a round's fit instructions as batches (:func:`train_clients`)
    and runs everything else (evaluation, protocol stages) through the in-process pool it wraps.

    Replies come in the order of the instructions, as the in-process pool yields them, so the round loop folds the
    updates in the same order. A client whose data is unusable (``x`` and ``y`` of different lengths) fails alone,
    as it would in-process; a batch that fails fails each of its clients with the reason. Each reply's
    ``fit_seconds`` is its batch's wall time divided among the batch's clients.

    Args:
        pool: the in-process pool of the same clients (their tasks, evaluation, stages).
        batch_clients: train at most this many clients together (0: on the CPU as many as keep the largest stacked
            parameter within :data:`CPU_STACK_BYTES`, on a CUDA GPU as many as fit its free memory, :func:`gpu_batch`).
        device: where to train the batches (default: the CPU).

    Raises:
        ConfigError: (from :meth:`run`) a fit instruction carries client mods or tensor groups, or a client's task
            is not batchable (:func:`check_batchable`).
    """

    def __init__(self, pool: InMemoryPool, *, batch_clients: int = 0, device: torch.device | str | None = None) -> None:
        if batch_clients < 0:
            raise ConfigError(f"batch_clients must be >= 0 (0: all of a round's clients), got {batch_clients}")
        super().__init__(pool)
        self._pool: InMemoryPool = pool
        self._batch_clients = batch_clients
        self._device = device
        self._models: dict[Key, nn.Module] = {}

    def run(self, instructions: Mapping[str, ServerMessage], *, timeout_s: float | None = None) -> Iterator[Reply]:
        """Fit instructions: trained in batches, one reply per client in instruction order. Anything else (or a
        mix): the in-process pool's replies."""
        if not instructions or not all(isinstance(ins, FitIns) for ins in instructions.values()):
            yield from self._pool.run(instructions, timeout_s=timeout_s)
            return
        items = [(cid, ins) for cid, ins in instructions.items() if isinstance(ins, FitIns)]
        size = self._batch_clients or self._auto_batch(items[0][0], len(items))
        for begin in range(0, len(items), size):
            yield from self._fit(items[begin : begin + size])

    def _auto_batch(self, client_id: str, count: int) -> int:
        """How many clients to train together when ``batch_clients`` is 0: on the CPU, as many as keep the largest
        stacked parameter within :data:`CPU_STACK_BYTES`; on a CUDA GPU, as many as :func:`gpu_batch` fits in its
        free memory; on another accelerator all of them."""
        task = self._pool.task(client_id)
        device = torch.device(self._device) if self._device is not None else torch.device("cpu")
        if not isinstance(task, SupervisedTask):
            return count
        parameters = list(self._model(task).parameters())
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return gpu_batch(count, sum(p.numel() * p.element_size() for p in parameters), free)
        if device.type != "cpu":
            return count
        largest = max((p.numel() * p.element_size() for p in parameters), default=1)
        return max(1, min(count, CPU_STACK_BYTES // max(largest, 1)))

    def _model(self, task: SupervisedTask) -> nn.Module:
        key = (task.model_fn, task.loss_fn)
        model = self._models.get(key)
        if model is None:
            check_batchable(task)
            with torch.random.fork_rng(devices=[]):
                model = task.build_model()
            self._models[key] = model
        return model

    def _fit(self, items: Sequence[tuple[str, FitIns]]) -> Iterator[Reply]:
        replies: dict[str, Reply] = {}
        groups: dict[Key, list[tuple[str, FitIns, SupervisedTask]]] = {}
        for cid, ins in items:
            if ins.mods or ins.groups or ins.config.report_validation:
                raise ConfigError(
                    f"round {ins.round}: client {cid!r} was sent client mods, tensor groups or report_validation, "
                    "which batched clients do not run" + _ADVICE
                )
            task = self._pool.task(cid)
            if not isinstance(task, SupervisedTask):
                check_batchable(task)  # raises: names what the task lacks
                continue
            x, y = task.training_data()
            if len(x) != len(y):
                replies[cid] = Failure(
                    client_id=cid,
                    round=ins.round,
                    stage=Stage.FIT,
                    reason=f"x has {len(x)} samples but y has {len(y)}; give inputs and labels of the same length",
                )
                continue
            key = (task.model_fn, task.loss_fn, id(ins.parameters), ins.config, ins.seed, ins.round)
            groups.setdefault(key, []).append((cid, ins, task))
        for members in groups.values():
            replies.update(self._train_group(members))
        for cid, _ in items:
            yield replies[cid]

    def _train_group(self, members: Sequence[tuple[str, FitIns, SupervisedTask]]) -> dict[str, Reply]:
        _, ins, task = members[0]
        started = time.perf_counter()
        try:
            model = self._model(task)
            check_spec(ins.parameters, state_spec(model.state_dict()), round=ins.round)
            global_parameters = _tensors(ins.parameters)
            shards = [ClientShard(cid, *member_task.training_data()) for cid, _, member_task in members]
            updates = train_clients(
                model,
                global_parameters,
                shards,
                ins.config,
                seed=ins.seed,
                round=ins.round,
                loss_fn=task.loss_fn,
                device=self._device,
            )
        except ConfigError:
            raise
        except FedcoreError as exc:
            return {
                cid: Failure(client_id=cid, round=ins.round, stage=Stage.FIT, reason=str(exc)) for cid, *_ in members
            }
        except Exception as exc:  # a bug in user code (model, loss) fails the batch's clients, not the simulation
            log.exception("a batch of %d clients raised", len(members))
            reason = f"{type(exc).__name__}: {exc}"
            return {cid: Failure(client_id=cid, round=ins.round, stage=Stage.FIT, reason=reason) for cid, *_ in members}
        seconds = (time.perf_counter() - started) / len(members)
        replies: dict[str, Reply] = {}
        for (cid, member_ins, _), update in zip(members, updates, strict=True):
            arrays: NamedArrays = {name: t.numpy() for name, t in update.parameters.items()}
            reply = FitRes(
                client_id=cid,
                round=member_ins.round,
                parameters=arrays,
                num_examples=update.num_examples,
                metrics={**update.metrics, "fit_seconds": seconds},
            )
            replies[cid] = replace(reply, payload_bytes=packed_nbytes(reply))  # as the in-process pool measures it
        return replies


def gpu_batch(count: int, model_bytes: int, free_bytes: int) -> int:
    """How many of ``count`` clients a GPU with ``free_bytes`` free trains together: as many as keep three stacked
    copies of a model of ``model_bytes`` (parameters, gradients, momentum) within :data:`GPU_STACK_FRACTION` of
    the free memory, at least 1 and at most ``count``."""
    fits = int(GPU_STACK_FRACTION * free_bytes) // max(3 * model_bytes, 1)
    return max(1, min(count, fits))


def _tensors(arrays: NamedArrays) -> dict[str, torch.Tensor]:
    """Named numpy arrays as tensors sharing their memory (read-only arrays are only ever read here)."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return {name: torch.from_numpy(np.asarray(array)) for name, array in arrays.items()}
