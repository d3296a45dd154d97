"""The typed messages of SecAgg+'s four stages (Bonawitz et al. 2017, Fig. 4; Bell et al. 2020), server to client
(``*Ins``) and client to server (``*Res``).

Every message carries the round; a client answers only messages of its round and stage, and the server keeps
only replies of the round from the clients it asked. Sizes are bounded by the round's parameters (k neighbours,
D coordinates): :meth:`payload_bytes` is what a message carries besides its fixed fields, and
:func:`max_payload_bytes` bounds it per stage (the tests hold every message to it). Wire encodings live at the
transport's edge, not here.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from fedcore.errors import ProtocolError
from fedcore.tensors import TensorSpec
from privacy.secagg.config import RoundParams
from privacy.secagg.crypto import KEY_BYTES, NONCE_BYTES, TAG_BYTES
from privacy.secagg.shamir import SHARE_BYTES

MAX_ID_BYTES = 128
"""Longest client id (UTF-8 bytes) a round accepts."""

SHARE_PLAINTEXT_BYTES = 2 * SHARE_BYTES
"""A decrypted share message: the self-mask seed share then the mask-key share."""

CIPHERTEXT_BYTES = NONCE_BYTES + SHARE_PLAINTEXT_BYTES + TAG_BYTES
"""Every share ciphertext has exactly this size (160 bytes)."""


class Stage(enum.Enum):
    """The stages of a SecAgg+ round, in order; DONE and ABORTED end it."""

    ADVERTISE_KEYS = "advertise_keys"
    SHARE_KEYS = "share_keys"
    COLLECT_MASKED_INPUT = "collect_masked_input"
    UNMASK = "unmask"
    DONE = "done"
    ABORTED = "aborted"


def _ids_bytes(ids: Mapping[str, object] | tuple[str, ...]) -> int:
    return sum(len(i.encode()) for i in ids)


@dataclass(frozen=True, slots=True)
class AdvertiseKeysIns:
    """Stage 1, server -> each selected client: the round's parameters, participants and graph.

    Attributes:
        round: the round number.
        params: the round's resolved parameters (the client re-validates them).
        participants: every selected client id, in the order that numbers them ``0..n-1`` (Shamir points are
            ``index + 1``).
        graph_seed: 32 public random bytes from which everyone derives the sharing graph.
        spec: names, shapes and dtypes of the tensors to aggregate, in upload order.
        attempt: the attempt of the round (a round that misses its quorum is tried again with a fresh
            selection); bound, with the round, into every key and ciphertext.
    """

    round: int
    params: RoundParams
    participants: tuple[str, ...]
    graph_seed: bytes
    spec: tuple[TensorSpec, ...]
    attempt: int = 1

    stage = Stage.ADVERTISE_KEYS

    def payload_bytes(self) -> int:
        """Bytes of participant ids and graph seed (the spec is the model's, known to both sides)."""
        return _ids_bytes(self.participants) + len(self.graph_seed)


@dataclass(frozen=True, slots=True)
class AdvertiseKeysRes:
    """Stage 1, client -> server: the client's two fresh X25519 public keys (raw, 32 bytes each).

    Attributes:
        encryption_key: agreed with a neighbour's to encrypt the shares sent between them.
        mask_key: agreed with a neighbour's to seed their pairwise mask.
    """

    round: int
    client_id: str
    encryption_key: bytes
    mask_key: bytes

    stage = Stage.ADVERTISE_KEYS

    def payload_bytes(self) -> int:
        """Bytes of the two keys."""
        return len(self.encryption_key) + len(self.mask_key)


@dataclass(frozen=True, slots=True)
class ShareKeysIns:
    """Stage 2, server -> each client that advertised: its neighbours' public keys.

    Attributes:
        public_keys: ``neighbour id -> (encryption_key, mask_key)`` for the neighbours that advertised.
    """

    round: int
    public_keys: Mapping[str, tuple[bytes, bytes]]

    stage = Stage.SHARE_KEYS

    def payload_bytes(self) -> int:
        """Bytes of ids and keys."""
        return _ids_bytes(self.public_keys) + 2 * KEY_BYTES * len(self.public_keys)


@dataclass(frozen=True, slots=True)
class ShareKeysRes:
    """Stage 2, client -> server: one AES-GCM ciphertext per neighbour holding that neighbour's shares of the
    client's self-mask seed and mask secret key (``CIPHERTEXT_BYTES`` each).

    Attributes:
        ciphertexts: ``receiver id -> ciphertext``.
    """

    round: int
    client_id: str
    ciphertexts: Mapping[str, bytes]

    stage = Stage.SHARE_KEYS

    def payload_bytes(self) -> int:
        """Bytes of ids and ciphertexts."""
        return _ids_bytes(self.ciphertexts) + sum(len(c) for c in self.ciphertexts.values())


@dataclass(frozen=True, slots=True)
class MaskedInputIns:
    """Stage 3, server -> each client that shared: the ciphertexts its neighbours addressed to it.

    Attributes:
        ciphertexts: ``sender id -> ciphertext``; the client masks with exactly these senders.
    """

    round: int
    ciphertexts: Mapping[str, bytes]

    stage = Stage.COLLECT_MASKED_INPUT

    def payload_bytes(self) -> int:
        """Bytes of ids and ciphertexts."""
        return _ids_bytes(self.ciphertexts) + sum(len(c) for c in self.ciphertexts.values())


@dataclass(frozen=True, slots=True)
class MaskedInputRes:
    """Stage 3, client -> server: the masked upload, ``D + 1`` field elements of the round's dtype.

    Attributes:
        masked: flat array of ``params.dtype`` (uint32 for b = 32): the weighted quantized update and the weight,
            plus the self mask and the pairwise masks, modulo ``2^b``.
    """

    round: int
    client_id: str
    masked: np.ndarray

    stage = Stage.COLLECT_MASKED_INPUT

    def payload_bytes(self) -> int:
        """Bytes of the masked vector."""
        return int(self.masked.nbytes)


@dataclass(frozen=True, slots=True)
class UnmaskIns:
    """Stage 4, server -> each client whose masked input arrived: which of its neighbours survived and which
    dropped after sharing.

    Attributes:
        survivors: neighbours whose masked input arrived; the client reveals their self-mask seed shares.
        dropped: neighbours that shared keys but sent no masked input; the client reveals their mask-key shares.
    """

    round: int
    survivors: tuple[str, ...]
    dropped: tuple[str, ...]

    stage = Stage.UNMASK

    def payload_bytes(self) -> int:
        """Bytes of the ids."""
        return _ids_bytes(self.survivors) + _ids_bytes(self.dropped)


@dataclass(frozen=True, slots=True)
class UnmaskRes:
    """Stage 4, client -> server: one kind of share per neighbour (``SHARE_BYTES`` each), never both.

    Attributes:
        seed_shares: ``survivor id -> share of its self-mask seed``.
        key_shares: ``dropped id -> share of its mask secret key``.
    """

    round: int
    client_id: str
    seed_shares: Mapping[str, bytes]
    key_shares: Mapping[str, bytes]

    stage = Stage.UNMASK

    def payload_bytes(self) -> int:
        """Bytes of ids and shares."""
        shares = [*self.seed_shares.values(), *self.key_shares.values()]
        return _ids_bytes(self.seed_shares) + _ids_bytes(self.key_shares) + sum(len(s) for s in shares)


ServerMessage = AdvertiseKeysIns | ShareKeysIns | MaskedInputIns | UnmaskIns
ClientMessage = AdvertiseKeysRes | ShareKeysRes | MaskedInputRes | UnmaskRes


def max_payload_bytes(stage: Stage, params: RoundParams, vector_length: int, *, from_server: bool) -> int:
    """The most :meth:`payload_bytes` a message of ``stage`` can carry in a round of ``params`` whose uploads
    have ``vector_length`` elements (client ids of at most ``MAX_ID_BYTES``)."""
    k, n = params.neighbours, params.num_clients
    if stage is Stage.ADVERTISE_KEYS:
        return n * MAX_ID_BYTES + KEY_BYTES if from_server else 2 * KEY_BYTES
    if stage is Stage.SHARE_KEYS:
        return k * (MAX_ID_BYTES + (2 * KEY_BYTES if from_server else CIPHERTEXT_BYTES))
    if stage is Stage.COLLECT_MASKED_INPUT:
        return k * (MAX_ID_BYTES + CIPHERTEXT_BYTES) if from_server else vector_length * params.dtype.itemsize
    if stage is Stage.UNMASK:
        return k * MAX_ID_BYTES if from_server else k * (MAX_ID_BYTES + SHARE_BYTES)
    raise ProtocolError(f"secure aggregation: stage {stage.value} carries no messages")
