"""The client side of one SecAgg+ round as an I/O-free state machine: a server message in, the reply out.

Follows Bonawitz et al. 2017 (Fig. 4, honest-but-curious variant, without the consistency-check round) on the
sharing graph of Bell et al. 2020: secrets are shared with, and pairwise masks agreed with, the client's ``k``
neighbours only. Stages, each refused out of order, for another round, or with peers outside the neighbourhood:

1. :meth:`SecAggClient.advertise_keys`: check the round's parameters, derive the graph, make two X25519 key pairs.
2. :meth:`SecAggClient.share_keys`: draw a self-mask seed, Shamir-share it and the mask secret key t-of-k among
   the neighbours that advertised, and encrypt each neighbour's shares to it (AES-GCM bound to round and ids).
3. :meth:`SecAggClient.masked_input`: decrypt and keep the shares received, quantize the update with the weight
   folded in, add the self mask and one pairwise mask per neighbour that shared (+ toward a higher-numbered
   neighbour, - toward a lower one), modulo ``2^b``. Its two halves, :meth:`SecAggClient.receive_shares` and
   :meth:`SecAggClient.mask`, may run apart (the shares can travel with the fit instruction, the masking run
   as a client mod on the fit result).
4. :meth:`SecAggClient.unmask`: reveal, per neighbour, the self-mask seed share if it survived or the mask-key
   share if it dropped out after sharing, never both; refused if fewer than ``t`` neighbours survived; a second
   unmask request is refused.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from fedcore.errors import ConfigError, ProtocolError
from fedcore.tensors import TensorSpec
from privacy.secagg import crypto, shamir
from privacy.secagg.config import RoundParams, SecAggConfig
from privacy.secagg.graph import harary
from privacy.secagg.messages import (
    CIPHERTEXT_BYTES,
    AdvertiseKeysIns,
    AdvertiseKeysRes,
    MaskedInputIns,
    MaskedInputRes,
    ServerMessage,
    ShareKeysIns,
    ShareKeysRes,
    Stage,
    UnmaskIns,
    UnmaskRes,
)
from privacy.secagg.quantize import quantize

SHARE_ENCRYPTION = b"share-encryption"
PAIRWISE_MASK = b"pairwise-mask"
STOCHASTIC_ROUNDING = b"stochastic-rounding"


def share_associated_data(round: int, attempt: int, sender: str, receiver: str) -> bytes:
    """AES-GCM associated data of the share ciphertext ``sender -> receiver`` in ``round``'s ``attempt``."""
    return b"share" + crypto.context(round, attempt, sender, receiver)


def rounding_key(seed: bytes, round: int, client_id: str) -> bytes:
    """The key of a client's stochastic-rounding dither in ``round``, derived from a 32-byte ``seed``."""
    return crypto.derive(seed, STOCHASTIC_ROUNDING, crypto.context(round, 0, client_id))


class SecAggClient:
    """One client's state in one SecAgg+ round (make a new one per round).

    Args:
        client_id: this client's id, as the server lists it among the participants.
        rounding_seed: 32 bytes from which the stochastic-rounding dither is derived (with round and client id),
            for reproducible runs; None: fresh bytes from the OS CSPRNG. Key pairs, the self-mask seed and the
            Shamir coefficients always come from the OS CSPRNG.

    Every method raises :class:`~fedcore.errors.ProtocolError` for a message it must refuse (another round, the
    wrong stage, a peer outside the neighbourhood, a tampered ciphertext, too few neighbours left to stay
    protected) and keeps nothing of it; the client then drops out of the round.
    """

    def __init__(self, client_id: str, *, rounding_seed: bytes | None = None) -> None:
        if rounding_seed is not None and len(rounding_seed) != crypto.KEY_BYTES:
            raise ConfigError(f"secure aggregation: the rounding seed has {crypto.KEY_BYTES} bytes")
        self.client_id = client_id
        self.stage = Stage.ADVERTISE_KEYS
        self._rounding_seed = rounding_seed if rounding_seed is not None else os.urandom(crypto.KEY_BYTES)
        self.round = -1
        self.attempt = 0
        self._params: RoundParams | None = None
        self._spec: tuple[TensorSpec, ...] = ()
        self._index: dict[str, int] = {}
        self._neighbours: frozenset[str] = frozenset()
        self._encryption_key: X25519PrivateKey | None = None
        self._mask_key: X25519PrivateKey | None = None
        self._seed = b""
        self._peer_keys: dict[str, tuple[bytes, bytes]] = {}
        self._share_keys: dict[str, bytes] = {}
        self._received: dict[str, tuple[int, int]] = {}

    # -- dispatch -------------------------------------------------------------------------------------------------

    def handle(
        self,
        message: ServerMessage,
        *,
        update: Mapping[str, np.ndarray] | None = None,
        weight: int | None = None,
        noise: np.ndarray | None = None,
    ) -> AdvertiseKeysRes | ShareKeysRes | MaskedInputRes | UnmaskRes:
        """Answer ``message`` with the method of its stage; ``update`` and ``weight`` (and ``noise``, optional:
        :meth:`mask`) are needed for stage 3."""
        if isinstance(message, AdvertiseKeysIns):
            return self.advertise_keys(message)
        if isinstance(message, ShareKeysIns):
            return self.share_keys(message)
        if isinstance(message, MaskedInputIns):
            if update is None or weight is None:
                raise ProtocolError(
                    "secure aggregation: the masked-input stage needs the client's update and weight",
                    round=message.round,
                    client_id=self.client_id,
                    stage=message.stage.value,
                )
            return self.masked_input(message, update, weight, noise)
        if isinstance(message, UnmaskIns):
            return self.unmask(message)
        raise self._error(f"a {type(message).__name__} is not a server message of this protocol")

    # -- stages ---------------------------------------------------------------------------------------------------

    def advertise_keys(self, message: AdvertiseKeysIns) -> AdvertiseKeysRes:
        """Stage 1: validate the round's parameters, derive the neighbours, answer with two fresh public keys."""
        self._expect(Stage.ADVERTISE_KEYS, message.stage, message.round, first=True)
        for name, value in (("round", message.round), ("attempt", message.attempt)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**32:
                raise self._error(f"the {name} must be an integer in 0..2^32-1, got {value!r}")
        params = message.params
        try:
            resolved = SecAggConfig(
                neighbours=params.neighbours,
                threshold=params.threshold,
                field_bits=params.field_bits,
                clip=params.clip,
                max_weight=params.max_weight,
                quantization_levels=params.levels,
            ).resolve(len(message.participants))
        except ConfigError as exc:
            raise self._error(f"the server's parameters are invalid: {exc.message}") from None
        if resolved != params:
            raise self._error("the server's parameters do not match the number of participants")
        if len(set(message.participants)) != len(message.participants) or self.client_id not in message.participants:
            raise self._error("the participant list repeats ids or does not name this client")
        try:
            graph = harary(params.num_clients, params.neighbours, message.graph_seed)
        except ConfigError as exc:
            raise self._error(f"the server's graph is invalid: {exc.message}") from None
        self.round = message.round
        self.attempt = message.attempt
        self._params = params
        self._spec = message.spec
        self._index = {cid: i for i, cid in enumerate(message.participants)}
        self._neighbours = frozenset(message.participants[j] for j in graph[self._index[self.client_id]])
        self._encryption_key = crypto.new_private_key()
        self._mask_key = crypto.new_private_key()
        self.stage = Stage.SHARE_KEYS
        return AdvertiseKeysRes(
            round=self.round,
            client_id=self.client_id,
            encryption_key=crypto.public_bytes(self._encryption_key),
            mask_key=crypto.public_bytes(self._mask_key),
        )

    def share_keys(self, message: ShareKeysIns) -> ShareKeysRes:
        """Stage 2: share the self-mask seed and the mask secret key t-of-k among the neighbours that advertised,
        each neighbour's two shares encrypted to it."""
        self._expect(Stage.SHARE_KEYS, message.stage, message.round)
        params, encryption_key, mask_key = self._state()
        peers = self._check_peers(message.public_keys)
        own = {crypto.public_bytes(encryption_key), crypto.public_bytes(mask_key)}
        keys = [key for pair in message.public_keys.values() for key in pair]
        if any(len(k) != crypto.KEY_BYTES for k in keys) or len(set(keys)) != len(keys) or own & set(keys):
            raise self._error("the neighbours' public keys are malformed or not all distinct")
        self._seed = os.urandom(crypto.KEY_BYTES)
        points = [self._index[p] + 1 for p in peers]
        seed_shares = shamir.split(self._seed, params.threshold, points)
        key_shares = shamir.split(crypto.private_bytes(mask_key), params.threshold, points)
        ciphertexts = {}
        for peer in peers:
            key = self._pair_key(encryption_key, message.public_keys[peer][0], SHARE_ENCRYPTION, peer)
            self._share_keys[peer] = key
            x = self._index[peer] + 1
            plaintext = shamir.encode(seed_shares[x]) + shamir.encode(key_shares[x])
            ciphertexts[peer] = crypto.encrypt(
                key, plaintext, share_associated_data(self.round, self.attempt, self.client_id, peer)
            )
        self._peer_keys = {p: message.public_keys[p] for p in peers}
        self.stage = Stage.COLLECT_MASKED_INPUT
        return ShareKeysRes(round=self.round, client_id=self.client_id, ciphertexts=ciphertexts)

    def masked_input(
        self,
        message: MaskedInputIns,
        update: Mapping[str, np.ndarray],
        weight: int,
        noise: np.ndarray | None = None,
    ) -> MaskedInputRes:
        """Stage 3: keep the neighbours' shares (:meth:`receive_shares`), answer with the masked upload
        (:meth:`mask`).

        Args:
            message: the ciphertexts of the neighbours that shared.
            update: ``name -> float array`` matching the round's spec.
            weight: integer example weight, ``0..max_weight``.
            noise: integer noise added after quantization (:meth:`mask`), or None.

        Raises:
            ProtocolError: as :meth:`receive_shares`.
            PayloadError, NonFiniteError, ConfigError: the update or weight cannot be quantized.
        """
        self.receive_shares(message)
        return self.mask(update, weight, noise)

    def receive_shares(self, message: MaskedInputIns) -> None:
        """First half of stage 3 (where the shares travel ahead of training, e.g. with the fit instruction):
        decrypt, check and keep the shares the neighbours sent; they fix whom the upload is masked with.

        Raises:
            ProtocolError: a ciphertext of the wrong size or that fails authentication (tampered, replayed from
                another round, redirected), a sender that is not a neighbour that advertised, fewer than ``t``
                senders, or shares received twice.
        """
        self._expect(Stage.COLLECT_MASKED_INPUT, message.stage, message.round)
        if self._received:
            raise self._error("the neighbours' shares arrived twice")
        senders = self._check_peers(message.ciphertexts, known=self._peer_keys)
        received = {}
        for sender in senders:
            ciphertext = message.ciphertexts[sender]
            if len(ciphertext) != CIPHERTEXT_BYTES:
                raise self._error(f"a share ciphertext has {len(ciphertext)} bytes, expected {CIPHERTEXT_BYTES}")
            try:
                plaintext = crypto.decrypt(
                    self._share_keys[sender],
                    ciphertext,
                    share_associated_data(self.round, self.attempt, sender, self.client_id),
                )
            except ProtocolError as exc:
                raise self._error(f"from neighbour {sender[:64]!r}: {exc.message}") from None
            received[sender] = (
                shamir.decode(plaintext[: shamir.SHARE_BYTES]),
                shamir.decode(plaintext[shamir.SHARE_BYTES :]),
            )
        self._received = received

    def mask(self, update: Mapping[str, np.ndarray], weight: int, noise: np.ndarray | None = None) -> MaskedInputRes:
        """Second half of stage 3: quantize ``update`` with ``weight`` folded in, add ``noise`` (if given) to the
        values, then the self mask and one pairwise mask per neighbour whose shares arrived (+ toward a
        higher-numbered one, - toward a lower one), all modulo ``2^b``.

        Args:
            update: ``name -> float array`` matching the round's spec.
            weight: integer example weight, ``0..max_weight``.
            noise: distributed DP's integer noise share (:mod:`privacy.dp.ddgauss`), int64 of the update's ``D``
                values, added modulo ``2^b`` after quantization (the weight element gets none).

        Raises:
            ProtocolError: the shares have not arrived (:meth:`receive_shares`).
            PayloadError, NonFiniteError, ConfigError: the update, weight or noise cannot be used.
        """
        if self.stage is not Stage.COLLECT_MASKED_INPUT or not self._received:
            raise self._error("the update can be masked only once, after the neighbours' shares arrived")
        params, _, mask_key = self._state()
        vector = quantize(
            update, weight, params, self._spec, rounding_key(self._rounding_seed, self.round, self.client_id)
        )
        if noise is not None:
            if noise.dtype != np.int64 or noise.shape != (vector.size - 1,):
                raise ConfigError(
                    f"secure aggregation: the noise must be {vector.size - 1} int64 values, got {noise.dtype} "
                    f"of shape {noise.shape}"
                )
            wide = vector[:-1].astype(np.uint64)
            wide += noise.view(np.uint64)  # two's complement: adding modulo 2^64, then reduced to 2^b
            vector[:-1] = (wide & np.uint64(params.modulus_mask)).astype(params.dtype)
        expander = crypto.MaskExpander(params.dtype)
        streams = [(expander.stream(self._seed), 1)]
        me = self._index[self.client_id]
        for peer in sorted(self._received, key=self._index.__getitem__):
            seed = self._pair_key(mask_key, self._peer_keys[peer][1], PAIRWISE_MASK, peer)
            streams.append((expander.stream(seed), 1 if me < self._index[peer] else -1))
        expander.apply(vector, streams)
        if params.field_bits < 8 * params.dtype.itemsize:
            vector &= params.dtype.type(params.modulus_mask)
        self.stage = Stage.UNMASK
        return MaskedInputRes(round=self.round, client_id=self.client_id, masked=vector)

    def unmask(self, message: UnmaskIns) -> UnmaskRes:
        """Stage 4: the self-mask seed share of each surviving neighbour and the mask-key share of each neighbour
        that dropped after sharing; refused if a neighbour is named both, or is not one whose shares this client
        holds, or if fewer than ``t`` of its neighbours survived."""
        self._expect(Stage.UNMASK, message.stage, message.round)
        params, _, _ = self._state()
        survivors, dropped = set(message.survivors), set(message.dropped)
        if len(survivors) != len(message.survivors) or len(dropped) != len(message.dropped):
            raise self._error("the unmask request repeats a neighbour")
        if survivors & dropped:
            raise self._error("the unmask request names a neighbour both survived and dropped; revealing nothing")
        unknown = (survivors | dropped) - self._received.keys()
        if unknown:
            raise self._error(
                f"the unmask request names {len(unknown)} client(s) whose shares this client does not hold"
            )
        if len(survivors) < params.threshold:
            raise self._error(
                f"only {len(survivors)} of this client's neighbours survived, fewer than the threshold "
                f"{params.threshold}; revealing nothing"
            )
        self.stage = Stage.DONE
        return UnmaskRes(
            round=self.round,
            client_id=self.client_id,
            seed_shares={p: shamir.encode(self._received[p][0]) for p in message.survivors},
            key_shares={p: shamir.encode(self._received[p][1]) for p in message.dropped},
        )

    # -- helpers --------------------------------------------------------------------------------------------------

    def _error(self, text: str) -> ProtocolError:
        return ProtocolError(
            f"secure aggregation: {text}",
            round=self.round if self.round >= 0 else None,
            client_id=self.client_id,
            stage=self.stage.value,
        )

    def _expect(self, stage: Stage, got: Stage, round: int, *, first: bool = False) -> None:
        if self.stage is not stage or got is not stage:
            raise self._error(f"a {got.value} message arrived while the client is at stage {self.stage.value}")
        if not first and round != self.round:
            raise self._error(f"a message of round {round} arrived in round {self.round} (replayed?)")

    def _state(self) -> tuple[RoundParams, X25519PrivateKey, X25519PrivateKey]:
        if self._params is None or self._encryption_key is None or self._mask_key is None:
            raise self._error("the round has not started")
        return self._params, self._encryption_key, self._mask_key

    def _check_peers(self, peers: Mapping[str, object], *, known: Mapping[str, object] | None = None) -> list[str]:
        """The peers named in ``peers`` (ordered by participant index), all neighbours (and in ``known``), at
        least ``t`` of them."""
        params, _, _ = self._state()
        outside = [p for p in peers if p not in self._neighbours or (known is not None and p not in known)]
        if outside:
            raise self._error(f"a message names {len(outside)} client(s) outside this client's neighbourhood")
        if len(peers) < params.threshold:
            raise self._error(
                f"only {len(peers)} neighbours remain, fewer than the threshold {params.threshold}; "
                "sharing with fewer would leave this client's secrets unrecoverable"
            )
        return sorted(peers, key=self._index.__getitem__)

    def _pair_key(self, key: X25519PrivateKey, peer_public: bytes, purpose: bytes, peer: str) -> bytes:
        first, second = sorted((self.client_id, peer), key=self._index.__getitem__)
        return crypto.agree(key, peer_public, purpose, crypto.context(self.round, self.attempt, first, second))
