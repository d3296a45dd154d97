"""Run one SecAgg+ round in memory: the reference driver of the two state machines (tests, benchmarks).

Messages pass by reference between one :class:`~privacy.secagg.server.SecAggServer` and a
:class:`~privacy.secagg.client.SecAggClient` per selected client; ``dropouts`` names, per stage, the clients
that fall silent at that stage (they answer nothing from it on). A client that refuses a message
(:class:`~fedcore.errors.ProtocolError`) drops out the same way, as does a reply the server rejects. The round
loop's stage exchange drives the same machines over its transports, with deadlines in place of ``dropouts``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from fedcore.errors import ProtocolError, UpdateRejected
from fedcore.tensors import TensorSpec
from privacy.secagg.client import SecAggClient
from privacy.secagg.config import SecAggConfig
from privacy.secagg.messages import ClientMessage, ServerMessage, Stage
from privacy.secagg.server import SecAggResult, SecAggServer

Tamper = Callable[[str, ServerMessage], ServerMessage]
"""``(receiver id, message) -> message``: what a test puts between the server and a client."""


def run_round(
    config: SecAggConfig,
    updates: Mapping[str, tuple[Mapping[str, np.ndarray], int]],
    spec: Sequence[TensorSpec],
    *,
    round: int = 1,
    dropouts: Mapping[Stage, set[str]] | None = None,
    rounding_seeds: Mapping[str, bytes] | None = None,
    graph_seed: bytes | None = None,
    tamper: Tamper | None = None,
    on_reply: Callable[[ClientMessage], None] | None = None,
    timings: dict[str, float] | None = None,
    client_timings: dict[tuple[str, str], float] | None = None,
    noise: Mapping[str, np.ndarray] | None = None,
) -> SecAggResult:
    """One round over ``updates`` (``client id -> (update, integer weight)``); the result of the server.

    Args:
        config: the SecAgg+ configuration.
        updates: every selected client's update and weight.
        spec: the tensors to aggregate.
        round: the round number.
        dropouts: ``stage -> clients`` that stop answering at that stage.
        rounding_seeds: per-client rounding seeds (reproducible quantization), else random.
        graph_seed: the graph's seed, else random.
        tamper: applied to every server message before its client sees it.
        on_reply: called with every client reply before the server sees it (e.g. to record sizes).
        timings: if given, seconds spent are added under ``"client:<stage>"`` (all clients together) and
            ``"server:<stage>"`` (receiving that stage's replies and closing it).
        client_timings: if given, each client's seconds per stage are added under ``(stage value, client id)``
            (what the slowest client of each stage costs a deployment, where clients run in parallel).
        noise: per-client integer noise added after quantization (distributed DP,
            :meth:`~privacy.secagg.client.SecAggClient.mask`), for the clients it names.

    Raises:
        RoundFailed: the server aborted the round.
        ConfigError: the configuration cannot run for these clients.
    """
    server = SecAggServer(config, round=round, clients=list(updates), spec=spec, graph_seed=graph_seed)
    seeds = rounding_seeds or {}
    clients = {cid: SecAggClient(cid, rounding_seed=seeds.get(cid)) for cid in updates}
    silent: set[str] = set()
    spent = timings if timings is not None else {}
    outbox = server.start()
    while server.stage not in (Stage.DONE, Stage.ABORTED):
        stage = server.stage
        silent |= (dropouts or {}).get(stage, set())
        client_time = server_time = 0.0
        for cid, message in outbox.items():
            if cid in silent:
                continue
            if tamper is not None:
                message = tamper(cid, message)
            update, weight = updates[cid]
            start = time.perf_counter()
            try:
                reply = clients[cid].handle(message, update=update, weight=weight, noise=(noise or {}).get(cid))
            except ProtocolError:
                silent.add(cid)
                continue
            finally:
                seconds = time.perf_counter() - start
                client_time += seconds
                if client_timings is not None:
                    key = (stage.value, cid)
                    client_timings[key] = client_timings.get(key, 0.0) + seconds
            if on_reply is not None:
                on_reply(reply)
            start = time.perf_counter()
            try:
                server.receive(reply)
            except UpdateRejected:
                silent.add(cid)
            server_time += time.perf_counter() - start
        start = time.perf_counter()
        outbox = server.advance()
        server_time += time.perf_counter() - start
        spent[f"client:{stage.value}"] = spent.get(f"client:{stage.value}", 0.0) + client_time
        spent[f"server:{stage.value}"] = spent.get(f"server:{stage.value}", 0.0) + server_time
    return server.result
