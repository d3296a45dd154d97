"""The engine's input pipeline: an epoch's batches cut from the training data and put on the rank's device.

Every rank walks the same global batches (``batch_size`` samples in the order of the epoch's ``torch.randperm``)
but reads only its part of each: the rows its executor asks for (:class:`Rows`: a data-parallel shard, and on a
pipeline rank only the inputs for the first stage and the targets for the last). :class:`BatchLoader` gathers
those rows and hands them out as :class:`Batch` values, on the device, in order.

Where the data live decides what a batch costs (``device_bytes``, default :data:`DEVICE_DATA_BYTES`):

- CPU ranks: rows are gathered from the tensors as given (``index_select``);
- CUDA, data up to ``device_bytes``: the data move to the GPU once, and each batch is gathered there;
- CUDA, larger data: the data are pinned once; each batch's rows are gathered on the host into pinned memory and
  copied to the GPU on a side stream (``non_blocking``), so the copy overlaps the compute stream's work.

With ``prefetch`` (the default), batch ``k + 1`` is prepared while step ``k`` runs. For pinned data a
background thread (one per epoch) gathers its rows on the host (``index_select`` releases the GIL, so the gather
overlaps the training loop's kernel launches) and queues its copy on the side stream, where it overlaps the
compute stream's work; the loader asks for batch ``k + 1`` when it hands out batch ``k``, before step ``k`` is
queued. Before a batch is handed out, the compute stream waits for that batch's copy only (one CUDA event per
batch, recorded after its copies; ``wait_stream`` would also wait for the next batch's copy), and its device
tensors are marked as used by the compute stream (``record_stream``): they were allocated on the side stream, and
the caching allocator must not give their memory to a later copy while a queued step still reads them. Pinned
host buffers are kept until their batch is handed out (the caching host allocator also holds a pinned block
until the copy that reads it has finished).

On the CPU, and for data resident on the GPU, there is no host work to hide: the next batch is gathered, in the
loop's own thread, when the current one is handed out. With or without prefetching, and wherever the data live,
the batches hold the same values in the same order, and so training gives the same result.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from fedcore.errors import ConfigError

DEVICE_DATA_BYTES = 1 << 30
"""Training data up to this size (inputs plus targets) move to a CUDA device once; larger data stay on the host,
pinned, and each batch is copied on a side stream."""


@dataclass(frozen=True)
class Rows:
    """The rows of a global batch that one rank reads, and which of its tensors it needs.

    Attributes:
        start: first position read, in the global batch's own order (``0 <= start <= stop``).
        stop: one past the last position read (``<=`` the batch size).
        inputs: the rank reads the inputs ``x`` (false on a pipeline rank without the first stage).
        targets: the rank reads the targets ``y`` (false on a pipeline rank without the last stage).
    """

    start: int
    stop: int
    inputs: bool = True
    targets: bool = True


def all_rows(size: int) -> Rows:
    """Every row of a global batch of ``size`` samples, inputs and targets (one rank training alone)."""
    return Rows(0, size)


def part(size: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of part ``index`` when ``size`` consecutive items are cut into ``parts`` contiguous parts
    as ``torch.tensor_split`` cuts them: the first ``size % parts`` parts hold one item more.

    Raises:
        ConfigError: ``parts < 1`` or ``index`` outside ``[0, parts)``.
    """
    if parts < 1 or not 0 <= index < parts:
        raise ConfigError(f"cannot take part {index} of {parts} parts; need parts >= 1 and 0 <= index < parts")
    quotient, remainder = divmod(size, parts)
    start = index * quotient + min(index, remainder)
    return start, start + quotient + (1 if index < remainder else 0)


@dataclass(frozen=True)
class Batch:
    """One optimizer step's data as one rank sees it.

    Attributes:
        x: rows ``[start, start + len(x))`` of the global batch's inputs on the rank's device, shape
            ``(rows, *x.shape[1:])`` and the data's dtype; None when the rank does not read inputs.
        y: the same rows of the targets; None when the rank does not read targets.
        size: samples in the global batch (over all ranks), which the loss is scaled by.
        start: position of the first row in the global batch.
        rows: the number of rows this rank read.
    """

    x: torch.Tensor | None
    y: torch.Tensor | None
    size: int
    start: int
    rows: int


@dataclass
class _Staged:
    """A batch whose gather (and copy) has been queued, before it is handed out."""

    batch: Batch
    copied: torch.cuda.Event | None = None  # recorded on the side stream after the batch's copies
    host: tuple[torch.Tensor, ...] = ()  # pinned sources of those copies


class BatchLoader:
    """An epoch's batches for one rank, on its device, optionally prepared one batch ahead (see the module text).

    Args:
        x: the training inputs, first dimension the sample; not modified.
        y: the targets, as many as inputs.
        device: the rank's device.
        rows: the rows a rank reads of a global batch of a given size (the executor's ``batch_rows``); default
            :func:`all_rows`.
        prefetch: prepare batch ``k + 1`` when batch ``k`` is handed out.
        device_bytes: on CUDA, data up to this many bytes (inputs plus targets) move to the device once; larger
            data are pinned and copied batch by batch on a side stream.
        background: prefetch in a background thread; by default only for pinned data on CUDA, where host work
            can overlap GPU work (True also elsewhere: the same batches; the CPU tests use it).

    Raises:
        ConfigError: ``x`` and ``y`` differ in length, or ``device_bytes`` is negative.
    """

    def __init__(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        device: torch.device,
        *,
        rows: Callable[[int], Rows] = all_rows,
        prefetch: bool = True,
        device_bytes: int = DEVICE_DATA_BYTES,
        background: bool | None = None,
    ) -> None:
        if len(x) != len(y):
            raise ConfigError(f"the training data have {len(x)} inputs but {len(y)} targets; give as many of each")
        if device_bytes < 0:
            raise ConfigError(f"device_bytes must be >= 0, got {device_bytes}")
        self.device = device
        self.prefetch = prefetch
        self._rows = rows
        self._stream: torch.cuda.Stream | None = None
        if device.type == "cuda" and x.nbytes + y.nbytes <= device_bytes:
            x, y = x.to(device), y.to(device)
        elif device.type == "cuda":
            x, y = x.pin_memory(), y.pin_memory()
            self._stream = torch.cuda.Stream(device=device)
        self._x, self._y = x, y
        self._background = prefetch and (self._stream is not None if background is None else background)

    def __len__(self) -> int:
        """Samples in the training data."""
        return len(self._x)

    @property
    def copies_on_side_stream(self) -> bool:
        """True when batches are gathered on the host and copied on a side CUDA stream (large data on CUDA)."""
        return self._stream is not None

    def epoch(self, order: torch.Tensor, batch_size: int) -> Generator[Batch, None, None]:
        """The batches of one epoch: ``order[s : s + batch_size]`` for ``s = 0, batch_size, ...`` (the last one may
        be shorter), each cut to this rank's rows.

        Args:
            order: a permutation of the sample indices (``torch.randperm(len(self))``), int64, on the CPU.
            batch_size: samples per global batch (>= 1).

        Raises:
            ConfigError: ``batch_size < 1``.
        """
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        order = order.to(self._x.device)
        pool = ThreadPoolExecutor(1, "fedcore-batches") if self._background else None
        try:
            pending: Future[_Staged] | None = None
            for start in range(0, len(order), batch_size):
                if pending is None:  # the epoch's first batch, or every batch without prefetching
                    pending = self._submit(pool, order[start : start + batch_size])
                following = start + batch_size
                upcoming = None
                if self.prefetch and following < len(order):
                    upcoming = self._submit(pool, order[following : following + batch_size])
                yield self._ready(pending.result())
                pending = upcoming
        finally:  # also when the loop stops early (max_steps): the pending batch is finished, then dropped
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)

    def _submit(self, pool: ThreadPoolExecutor | None, indices: torch.Tensor) -> Future[_Staged]:
        """:meth:`_stage` on ``pool``'s thread, or now in this thread when there is no pool."""
        if pool is not None:
            return pool.submit(self._stage, indices)
        done: Future[_Staged] = Future()
        done.set_result(self._stage(indices))
        return done

    def _stage(self, indices: torch.Tensor) -> _Staged:
        """Queue the gather (and, on the side stream, the copy) of this rank's rows of the batch ``indices``."""
        size = len(indices)
        rows = self._rows(size)
        mine = indices[rows.start : rows.stop]
        x = _gather(self._x, mine, pinned=self._stream is not None) if rows.inputs else None
        y = _gather(self._y, mine, pinned=self._stream is not None) if rows.targets else None
        if self._stream is None:
            return _Staged(Batch(x, y, size, rows.start, len(mine)))
        host = tuple(t for t in (x, y) if t is not None)
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):  # the device: also in the thread
            x = None if x is None else x.to(self.device, non_blocking=True)
            y = None if y is None else y.to(self.device, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self._stream)
        return _Staged(Batch(x, y, size, rows.start, len(mine)), copied, host)

    def _ready(self, staged: _Staged) -> Batch:
        """The batch, usable on the current stream: it waits for the batch's copy, and the batch's memory is not
        reused until the current stream is done with it."""
        if staged.copied is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(staged.copied)
            for tensor in (staged.batch.x, staged.batch.y):
                if tensor is not None:
                    tensor.record_stream(compute)
        return staged.batch


def _gather(data: torch.Tensor, idx: torch.Tensor, *, pinned: bool) -> torch.Tensor:
    """Rows ``idx`` of ``data`` (on ``data``'s device); into pinned memory when ``pinned``, so that the copy to the
    GPU that follows is asynchronous."""
    if not pinned:
        return data.index_select(0, idx)
    out = torch.empty((len(idx), *data.shape[1:]), dtype=data.dtype, pin_memory=True)
    return torch.index_select(data, 0, idx, out=out)
