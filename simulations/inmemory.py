"""The in-memory client pool: virtual clients in this process, run one after another.

Deterministic by construction: clients run in the order of the instructions (the sorted selection), each with
randomness keyed by (seed, round, client), so the same seed gives the same history to the last bit. The clients
share one model object (:class:`client.runner.ModelCache`): it is built once, every instruction overwrites its
state, and it trains exactly as a model built for the instruction would; a client whose task builds another kind
of model gets its own (which the runner rejects when it does not fit the global model). Memory stays at one
model plus the data whatever the number of clients.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence

from client.runner import ModelCache, ParallelTraining, run_instruction
from client.state import ClientStateStore
from fedcore.errors import ConfigError, FedcoreError, RoundFailed
from fedcore.messages import Failure, Instruction, Reply
from fedcore.task import Task

log = logging.getLogger("fedcore.simulation")


class InMemoryPool:
    """A :class:`server.pool.ClientPool` whose clients are :class:`~fedcore.task.Task` objects in this process.

    Args:
        client_ids: the virtual clients' ids.
        make_task: builds the task (data shard) of one client; called once per client, on first use.
        parallel: optionally, per client, a parallel plan to train its fit instructions with (None: in-process).
        state: the virtual clients' persistent state (a directory keyed by client id, read only for the clients
            being run), or None when no client keeps state.
    """

    def __init__(
        self,
        client_ids: Sequence[str],
        make_task: Callable[[str], Task],
        parallel: Callable[[str], ParallelTraining | None] | None = None,
        state: ClientStateStore | None = None,
    ) -> None:
        if len(set(client_ids)) != len(client_ids):
            raise ConfigError(f"client ids must be unique; {len(client_ids) - len(set(client_ids))} repeat")
        self._ids = list(client_ids)
        self._make_task = make_task
        self._tasks: dict[str, Task] = {}
        self._parallel = parallel
        self._state = state
        self._models = ModelCache()

    def available(self) -> list[str]:
        """All virtual clients are always available."""
        return list(self._ids)

    def wait_for(self, num_clients: int, timeout_s: float) -> list[str]:
        """Return all clients, or raise :class:`RoundFailed` if there are fewer than ``num_clients``."""
        if num_clients > len(self._ids):
            raise RoundFailed(
                f"the simulation has {len(self._ids)} clients but {num_clients} are needed per round; "
                "lower sampling.min_fit_clients or raise data.num_clients"
            )
        return self.available()

    def task(self, client_id: str) -> Task:
        """The task of ``client_id`` (built on first use)."""
        if client_id not in self._tasks:
            self._tasks[client_id] = self._make_task(client_id)
        return self._tasks[client_id]

    def run(self, instructions: Mapping[str, Instruction], *, timeout_s: float | None = None) -> Iterator[Reply]:
        """Run each instruction in turn and yield its reply; a client that raises yields a Failure."""
        for client_id, instruction in instructions.items():
            try:
                plan = self._parallel(client_id) if self._parallel is not None else None
                yield run_instruction(
                    self.task(client_id), instruction, client_id, models=self._models, parallel=plan, state=self._state
                )
            except FedcoreError as exc:
                yield Failure(client_id=client_id, round=instruction.round, stage=instruction.stage, reason=str(exc))
            except Exception as exc:  # a bug in user code must not kill the whole simulation
                log.exception("client %s raised", client_id)
                yield Failure(
                    client_id=client_id,
                    round=instruction.round,
                    stage=instruction.stage,
                    reason=f"{type(exc).__name__}: {exc}",
                )
