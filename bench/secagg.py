"""Benchmark: one SecAgg+ round (privacy/secagg) against plain aggregation, on one machine, in memory.

    python bench/secagg.py                                   # 1M float32 params; n=10, n=50, n=50 with 10% dropout
    python bench/secagg.py --clients 100 --neighbours 15 --dropout 0 0.1   # the issue's setup (slower)

For each row, every client's update is a fresh random 1M-parameter float32 model; the round runs through
``privacy.secagg.inmemory.run_round`` (the client and server state machines passing messages by reference), and
the dropouts (a fraction of the clients) vanish after sharing keys, the costly case for the server (their
masks are rebuilt from neighbours' shares). Printed per row:

- client s: one client's compute per round, all four stages (mean over all selected clients, dropouts included,
  who skip the last stages);
- server s: the server's compute per round (receiving every reply, the running sum, unmasking, dequantizing),
  beside the plain streaming weighted mean (``fedcore.aggregation.WeightedMean``) of the same float32 updates;
- upload: bytes one client sends over the round (keys, share ciphertexts, masked vector, unmask shares)
  against the plain float32 update.

It also prints the mask PRG's rate (MaskExpander adding 16M uint32 elements into a vector) against the raw
AES-256-CTR keystream of ``cryptography`` written into a preallocated buffer of the same size (best of 5). One
core; times are wall seconds of the best of ``--repeat`` rounds. On a shared machine compare numbers only within
one run (the header prints the load average).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from fedcore.aggregation import WeightedMean
from fedcore.tensors import spec_of
from privacy.secagg import ClientMessage, SecAggConfig, Stage
from privacy.secagg.crypto import MaskExpander
from privacy.secagg.inmemory import run_round


def _updates(clients: int, params: int, seed: int) -> dict[str, tuple[dict[str, np.ndarray], int]]:
    rng = np.random.default_rng(seed)
    a = params * 3 // 4
    return {
        f"client-{i}": (
            {
                "fc1.weight": rng.uniform(-0.5, 0.5, a).astype(np.float32),
                "fc2.weight": rng.uniform(-0.5, 0.5, params - a).astype(np.float32),
            },
            int(rng.integers(1, 1000)),
        )
        for i in range(clients)
    }


def _row(clients: int, params: int, dropout: float, neighbours: int | None) -> dict[str, float]:
    updates = _updates(clients, params, seed=clients)
    spec = spec_of(next(iter(updates.values()))[0])
    config = SecAggConfig(neighbours=neighbours, clip=0.5, max_weight=1000)
    gone = {f"client-{i}" for i in range(round(dropout * clients))}
    sent: dict[str, int] = {}

    def count(reply: ClientMessage) -> None:
        sent[reply.client_id] = sent.get(reply.client_id, 0) + reply.payload_bytes()

    timings: dict[str, float] = {}
    result = run_round(
        config, updates, spec, dropouts={Stage.COLLECT_MASKED_INPUT: gone}, on_reply=count, timings=timings
    )
    client_s = sum(v for k, v in timings.items() if k.startswith("client:")) / clients
    server_s = sum(v for k, v in timings.items() if k.startswith("server:"))

    warm = WeightedMean(spec, threads=1)  # the fold kernels compile on first use: not part of a round
    warm.add(next(iter(updates.values()))[0], 1.0)
    warm.result()
    start = time.perf_counter()
    plain = WeightedMean(spec, threads=1)
    for cid, (update, weight) in updates.items():
        if cid not in gone:
            plain.add(update, weight)
    reference = plain.result()
    plain_s = time.perf_counter() - start

    secure = result.mean(spec)
    error = max(float(np.abs(secure[s.name] - reference[s.name]).max()) for s in spec)
    survivor = next(c for c in updates if c not in gone)
    return {
        "client_s": client_s,
        "server_s": server_s,
        "plain_server_s": plain_s,
        "upload": float(sent[survivor]),
        "plain_upload": float(sum(a.nbytes for a in updates[survivor][0].values())),
        "error": error,
        "bound": config.resolve(clients).error_bound,
        "neighbours": float(config.resolve(clients).neighbours),
    }


def _prg_rates(elements: int = 16 << 20) -> tuple[float, float]:
    seed = bytes(range(32))
    nbytes = elements * 4
    zeros = bytes(nbytes)
    buffer = bytearray(nbytes + 15)
    out = np.ones(elements, dtype="<u4")  # written already, as a client's quantized vector is
    best_raw = best_mask = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor().update_into(zeros, buffer)
        best_raw = min(best_raw, time.perf_counter() - start)
        expander = MaskExpander(np.dtype("<u4"))
        start = time.perf_counter()
        expander.apply(out, [(expander.stream(seed), 1)])
        best_mask = min(best_mask, time.perf_counter() - start)
    return nbytes / best_raw / 1e9, nbytes / best_mask / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 50])
    parser.add_argument("--params", type=int, default=1_000_000)
    parser.add_argument("--dropout", type=float, nargs="+", default=[0.0], help="fractions dropping after sharing")
    parser.add_argument("--extra-dropout-row", type=float, default=0.1, help="also run the largest n at this dropout")
    parser.add_argument("--neighbours", type=int, default=None, help="k (default: SecAggConfig's)")
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()

    print(f"load average before: {os.getloadavg()[0]:.2f}; {args.params:,} float32 parameters per client")
    rows = [(n, d) for n in args.clients for d in args.dropout]
    if args.extra_dropout_row and (max(args.clients), args.extra_dropout_row) not in rows:
        rows.append((max(args.clients), args.extra_dropout_row))
    header = (
        f"{'n':>4} {'k':>3} {'drop':>5} | {'client s':>8} | {'server s':>8} {'plain s':>8} {'ratio':>6} | "
        f"{'upload MB':>9} {'plain MB':>8} {'ratio':>6} | {'max err':>8} {'bound':>8}"
    )
    print(header)
    print("-" * len(header))
    for n, drop in rows:
        runs = [_row(n, args.params, drop, args.neighbours) for _ in range(args.repeat)]
        b = min(runs, key=lambda r: r["server_s"] + r["client_s"])
        print(
            f"{n:>4} {int(b['neighbours']):>3} {drop:>5.0%} | {b['client_s']:>8.3f} | "
            f"{b['server_s']:>8.3f} {b['plain_server_s']:>8.3f} {b['server_s'] / b['plain_server_s']:>6.1f} | "
            f"{b['upload'] / 1e6:>9.3f} {b['plain_upload'] / 1e6:>8.3f} {b['upload'] / b['plain_upload']:>6.3f} | "
            f"{b['error']:>8.1e} {b['bound']:>8.1e}",
            flush=True,
        )
    raw, mask = _prg_rates()
    print(
        f"mask PRG: {mask:.2f} GB/s added into a uint32 vector; raw AES-256-CTR keystream {raw:.2f} GB/s "
        f"({mask / raw:.0%} of raw)"
    )
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
