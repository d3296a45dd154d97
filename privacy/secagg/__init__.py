"""Secure aggregation: SecAgg+ (Bell et al. 2020, building on Bonawitz et al. 2017) as I/O-free state machines.

The server learns the weighted sum of the surviving clients' quantized updates and their total weight, and
nothing else about any one update, as long as it follows the protocol (honest but curious) and fewer than ``t``
of any client's ``k`` neighbours collude with it. Modules:

- :mod:`~privacy.secagg.config`: parameters (k, t, field bits, clipping, weights, levels) and the bit budget,
  validated before any client is contacted.
- :mod:`~privacy.secagg.graph`: the randomly permuted k-regular Harary graph of neighbours.
- :mod:`~privacy.secagg.shamir`: t-of-k Shamir sharing over GF(2^521 - 1).
- :mod:`~privacy.secagg.crypto`: X25519, HKDF-SHA256, AES-GCM, and the AES-CTR mask PRG (``cryptography``).
- :mod:`~privacy.secagg.quantize`: clipping, stochastic rounding, the weight folded in, and back.
- :mod:`~privacy.secagg.messages`: the four stages' typed messages and their size bounds.
- :mod:`~privacy.secagg.client`, :mod:`~privacy.secagg.server`: the two state machines.

What it does not protect against: a server that lies about who dropped out across several rounds or sends
different participant lists to different clients (the malicious-server variant needs the consistency-check
round and signatures of Bonawitz et al. §6, not implemented); what the sum itself reveals (with 2 clients, each
learns the other's update from the model; use differential privacy for that); clients that send arbitrary
values within the field (the sum is not robust to poisoning).
"""

from privacy.secagg.client import SecAggClient
from privacy.secagg.config import RoundParams, SecAggConfig, default_neighbours
from privacy.secagg.messages import (
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
from privacy.secagg.server import SecAggResult, SecAggServer

__all__ = [
    "AdvertiseKeysIns",
    "AdvertiseKeysRes",
    "ClientMessage",
    "MaskedInputIns",
    "MaskedInputRes",
    "RoundParams",
    "SecAggClient",
    "SecAggConfig",
    "SecAggResult",
    "SecAggServer",
    "ServerMessage",
    "ShareKeysIns",
    "ShareKeysRes",
    "Stage",
    "UnmaskIns",
    "UnmaskRes",
    "default_neighbours",
]
