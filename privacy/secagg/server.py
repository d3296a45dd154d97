"""The server side of one SecAgg+ round as an I/O-free state machine: replies in, the next stage's messages out.

A driver (the round's stage exchange) runs it as::

    server = SecAggServer(config, round=r, clients=selected, spec=spec)     # ConfigError before any message
    outbox = server.start()                                                 # {client id: AdvertiseKeysIns}
    while server.stage not in (Stage.DONE, Stage.ABORTED):
        for reply in replies_to(outbox, deadline):                          # the transport's business
            server.receive(reply)                                           # UpdateRejected: ignore that one
        outbox = server.advance()                                           # RoundFailed: the round aborts
    result = server.result                                                  # weighted sum, total weight

A client that does not answer a stage before :meth:`SecAggServer.advance` is a dropout from then on. The server
keeps a running sum of the masked uploads (never an individual one), and aborts with
:class:`~fedcore.errors.RoundFailed`, revealing nothing, when fewer than 2 (or ``t``) clients answer a stage (a
"sum" of one update is that update), or when fewer than ``t`` neighbours of any client that is still needed
remain: before asking anyone to unmask when it can see that coming, and after the unmask stage if
too few answered (the server then holds fewer than ``t`` shares of some secret, which reveal nothing about it,
and computes nothing from the others). Dropouts after key sharing are recovered: their pairwise masks are
recomputed from their mask secret keys, rebuilt from ``t`` neighbours' shares (Bonawitz et al. 2017, §4;
Bell et al. 2020).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from fedcore.errors import AggregationError, ConfigError, ProtocolError, RoundFailed, UpdateRejected
from fedcore.tensors import NamedArrays, TensorSpec
from privacy.secagg import crypto, shamir
from privacy.secagg.client import PAIRWISE_MASK
from privacy.secagg.config import SecAggConfig
from privacy.secagg.graph import harary
from privacy.secagg.messages import (
    CIPHERTEXT_BYTES,
    MAX_ID_BYTES,
    AdvertiseKeysIns,
    AdvertiseKeysRes,
    ClientMessage,
    MaskedInputIns,
    MaskedInputRes,
    ServerMessage,
    ShareKeysIns,
    ShareKeysRes,
    Stage,
    UnmaskIns,
    UnmaskRes,
)
from privacy.secagg.quantize import check_quantizable, dequantize, vector_length

_NEXT = {
    Stage.ADVERTISE_KEYS: Stage.SHARE_KEYS,
    Stage.SHARE_KEYS: Stage.COLLECT_MASKED_INPUT,
    Stage.COLLECT_MASKED_INPUT: Stage.UNMASK,
    Stage.UNMASK: Stage.DONE,
}


@dataclass(frozen=True, slots=True)
class SecAggResult:
    """What a SecAgg+ round reveals: the sum over surviving clients, nothing per client.

    Attributes:
        weighted_sum: ``name -> float64 array``: ``Σ_k w_k · x_k`` over the survivors, from their quantized,
            clipped updates (error below ``params.step · total_weight`` per coordinate).
        total_weight: ``Σ_k w_k`` over the survivors.
        field_sum: the exact unmasked sum of the uploads, ``D + 1`` elements of the field dtype.
        survivors: ids of the clients whose updates are in the sum.
        dropped: ids of the clients that shared keys and then dropped out (recovered).
    """

    weighted_sum: NamedArrays
    total_weight: int
    field_sum: np.ndarray
    survivors: tuple[str, ...]
    dropped: tuple[str, ...]

    def mean(self, spec: Sequence[TensorSpec]) -> NamedArrays:
        """The weighted mean (FedAvg) with the dtypes of ``spec``.

        Raises:
            AggregationError: the total weight is 0.
        """
        if self.total_weight <= 0:
            raise AggregationError("secure aggregation: the surviving clients' weights sum to 0; nothing to average")
        return {s.name: (self.weighted_sum[s.name] / self.total_weight).astype(s.dtype) for s in spec}


class SecAggServer:
    """The server's state in one SecAgg+ round.

    Args:
        config: the user's configuration; resolved here for ``len(clients)`` clients.
        round: the round number (bound into every key and ciphertext of the round).
        attempt: the round's attempt (a round retried with a fresh selection), bound in the same way.
        clients: the selected client ids (unique, non-empty, at most ``MAX_ID_BYTES`` UTF-8 bytes each).
        spec: the float tensors to aggregate, in upload order.
        graph_seed: 32 public bytes that permute the sharing graph; None: fresh from the OS CSPRNG.

    Raises:
        ConfigError: any parameter the protocol cannot honour for these clients (raised here, before any
            message exists).
    """

    def __init__(
        self,
        config: SecAggConfig,
        *,
        round: int,
        clients: Sequence[str],
        spec: Sequence[TensorSpec],
        attempt: int = 1,
        graph_seed: bytes | None = None,
    ) -> None:
        for name, value in (("round", round), ("attempt", attempt)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**32:
                raise ConfigError(f"secure aggregation: the {name} must be an integer in 0..2^32-1, got {value!r}")
        ids = tuple(clients)
        if len(set(ids)) != len(ids):
            raise ConfigError("secure aggregation: the selected client ids repeat")
        for cid in ids:
            if not isinstance(cid, str) or not cid or len(cid.encode()) > MAX_ID_BYTES:
                raise ConfigError(f"secure aggregation: client ids must be 1..{MAX_ID_BYTES} UTF-8 bytes")
        self.params = config.resolve(len(ids))
        self.spec = tuple(spec)
        check_quantizable(self.spec)
        self.round = round
        self.attempt = attempt
        self.clients = ids
        self.graph_seed = graph_seed if graph_seed is not None else os.urandom(crypto.KEY_BYTES)
        self._index = {cid: i for i, cid in enumerate(ids)}
        graph = harary(len(ids), self.params.neighbours, self.graph_seed)
        self.neighbours: dict[str, frozenset[str]] = {
            ids[i]: frozenset(ids[j] for j in graph[i]) for i in range(len(ids))
        }
        self.length = vector_length(self.spec)
        self.stage = Stage.ADVERTISE_KEYS
        self.expected: frozenset[str] = frozenset()
        self._replied: set[str] = set()
        self._keys: dict[str, tuple[bytes, bytes]] = {}
        self._seen_keys: set[bytes] = set()
        self._advertised: frozenset[str] = frozenset()
        self._ciphertexts: dict[str, Mapping[str, bytes]] = {}
        self._shared: frozenset[str] = frozenset()
        self._sum: np.ndarray | None = None
        self._survivors: frozenset[str] = frozenset()
        self._requests: dict[str, UnmaskIns] = {}
        self._seed_shares: dict[str, dict[int, int]] = {}
        self._key_shares: dict[str, dict[int, int]] = {}
        self._result: SecAggResult | None = None

    @property
    def result(self) -> SecAggResult:
        """The round's result once the stage is DONE.

        Raises:
            RoundFailed: the round has not finished or was aborted.
        """
        if self._result is None:
            raise RoundFailed(
                f"secure aggregation: the round is at stage {self.stage.value}, it has no result",
                round=self.round,
                stage=self.stage.value,
            )
        return self._result

    def start(self) -> dict[str, ServerMessage]:
        """Stage 1's messages: the parameters, participants, graph seed and spec, to every selected client."""
        if self.stage is not Stage.ADVERTISE_KEYS or self.expected:
            raise self._failed("the round has already started")
        self.expected = frozenset(self.clients)
        message = AdvertiseKeysIns(
            round=self.round,
            params=self.params,
            participants=self.clients,
            graph_seed=self.graph_seed,
            spec=self.spec,
            attempt=self.attempt,
        )
        return dict.fromkeys(self.clients, message)

    # -- replies --------------------------------------------------------------------------------------------------

    def receive(self, reply: ClientMessage) -> None:
        """Take in one client's reply to the current stage, after checking it completely. The transport vouches
        that ``reply.client_id`` is the sender (an authenticated session); the server checks everything else.

        Raises:
            UpdateRejected: a reply of another round or stage, from a client not asked, a second reply, or one
                whose contents do not fit the protocol (sizes, peers); the server keeps nothing of it and the
                client counts as dropped out of this stage.
        """
        cid = reply.client_id
        if reply.round != self.round or reply.stage is not self.stage or cid not in self.expected:
            raise self._rejected("a reply of another round or stage, or from a client not asked in this stage", cid)
        if cid in self._replied:
            raise self._rejected("a second reply in the same stage", cid)
        if isinstance(reply, AdvertiseKeysRes):
            self._take_keys(reply)
        elif isinstance(reply, ShareKeysRes):
            self._take_ciphertexts(reply)
        elif isinstance(reply, MaskedInputRes):
            self._take_masked(reply)
        else:
            self._take_shares(reply)
        self._replied.add(cid)

    def _take_keys(self, reply: AdvertiseKeysRes) -> None:
        pair = (reply.encryption_key, reply.mask_key)
        if any(len(k) != crypto.KEY_BYTES for k in pair) or pair[0] == pair[1]:
            raise self._rejected("public keys must be two distinct 32-byte X25519 keys", reply.client_id)
        if self._seen_keys & set(pair):
            raise self._rejected("public keys already advertised by another client (replayed?)", reply.client_id)
        self._keys[reply.client_id] = pair
        self._seen_keys.update(pair)

    def _take_ciphertexts(self, reply: ShareKeysRes) -> None:
        cid = reply.client_id
        if set(reply.ciphertexts) != self.neighbours[cid] & self._advertised:
            raise self._rejected("the share ciphertexts are not addressed to exactly its neighbours", cid)
        if any(len(c) != CIPHERTEXT_BYTES for c in reply.ciphertexts.values()):
            raise self._rejected(f"a share ciphertext is not {CIPHERTEXT_BYTES} bytes", cid)
        self._ciphertexts[cid] = dict(reply.ciphertexts)

    def _take_masked(self, reply: MaskedInputRes) -> None:
        masked = reply.masked
        if not isinstance(masked, np.ndarray) or masked.dtype != self.params.dtype or masked.shape != (self.length,):
            raise self._rejected(
                f"the masked input must be {self.length} elements of {self.params.dtype.name} (field of "
                f"{self.params.field_bits} bits)",
                reply.client_id,
            )
        if self.params.field_bits < 8 * self.params.dtype.itemsize and bool(np.any(masked > self.params.modulus_mask)):
            raise self._rejected(
                f"the masked input holds values outside the field 2^{self.params.field_bits}", reply.client_id
            )
        if self._sum is None:
            self._sum = masked.astype(self.params.dtype, copy=True)
        else:
            np.add(self._sum, masked, out=self._sum)

    def _take_shares(self, reply: UnmaskRes) -> None:
        cid = reply.client_id
        request = self._requests[cid]
        if set(reply.seed_shares) != set(request.survivors) or set(reply.key_shares) != set(request.dropped):
            raise self._rejected("the unmask reply does not answer exactly the neighbours asked", cid)
        try:
            seeds = {owner: shamir.decode(s) for owner, s in reply.seed_shares.items()}
            keys = {owner: shamir.decode(s) for owner, s in reply.key_shares.items()}
        except ProtocolError as exc:
            raise self._rejected(f"a malformed share: {exc}", cid) from None
        x = self._index[cid] + 1
        for owner, value in seeds.items():
            self._seed_shares.setdefault(owner, {})[x] = value
        for owner, value in keys.items():
            self._key_shares.setdefault(owner, {})[x] = value

    # -- stage transitions ----------------------------------------------------------------------------------------

    def advance(self) -> dict[str, ServerMessage]:
        """Close the current stage (clients that did not reply are dropouts) and return the next stage's
        messages; after the unmask stage, compute :attr:`result` and return no messages.

        Raises:
            RoundFailed: too few clients or neighbours remain for the protocol to go on (or to unmask); the round
                is ABORTED and nothing is revealed.
        """
        if self.stage in (Stage.DONE, Stage.ABORTED) or not self.expected:
            raise self._failed(f"no stage to close (stage {self.stage.value})")
        alive = frozenset(self._replied)
        stage = self.stage
        self._replied = set()
        outbox: dict[str, ServerMessage]
        if stage is not Stage.UNMASK and len(alive) < max(2, self.params.threshold):
            raise self._abort(
                f"only {len(alive)} of {len(self.clients)} clients answered, fewer than max(2, threshold "
                f"{self.params.threshold}); a sum of fewer than 2 updates would reveal an update"
            )
        if stage is Stage.ADVERTISE_KEYS:
            self._advertised = alive
            self._require(alive, alive, "advertised keys")
            outbox = {
                cid: ShareKeysIns(
                    round=self.round, public_keys={p: self._keys[p] for p in self.neighbours[cid] & alive}
                )
                for cid in alive
            }
        elif stage is Stage.SHARE_KEYS:
            self._shared = alive
            self._require(alive, alive, "shared their keys")
            outbox = {
                cid: MaskedInputIns(
                    round=self.round,
                    ciphertexts={p: self._ciphertexts[p][cid] for p in self.neighbours[cid] & alive},
                )
                for cid in alive
            }
            self._ciphertexts = {}
        elif stage is Stage.COLLECT_MASKED_INPUT:
            self._survivors = alive
            self._require(self._shared, alive, "sent their masked input")
            dropped = self._shared - alive
            self._requests = {
                cid: UnmaskIns(
                    round=self.round,
                    survivors=self._ordered(self.neighbours[cid] & alive),
                    dropped=self._ordered(self.neighbours[cid] & dropped),
                )
                for cid in alive
            }
            outbox = dict(self._requests)
        else:
            self._unmask(alive)
            outbox = {}
        self.stage = _NEXT[stage]
        self.expected = frozenset(outbox)
        return outbox

    def _require(self, owners: frozenset[str], holders: frozenset[str], what: str) -> None:
        """Abort unless every client in ``owners`` has at least ``t`` neighbours in ``holders``."""
        t = self.params.threshold
        for cid in self._ordered(owners):
            count = len(self.neighbours[cid] & holders)
            if count < t:
                raise self._abort(
                    f"only {count} neighbours of client {cid[:64]!r} {what}, fewer than the threshold {t}; "
                    "its secrets could not be recovered"
                )

    def _unmask(self, answered: frozenset[str]) -> None:
        t = self.params.threshold
        dropped = self._shared - self._survivors
        seeds: dict[str, bytes] = {}
        keys: dict[str, bytes] = {}
        for owner, shares_of, out in (
            *((o, self._seed_shares, seeds) for o in self._ordered(self._survivors)),
            *((o, self._key_shares, keys) for o in self._ordered(dropped)),
        ):
            shares = {x: v for x, v in shares_of.get(owner, {}).items() if self.clients[x - 1] in answered}
            if len(shares) < t:
                raise self._abort(
                    f"only {len(shares)} neighbours of client {owner[:64]!r} answered the unmask stage, fewer than "
                    f"the threshold {t}"
                )
            try:
                out[owner] = shamir.combine(shares, t)
            except ProtocolError as exc:
                raise self._abort(f"the shares of client {owner[:64]!r} do not reconstruct its secret: {exc}") from None
        self._seed_shares, self._key_shares = {}, {}
        total = self._sum
        if total is None:
            raise self._abort("no masked input arrived")
        expander = crypto.MaskExpander(self.params.dtype)
        streams = [(expander.stream(seed), -1) for seed in seeds.values()]
        for owner, raw in keys.items():
            private = crypto.private_key(raw)
            if crypto.public_bytes(private) != self._keys[owner][1]:
                raise self._abort(f"the reconstructed mask key of client {owner[:64]!r} does not match its public key")
            for peer in self._ordered(self.neighbours[owner] & self._survivors):
                first, second = sorted((owner, peer), key=self._index.__getitem__)
                seed = crypto.agree(
                    private, self._keys[peer][1], PAIRWISE_MASK, crypto.context(self.round, self.attempt, first, second)
                )
                # the survivor added +mask toward a higher-numbered peer, -mask toward a lower one: undo it
                streams.append((expander.stream(seed), -1 if self._index[peer] < self._index[owner] else 1))
        expander.apply(total, streams)
        if self.params.field_bits < 8 * self.params.dtype.itemsize:
            total &= self.params.dtype.type(self.params.modulus_mask)
        self._sum = None
        weighted_sum, total_weight = dequantize(total, self.params, self.spec)
        self._result = SecAggResult(
            weighted_sum=weighted_sum,
            total_weight=total_weight,
            field_sum=total,
            survivors=self._ordered(self._survivors),
            dropped=self._ordered(dropped),
        )

    # -- helpers --------------------------------------------------------------------------------------------------

    def _ordered(self, ids: frozenset[str] | set[str]) -> tuple[str, ...]:
        return tuple(sorted(ids, key=self._index.__getitem__))

    def _rejected(self, text: str, client_id: str) -> UpdateRejected:
        return UpdateRejected(
            f"secure aggregation: {text}; the reply is ignored",
            round=self.round,
            client_id=client_id[:64],
            stage=self.stage.value,
        )

    def abort(self, reason: str) -> None:
        """Abort the round for ``reason`` (a rule above the protocol's, e.g. distributed DP's fewest noise shares):
        the running sum and the shares are dropped, nothing is revealed.

        Raises:
            RoundFailed: always, with ``reason``.
        """
        raise self._abort(reason)

    def _failed(self, text: str) -> RoundFailed:
        return RoundFailed(f"secure aggregation: {text}", round=self.round, stage=self.stage.value)

    def _abort(self, text: str) -> RoundFailed:
        stage = self.stage.value
        self.stage = Stage.ABORTED
        self.expected = frozenset()
        self._sum = None
        self._seed_shares, self._key_shares = {}, {}
        return RoundFailed(
            f"secure aggregation aborted, nothing is revealed: {text}. Select more clients, lower the threshold, "
            "or give clients more time",
            round=self.round,
            stage=stage,
        )
