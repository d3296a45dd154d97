"""A small three-stage round protocol for the tests of multi-stage rounds, and a task for daemons that answer it.

"transcript" runs two exchanges before the fit exchange and one after it:

1. ``hello``: the server sends each client a nonce (bytes), its index (int), the protocol's label (str) and a
   probe tensor; the client keeps the nonce, answers with a secret (int, keyed by round and client id), the
   SHA-256 of the nonce, and the probe doubled.
2. ``sum`` (deadline ``deadline_s``): the server sends each client still in the total of the secrets it heard;
   the client answers with SHA-256(nonce, total), which only a client that kept its state from ``hello`` knows.
3. ``confirm`` (after fit): the server sends the clients whose updates were folded their count; each answers
   with a digest of everything it received this round, which the server checks against its own record.

The server side refuses any answer that does not check out, stops the round when fewer than ``min_clients``
remain, and records what it was told at each stage (``TranscriptProtocol.rounds``). Dropouts are injected by
client id: ``fail-hello``, ``fail-sum``, ``fail-confirm`` in an id make that client raise at that stage,
``slow-sum`` makes it answer ``sum`` one second after the deadline it was told, ``lie-sum`` makes it answer
``sum`` with a wrong digest. Importing this module registers the client side (a daemon started with
``--task tests.stage_protocol:stage_task`` answers the protocol).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from client.stages import register_client_protocol
from fedcore.errors import ClientTaskError, ConfigError, RoundFailed
from fedcore.messages import StageIns, StageRes, StageValue
from fedcore.seeding import derive_seed
from fedcore.stages import Exchange, Phase
from fedcore.supervised import SupervisedTask
from fedcore.task import FitConfig, TaskContext, TrainContext, TrainResult

NAME = "transcript"
LABEL = "fedcore test protocol"


def nonce(seed: int, round: int, attempt: int, client_id: str) -> bytes:
    return hashlib.sha256(f"{seed}/{round}/{attempt}/{client_id}".encode()).digest()


def secret(round: int, client_id: str) -> int:
    return derive_seed(round, "secret", client_id) % 1_000_003


def probe(round: int, attempt: int, index: int) -> np.ndarray:
    return np.array([round, attempt, index, -1.5], dtype=np.float32)


def digest(*parts: bytes | int | str) -> bytes:
    hasher = hashlib.sha256()
    for part in parts:
        data = part if isinstance(part, bytes) else str(part).encode()
        hasher.update(len(data).to_bytes(8, "little") + data)
    return hasher.digest()


@dataclass(eq=False)
class TranscriptServer:
    """The server side of one round attempt."""

    protocol: TranscriptProtocol
    round: int
    attempt: int
    clients: list[str]
    seed: int
    secrets: dict[str, int] = field(default_factory=dict)
    received: dict[str, list[bytes]] = field(default_factory=dict)  # what each client was sent, digested
    stages: list[tuple[str, list[str], dict[str, str]]] = field(default_factory=list)  # (stage, answered, dropped)
    fit: tuple[list[str], dict[str, str]] | None = None
    alive: list[str] = field(default_factory=list)
    _next: list[str] = field(default_factory=lambda: ["hello", "sum"])

    def __post_init__(self) -> None:
        self.alive = list(self.clients)

    def _ins(
        self, client_id: str, name: str, fields: Mapping[str, StageValue], tensors: dict | None = None
    ) -> StageIns:
        self.received.setdefault(client_id, []).append(digest(name, *sorted(f"{k}={v!r}" for k, v in fields.items())))
        return StageIns(
            round=self.round, attempt=self.attempt, protocol=NAME, name=name, fields=fields, tensors=tensors or {}
        )

    def next_exchange(self, phase: Phase) -> Exchange | None:
        if phase is Phase.BEFORE_FIT:
            if not self._next:
                return None
            name = self._next.pop(0)
            if name == "hello":
                return Exchange(
                    name="hello",
                    instructions={
                        cid: self._ins(
                            cid,
                            "hello",
                            {"nonce": nonce(self.seed, self.round, self.attempt, cid), "index": i, "label": LABEL},
                            {"probe": probe(self.round, self.attempt, i)},
                        )
                        for i, cid in enumerate(self.clients)
                    },
                )
            total = sum(self.secrets[cid] for cid in self.alive)
            deadline_ms = int(self.protocol.deadline_s * 1000)
            return Exchange(
                name="sum",
                instructions={
                    cid: self._ins(cid, "sum", {"total": total, "deadline_ms": deadline_ms}) for cid in self.alive
                },
                deadline_s=self.protocol.deadline_s,
            )
        if self.fit is None or any(stage == "confirm" for stage, _, _ in self.stages):
            return None
        accepted = self.fit[0]
        return Exchange(
            name="confirm",
            instructions={cid: self._ins(cid, "confirm", {"accepted": len(accepted)}) for cid in accepted},
        )

    def receive(self, stage: str, replies: Mapping[str, StageRes], dropped: Mapping[str, str]) -> Mapping[str, str]:
        refused: dict[str, str] = {}
        for cid, reply in replies.items():
            problem = self._check(stage, cid, reply)
            if problem:
                refused[cid] = problem
        self.stages.append((stage, sorted(replies), dict(dropped)))
        gone = set(dropped) | set(refused)
        self.alive = [cid for cid in self.alive if cid not in gone]
        if stage == "sum":
            self.secrets = {cid: s for cid, s in self.secrets.items() if cid in self.alive}
        if len(self.alive) < self.protocol.min_clients:
            raise RoundFailed(
                f"{len(self.alive)} client(s) left after stage {stage!r}; the protocol needs "
                f"{self.protocol.min_clients}",
                round=self.round,
                stage=stage,
            )
        return refused

    def _check(self, stage: str, cid: str, reply: StageRes) -> str:
        fields = reply.fields
        if stage == "hello":
            index = self.clients.index(cid)
            doubled = reply.tensors.get("probe2")
            if fields.get("echo") != hashlib.sha256(nonce(self.seed, self.round, self.attempt, cid)).digest():
                return "wrong echo of the nonce"
            if doubled is None or not np.array_equal(doubled, 2 * probe(self.round, self.attempt, index)):
                return "wrong doubled probe"
            value = fields.get("secret")
            if value != secret(self.round, cid):
                return "wrong secret"
            self.secrets[cid] = int(value)
            return ""
        if stage == "sum":
            total = sum(self.secrets[c] for c in self.alive)
            want = digest(nonce(self.seed, self.round, self.attempt, cid), total)
            return "" if fields.get("proof") == want else "wrong proof of the total"
        if fields.get("transcript") != digest(*self.received[cid]):
            return "the client's transcript differs from the server's"
        return ""

    def fit_done(self, accepted: Sequence[str], dropped: Mapping[str, str]) -> None:
        self.fit = (list(accepted), dict(dropped))
        self.alive = list(accepted)


@dataclass(eq=False)
class TranscriptProtocol:
    """The server side: a :class:`fedcore.stages.RoundProtocol`."""

    min_clients: int = 1
    deadline_s: float = 2.0
    name: str = NAME
    rounds: dict[tuple[int, int], TranscriptServer] = field(default_factory=dict)

    def check(self, num_clients: int) -> None:
        if num_clients < self.min_clients:
            raise ConfigError(f"the transcript protocol needs {self.min_clients} clients, {num_clients} are selected")

    def start(self, *, round: int, attempt: int, clients: Sequence[str], seed: int) -> TranscriptServer:
        machine = TranscriptServer(protocol=self, round=round, attempt=attempt, clients=list(clients), seed=seed)
        self.rounds[(round, attempt)] = machine
        return machine


@dataclass(eq=False)
class TranscriptClient:
    """The client side of one round attempt."""

    round: int
    attempt: int
    client_id: str
    nonce: bytes = b""
    seen: list[bytes] = field(default_factory=list)

    def handle(self, instruction: StageIns) -> StageRes:
        name, fields = instruction.name, instruction.fields
        if f"fail-{name}" in self.client_id:
            raise ClientTaskError(f"this client fails at stage {name}", round=self.round, client_id=self.client_id)
        self.seen.append(digest(name, *sorted(f"{k}={v!r}" for k, v in fields.items())))
        out: dict[str, StageValue] = {}
        tensors = {}
        if name == "hello":
            value = fields["nonce"]
            if not isinstance(value, bytes) or fields["label"] != LABEL or not isinstance(fields["index"], int):
                raise ClientTaskError("a hello without its typed fields", round=self.round, client_id=self.client_id)
            self.nonce = value
            out = {"secret": secret(self.round, self.client_id), "echo": hashlib.sha256(value).digest()}
            tensors = {"probe2": 2 * instruction.tensors["probe"]}
        elif name == "sum":
            if "slow-sum" in self.client_id:
                time.sleep(int(fields["deadline_ms"]) / 1000 + 1.0)
            total = fields["total"]
            out = {"proof": digest(self.nonce, total if "lie-sum" not in self.client_id else -1)}
        else:
            out = {"transcript": digest(*self.seen)}
        return StageRes(
            client_id=self.client_id,
            round=self.round,
            attempt=self.attempt,
            protocol=NAME,
            name=name,
            fields=out,
            tensors=tensors,
        )


@dataclass(eq=False)
class TranscriptClientProtocol:
    """The client side: a :class:`fedcore.stages.ClientProtocol`; counts the machines it made."""

    name: str = NAME
    started: list[tuple[int, int, str]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self, *, round: int, attempt: int, client_id: str) -> TranscriptClient:
        with self._lock:
            self.started.append((round, attempt, client_id))
        return TranscriptClient(round=round, attempt=attempt, client_id=client_id)


CLIENT_PROTOCOL = TranscriptClientProtocol()
register_client_protocol(CLIENT_PROTOCOL)

FEATURES, CLASSES = 5, 3


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, CLASSES))


class _FailingFit(SupervisedTask):
    def train(self, model: nn.Module, config: FitConfig, context: TrainContext) -> TrainResult:
        raise RuntimeError("this client fails at fit")


def stage_task(ctx: TaskContext) -> SupervisedTask:
    """A small classifier on random data keyed by (seed, client id); a client whose id holds ``fail-fit`` raises
    when it trains."""
    gen = torch.Generator().manual_seed(derive_seed(ctx.seed, "data", ctx.client_id))
    x = torch.randn(24, FEATURES, generator=gen)
    y = torch.randint(0, CLASSES, (24,), generator=gen)
    kind = _FailingFit if "fail-fit" in ctx.client_id else SupervisedTask
    return kind(model_fn=model, train_data=(x, y))
