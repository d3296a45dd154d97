"""The in-memory client pool: virtual clients in this process, run one after another.

Deterministic by construction: clients run in the order of the instructions (the sorted selection), each with
randomness keyed by (seed, round, client), so the same seed gives the same history to the last bit. The clients
share one model object (:class:`client.runner.ModelCache`): it is built once, every instruction overwrites its
state, and it trains exactly as a model built for the instruction would; a client whose task builds another kind
of model gets its own (which the runner rejects when it does not fit the global model). Memory stays at one
model plus the data whatever the number of clients: the update lends the model's memory rather than copying it
(:meth:`client.runner.ModelCache.lend`), and between rounds the model's memory is freed.

Stage instructions of a multi-stage round protocol (:class:`~fedcore.messages.StageIns`) go to the clients'
state machines through one :class:`client.stages.ClientStages` (kept per round and client). Virtual clients
answer one after another, but each as if alone: a client whose answer to a stage took longer than the stage's
deadline missed it, as it would have over the network. Fit and evaluate instructions keep no deadline here, so
that a simulation's model never depends on timing.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace

import torch

from client.runner import ModelCache, ParallelTraining, run_instruction
from client.stages import ClientStages
from client.state import ClientStateStore
from fedcore.errors import ConfigError, FedcoreError, RoundFailed, failure_reason
from fedcore.messages import DEADLINE_MISSED, Failure, FitRes, Reply, ServerMessage, StageIns, packed_nbytes
from fedcore.supervised import SupervisedTask
from fedcore.task import Task

log = logging.getLogger("fedcore.simulation")


def all_virtual_clients(client_ids: Sequence[str], num_clients: int) -> list[str]:
    """A simulation's ``wait_for``: every virtual client is always available.

    Raises:
        RoundFailed: there are fewer than ``num_clients`` clients.
    """
    if num_clients > len(client_ids):
        raise RoundFailed(
            f"the simulation has {len(client_ids)} clients but {num_clients} are needed per round; "
            "lower sampling.min_fit_clients or raise data.num_clients"
        )
    return list(client_ids)


def on_device(task: Task, device: torch.device, copies: DeviceCopies | None = None) -> Task:
    """``task`` with its data on ``device``: a :class:`~fedcore.supervised.SupervisedTask`'s ``train_data`` and
    ``test_data`` tensors copied there (``dataclasses.replace``); any other task as it is (it gets the model on the
    device and moves its own data).

    Args:
        copies: the copies already made (:class:`DeviceCopies`), so that data the tasks share go to the device
            once: one test set that every client evaluates on, and the dataset whose rows the clients' shards view.
    """
    if not isinstance(task, SupervisedTask):
        return task
    moved = copies if copies is not None else DeviceCopies(device)

    def pair(data: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if data is None else (moved.to(data[0]), moved.to(data[1]))

    return replace(task, train_data=pair(task.train_data), test_data=pair(task.test_data))


MOVED_KEPT = 8
"""How many tensors, and how many storages, :class:`DeviceCopies` remembers having copied (a client's own shard is
copied once anyway; a shared test set, or the dataset the shards view, stays among the last few copied while tasks
keep referring to it)."""

STORAGE_FRACTION = 0.25
"""The largest share of a GPU's free memory that :class:`DeviceCopies` fills with one storage that tensors view:
a larger one is copied view by view."""


class DeviceCopies:
    """Copies of CPU tensors on ``device``, made once for the tasks that share them.

    A tensor that views part of a larger storage (a client's shard of one dataset,
    :meth:`simulations.tasks.PreparedData.shard`) is copied by copying that whole storage once and viewing the
    copy with the tensor's own offset, shape and strides: every client's shard then views one storage on the
    device as on the CPU, so the batched backend gathers a round's mini-batches out of it directly
    (:func:`simulations.batched._one_storage`) instead of concatenating the clients' data each round, and a new
    client costs no copy at all. On a GPU a storage larger than :data:`STORAGE_FRACTION` of the free memory is
    copied view by view instead (only the clients' rows that are used go there). Any other tensor is copied as it
    is, and the same tensor object gives the same copy while it is among the last :data:`MOVED_KEPT` copied.

    A storage is copied as it is when the first task that views it moves (again if it was reallocated since): a
    task made later that writes into the shared rows of the CPU's copy, rather than into tensors of its own (as
    the label attacks do), is not seen on the device.

    Args:
        device: where the copies go.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.tensors: OrderedDict[int, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        # id of a CPU storage (torch keeps one Python object per storage) -> (that storage, kept alive so the id is
        # not reused; its address and bytes when copied; the copy, as uint8 on the device)
        self.storages: OrderedDict[int, tuple[torch.UntypedStorage, tuple[int, int], torch.Tensor]] = OrderedDict()

    def to(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` on the device: itself when it is there already, else a copy (made once, see the class)."""
        if tensor.device == self.device:
            return tensor
        if _views_part(tensor):
            view = self._view(tensor, tensor.untyped_storage())
            if view is not None:
                return view
        entry = self.tensors.get(id(tensor))
        if entry is not None and entry[0] is tensor:
            self.tensors.move_to_end(id(tensor))
            return entry[1]
        copy = tensor.to(self.device)
        self.tensors[id(tensor)] = (tensor, copy)
        while len(self.tensors) > MOVED_KEPT:
            self.tensors.popitem(last=False)
        return copy

    def _view(self, tensor: torch.Tensor, storage: torch.UntypedStorage) -> torch.Tensor | None:
        """``tensor`` as a view of the copy of its whole ``storage`` (copied on first use); None when the storage is
        too large to copy whole (:data:`STORAGE_FRACTION`)."""
        where = (storage.data_ptr(), storage.nbytes())
        entry = self.storages.get(id(storage))
        if entry is not None and entry[0] is storage and entry[1] == where:
            self.storages.move_to_end(id(storage))
        else:  # first seen, or reallocated in place since (resized): copied as it is now
            if self.device.type == "cuda" and where[1] > STORAGE_FRACTION * torch.cuda.mem_get_info(self.device)[0]:
                return None
            entry = (storage, where, torch.empty(0, dtype=torch.uint8).set_(storage).to(self.device, copy=True))
            self.storages[id(storage)] = entry
            while len(self.storages) > MOVED_KEPT:
                self.storages.popitem(last=False)
        return torch.empty(0, dtype=tensor.dtype, device=self.device).set_(
            entry[2].untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride()
        )


def _views_part(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a plain strided view of part of a larger storage, outside autograd (which a view of a
    copied storage would leave), with no lazy conjugate or negative bit (which it would drop)."""
    return (
        tensor.layout == torch.strided
        and not tensor.requires_grad
        and not tensor.is_conj()
        and not tensor.is_neg()
        and tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size()
    )


class InMemoryPool:
    """A :class:`server.pool.ClientPool` whose clients are :class:`~fedcore.task.Task` objects in this process.

    Args:
        client_ids: the virtual clients' ids.
        make_task: builds the task (data shard) of one client; called once per client, on first use.
        parallel: optionally, per client, a parallel plan to train its fit instructions with (None: in-process).
        state: the virtual clients' persistent state (a directory keyed by client id, read only for the clients
            being run), or None when no client keeps state.
        stages: the clients' dispatcher of round protocol stages (default: the protocols registered in this
            process, :func:`client.stages.register_client_protocol`).
        max_tasks: keep at most this many clients' tasks built, dropping the least recently used (None: keep
            every task built, e.g. when clients share a dataset in memory and a task is a cheap view of it; a
            bound keeps memory flat when tasks make their own data, e.g. generated on demand).
        device: where the clients train (None or the CPU: where the tasks put their data and models). Another
            device gets the shared model (:class:`client.runner.ModelCache`) and, once per task built, a
            :class:`~fedcore.supervised.SupervisedTask`'s training and test tensors (:func:`on_device`; the
            dataset that the clients' shards view goes there once, :class:`DeviceCopies`).
    """

    def __init__(
        self,
        client_ids: Sequence[str],
        make_task: Callable[[str], Task],
        parallel: Callable[[str], ParallelTraining | None] | None = None,
        state: ClientStateStore | None = None,
        stages: ClientStages | None = None,
        max_tasks: int | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        if max_tasks is not None and max_tasks < 1:
            raise ConfigError(f"max_tasks must be >= 1 or None, got {max_tasks}")
        if len(set(client_ids)) != len(client_ids):
            raise ConfigError(f"client ids must be unique; {len(client_ids) - len(set(client_ids))} repeat")
        self._ids = list(client_ids)
        self._make_task = make_task
        self._tasks: OrderedDict[str, Task] = OrderedDict()
        self._max_tasks = max_tasks
        self._parallel = parallel
        self._state = state
        self._device = torch.device(device) if device is not None else torch.device("cpu")
        # on the CPU the models stay where the tasks build them (a task may put its own on a GPU)
        self._models = ModelCache(self._device if self._device.type != "cpu" else None)
        self._moved = DeviceCopies(self._device)
        self._stages = stages if stages is not None else ClientStages()

    @property
    def max_tasks(self) -> int | None:
        """The most clients' tasks kept built (None: every task built)."""
        return self._max_tasks

    def available(self) -> list[str]:
        """All virtual clients are always available."""
        return list(self._ids)

    def wait_for(self, num_clients: int, timeout_s: float) -> list[str]:
        """Return all clients, or raise :class:`RoundFailed` if there are fewer than ``num_clients``."""
        return all_virtual_clients(self._ids, num_clients)

    def task(self, client_id: str) -> Task:
        """The task of ``client_id`` (built on first use, and again after ``max_tasks`` others were used)."""
        task = self._tasks.get(client_id)
        if task is None:
            task = self._make_task(client_id)
            if self._device.type != "cpu":
                task = on_device(task, self._device, self._moved)
            self._tasks[client_id] = task
            if self._max_tasks is not None and len(self._tasks) > self._max_tasks:
                self._tasks.popitem(last=False)
        elif self._max_tasks is not None:
            self._tasks.move_to_end(client_id)
        return task

    def run(self, instructions: Mapping[str, ServerMessage], *, timeout_s: float | None = None) -> Iterator[Reply]:
        """Run each instruction in turn and yield its reply; a client that raises, or answers a stage after its
        deadline ``timeout_s``, yields a Failure."""
        for client_id, instruction in instructions.items():
            reply = self._run_one(client_id, instruction, timeout_s)
            yield reply
            # dropped before the next client trains: the consumer has folded it, and a model-sized update kept
            # here would sit beside the next client's model and the running sum
            del reply
        # the round's instructions are done: the shared model's memory goes until the next round's first client
        # (it would sit beside the server's step: the new global model and the optimizer's state)
        self._models.release()

    def _run_one(self, client_id: str, instruction: ServerMessage, timeout_s: float | None) -> Reply:
        """One instruction's reply; a client that raises, or answers a stage late, gives a Failure."""
        try:
            if isinstance(instruction, StageIns):
                return self._stage(instruction, client_id, timeout_s)
            self._stages.observe(instruction.round)
            plan = self._parallel(client_id) if self._parallel is not None else None
            reply = run_instruction(
                self.task(client_id),
                instruction,
                client_id,
                models=self._models,
                parallel=plan,
                state=self._state,
                stages=self._stages,
            )
            if isinstance(reply, FitRes):  # what would travel: the tensors' bytes (see FitRes.payload_bytes)
                reply = replace(reply, payload_bytes=packed_nbytes(reply))
            return reply
        except Exception as exc:  # a bug in user code must not kill the whole simulation
            if not isinstance(exc, FedcoreError):
                log.debug("client %s raised", client_id, exc_info=True)  # its reason is logged with the failures
            reason = failure_reason(exc)
            return Failure(client_id=client_id, round=instruction.round, stage=instruction.stage, reason=reason)

    def _stage(self, instruction: StageIns, client_id: str, timeout_s: float | None) -> Reply:
        started = time.perf_counter()
        reply = self._stages.handle(instruction, client_id)
        took = time.perf_counter() - started
        if timeout_s is not None and took > timeout_s:
            return Failure(
                client_id=client_id,
                round=instruction.round,
                stage=instruction.stage,
                reason=f"{DEADLINE_MISSED} stage deadline of {timeout_s} s (it took {took:.2f} s)",
            )
        return reply
