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
reproduces the model's own output. Where the first Linear layer is wide enough (the 2NN's, not logistic
regression's), its updates are deferred over windows of a few steps (:class:`_DeferredFirst`): its inputs are data,
known in advance, so a window's outputs come from one matrix product and a small correction per step, and the
window's updates from one more, which takes a third off a round of issue 12's workload. That order of float
operations differs from one-by-one training's more than the batched matmuls' does, enough that a pre-activation
within rounding of 0 now and then lands on the other side of a ReLU, so it is off unless asked for
(``[simulation] defer_first_layer``).

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

import functools
import logging
import math
import re
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from fedcore.aggregation import MeanAggregator
from fedcore.aggregation.blocks import check_weight
from fedcore.aggregation.weights import update_weight
from fedcore.errors import ClientTaskError, ConfigError, FedcoreError, NonFiniteError, failure_reason
from fedcore.kernels import FUSED_DTYPES, all_finite, batch_rows, fold_rows
from fedcore.messages import (
    Failure,
    FitBatchRes,
    FitIns,
    FitRes,
    PoolReply,
    Reply,
    ServerMessage,
    Stage,
    packed_nbytes,
)
from fedcore.seeding import derive_seeds
from fedcore.strategy import Strategy
from fedcore.supervised import SupervisedTask
from fedcore.task import FitConfig, LossFn, Task
from fedcore.tensors import NamedArrays, check_spec, num_bytes, state_spec
from fedcore.training import CLASS_LOSSES, label_problem, reads_class_labels
from server.pool import PoolWrapper
from simulations.inmemory import InMemoryPool
from simulations.shuffle import epoch_permutations

log = logging.getLogger("fedcore.simulation")

__all__ = [
    "BatchedPool",
    "ClientShard",
    "ClientUpdate",
    "TrainedClients",
    "check_batchable",
    "check_batchable_clients",
    "first_buildable_task",
    "presum_weight",
    "train_stack",
]

_RANDOM_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
CPU_STACK_BYTES = 16 << 20
"""On the CPU, clients are trained together by default only as many as keep their largest stacked parameter (and
so its gradient) within this many bytes: each step's gradients are fresh allocations, and blocks this small are
reused from glibc's heap, where larger ones are new mappings whose pages fault in at every step (measured on the
2NN, 100 clients of 60: 130,000 page faults a round at 100 together, 30,000 at 20; about 20% of the time)."""
FUSED_STACK_BYTES = 128 << 20
"""On the CPU, clients taking the fused path (:class:`_LinearChain`, which makes no stacked gradient) are trained
together by default as many as keep their stacked models within this many bytes (the 2NN: 168; a round of issue
12's workload, 100 clients, as one batch): fewer, larger batches, measured on that workload at 0.21 s a round
against 0.25-0.27 in batches of 26, and a round that is one batch sums to the very bits of one-by-one folding. The
stack stays in :class:`StackBuffers` between rounds."""
FUSED_CHUNK_BYTES = 8 << 20
"""On the CPU, the fused path trains a batch's clients this many bytes at a time (their stacked models and one
step's inputs) through all their steps (:func:`train_stack`): each step reads every client's weights three times
and writes them once, so a chunk that stays in cache from step to step saves most of that memory traffic. Measured
on issue 12's workload, one thread, on an AMD EPYC VM (s a round): the 2NN at 100 clients a round 0.135 as one
chunk, 0.127 / 0.106 / 0.096 / 0.102 / 0.121 at 32 / 16 / 8 / 4 / 2 MiB of models; logistic regression at 1,000
0.130 as one chunk, 0.092 at 8 MiB of models and 0.082 at 4 or 2 (about 8 MiB with the inputs counted)."""
GPU_STACK_FRACTION = 0.5
"""On a GPU, clients are trained together by default as many as keep their stacked models, three copies of each
(parameters, gradients, momentum), within this fraction of the GPU's free memory when the round starts (all of a
round's clients for a small model: 1,000 2NNs take 2.4 GB; 20M-parameter models, 240 MB each, about 290 at a time
on an empty H200); the rest of it is left to the activations and the data."""
_ADVICE = "; run it with [simulation] backend = 'inprocess' (--backend inprocess)"
_MOD_OPTIONS = {
    "compress": "[strategy] compression (--compression)",
    "dp-clip": "[privacy] dp = 'distributed' (--dp distributed)",
    "dp-sgd": "[privacy] dp_sgd (--dp-sgd)",
    "secagg": "secure aggregation (--secure-aggregation)",
}
"""The recipe key (and flag) that adds each built-in client mod to a strategy, named when batched clients refuse it."""


class StackBuffers:
    """CPU memory that :func:`train_stack` reuses from one batch, and one round, to the next: the batch's
    concatenated data (when it cannot be read where it is, :func:`_rows`), each step's gathered mini-batches, the
    stacked parameters and momentum.

    A CPU tensor of these sizes allocated afresh comes from new pages (glibc maps blocks over its mmap threshold
    anew, and the round loop trims its heap at every round's end, :func:`server.round_loop.release_memory`), and
    the first touch of each 4 KiB page costs more than the copy into it. Measured on this repository's 2-core VM,
    one thread: concatenating 1,000 Fashion-MNIST shards of 60 samples (188 MB) took 120 ms into new memory and
    20 ms into reused memory; gathering 10,000 of those rows (31 MB), 24 ms and 5 ms. Each buffer grows to the
    largest size asked of it and is then kept (one per parameter name, so models of different architectures keep
    one stack each): between rounds this holds the largest batch's data and stack, which a round holds at its peak
    anyway.
    """

    def __init__(self) -> None:
        self._tensors: dict[str, torch.Tensor] = {}

    def take(self, key: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized CPU tensor of ``shape`` and ``dtype`` in the memory kept under ``key`` (replaced by a
        larger one when too small); it stays valid until the next ``take`` of the same key."""
        numel = math.prod(shape)
        held = self._tensors.get(key)
        if held is None or held.dtype != dtype or held.numel() < numel:
            self._tensors.pop(key, None)
            del held  # the old buffer goes before its replacement is allocated
            held = self._tensors[key] = torch.empty(max(numel, 1), dtype=dtype)
        return held[:numel].view(tuple(shape))

    def nbytes(self) -> int:
        """The bytes held."""
        return sum(t.numel() * t.element_size() for t in self._tensors.values())


@dataclass(frozen=True, slots=True)
class ClientShard:
    """One client's training data.

    Attributes:
        client_id: keys the client's shuffling generator (with the seed and round).
        x: inputs ``(N, ...)`` (every client's of the same trailing shape and dtype).
        y: targets ``(N, ...)`` as the loss function takes them (class indices, int64, for cross-entropy).
        read: what :func:`read_shard` read of ``x`` and ``y``, when the caller read it already and the tensors
            have not changed shape or memory since (:class:`BatchedPool` keeps it across rounds); None: read by
            :func:`train_stack` itself.
    """

    client_id: str
    x: torch.Tensor
    y: torch.Tensor
    read: ShardRead | None = field(default=None, compare=False, repr=False)


ShardRead = tuple[str | None, int, tuple[int, ...], "RowRun | None", "RowRun | None"]
"""What a round reads of a client's tensors (:func:`read_shard`): ``(problem, samples, input shape per sample, x's
row run, y's row run)``. Plain tuples of numbers, dtypes and devices, which Python's garbage collector stops
tracking after a few collections (one nesting level each): a pool that keeps 1,000 of them adds nothing to the
full collection each round ends with (measured: kept as torch.Size and cached properties, they made it 2.4 ms
instead of 0.8 with 700 clients seen)."""


def read_shard(x: torch.Tensor, y: torch.Tensor) -> ShardRead:
    """What makes ``x`` and ``y`` unusable (:func:`_data_problem`, None when they are fine; then 0 samples and
    ``()``), the number of samples, the input shape per sample, and where each lies in its storage
    (:func:`_row_run`)."""
    x_shape, y_shape = x.shape, y.shape
    problem = _shape_problem(x_shape, y_shape)
    if problem is not None:
        return problem, 0, (), None, None
    return None, int(x_shape[0]), tuple(x_shape[1:]), _row_run(x), _row_run(y)


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
            ``p > 0``, a parameter that is not floating point, or one module under two names (``self.b = self.a``).
    """
    name = type(model).__name__
    buffers = [n for n, _ in model.named_buffers()]
    if buffers:
        owner = type(model.get_submodule(buffers[0].rpartition(".")[0])).__name__
        raise ConfigError(
            f"batched clients need a model without buffers, and {name} has {len(buffers)} (e.g. {buffers[0]!r}, of "
            f"{owner}): batched clients stack each client's parameters, but a buffer would be one tensor for all of "
            "them (and one that changes in training, as BatchNorm's running statistics do, would mix their updates)"
            + _ADVICE
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
    places: dict[int, list[str]] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        places.setdefault(id(module), []).append(mname)
    if shared := next((names for names in places.values() if len(names) > 1), None):
        raise ConfigError(
            f"batched clients cannot train {name}, which holds one module under several names ({shared[0]!r} and "
            f"{shared[1]!r}): torch.func.functional_call would leave a batched tensor in it; tie the parameters "
            "instead (b.weight = a.weight)" + _ADVICE
        )


def check_batchable(task: Task, strategy: Strategy | None = None) -> list[str]:
    """Refuse, before the first round, what batched clients cannot train exactly as the in-process backend.

    Builds the task's model (global RNG untouched) and runs one batched gradient on the task's first two samples,
    so that a model whose forward draws random numbers is refused here and not in a round.

    Args:
        task: a client's task (its model and data stand for every client's).
        strategy: the run's strategy, whose client mods and tensor groups are refused; None to check the task only.

    A first client whose two samples fail the model's plain forward and loss as well (labels beyond its classes)
    is not refused: that is its data, and it fails alone in its round, as in process.

    Returns:
        The ops of the model's training step that ``torch.func.vmap`` has no batching rule for (e.g.
        ``aten::mkldnn_rnn_layer``, an LSTM's on the CPU), sorted: vmap runs each of them one client at a time, so
        such a model may train slower batched than in-process (the caller says so). Empty for most models.

    Raises:
        ConfigError: what is missing, and that ``backend = "inprocess"`` runs it.
    """
    return _batchable_trial(task, strategy) or []


def check_batchable_clients(
    pool: InMemoryPool, client_ids: Sequence[str], strategy: Strategy | None = None
) -> list[str]:
    """:func:`check_batchable` on the first of ``client_ids`` whose task builds and whose first two samples the
    model's plain forward and loss accept: a first client with labels beyond the model's classes, or no data, would
    leave the model's batched step untried (and a model that vmap cannot run would then fail every client of every
    round). Clients whose task raises or whose data fail are passed over; they fail alone in their rounds.

    Returns:
        As :func:`check_batchable`; empty when no client of ``client_ids`` could try the model: each fails alone, as
        in process (also when no task of theirs builds: later clients may, and :class:`BatchedPool` tries the model
        on the first client of a round that can).

    Raises:
        ConfigError: as :func:`check_batchable`, or a factory's ConfigError (the recipe's, not one client's).
    """
    for client_id, task in _buildable_tasks(pool, client_ids):
        unbatched = _batchable_trial(task, strategy)
        if unbatched is not None:
            return unbatched
        log.debug("client %s's first samples fail unbatched too; the batched step is tried on the next", client_id)
    return []


def _batchable_trial(task: Task, strategy: Strategy | None) -> list[str] | None:
    """:func:`check_batchable`, with None when the task's first two samples fail the model's plain forward and loss
    as well, or it has no data: the model's batched step then was not tried."""
    if strategy is not None:
        if strategy.fit.report_validation:
            raise ConfigError(
                "batched clients do not evaluate each trained model on the client's held-out data; turn "
                "train.report_validation off" + _ADVICE
            )
        if strategy.mods:
            names = ", ".join(
                f"{mod.name}, from {_MOD_OPTIONS[mod.name]}" if mod.name in _MOD_OPTIONS else mod.name
                for mod in strategy.mods
            )
            raise ConfigError(
                f"batched clients train plain or FedProx SGD; strategy {strategy.name!r} declares client mods "
                f"({names}), which run per client; run it with [simulation] backend = 'inprocess' (--backend "
                "inprocess), or 'process' for every core"
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
    if _data_problem(x, y) is not None or len(x) == 0:  # fails alone in its round (read_shard), or has nothing
        return None
    trial = _Batched(model, task.loss_fn)
    params = {n: p.detach().unsqueeze(0) for n, p in trial.trainable.items()}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            labels = y[None, :2].cpu()
            trial._grad(
                params, trial.frozen, x[None, :2].cpu(), labels.long() if labels.dtype == torch.uint8 else labels
            )
    except Exception as exc:  # vmap's refusal, or the data's (which the plain forward and loss meet as well)
        if _fails_unbatched(model, task.loss_fn, x[:2].cpu(), y[:2].cpu()):
            return None  # this client's data, not batching: it fails alone in its round, as it would in process
        loss = getattr(task.loss_fn, "__name__", type(task.loss_fn).__name__)
        raise ConfigError(
            f"batched clients could not vmap the training step, the model's forward and the task's loss function "
            f"{loss!r} "
            f"({type(exc).__name__}: {str(exc)[:300]}); a model or loss that draws random numbers, writes to its own "
            "tensors or branches on a tensor's value (.item(), if on a tensor) cannot be batched" + _ADVICE
        ) from None
    unbatched: set[str] = set()
    for warning in caught:
        if match := _NO_BATCHING_RULE.search(str(warning.message)):
            unbatched.add(match.group(1))
        else:  # not ours to keep
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    return sorted(unbatched)


def first_buildable_task(pool: InMemoryPool, client_ids: Sequence[str]) -> tuple[str, Task] | None:
    """The first of ``client_ids`` whose task builds, with its task (None if none does): a user's factory that
    raises for some clients fails those clients in their rounds, not the run.

    Raises:
        ConfigError: a factory's ConfigError (the recipe's, not one client's).
    """
    return next(_buildable_tasks(pool, client_ids), None)


def _buildable_tasks(pool: InMemoryPool, client_ids: Sequence[str]) -> Iterator[tuple[str, Task]]:
    """``(client id, task)`` of those of ``client_ids`` whose task builds, in order, built as they are asked for;
    those whose factory raises are passed over (they fail alone when they train), a ConfigError is raised."""
    for client_id in client_ids:
        try:
            task = pool.task(client_id)
        except ConfigError:
            raise
        except Exception:  # that client fails alone when it trains
            log.debug("client %s's task could not be built", client_id, exc_info=True)
            continue
        yield client_id, task


def _fails_unbatched(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether the plain forward and loss of ``model`` on ``x``, ``y`` raise too (labels beyond the model's classes,
    inputs of another shape or dtype): a problem of the data, which one-by-one training meets as well."""
    try:
        with torch.random.fork_rng(devices=[]):
            loss_fn(model(x), y)
    except Exception:  # any error of the user's model or loss on these samples is the answer
        return True
    return False


_NO_RULE_WARNING = "There is a performance drop because we have not yet implemented the batching rule"


def _quiet_batching_rule() -> None:
    """Filter torch.func's warning that an op has no batching rule, which would come at every step of every round
    (the run says it once, from :func:`check_batchable`'s answer): one filter for that message only, added when
    missing (a ``catch_warnings`` at each step would reset the once-per-place record of every other warning, which
    then showed at every step)."""
    if not any(f[0] == "ignore" and f[1] is not None and f[1].pattern == _NO_RULE_WARNING for f in warnings.filters):
        warnings.filterwarnings("ignore", message=_NO_RULE_WARNING)


_NO_BATCHING_RULE = re.compile(r"not yet implemented the batching rule for ([\w:.]*\w)")
"""torch.func's warning that vmap runs an op in a loop over the batch (here: over the clients)."""


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
    on the CPU, where the stacked weights do not fit in cache and every pass over them costs. A round's first step,
    where every client still holds the global model, runs its products through that one model's weights (one matrix
    product over all the clients' rows rather than one per client: on issue 12's workload a round 0.122 s against
    0.135, one thread, with the bias added after the product rather than by ``baddbmm``).

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
            (f"{prefix}weight", f"{prefix}bias" if m.bias is not None else None)
            for prefix, m in ((f"{name}." if name else "", m) for name, m in leaves)  # "": the model is the Linear
            if isinstance(m, nn.Linear)
        ]
        try:
            with torch.no_grad():
                h = sample.flatten(1)
                for layer in layers:
                    if isinstance(layer, nn.Linear) and h.shape[-1] != layer.in_features:
                        return None
                    h = layer(h)
                output = model(sample)
        except Exception:  # e.g. inputs of another dtype than the weights: the general path meets it in training and
            return None  # fails the clients it concerns, as one-by-one training fails each
        same = (
            isinstance(output, torch.Tensor)
            and output.shape == h.shape
            and bool(torch.isclose(output, h, rtol=0.0, atol=0.0, equal_nan=True).all())  # NaN data: NaN outputs
        )
        return _LinearChain(layers, names) if same else None

    def step(
        self,
        params: Mapping[str, torch.Tensor],
        x: torch.Tensor,
        y: torch.Tensor,
        lr: float,
        *,
        first_done: bool = False,
        shared: Mapping[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One SGD step of mean cross-entropy on clients' batches ``x (clients, batch, ...)``, ``y (clients,
        batch)`` int64, updating ``params`` (stacked views) in place; returns the losses ``(clients,)`` and None.

        With ``first_done``, ``x`` is the first Linear's output on the batches ``(clients, batch, out)`` as the
        caller computed it (:class:`_DeferredFirst`), and the first Linear is neither run nor updated: the gradient
        of the loss with respect to its output, ``(clients, batch, out)``, is returned in place of None.

        ``shared``: the one model every client of ``params`` holds before this step (name -> unstacked tensor; a
        round's first step), which the forward and the backward's products then read in place of the stacked
        copies: one matrix product over all the clients' rows instead of one per client, the weight read once (a
        client's rows may then round otherwise with the number of rows beside them). The updates still go to
        ``params``.
        """
        h = x if first_done else x.flatten(2)
        clients, batch = y.shape[0], y.shape[1]
        inputs: list[torch.Tensor] = []
        linear = iter(self.names)
        for position, layer in enumerate(self.layers):
            if position == 0 and first_done:
                next(linear)
                inputs.append(h)  # never read: the backward stops above this layer
                continue
            if isinstance(layer, nn.Linear):
                weight, bias = next(linear)
                inputs.append(h)
                if shared is not None:  # every client's rows through the one weight
                    flat = h.reshape(clients * batch, -1)
                    h = (
                        torch.addmm(shared[bias], flat, shared[weight].t())
                        if bias is not None
                        else torch.mm(flat, shared[weight].t())
                    ).view(clients, batch, -1)
                else:  # the product, then the bias: baddbmm would first copy the bias into every row of its output
                    h = torch.bmm(h, params[weight].transpose(1, 2))
                    if bias is not None:
                        h.add_(params[bias].unsqueeze(1))
            else:
                h = torch.relu(h)
                inputs.append(h)
        target = y.unsqueeze(-1)
        log_p = torch.log_softmax(h, -1)  # as cross-entropy computes it
        losses = log_p.gather(-1, target).squeeze(-1).mean(1).neg_()
        delta = log_p.exp_()  # softmax, as log_softmax's backward takes it
        delta.scatter_add_(-1, target, torch.full_like(delta[..., :1], -1.0)).div_(batch)
        linear_back = iter(reversed(self.names))
        for index in range(len(self.layers) - 1, -1, -1):
            layer, below = self.layers[index], inputs[index]
            if index == 0 and first_done:
                return losses, delta
            if isinstance(layer, nn.Linear):
                weight, bias = next(linear_back)
                if index == 0:
                    grad_in = None
                elif shared is not None:
                    grad_in = torch.mm(delta.reshape(clients * batch, -1), shared[weight]).view(clients, batch, -1)
                else:
                    grad_in = torch.bmm(delta, params[weight])
                params[weight].baddbmm_(delta.transpose(1, 2), below, alpha=-lr)
                if bias is not None:
                    params[bias].add_(delta.sum(1), alpha=-lr)
                if grad_in is None:
                    break
                delta = grad_in
            else:
                delta = torch.ops.aten.threshold_backward(delta, below, 0.0)  # autograd's ReLU backward (0 at 0)
        return losses, None

    def deferral(self, params: Mapping[str, torch.Tensor], batch_size: int) -> int:
        """How many steps :class:`_DeferredFirst` takes the first Linear's updates over at a time (0: not at all).

        A window of ``k`` steps of ``batch_size`` rows (``R = k * batch_size``) replaces ``k`` passes of the
        first layer's forward and update (``4 R in out`` flops) by one pass of each over ``R``
        rows, plus a Gram matrix of the rows (``2 R^2 in``) and the corrections (about ``R^2 out``): at most a
        quarter more flops, and never more than :data:`DEFER_ROWS` rows (the Gram matrix and the stored output
        gradients grow with them). Deferring one step gains nothing; a layer that is not first, or a narrow one
        (logistic regression's), is not deferred.
        """
        if not isinstance(self.layers[0], nn.Linear):
            return 0
        out_features, in_features = params[self.names[0][0]].shape[-2:]
        worth = (in_features * out_features) // ((2 * in_features + out_features) * batch_size)
        steps = min(worth, DEFER_ROWS // batch_size)
        return steps if steps >= 2 else 0


DEFER_ROWS = 64
"""The most rows (steps x batch size) :class:`_DeferredFirst` defers the first layer's updates over."""


class _DeferredFirst:
    """The first Linear of a :class:`_LinearChain` over a window of steps, its SGD updates applied once at the end.

    The first layer's inputs are data, known for every step of the window before it starts. With ``W_0, b_0`` the
    layer's weight and bias at the window's start, ``x_s`` the batch of step ``s`` and ``g_s`` the mean loss's
    gradient with respect to the layer's output at step ``s``, plain SGD gives ``W_t = W_0 - lr sum_{s<t} g_s^T
    x_s`` and ``b_t = b_0 - lr sum_{s<t} 1^T g_s``, so the output at step ``t`` is ``x_t W_t^T + b_t = x_t W_0^T +
    b_0 - lr sum_{s<t} (x_t x_s^T + 1) g_s``: one matrix product over all the window's rows (``P``), their Gram
    matrix (``K``, plus 1 for the bias) and, at each step, a small correction from the gradients stored so far
    (``D``). At the window's end ``W -= lr D^T X`` and ``b -= lr 1^T D`` apply the window's steps at once. The
    stacked weight is read twice and written once per window instead of read three times and written once per
    step: the same mathematics, summed in another float order (within the tests' 1e-5 of one-by-one training).

    Rows of a partial batch, or of a client that has finished, are zeros (not the row ``index`` pads them with,
    which could be another client's sample, and ``0 * inf`` is NaN) and their stored gradients stay 0, so they add
    nothing.

    Args:
        chain: the fused path whose first Linear this defers (it trains the layers above).
        params: the stacked parameters (views of them are updated at each window's end).
        x_all, index: the clients' inputs (:func:`_rows`) and :func:`_batch_index`'s rows of them.
        table: :func:`_step_sizes` of the clients (which rows of each step are real).
        buffers: where to keep the window's tensors on the CPU (:class:`StackBuffers`), or None.
    """

    def __init__(
        self,
        chain: _LinearChain,
        params: Mapping[str, torch.Tensor],
        x_all: torch.Tensor,
        index: torch.Tensor,
        table: np.ndarray,
        buffers: StackBuffers | None,
    ) -> None:
        weight, bias = chain.names[0]
        self.chain = chain
        self.weight = params[weight]
        self.bias = params[bias] if bias is not None else None
        self.x_all, self.index, self.table, self.buffers = x_all, index, table, buffers
        self.start = self.active = 0
        self.x = self.p = self.k = self.d = torch.empty(0)

    def begin(self, start: int, stop: int, active: int) -> None:
        """Start a window of steps ``start .. stop - 1`` for the first ``active`` clients of the stack."""
        rows = self.index[:active, start:stop].reshape(-1)
        batch = self.index.shape[2]
        width = batch * (stop - start)
        x = _gather(self.x_all, rows, self.buffers, "defer:x").view(active, width, -1)
        padding = np.arange(batch)[None, None, :] >= self.table[:active, start:stop, None]
        if padding.any():
            x.masked_fill_(torch.from_numpy(padding.reshape(active, width, 1)).to(x.device), 0.0)
        weight = self.weight[:active]
        shape = (active, width, weight.shape[1])
        p = _empty(shape, x, self.buffers, "defer:p")
        if self.bias is not None:
            torch.baddbmm(self.bias[:active].unsqueeze(1), x, weight.transpose(1, 2), out=p)
        else:
            torch.bmm(x, weight.transpose(1, 2), out=p)
        k = torch.bmm(x, x.transpose(1, 2), out=_empty((active, width, width), x, self.buffers, "defer:k"))
        if self.bias is not None:
            k.add_(1.0)
        self.d = _empty(shape, x, self.buffers, "defer:d").zero_()
        self.x, self.p, self.k, self.start, self.active = x, p, k, start, active

    def step(
        self, step: int, start: int, end: int, views: Mapping[str, torch.Tensor], y: torch.Tensor, lr: float
    ) -> torch.Tensor:
        """One SGD step of clients ``start .. end - 1`` (``views``: their stacked parameters) on their batches'
        targets ``y (end - start, size)`` at ``step``: the first layer's output from the window's product and the
        correction of the steps before, the layers above trained by the chain, the first layer's output gradient
        kept for the window's end. Returns the losses ``(end - start,)``."""
        offset = (step - self.start) * self.index.shape[2]
        rows = slice(offset, offset + y.shape[1])
        first = self.p[start:end, rows]
        if offset:
            first = torch.baddbmm(first, self.k[start:end, rows, :offset], self.d[start:end, :offset], alpha=-lr)
        losses, gradient = self.chain.step(views, first, y, lr, first_done=True)
        if gradient is not None:  # always, with first_done
            self.d[start:end, rows] = gradient
        return losses

    def end(self, lr: float) -> None:
        """Apply the window's updates to the first layer's stacked weight and bias."""
        active = self.active
        self.weight[:active].baddbmm_(self.d.transpose(1, 2), self.x, alpha=-lr)
        if self.bias is not None:
            self.bias[:active].add_(self.d.sum(1), alpha=-lr)


def _empty(shape: Sequence[int], like: torch.Tensor, buffers: StackBuffers | None, key: str) -> torch.Tensor:
    """An uninitialized tensor of ``shape`` with ``like``'s dtype and device (in ``buffers`` when given: on the
    CPU)."""
    if buffers is None:
        return torch.empty(tuple(shape), dtype=like.dtype, device=like.device)
    return buffers.take(key, shape, like.dtype)


def _schedule(n: int, config: FitConfig) -> tuple[int, int]:
    """``(batches per epoch, steps)`` of a client with ``n`` samples, as the one-by-one loop counts them."""
    per_epoch = math.ceil(n / config.batch_size)
    steps = per_epoch * config.local_epochs
    if config.max_steps is not None:
        steps = min(steps, config.max_steps)
    return per_epoch, steps


def _fused_chain(
    model: nn.Module,
    loss_fn: LossFn,
    config: FitConfig,
    x: torch.Tensor,
    y: torch.Tensor,
    sample: Callable[[], torch.Tensor],
    checks: dict[Key, _LinearChain | None] | None = None,
) -> _LinearChain | None:
    """The fused path's chain for ``model`` when the round trains it with plain SGD (no momentum, weight decay or
    mu) on cross-entropy with class-index targets (``y`` 1-D int64, none negative: cross-entropy's ignored -100 is
    left to the general path, which divides each batch's loss by its samples not ignored, as one-by-one training
    does), checked (:meth:`_LinearChain.detect`) on ``sample()``, a few of the clients' inputs ``x``; else None.

    Args:
        checks: where the check's answers for this model are kept, by the inputs' shape per sample and dtype, when
            the caller never changes the model (:class:`BatchedPool`'s own models); None: checked at every call.
    """
    plain_sgd = config.momentum == 0 and config.weight_decay == 0 and config.mu == 0
    if not (plain_sgd and loss_fn is nn.functional.cross_entropy and y.dtype == torch.int64 and y.dim() == 1):
        return None
    if len(y) and int(y.min()) < 0:  # one read of the labels (a device-to-host copy of one number on a GPU)
        return None
    key = (tuple(x.shape[1:]), x.dtype)
    if checks is not None and key in checks:
        return checks[key]
    chain = _LinearChain.detect(model, sample().cpu())
    if checks is not None:
        checks[key] = chain
    return chain


def _first_rows(x_all: torch.Tensor, firsts: np.ndarray, sizes: Sequence[int], count: int = 2) -> torch.Tensor:
    """The first ``count`` samples of the clients taken in order (client ``k``'s rows begin at ``firsts[k]``): the
    same samples whether the clients' data were read in place or concatenated (:func:`_rows`)."""
    rows = [int(first) + j for first, n in zip(firsts, sizes, strict=True) for j in range(min(n, count))][:count]
    return x_all.index_select(0, torch.tensor(rows, dtype=torch.int64, device=x_all.device))


def _plan_arrays(sizes: Sequence[int], plans: Sequence[tuple[int, int]]) -> PlanArrays:
    """The clients' sample counts, batches per epoch (at least 1, so a client without data divides safely) and steps,
    as ``(clients,)`` int64 arrays; ``sizes`` and ``plans`` are the counts and :func:`_schedule`."""
    count = len(sizes)
    n = np.asarray(sizes, dtype=np.int64).reshape(count)
    per_epoch = np.maximum(np.asarray([p for p, _ in plans], dtype=np.int64).reshape(count), 1)
    steps = np.asarray([s for _, s in plans], dtype=np.int64).reshape(count)
    return n, per_epoch, steps


PlanArrays = tuple[np.ndarray, np.ndarray, np.ndarray]
""":func:`_plan_arrays`: the clients' sample counts, batches per epoch and steps."""


def _step_sizes(arrays: PlanArrays, batch_size: int, width: int) -> np.ndarray:
    """``(clients, width)`` int64: each client's batch size at each step, as the one-by-one loop takes its batches
    (the last batch of an epoch holds the rest), and 0 from its last step on; ``arrays``: :func:`_plan_arrays`."""
    n, per_epoch, steps = arrays
    step = np.arange(width, dtype=np.int64)[None, :]
    last_of_epoch = step % per_epoch[:, None] == per_epoch[:, None] - 1
    table = np.where(last_of_epoch, (n - (per_epoch - 1) * batch_size)[:, None], batch_size)
    return np.where(step < steps[:, None], table, 0)


def train_stack(
    model: nn.Module,
    global_parameters: Mapping[str, torch.Tensor],
    clients: Sequence[ClientShard],
    config: FitConfig,
    *,
    seed: int,
    round: int,
    loss_fn: LossFn = nn.functional.cross_entropy,
    device: torch.device | str | None = None,
    buffers: StackBuffers | None = None,
    defer_first_layer: bool = False,
    fused_checks: dict[Key, Any] | None = None,
    classes: int | None = None,
) -> TrainedClients:
    """Train ``clients`` together for one round, each from ``global_parameters``, as
    :func:`fedcore.training.train_supervised` trains each alone (see the module docstring), and keep the trained
    models stacked where they were trained: :meth:`TrainedClients.updates` gives each client's, and
    :meth:`TrainedClients.weighted_sum` their weighted sum without taking them apart.

    Args:
        model: a model of the clients' architecture (checked with :func:`check_model`); its parameter values are
            not used or changed, its train mode is set.
        global_parameters: the round's global model, state-dict name -> tensor (every parameter of ``model``, the
            frozen ones too, whose values the forward reads from it, as one-by-one training loads them; not memory of
            ``buffers``, which the training overwrites).
        clients: the clients' data, in any order (results come back in this order).
        config: epochs, batch size, lr, momentum, weight decay, mu, max_steps.
        seed, round: with each client id, key the clients' shuffling (``derive_seed(seed, round, client_id)``).
        loss_fn: ``loss_fn(output, target)``, mean over the batch (the task's).
        device: where to train (default: the CPU); the results come back on the CPU.
        buffers: on the CPU, memory to reuse for the data and the stacked models (:class:`StackBuffers`); the
            result then lives in it, valid until the next call with the same buffers (:meth:`TrainedClients.updates`
            copies out of it). Ignored on another device, whose allocator reuses memory itself.
        defer_first_layer: on the fused path, take the first Linear's updates once per window of steps
            (:class:`_DeferredFirst`, where :meth:`_LinearChain.deferral` finds it gains): faster, in another float
            order, and so a client whose pre-activation lands within rounding of 0 can take the other side of a
            ReLU and end far more than 1e-5 from one-by-one training (see
            :class:`simulations.config.BackendConfig`).
        fused_checks: a dict in which to keep whether ``model`` takes the fused path (a plain perceptron under
            plain SGD), for a caller that trains the same model object again and never changes it (its modules, which
            parameters train, or what its forward does); None: asked at every call, on a few of the clients' inputs.
        classes: the model's number of classes, when ``loss_fn`` indexes them with the labels (torch's cross-entropy
            or NLL loss, :func:`~fedcore.training.reads_class_labels`): the batch's labels are checked against it
            before the first step (one pass over them and one device-to-host read), so that labels changed in place
            since a caller last checked a client fail that client by name (:func:`~fedcore.training.label_problem`)
            rather than as an index error, or, on a GPU, a device-side assert that ends the CUDA context.

    Returns:
        The trained clients (:class:`TrainedClients`), in the order of ``clients``.

    Raises:
        ClientTaskError: a client's ``x`` or ``y`` is 0-dim, or they differ in length; the clients' inputs differ
            in trailing shape (inputs of different dtypes are promoted, as ``torch.cat`` does); with ``classes``, a
            client's labels lie outside them (the first such client named).
        ConfigError: the model is not batchable (:func:`check_model`).
    """
    check_model(model)
    _quiet_batching_rule()
    device = torch.device(device) if device is not None else torch.device("cpu")
    reuse = buffers if device.type == "cpu" else None
    lengths: list[int] = []
    shapes: set[tuple[int, ...]] = set()
    reads = [shard.read if shard.read is not None else read_shard(shard.x, shard.y) for shard in clients]
    for shard, (problem, length, trailing, _, _) in zip(clients, reads, strict=True):  # one pass, each read once
        if problem is not None:
            raise ClientTaskError(problem, client_id=shard.client_id, round=round)
        lengths.append(length)
        shapes.add(trailing)
    if len(shapes) > 1:
        raise ClientTaskError(
            f"the clients' inputs differ in shape per sample ({', '.join(map(str, sorted(shapes)[:3]))}); batched "
            "clients are trained together and need one input shape",
            round=round,
        )
    # largest first: the clients still training at step t are a prefix, clients of one size are neighbours
    order = sorted(range(len(clients)), key=lambda i: -lengths[i])
    shards = [clients[i] for i in order]
    sizes = [lengths[i] for i in order]
    schedules = {n: _schedule(n, config) for n in set(sizes)}
    plans = [schedules[n] for n in sizes]
    num_steps = max((steps for _, steps in plans), default=0)
    batched = _Batched(model, loss_fn)
    batched.frozen = {n: global_parameters[n] for n in batched.frozen}  # the round's values, not the model's own
    batched.to(device)
    names = list(batched.trainable)
    count = len(shards)
    initial = {n: global_parameters[n].to(device) for n in names}
    # on the CPU each chunk's rows get the global model just before the chunk's first step (below), written where
    # that step reads them, in cache; elsewhere all rows now
    by_chunk = reuse is not None and num_steps > 0
    params = {n: _stacked(initial[n], count, reuse, f"param:{n}", fill=not by_chunk) for n in names}
    losses = torch.zeros(count, max(num_steps, 1), dtype=torch.float32, device=device)
    deferred: _DeferredFirst | None = None
    not_deferred = "no client of the batch has data to train on" if defer_first_layer else ""
    if num_steps:
        x_all, y_all, firsts = _rows(shards, sizes, device, reuse, [reads[i] for i in order])
        if classes is not None and reads_class_labels(loss_fn, y_all):
            # the batch's own labels: y_all when it holds just them, not rows of one storage with others' between
            labels = y_all if len(y_all) == sum(sizes) else torch.cat([shard.y for shard in shards])
            _check_batch_labels(shards, labels, classes, round)
        if y_all.dtype == torch.uint8:  # class indices, as the losses read them; vmap's gather takes int64 only
            y_all = y_all.long()
        arrays = _plan_arrays(sizes, plans)  # read by the index and the step table
        index = _batch_index(shards, arrays, config, firsts, seed=seed, round=round).to(device)
        reference = {n: global_parameters[n].to(device) for n in names} if config.mu > 0 else {}
        momentum = {n: _zeros(params[n], reuse, f"momentum:{n}") for n in names} if config.momentum != 0 else {}
        fused = _fused_chain(
            model, loss_fn, config, x_all, y_all, lambda: _first_rows(x_all, firsts, sizes), fused_checks
        )
        table = _step_sizes(arrays, config.batch_size, num_steps)
        window = fused.deferral(params, config.batch_size) if fused is not None and defer_first_layer else 0
        deferred = _DeferredFirst(fused, params, x_all, index, table, reuse) if fused and window else None
        if defer_first_layer:
            not_deferred = "" if deferred is not None else _not_deferred(fused, config, loss_fn, params)
        # on the CPU the fused path takes the clients a cache-sized chunk at a time through all their steps, so that a
        # chunk's stacked models stay in cache from one step to the next; elsewhere, and when deferring, all of them
        # step by step. Each client's arithmetic is its own except at the first step, whose one product over a run's
        # rows (shared=) can round otherwise when the run has very few rows (MKL takes another kernel below about 7):
        # the same bits for the same seed and batch settings, not whatever clients train beside it
        cached = fused is not None and deferred is None and reuse is not None
        chunk = _fused_chunk(params, x_all, config.batch_size, count) if cached else count
        for lo in range(0, count, chunk):
            if by_chunk:
                _fill_rows(params, initial, lo, lo + chunk)
            rows_in_chunk = min(chunk, count - lo)
            whole = {n: params[n][lo : lo + chunk] for n in names}  # the chunk's rows: most runs take them all
            for step, runs in enumerate(_step_runs(table[lo : lo + chunk])):  # until no client of the chunk trains
                if deferred is not None and step % window == 0:
                    deferred.begin(step, min(step + window, num_steps), runs[-1][1])
                for first, last, size in runs:  # runs of clients of one batch size
                    start, end = lo + first, lo + last  # rows of the stack
                    rows = index[start:end, step, :size].reshape(-1)
                    yb = _gather(y_all, rows, reuse, "yb").view(end - start, size, *y_all.shape[1:])
                    views = whole if (first, last) == (0, rows_in_chunk) else {n: params[n][start:end] for n in names}
                    if deferred is not None:  # the first layer's updates wait for the window's end
                        losses[start:end, step] = deferred.step(step, start, end, views, yb, config.lr)
                        continue
                    xb = _gather(x_all, rows, reuse, "xb").view(end - start, size, *x_all.shape[1:])
                    if fused is not None:
                        step_losses, _ = fused.step(views, xb, yb, config.lr, shared=initial if step == 0 else None)
                    else:
                        grads, step_losses = batched.grad(views, xb, yb)
                        run_momentum = {n: buf[start:end] for n, buf in momentum.items()}
                        _sgd_step(views, grads, run_momentum, reference, config, first=step == 0)
                    losses[start:end, step] = step_losses
                if deferred is not None and ((step + 1) % window == 0 or step + 1 == num_steps):
                    deferred.end(config.lr)
    return TrainedClients(
        clients=clients,
        order=order,
        params=params,
        global_parameters=global_parameters,
        canonical=batched.canonical,
        losses=losses.cpu(),
        sizes=sizes,
        plans=plans,
        config=config,
        borrowed=reuse is not None,
        deferred=deferred is not None,
        not_deferred=not_deferred,
    )


def _check_batch_labels(shards: Sequence[ClientShard], labels: torch.Tensor, classes: int, round: int) -> None:
    """Raise a ClientTaskError naming the first of ``shards`` whose labels lie outside ``classes`` (its reason from
    :func:`label_problem`), when the batch's labels ``labels`` (theirs, concatenated) hold any: one pass over them,
    each client's read only then."""
    if label_problem(labels, classes) is None:
        return
    for shard in shards:
        if (problem := label_problem(shard.y, classes)) is not None:
            raise ClientTaskError(problem, client_id=shard.client_id, round=round)


def _not_deferred(
    fused: _LinearChain | None, config: FitConfig, loss_fn: LossFn, params: Mapping[str, torch.Tensor]
) -> str:
    """Why ``defer_first_layer`` does not apply to a round of :func:`train_stack` (a sentence for the run's log)."""
    other = [
        f"{what} {value}"
        for what, value in (("momentum", config.momentum), ("weight decay", config.weight_decay), ("mu", config.mu))
        if value != 0
    ]
    if other:
        return f"the clients train with {', '.join(other)}, and it needs plain SGD"
    if loss_fn is not nn.functional.cross_entropy:
        return "the task's loss is not torch's cross-entropy, and it needs that loss"
    if fused is None:
        return (
            "the model is not a chain of Flatten, Linear and ReLU modules trained on class indices (none of them the "
            "ignored -100)"
        )
    first = params[fused.names[0][0]]
    return (
        f"the first Linear maps {first.shape[-1]} inputs to {first.shape[-2]} outputs, too narrow at batch size "
        f"{config.batch_size} for a window of steps to save work"
    )


def _step_runs(table: np.ndarray) -> list[list[tuple[int, int, int]]]:
    """For ``table`` (``(clients, steps)`` int64 batch sizes, :func:`_step_sizes` of clients sorted largest first,
    so that at each step the clients still training are a prefix and clients of one batch size are neighbours), each
    step's runs of clients of one batch size, ``(first, last, size)`` with rows ``first:last`` of ``table``, up to
    the first step at which no client trains (every later step has none either). Drawn up once for all the steps,
    not step by step in the training loop, where each small NumPy call costs far more than its work."""
    clients, width = table.shape
    if not clients or not width:
        return []
    by_step = np.ascontiguousarray(table.T)
    cuts = np.ones((width, clients + 1), dtype=bool)  # a run begins (or the column ends) at each True
    np.not_equal(by_step[:, 1:], by_step[:, :-1], out=cuts[:, 1:clients])
    steps, at = np.nonzero(cuts)  # step by step, row by row
    size_at = by_step[steps, np.minimum(at, clients - 1)]
    runs: list[list[tuple[int, int, int]]] = [[] for _ in range(width)]
    same_step = (steps[1:] == steps[:-1]).tolist()  # a run ends at the next cut of its own step
    pairs = zip(steps[:-1].tolist(), at[:-1].tolist(), at[1:].tolist(), size_at[:-1].tolist(), same_step, strict=True)
    for step, first, last, size, same in pairs:
        if same and size:
            runs[step].append((first, last, size))
    done = next((step for step, step_runs in enumerate(runs) if not step_runs), width)
    return runs[:done]


def _fused_chunk(params: Mapping[str, torch.Tensor], x_all: torch.Tensor, batch_size: int, count: int) -> int:
    """How many of ``count`` clients the fused path on the CPU takes through their steps together: as many as keep
    their stacked models and one step's inputs (``batch_size`` rows of ``x_all``) within :data:`FUSED_CHUNK_BYTES`
    (at least 1)."""
    per_client = sum(stacked[0].numel() * stacked.element_size() for stacked in params.values())
    per_client += batch_size * math.prod(x_all.shape[1:]) * x_all.element_size()
    return max(1, min(count, FUSED_CHUNK_BYTES // max(per_client, 1)))


def _data_problem(x: torch.Tensor, y: torch.Tensor) -> str | None:
    """What makes a client's ``x`` and ``y`` unusable (a 0-dim tensor, different sample counts), or None."""
    return _shape_problem(x.shape, y.shape)


def _shape_problem(x_shape: torch.Size, y_shape: torch.Size) -> str | None:
    """:func:`_data_problem` from the tensors' shapes (read once by a caller that needs them too)."""
    for name, shape in (("x", x_shape), ("y", y_shape)):
        if not shape:
            return f"{name} is a 0-dim tensor; give the samples along its first dimension"
    if x_shape[0] != y_shape[0]:
        return f"x has {x_shape[0]} samples but y has {y_shape[0]}; give inputs and labels of the same length"
    return None


def _stacked(
    tensor: torch.Tensor, count: int, buffers: StackBuffers | None, key: str, *, fill: bool = True
) -> torch.Tensor:
    """``count`` copies of ``tensor`` stacked along a new leading dimension (in ``buffers`` when given; with ``fill``
    False, the memory in ``buffers`` is returned as it is, for the caller to fill)."""
    stacked = tensor.expand(count, *tensor.shape)
    if buffers is None:
        return stacked.clone()
    held = buffers.take(key, stacked.shape, tensor.dtype)
    return held.copy_(stacked) if fill else held


def _fill_rows(params: Mapping[str, torch.Tensor], values: Mapping[str, torch.Tensor], start: int, stop: int) -> None:
    """Set rows ``start:stop`` of each stacked tensor ``params[n]`` to ``values[n]`` (the global model)."""
    for name, stacked in params.items():
        rows = stacked[start:stop]
        rows.copy_(values[name].expand_as(rows))


def _zeros(like: torch.Tensor, buffers: StackBuffers | None, key: str) -> torch.Tensor:
    """Zeros of ``like``'s shape and dtype (in ``buffers`` when given)."""
    if buffers is None:
        return torch.zeros_like(like)
    return buffers.take(key, like.shape, like.dtype).zero_()


def _rows(
    shards: Sequence[ClientShard],
    sizes: Sequence[int],
    device: torch.device,
    buffers: StackBuffers | None,
    reads: Sequence[ShardRead] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """The clients' inputs and labels as tensors of rows on ``device``, outside autograd, and each client's first
    row in them (int64 ``(clients,)``; ``sizes``: each shard's samples, those of none taking no part).

    Clients whose ``x`` and ``y`` are, each, contiguous runs of rows of one storage on ``device``, at the same rows
    of both (:meth:`simulations.tasks.PreparedData.shard`: views of one client-ordered copy of the dataset), are
    read where they are, with no copy; other data are concatenated (:func:`_concat`), the clients in order. Either
    way the data are data: what trains is the parameters (inputs that require grad would refuse out= products).
    Measured at issue 12's workload with 1,000 clients a round (logistic regression, one thread): 0.16 s a round
    against 0.18 when the shards were copies, concatenated into a 188 MB buffer every round.
    """
    counts = np.asarray(sizes, dtype=np.int64)
    present = [k for k, n in enumerate(sizes) if n]
    runs = [reads[k] for k in present] if reads is not None else [read_shard(shards[k].x, shards[k].y) for k in present]
    xs = _one_storage([shards[k].x for k in present], device, [read[3] for read in runs])
    ys = _one_storage([shards[k].y for k in present], device, [read[4] for read in runs])
    if xs is not None and ys is not None and xs[1] == ys[1]:
        firsts = np.zeros(len(sizes), dtype=np.int64)
        firsts[counts > 0] = xs[1]
        return xs[0], ys[0], firsts
    x_all = _concat([shards[k].x for k in present], buffers, "x").to(device).detach()
    y_all = _concat([shards[k].y for k in present], buffers, "y").to(device).detach()
    return x_all, y_all, np.cumsum(counts) - counts


RowRun = tuple[tuple[Any, ...], int]
"""Where a tensor lies in its storage as a contiguous run of whole rows (:func:`_row_run`): ``(key, first row)``."""


def _row_run(tensor: torch.Tensor) -> RowRun | None:
    """``(key, first row)`` of ``tensor`` when it is a contiguous run of whole rows of its storage, outside autograd,
    with ``key`` = (the storage's address and bytes, dtype, trailing shape, device): tensors of one key view one
    storage as rows of one layout. None for any other tensor (strided, not row-aligned, requiring grad, of
    zero-sized rows)."""
    trailing = tensor.shape[1:]
    row = math.prod(trailing)
    if row == 0 or tensor.requires_grad or not tensor.is_contiguous():
        return None
    storage = tensor.untyped_storage()
    offset, size = tensor.storage_offset(), storage.nbytes()
    if offset % row or offset // row + tensor.shape[0] > size // (row * tensor.element_size()):
        return None
    # two storages may begin at one address (numpy views of one buffer): the bytes tell them apart
    return (storage.data_ptr(), size, tensor.dtype, tuple(trailing), tensor.device), offset // row


def _fingerprint(x: torch.Tensor, y: torch.Tensor) -> Key | None:
    """What :func:`read_shard` reads of ``x`` and ``y`` depends on besides the tensors' identity: their addresses,
    shapes and strides (plain tuples, which the garbage collector stops tracking), or None for tensors that are not
    strided (read anew each time)."""
    if x.layout != torch.strided or y.layout != torch.strided:
        return None
    return (x.data_ptr(), y.data_ptr(), tuple(x.shape), tuple(y.shape), x.stride(), y.stride())


def _one_storage(
    tensors: Sequence[torch.Tensor], device: torch.device, runs: Sequence[RowRun | None] | None = None
) -> tuple[torch.Tensor, list[int]] | None:
    """A tensor of all the rows of the storage every one of ``tensors`` views, and each tensor's first row in it;
    None unless each is a contiguous run of whole rows of that one storage on ``device``, of one dtype and trailing
    shape, outside autograd (``runs``: the tensors' :func:`_row_run`, when the caller holds them already)."""
    if not tensors:
        return None
    runs = runs if runs is not None else [_row_run(tensor) for tensor in tensors]
    if runs[0] is None or runs[0][0][4] != device:
        return None
    key = runs[0][0]
    firsts: list[int] = []
    for run in runs:
        if run is None or run[0] != key:
            return None
        firsts.append(run[1])
    first = tensors[0]
    trailing = first.shape[1:]
    row = math.prod(trailing)
    rows = key[1] // (row * first.element_size())
    strides = [row]
    for size in trailing:  # a row's contiguous strides
        strides.append(strides[-1] // size)
    return first.as_strided((rows, *trailing), strides, 0), firsts


def _concat(tensors: list[torch.Tensor], buffers: StackBuffers | None, key: str) -> torch.Tensor:
    """``torch.cat(tensors)``, into ``buffers`` when given and the tensors are CPU tensors outside autograd that
    agree in dtype and trailing shape (else ``torch.cat`` itself, which promotes dtypes or raises as it does)."""
    first = tensors[0]
    kinds = {(t.dtype, t.shape[1:], t.device.type, t.requires_grad) for t in tensors}
    if buffers is None or kinds != {(first.dtype, first.shape[1:], "cpu", False)}:
        return torch.cat(tensors)
    rows = sum(int(t.shape[0]) for t in tensors)
    return torch.cat(tensors, out=buffers.take(key, (rows, *first.shape[1:]), first.dtype))


def _gather(source: torch.Tensor, rows: torch.Tensor, buffers: StackBuffers | None, key: str) -> torch.Tensor:
    """``source.index_select(0, rows)``, into ``buffers`` when given (the training's data: detached, on the CPU
    when there are buffers)."""
    if buffers is None:
        return source.index_select(0, rows)
    out = buffers.take(key, (rows.numel(), *source.shape[1:]), source.dtype)
    return torch.index_select(source, 0, rows, out=out)


def _batch_index(
    shards: Sequence[ClientShard],
    arrays: PlanArrays,
    config: FitConfig,
    firsts: np.ndarray,
    *,
    seed: int,
    round: int,
) -> torch.Tensor:
    """``(clients, steps, batch_size)`` int64: the rows of the clients' data (:func:`_rows`, in which client ``k``'s
    samples begin at row ``firsts[k]``) each client's batch takes at each step (a partial batch padded with row 0,
    never read), drawn as :func:`fedcore.training.train_supervised` draws them: one ``randperm`` per epoch begun,
    from the client's generator.

    The draws are the one-by-one loop's (:func:`simulations.shuffle.epoch_permutations`, every client's in one
    call), and the index is laid out for all clients at once: step ``t`` of a client with ``n`` samples and ``p``
    batches an epoch takes positions ``(t mod p) * batch_size + j`` of its permutation for epoch ``t div p``.
    ``arrays``: the shards' :func:`_plan_arrays`.
    """
    counts, per_epoch, steps = arrays
    index = np.zeros((len(shards), int(steps.max(initial=0)), config.batch_size), dtype=np.int64)
    epochs = -(-steps // per_epoch)  # ceil; 0 for a client without data
    drawn = epoch_permutations(derive_seeds(seed, round, each=[shard.client_id for shard in shards]), counts, epochs)
    if drawn.size:
        starts = np.cumsum(epochs * counts) - epochs * counts  # each client's first draw in ``drawn``
        batch_rows(drawn, starts, counts, per_epoch, steps, np.asarray(firsts, dtype=np.int64), index)
    return torch.from_numpy(index)


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


BATCHED_METRICS = ("train_loss", "fit_seconds")
"""The metrics a batched client's result reports (``train_loss`` only for a client with data)."""
SUM_CHUNK_BYTES = 64 << 20
"""The weighted sum of stacked updates casts at most this many bytes of them to float64 at a time (a chunk of
clients): one matrix-vector product per chunk and tensor, without a float64 copy of the whole stack."""


@dataclass(frozen=True, kw_only=True)
class TrainedClients:
    """A batch of clients after :func:`train_stack`: their models stacked along a leading client dimension, where
    they were trained.

    Attributes:
        clients: the clients, in the order given.
        order: ``order[row]`` is the position in ``clients`` of the stack's ``row`` (largest clients first).
        params: trainable parameter name -> ``(clients, *shape)`` tensor, rows in ``order``.
        global_parameters: the round's global model (state-dict name -> tensor), the value of what is not trained.
        canonical: state-dict name -> the parameter name it shares storage with (tied weights).
        losses: ``(clients, steps)`` float32 on the CPU: each row's mean loss at each step, rows in ``order``.
        sizes, plans: each row's sample count and ``(batches per epoch, steps)``.
        config: the round's training settings.
        borrowed: :attr:`params` live in a :class:`StackBuffers` that the next batch reuses (:meth:`updates`
            copies them out).
        deferred: the first layer's updates were deferred (``defer_first_layer`` asked for it and it applied).
        not_deferred: why they were not when ``defer_first_layer`` asked for it (else "").
    """

    clients: Sequence[ClientShard]
    order: Sequence[int]
    params: Mapping[str, torch.Tensor]
    global_parameters: Mapping[str, torch.Tensor]
    canonical: Mapping[str, str]
    losses: torch.Tensor
    sizes: Sequence[int]
    plans: Sequence[tuple[int, int]]
    config: FitConfig
    borrowed: bool = False
    deferred: bool = False
    not_deferred: str = ""

    def metrics(self) -> list[dict[str, float]]:
        """Each client's metrics, in the order of :attr:`clients`: ``train_loss`` (:meth:`train_loss`); none for a
        client without data."""
        counts = self.num_examples().tolist()
        return [{"train_loss": loss} if n else {} for loss, n in zip(self.train_loss().tolist(), counts, strict=True)]

    def num_examples(self) -> np.ndarray:
        """int64 ``(clients,)``: each client's sample count, in the order of :attr:`clients`."""
        counts = np.zeros(len(self.clients), dtype=np.int64)
        counts[np.asarray(self.order, dtype=np.int64)] = np.asarray(self.sizes, dtype=np.int64)
        return counts

    def train_loss(self) -> np.ndarray:
        """float64 ``(clients,)``, in the order of :attr:`clients`: each client's ``train_loss`` summed in float64
        step by step as the one-by-one loop sums it (``loss * batch`` over the last epoch begun, over the samples
        seen in it); NaN for a client without data."""
        values = self.losses.double().numpy()
        count, width = values.shape
        arrays = _plan_arrays(self.sizes, self.plans)
        _, per_epoch, steps = arrays
        # each row's batch sizes over the steps of its last epoch begun, 0 elsewhere
        first = np.maximum(steps - 1, 0) // per_epoch * per_epoch
        size = _step_sizes(arrays, self.config.batch_size, width)
        size = np.where(np.arange(width)[None, :] >= first[:, None], size, 0)
        # summed step by step in float64, left to right, as the one-by-one loop sums ``loss * batch``
        terms = np.where(size > 0, values, 0.0) * size  # a step outside the last epoch adds exactly 0.0
        loss_sum = np.zeros(count, dtype=np.float64)
        with np.errstate(invalid="ignore"):  # inf + -inf is NaN here, silently, as in Python's own float sum
            for column in range(width):
                loss_sum += terms[:, column]
        seen = np.maximum(size.sum(axis=1), 1)
        train_loss = np.where(np.asarray(self.sizes, dtype=np.int64) > 0, loss_sum / seen, np.nan)
        by_position = np.empty(count, dtype=np.float64)
        by_position[np.asarray(self.order, dtype=np.int64)] = train_loss
        return by_position

    def updates(self, positions: Sequence[int] | None = None) -> list[ClientUpdate]:
        """Each client's result, in the order of :attr:`clients`, or only those at ``positions`` (in :attr:`clients`),
        in that order; their parameters on the CPU (views into one CPU copy of the stack, or of just their rows,
        which outlives the buffers the stack was trained in; a parameter that is not trained is the global one)."""
        row_of = {position: row for row, position in enumerate(self.order)}
        wanted = list(range(len(self.clients))) if positions is None else list(positions)
        rows = [row_of[position] for position in wanted]
        if positions is None:  # the whole stack, read at each client's row
            cpu = {n: p.clone() if self.borrowed else p.cpu() for n, p in self.params.items()}
            at = rows
        else:  # only these rows, copied out in this order
            index = torch.tensor(rows, dtype=torch.int64)
            cpu = {n: p.index_select(0, index.to(p.device)).cpu() for n, p in self.params.items()}
            at = list(range(len(rows)))
        metrics = self.metrics()
        updates = []
        for position, row, i in zip(wanted, rows, at, strict=True):
            state = {}
            for name, canonical in self.canonical.items():
                state[name] = cpu[canonical][i] if canonical in cpu else self.global_parameters[canonical].cpu()
            updates.append(ClientUpdate(parameters=state, num_examples=self.sizes[row], metrics=metrics[position]))
        return updates

    def finite(self, positions: Sequence[int]) -> list[bool]:
        """Whether the trained parameters of the clients at ``positions`` (in :attr:`clients`) are all finite, in
        that order: on the CPU by the aggregator's own kernel (:func:`fedcore.kernels.all_finite`, a pass over each
        row), on a device by one reduction per stacked tensor."""
        row_of = {position: row for row, position in enumerate(self.order)}
        rows = [row_of[position] for position in positions]
        flags = [True] * len(rows)
        if not rows:
            return flags
        for stacked in self.params.values():
            flat = stacked.detach().reshape(stacked.shape[0], -1)
            if _on_cpu_fused(stacked):
                values = flat.numpy()
                verdict = [bool(all_finite(values[row])) for row in rows]
            else:
                index = torch.tensor(rows, dtype=torch.int64, device=flat.device)
                verdict = torch.isfinite(flat.index_select(0, index)).all(dim=1).tolist()
            flags = [ok and bool(v) for ok, v in zip(flags, verdict, strict=True)]
        return flags

    def weighted_sum(self, weights: Sequence[float]) -> dict[str, np.ndarray]:
        """``Σ_k weights[k] · update_k`` per state-dict tensor, float64 on the CPU, over the clients with a weight
        > 0 (``weights`` in the order of :attr:`clients`; give 0 to leave a client out, e.g. one whose update is not
        finite: its values are never read). Each client's parameters are cast to float64 and the products summed in
        float64, as :meth:`fedcore.aggregation.WeightedMean.add` sums updates one by one: on the CPU by the same
        kernel (:func:`fedcore.kernels.fold_rows`) in the order of :attr:`clients`, so that a round trained as one
        batch sums to the very bits of one-by-one folding; on a device by one matrix-vector product per chunk of
        :data:`SUM_CHUNK_BYTES` (another order: relative differences of about 1e-16), and only the sum leaves the
        device. A parameter that is not trained adds ``(Σ_k weights[k]) · global``.

        Raises:
            ClientTaskError: ``weights`` is not one per client.
        """
        if len(weights) != len(self.clients):
            raise ClientTaskError(f"{len(weights)} weights for a batch of {len(self.clients)} clients; give one each")
        row_of = {position: row for row, position in enumerate(self.order)}
        taken = [(row_of[position], float(w)) for position, w in enumerate(weights) if w > 0]  # in client order
        rows = np.fromiter((row for row, _ in taken), dtype=np.int64, count=len(taken))
        w64 = np.fromiter((w for _, w in taken), dtype=np.float64, count=len(taken))
        sums: dict[str, np.ndarray] = {}
        on_device: dict[str, torch.Tensor] = {}
        for name, stacked in self.params.items():
            if _on_cpu_fused(stacked):
                sums[name] = _weighted_rows(stacked, rows, w64)
            else:
                on_device[name] = _device_weighted_rows(stacked, rows, w64)
        if on_device:  # one copy to the CPU for all of them, not one wait and copy per tensor
            flat = torch.cat([t.reshape(-1) for t in on_device.values()]).cpu().numpy()
            begin = 0
            for name, t in on_device.items():
                sums[name] = flat[begin : begin + t.numel()].reshape(tuple(t.shape))
                begin += t.numel()
        total = 0.0
        for w in w64.tolist():
            total += w
        result: dict[str, np.ndarray] = {}
        for name, canonical in self.canonical.items():
            if canonical in sums:
                result[name] = sums[canonical]
            else:
                result[name] = self.global_parameters[canonical].cpu().double().mul(total).numpy()
        return result


def _on_cpu_fused(stacked: torch.Tensor) -> bool:
    """Whether a stacked tensor is on the CPU in a dtype the aggregator's numba kernels take."""
    return stacked.device.type == "cpu" and stacked.dtype in _FUSED_TORCH_DTYPES


_FUSED_TORCH_DTYPES = frozenset(getattr(torch, dtype.name) for dtype in FUSED_DTYPES)
"""The torch dtypes of :data:`fedcore.kernels.FUSED_DTYPES` (bfloat16, which numpy has no dtype for, and float16 take
the device path's matrix-vector products)."""


def _weighted_rows(stacked: torch.Tensor, rows: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """``Σ weights[k] · stacked[rows[k]]``, summed in that order, float64: the CPU's, by the aggregator's kernel
    (:func:`fedcore.kernels.fold_rows`, the bits of folding the rows one by one)."""
    flat = stacked.detach().reshape(stacked.shape[0], -1)
    out = np.zeros(flat.shape[1], dtype=np.float64)
    fold_rows(out, flat.numpy(), rows, weights)
    return out.reshape(stacked.shape[1:])


def _device_weighted_rows(stacked: torch.Tensor, rows: np.ndarray, weights: np.ndarray) -> torch.Tensor:
    """``Σ weights[k] · stacked[rows[k]]`` where ``stacked`` lies, float64: a matrix-vector product per chunk of
    :data:`SUM_CHUNK_BYTES` (another order than the CPU's: relative differences of about 1e-16)."""
    flat = stacked.detach().reshape(stacked.shape[0], -1)
    index = torch.from_numpy(rows).to(flat.device)
    w64 = torch.from_numpy(weights).to(flat.device)
    total = torch.zeros(flat.shape[1], dtype=torch.float64, device=flat.device)
    chunk = max(1, SUM_CHUNK_BYTES // max(flat.shape[1] * 8, 1))
    for begin in range(0, rows.size, chunk):
        part = flat.index_select(0, index[begin : begin + chunk]).double()
        total.addmv_(part.t(), w64[begin : begin + chunk])
    return total.view(stacked.shape[1:])


Key = tuple[Any, ...]


class BatchedPool(PoolWrapper):
    """A :class:`server.pool.ClientPool` that trains a round's fit instructions as batches (:func:`train_stack`)
    and runs everything else (evaluation, protocol stages) through the in-process pool it wraps.

    Without ``weigh``, replies come one per client in the order of the instructions, as the in-process pool yields
    them, so the round loop folds the updates in the same order. With ``weigh`` (:func:`presum_weight`: the round's
    aggregation is a plain weighted mean), each batch's updates are summed where they were trained
    (:meth:`TrainedClients.weighted_sum`, weights ``weigh(num_examples, metrics)``) and the batch comes as one
    :class:`~fedcore.messages.FitBatchRes`, which the round loop folds once: only the sum leaves the device, and no
    per-client copy, reply or fold is made (the mean differs from one-by-one folding only by the float64 rounding
    of the sum's order). A client whose update is not finite, or whose weight ``weigh`` refuses, is left out of the
    sum and fails alone with the reason, as the round loop would reject it.

    A client whose data is unusable (``x`` and ``y`` of different lengths) fails alone, as it would in-process; so
    does one whose task cannot be built, or whose class labels lie beyond the model's classes (torch's cross-entropy
    or NLL loss), and a batch whose training raises is trained again in halves, down to single clients (one at a time
    where both halves raise), so that only the clients that raise alone fail, each with its reason. Each result's
    ``fit_seconds`` is its batch's wall time divided among the batch's clients.

    Args:
        pool: the in-process pool of the same clients (their tasks, evaluation, stages).
        batch_clients: train at most this many clients together (0: on the CPU as many as keep the largest stacked
            parameter within :data:`CPU_STACK_BYTES`, on a CUDA GPU as many as fit its free memory, :func:`gpu_batch`).
        device: where to train the batches (default: the CPU).
        weigh: the batch's clients' aggregation weights from their example counts and metrics, a column at a time
            (:data:`BatchWeights`, e.g. :func:`presum_weight`'s), to pre-sum each batch; None: one reply per client.
        defer_first_layer: :func:`train_stack`'s (off: within 1e-5 of one-by-one training).

    Raises:
        ConfigError: (from :meth:`run`) a fit instruction carries client mods or tensor groups, or a client's task
            is not batchable (:func:`check_batchable`).
    """

    def __init__(
        self,
        pool: InMemoryPool,
        *,
        batch_clients: int = 0,
        device: torch.device | str | None = None,
        weigh: BatchWeights | None = None,
        defer_first_layer: bool = False,
    ) -> None:
        if batch_clients < 0:
            raise ConfigError(f"batch_clients must be >= 0 (0: all of a round's clients), got {batch_clients}")
        super().__init__(pool)
        self._pool: InMemoryPool = pool
        self._batch_clients = batch_clients
        self._device = device
        self._weigh = weigh
        self._defer_first_layer = defer_first_layer
        self._said_not_deferred = False
        self._models: dict[Key, nn.Module] = {}
        self._buffers = StackBuffers()  # on the CPU: each batch trains in the memory of the one before
        self._shards: OrderedDict[str, tuple[SupervisedTask, ClientShard, Key | None, Key]] = OrderedDict()
        self._model_keys: dict[Key, Key] = {}
        self._checks: dict[int, dict[Key, Any]] = {}  # id of a model of self._models -> _fused_chain's answers
        self._classes: dict[Key, int | None] = {}  # a model's number of classes, for the label check
        self._tried: set[Key] = set()  # models whose batched step was tried on usable data (see _model)

    def run(self, instructions: Mapping[str, ServerMessage], *, timeout_s: float | None = None) -> Iterator[PoolReply]:
        """Fit instructions: trained in batches; one reply per client in instruction order, or with ``weigh`` a
        :class:`~fedcore.messages.FitBatchRes` per batch and a failure per client left out. Anything else (or a
        mix): the in-process pool's replies."""
        if not instructions or not all(isinstance(ins, FitIns) for ins in instructions.values()):
            yield from self._pool.run(instructions, timeout_s=timeout_s)
            return
        items = [(cid, ins) for cid, ins in instructions.items() if isinstance(ins, FitIns)]
        size = self._batch_clients
        if not size:  # sized from the first client whose task builds (one that cannot fails alone in _fit), and
            # with clients built on demand no larger than the tasks the pool keeps built, so that a batch's data are
            # bounded too (100,000 synthetic devices in one batch: 13 GB)
            first = first_buildable_task(self._pool, [cid for cid, _ in items])
            size = len(items) if first is None else self._auto_batch(first[0], len(items), items[0][1].config)
            size = min(size, self._pool.max_tasks or size)
        for begin in range(0, len(items), size):
            yield from self._fit(items[begin : begin + size])

    def _auto_batch(self, client_id: str, count: int, config: FitConfig) -> int:
        """How many clients to train together when ``batch_clients`` is 0: on the CPU, as many as keep the largest
        stacked parameter within :data:`CPU_STACK_BYTES`, or on the fused path (``config`` and the client's data
        tell) the whole stacked model within :data:`FUSED_STACK_BYTES`; on a CUDA GPU, as many as :func:`gpu_batch`
        fits in its free memory; on another accelerator all of them. :meth:`run` caps it at the in-process pool's
        ``max_tasks`` (clients built on demand), so that a batch's data are bounded too."""
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
        x, y = task.training_data()
        model = self._model(task)
        checks = self._checks.setdefault(id(model), {})
        if (
            _data_problem(x, y) is None
            and len(x)
            and _fused_chain(model, task.loss_fn, config, x, y, lambda: x[:2], checks)
        ):
            model_bytes = sum(p.numel() * p.element_size() for p in parameters)
            return max(1, min(count, FUSED_STACK_BYTES // max(model_bytes, 1)))
        largest = max((p.numel() * p.element_size() for p in parameters), default=1)
        return max(1, min(count, CPU_STACK_BYTES // max(largest, 1)))

    def _model(self, task: SupervisedTask) -> nn.Module:
        """The pool's model for ``task``'s ``(model_fn, loss_fn)``, built once. Its batched step is tried
        (:func:`check_batchable`) on the first task that gives it, and again on each later task while the tries so
        far were on data that fail the plain forward and loss too (a model that vmap cannot run is then refused at
        the first client with usable data, not failed in every round).

        Raises:
            ConfigError: the model cannot be batched.
        """
        key = (task.model_fn, task.loss_fn)
        model = self._models.get(key)
        if key not in self._tried and _batchable_trial(task, None) is not None:
            self._tried.add(key)
        if model is None:
            with torch.random.fork_rng(devices=[]):
                model = task.build_model()
            self._models[key] = model
        return model

    def _known(self, client_id: str) -> tuple[SupervisedTask, ClientShard, Key] | None:
        """Client ``client_id``'s task, its data as a shard (with what :func:`read_shard` reads of them) and its
        model's key; None for a task that is not supervised (after :func:`check_batchable`, which raises unless it
        is batchable).

        The task gives its data every round (:meth:`~fedcore.supervised.SupervisedTask.training_data` may give
        other tensors each time); the shard read before is used again while they are the same tensor objects with
        the same addresses, shapes and strides (:func:`_fingerprint`): values changed in place are read anew
        anyway, a tensor resized or re-pointed in place is read again as new."""
        task = self._pool.task(client_id)
        if not isinstance(task, SupervisedTask):
            check_batchable(task)  # raises: names what the task lacks
            return None
        x, y = task.training_data()
        fingerprint = _fingerprint(x, y)
        known = self._shards.get(client_id)
        if known is not None:
            if self._pool.max_tasks is not None:
                self._shards.move_to_end(client_id)
            held, shard, held_fingerprint, key = known
            same = held is task and shard.x is x and shard.y is y
            if same and fingerprint is not None and fingerprint == held_fingerprint:
                return task, shard, key  # a task is frozen: its model_fn and loss_fn are those the key was made of
        read = read_shard(x, y)
        key = self._model_key(task)
        if read[0] is None and (problem := self._label_problem(task, key, x, y)) is not None:
            read = (problem, 0, (), None, None)
        shard = ClientShard(client_id, x, y, read)
        self._shards[client_id] = (task, shard, fingerprint, key)
        if self._pool.max_tasks is not None and len(self._shards) > self._pool.max_tasks:
            self._shards.popitem(last=False)  # no data kept beyond the tasks the pool keeps
        return task, shard, key

    def _label_problem(self, task: SupervisedTask, key: Key, x: torch.Tensor, y: torch.Tensor) -> str | None:
        """Class labels of ``y`` that ``task``'s cross-entropy or NLL loss cannot index (:func:`label_problem`),
        found when a client's data are read, so that the client fails alone before its batch trains (on a GPU an
        out-of-range index is a device-side assert that ends the process's CUDA context, not an error one client
        can fail with). The model's number of classes comes from one forward of one sample, once per model."""
        if not len(x):  # nothing to train on: in process, the loss never reads its labels
            return None
        class_indices = task.loss_fn in CLASS_LOSSES and not y.is_floating_point() and not y.is_meta
        if class_indices and y.dtype not in (torch.int64, torch.uint8):  # as one-by-one training, whose loss refuses
            return (  # them (bool, int32, ...; a batch's torch.cat would promote them to int64 and train on them)
                f"labels of dtype {str(y.dtype).removeprefix('torch.')}: torch's {task.loss_fn.__name__} takes class "
                "indices as int64 (or uint8); give y.long()"
            )
        if not reads_class_labels(task.loss_fn, y):
            return None
        if key not in self._classes:
            model = self._model(task)  # raises ConfigError: the model cannot be batched
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                try:
                    output = model(x[:1].cpu())
                except Exception:  # the client's inputs: its training meets them and fails alone
                    return None
            self._classes[key] = int(output.shape[1]) if output.dim() >= 2 else None
        classes = self._classes[key]
        return None if classes is None else label_problem(y, classes)

    def _model_key(self, task: SupervisedTask) -> Key:
        """``(model_fn, loss_fn)`` of ``task``, one tuple object for all the tasks that share them."""
        key = (task.model_fn, task.loss_fn)
        return self._model_keys.setdefault(key, key)

    def _fit(self, items: Sequence[tuple[str, FitIns]]) -> Iterator[PoolReply]:
        replies: dict[str, Reply] = {}
        groups: dict[Key, list[tuple[str, FitIns, SupervisedTask]]] = {}
        shards: dict[str, ClientShard] = {}
        settings: dict[int, int] = {}  # id of an instruction -> the first of the instructions of its settings
        firsts: dict[Key, int] = {}
        for cid, ins in items:
            if ins.mods or ins.groups or ins.config.report_validation:
                raise ConfigError(
                    f"round {ins.round}: client {cid!r} was sent client mods, tensor groups or report_validation, "
                    "which batched clients do not run" + _ADVICE
                )
            try:
                known = self._known(cid)
            except ConfigError:  # the task is not batchable: the run's recipe, not this client
                raise
            except Exception as exc:  # the client's task could not be built or give its data: it alone fails
                log.debug("client %s raised", cid, exc_info=True)
                reason = failure_reason(exc)
                replies[cid] = Failure(client_id=cid, round=ins.round, stage=Stage.FIT, reason=reason)
                continue
            if known is None:
                continue
            task, shard, task_key = known
            problem = shard.read[0] if shard.read is not None else None
            if problem is not None:
                replies[cid] = Failure(client_id=cid, round=ins.round, stage=Stage.FIT, reason=problem)
                continue
            shards[cid] = shard
            same = settings.get(id(ins))
            if same is None:  # the round loop sends one instruction to all: its settings are hashed once
                same = settings[id(ins)] = firsts.setdefault(
                    (id(ins.parameters), ins.config, ins.seed, ins.round), id(ins)
                )
            # inputs of one dtype a batch: torch.cat would promote others (int64 inputs trained as float32, which the
            # model refuses one by one)
            groups.setdefault((task_key, same, shard.x.dtype), []).append((cid, ins, task))
        batches: list[FitBatchRes] = []
        for members in groups.values():
            per_client, batched = self._train_group(members, [shards[member[0]] for member in members])
            replies.update(per_client)
            batches.extend(batched)
        yield from batches
        for cid, _ in items:
            if cid in replies:
                yield replies[cid]

    def _train_group(
        self, members: Sequence[tuple[str, FitIns, SupervisedTask]], shards: Sequence[ClientShard]
    ) -> tuple[dict[str, Reply], list[FitBatchRes]]:
        """Train one group (same model, instruction settings, global model and input dtype; ``shards``: the members'
        data, in their order): its per-client replies, and with ``weigh`` the batches of those whose updates were
        summed.

        A group whose training raises (a bug in the task's model or loss that only some data reach) is searched
        (:meth:`_search`) so that only the clients that raise alone fail, each with its own reason, and the others'
        updates count."""
        outcome = self._attempt(members, shards)
        if not isinstance(outcome, Exception):
            return outcome
        if len(members) > 1:
            log.info(
                "round %d: a batch of %d clients raised %s; training it again in parts to find which clients",
                members[0][1].round,
                len(members),
                type(outcome).__name__,
            )
        return self._search(members, shards, outcome)

    def _search(
        self, members: Sequence[tuple[str, FitIns, SupervisedTask]], shards: Sequence[ClientShard], error: Exception
    ) -> tuple[dict[str, Reply], list[FitBatchRes]]:
        """The replies of a group whose training raised ``error``: a single client fails with it; a larger group is
        trained again in halves, and a half that raises is searched the same way. One bad client in a group of n
        costs about 2 log2(n) batched trainings, not n one-client ones. When both halves raise, failures are not rare
        in this group (a loss that most data break), and its clients are trained one at a time: n + 3 trainings at
        most when all fail, where halving down to each would take 2n - 1. The parts that train give their clients'
        results as the whole group would have (each client's training is independent of its batch-mates'; with
        ``weigh`` each part is its own pre-summed batch)."""
        if len(members) == 1:
            cid = members[0][0]
            log.debug("client %s raised", cid, exc_info=error)  # its reason is logged with the round's failures
            reason = failure_reason(error)
            if isinstance(error, ClientTaskError) and error.client_id == cid:  # its data, checked by train_stack
                reason = error.message  # as the same check reads in process (the round's log names client and round)
            return {cid: Failure(client_id=cid, round=members[0][1].round, stage=Stage.FIT, reason=reason)}, []
        half = len(members) // 2
        parts = [(members[:half], shards[:half]), (members[half:], shards[half:])]
        outcomes = [self._attempt(part, part_shards) for part, part_shards in parts]
        replies: dict[str, Reply] = {}
        batches: list[FitBatchRes] = []
        for (part, part_shards), outcome in zip(parts, outcomes, strict=True):
            if not isinstance(outcome, Exception):
                found = outcome
            elif len(part) == 1 or not all(isinstance(other, Exception) for other in outcomes):
                found = self._search(part, part_shards, outcome)
            else:  # both halves raised: each client of this part alone
                found = ({}, [])
                for member, shard in zip(part, part_shards, strict=True):
                    alone = self._attempt([member], [shard])
                    one = self._search([member], [shard], alone) if isinstance(alone, Exception) else alone
                    found[0].update(one[0])
                    found[1].extend(one[1])
            replies.update(found[0])
            batches.extend(found[1])
        return replies, batches

    def _attempt(
        self, members: Sequence[tuple[str, FitIns, SupervisedTask]], shards: Sequence[ClientShard]
    ) -> tuple[dict[str, Reply], list[FitBatchRes]] | Exception:
        """One batched training of ``members`` (see :meth:`_train_group`): their replies and batches, or the
        exception it raised (a ConfigError, the run's, is raised)."""
        _, ins, task = members[0]
        started = time.perf_counter()
        try:
            model = self._model(task)
            check_spec(ins.parameters, state_spec(model.state_dict()), round=ins.round)
            global_parameters = _tensors(ins.parameters)
            trained = train_stack(
                model,
                global_parameters,
                shards,
                ins.config,
                seed=ins.seed,
                round=ins.round,
                loss_fn=task.loss_fn,
                device=self._device,
                buffers=self._buffers,
                defer_first_layer=self._defer_first_layer,
                fused_checks=self._checks.setdefault(id(model), {}),  # the pool's models are built once, never changed
                classes=self._classes.get(self._model_key(task)),  # labels changed in place since they were read
            )
            if self._defer_first_layer and not trained.deferred and not self._said_not_deferred:
                self._said_not_deferred = True  # once a run
                log.warning(
                    "round %d: defer_first_layer deferred nothing: %s; these clients trained as without it (it applies "
                    "to a Flatten/Linear/ReLU model trained with plain SGD on cross-entropy, whose first layer is wide "
                    "enough to gain: the 2NN, not logistic regression or a CNN)",
                    ins.round,
                    trained.not_deferred,
                )
            if self._weigh is not None:
                per_client, batch = self._presummed(members, trained, started, self._weigh)
                return per_client, [] if batch is None else [batch]
            updates = trained.updates()
        except ConfigError:
            raise
        except Exception as exc:  # a client's data or a bug in user code (model, loss) fails clients, not the run
            return exc
        seconds = (time.perf_counter() - started) / len(members)
        replies: dict[str, Reply] = {
            cid: _fit_reply(cid, member_ins.round, update, seconds)
            for (cid, member_ins, _), update in zip(members, updates, strict=True)
        }
        return replies, []

    @staticmethod
    def _presummed(
        members: Sequence[tuple[str, FitIns, SupervisedTask]],
        trained: TrainedClients,
        started: float,
        weigh: BatchWeights,
    ) -> tuple[dict[str, Reply], FitBatchRes]:
        """The batch's sum (:meth:`TrainedClients.weighted_sum`) with its clients' results as columns, and a failure
        for each client left out of it: a weight that ``weigh`` refuses, an update that is not finite (the batch then
        counts their updates' bytes, as the round loop counts a reply it rejects; it has no clients when all are left
        out). A client with data whose training loss is NaN but whose update is finite (all its labels cross-entropy's
        ignored -100) reported that NaN, which a column cannot tell from no value: it is left out of the batch and
        replies with its own :class:`FitRes`, weighed, checked and its metric left out by the round loop as in
        process.

        The clients' updates are checked for NaN and Inf through their sum, one model's worth of values: only a sum
        that is not finite has each update of it checked (and the sum formed again without those that fail), as are
        the updates of weight 0, which the sum does not read, and those of a NaN loss.
        """
        rnd = members[0][1].round
        update_bytes = num_bytes(members[0][1].parameters)  # an update is the model's size (packed_nbytes of a FitRes)
        count = len(members)
        ids = [member[0] for member in members]
        num_examples = trained.num_examples()
        seconds = (time.perf_counter() - started) / count
        train_loss = trained.train_loss()
        metrics = {"train_loss": train_loss, "fit_seconds": np.full(count, seconds)}
        nan_loss = np.flatnonzero((num_examples > 0) & np.isnan(train_loss)).tolist()
        finite = trained.finite(nan_loss)
        alone = [position for position, ok in zip(nan_loss, finite, strict=True) if ok]
        diverged = [position for position, ok in zip(nan_loss, finite, strict=True) if not ok]
        weights, refused = weigh(num_examples, metrics)
        for position in alone:
            refused.pop(position, None)  # weighed by the round loop, from its own reply
        replies: dict[str, Reply] = {
            ids[position]: Failure(client_id=ids[position], round=rnd, stage=Stage.FIT, reason=reason)
            for position, reason in refused.items()
        }
        kept = np.ones(count, dtype=bool)
        kept[list(refused)] = False
        kept[alone] = False
        weights = np.where(kept, weights, 0.0)  # 0 for those left out: their updates are never read

        def fail(position: int) -> None:
            cid = ids[position]
            error = NonFiniteError("the trained model holds NaN or Inf", round=rnd, client_id=cid, stage="fit")
            replies[cid] = Failure(client_id=cid, round=rnd, stage=Stage.FIT, reason=str(error))
            kept[position] = False
            weights[position] = 0.0

        def reject(positions: Sequence[int]) -> None:
            for position, ok in zip(positions, trained.finite(positions), strict=True):
                if not ok:
                    fail(position)

        for position in diverged:  # checked above: a NaN loss and an update that is not finite
            if kept[position]:
                fail(position)
        reject(np.flatnonzero(kept & (weights == 0.0)).tolist())
        weighted_sum = trained.weighted_sum(weights.tolist())
        if not all(bool(np.isfinite(total).all()) for total in weighted_sum.values()):
            reject(np.flatnonzero(kept).tolist())
            weighted_sum = trained.weighted_sum(weights.tolist())
        index = np.flatnonzero(kept)
        batch = FitBatchRes(
            round=rnd,
            client_ids=tuple(ids[position] for position in index.tolist()),
            num_examples=num_examples[index],
            weights=weights[index],
            metrics={name: column[index] for name, column in metrics.items()},
            weighted_sum=weighted_sum,
            update_bytes=update_bytes,
            rejected_bytes=update_bytes * len(replies),  # uploaded, then refused: counted as one by one
        )
        for position, update in zip(alone, trained.updates(alone), strict=True):
            replies[ids[position]] = _fit_reply(ids[position], rnd, update, seconds)
        return replies, batch


def _fit_reply(client_id: str, round: int, update: ClientUpdate, seconds: float) -> FitRes:
    """The :class:`FitRes` of one batched client: its trained parameters as numpy views, its metrics with
    ``fit_seconds`` (its share of the batch's time), and ``payload_bytes`` as the in-process pool measures them."""
    arrays: NamedArrays = {name: t.numpy() for name, t in update.parameters.items()}
    reply = FitRes(
        client_id=client_id,
        round=round,
        parameters=arrays,
        num_examples=update.num_examples,
        metrics={**update.metrics, "fit_seconds": seconds},
    )
    return replace(reply, payload_bytes=packed_nbytes(reply))


BatchWeights = Callable[[np.ndarray, Mapping[str, np.ndarray]], tuple[np.ndarray, dict[int, str]]]
"""How a :class:`BatchedPool` weighs a batch's clients before it sums their updates: ``(num_examples, metrics) ->
(weights, refused)``, from the clients' int64 example counts and float64 metric columns (NaN: not reported), to
float64 weights (finite, >= 0) and, by position, the reason each client whose weight is refused fails with."""


def presum_weight(strategy: Strategy) -> BatchWeights | None:
    """How a :class:`BatchedPool` weighs each batch's clients to pre-sum their updates under ``strategy``
    (:data:`BatchWeights`: each client's :meth:`~fedcore.strategy.Strategy.weight`, for the example-count and uniform
    weightings a column at a time), or None when the round's aggregation needs each update on its own.

    Pre-summing is exact only for a rule linear in the updates whose weight a client's result gives without its
    update: the plain weighted mean (:class:`~fedcore.aggregation.MeanAggregator`, not a robust rule, DP-FedAvg's
    clipping or SecAgg+, which replace it), without tensor groups or client mods, weighted by example count,
    uniformly or by a metric this pool reports itself (:data:`BATCHED_METRICS`; a metric a wrapping pool adds, such
    as ``simulated_seconds``, comes too late); not by the server's evaluation of each update (``weighting =
    "server"``). A simulation whose attackers rewrite their updates must not pre-sum either (the harness checks
    that).
    """
    if type(strategy.aggregator) is not MeanAggregator or strategy.groups or strategy.mods:
        return None
    if strategy.weighting == "server":
        return None
    if strategy.weighting == "metric" and strategy.quality.metric not in BATCHED_METRICS:
        return None  # e.g. simulated_seconds: a pool wrapped around this one adds it after the weights were taken
    return functools.partial(_strategy_weights, strategy)


def _strategy_weights(
    strategy: Strategy, num_examples: np.ndarray, metrics: Mapping[str, np.ndarray]
) -> tuple[np.ndarray, dict[int, str]]:
    """:data:`BatchWeights` by ``strategy``'s weighting: the example counts as floats (``float(n)`` each, exact
    below 2**53) or ones, else each client's :func:`~fedcore.aggregation.weights.update_weight` of its reported
    metrics, as :meth:`~fedcore.strategy.Strategy.weight` gives it for the client's own result."""
    if strategy.weighting == "examples":
        return num_examples.astype(np.float64), {}
    if strategy.weighting == "uniform":
        return np.ones(num_examples.shape[0], dtype=np.float64), {}
    weights = np.zeros(num_examples.shape[0], dtype=np.float64)
    refused: dict[int, str] = {}
    columns = {name: column.tolist() for name, column in metrics.items()}
    for position, n in enumerate(num_examples.tolist()):
        reported = {name: values[position] for name, values in columns.items() if values[position] == values[position]}
        try:
            weight = update_weight(strategy.weighting, strategy.quality, n, reported)
            weights[position] = check_weight(weight, round=None)
        except FedcoreError as exc:
            refused[position] = str(exc)
    return weights, refused


def gpu_batch(count: int, model_bytes: int, free_bytes: int) -> int:
    """How many of ``count`` clients a GPU with ``free_bytes`` free trains together: as many as keep three stacked
    copies of a model of ``model_bytes`` (parameters, gradients, momentum) within :data:`GPU_STACK_FRACTION` of
    the free memory, at least 1 and at most ``count``."""
    fits = int(GPU_STACK_FRACTION * free_bytes) // max(3 * model_bytes, 1)
    return max(1, min(count, fits))


def _tensors(arrays: NamedArrays) -> dict[str, torch.Tensor]:
    """Named numpy arrays as tensors sharing their memory (read-only arrays are only ever read here)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return {name: torch.from_numpy(np.asarray(array)) for name, array in arrays.items()}
