"""Secure aggregation with real `fedcore client start` daemons: fresh processes load the SecAgg+ client side on
the first stage message, mask their updates, and the rounds give the in-memory simulation's model bit for bit;
with distributed DP and adaptive clipping (`fedcore server start` and TLS daemons) the model is the simulation's
within the noise both runs add, and the history carries the accountant's epsilon."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from fedcore.strategy import SamplingConfig, Strategy, StrategyConfig, build_strategy
from fedcore.task import FitConfig
from privacy.dp.accounting import epsilon
from privacy.dp.config import PrivacyConfig
from privacy.secagg.config import SecAggConfig
from privacy.tls import init_certs
from server.grpc_pool import GrpcClientPool, PoolConfig
from server.round_loop import RoundConfig, run_rounds
from server.service import AuthPolicy, CoordinatorService, build_server
from server.state import load_checkpoint
from simulations.config import DataConfig, ModelConfig, OutputConfig, SimulationConfig
from simulations.harness import client_ids, run_simulation, task_options
from simulations.inmemory import InMemoryPool
from tests.e2e.deploy_helpers import Proc, read_tokens, tls_client_args, tls_server_args
from tests.privacy.secagg.test_rounds import FIT, IDS, SECAGG, SEED, make_task, start_state

pytestmark = pytest.mark.slow

ROUNDS = 2


def secure() -> Strategy:  # every round waits for all four daemons
    config = StrategyConfig(secure_aggregation=True, secagg=SECAGG)
    return build_strategy(config, FIT, SamplingConfig(fraction_fit=1.0, min_fit_clients=len(IDS)))


def _client_args(port: int, client_id: str) -> list[str]:
    return [
        "-v", "client", "start", "--insecure", "--server", f"127.0.0.1:{port}", "--client-id", client_id,
        "--task", "tests.privacy.secagg.test_rounds:task_factory", "--poll-s", "1", "--backoff-max-s", "1",
        "--give-up-after-s", "60",
    ]  # fmt: skip


def test_secure_rounds_with_daemon_processes_equal_the_simulation_bit_for_bit(tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the daemons (OMP_NUM_THREADS=1)
    try:
        want, _ = run_rounds(
            InMemoryPool(IDS, make_task), secure(), start_state(secure()), RoundConfig(num_rounds=ROUNDS, seed=SEED)
        )
    finally:
        torch.set_num_threads(threads)
    pool = GrpcClientPool(
        PoolConfig(spill_dir=tmp_path / "spill", seed=SEED, heartbeat_interval_s=0.5, liveness_timeout_s=10.0)
    )
    server, port = build_server(
        CoordinatorService(pool, AuthPolicy()), "127.0.0.1:0", credentials=None, max_workers=32, chunk_bytes=1 << 20
    )
    server.start()
    daemons = [Proc(cid, _client_args(port, cid), tmp_path) for cid in IDS]
    try:
        strategy = secure()
        config = RoundConfig(num_rounds=ROUNDS, seed=SEED, round_timeout_s=60, wait_for_clients_s=300)
        got, records = run_rounds(pool, strategy, start_state(strategy), config)
        pool.finish()
        for daemon in daemons:
            assert daemon.wait(120) == 0, daemon.text()[-3000:]
    finally:
        for daemon in daemons:
            daemon.close()
        server.stop(0)
        pool.close()
    assert [sorted(r.accepted) for r in records] == [IDS] * ROUNDS
    for name in want.parameters:
        np.testing.assert_array_equal(got.parameters[name], want.parameters[name], err_msg=name)


# -- distributed DP under SecAgg+: `fedcore server start` and `fedcore client start` with TLS -----------------------

DP_ROUNDS = 2
DP_SEED = 7
Z, SIGMA_B, C0, CLIP = 0.02, 0.05, 0.5, 1.0  # z_delta = (0.02^-2 - 0.1^-2)^(-1/2) = 0.020412 on the update


def _dp_config(out: Path) -> SimulationConfig:
    return SimulationConfig(
        seed=DP_SEED,
        rounds=DP_ROUNDS,
        evaluate_every=DP_ROUNDS,
        data=DataConfig(dataset="digits", num_clients=len(DP_IDS), partition="iid"),
        model=ModelConfig(name="logreg"),
        strategy=StrategyConfig(name="fedavg", secure_aggregation=True, secagg=SecAggConfig(clip=CLIP, max_weight=1)),
        sampling=SamplingConfig(fraction_fit=1.0, min_fit_clients=len(DP_IDS)),
        train=FitConfig(local_epochs=1, batch_size=32, lr=0.1),
        privacy=PrivacyConfig(
            dp="distributed",
            clipping_norm=C0,
            noise_multiplier=Z,
            adaptive_clipping=True,
            clipped_count_stddev=SIGMA_B,
            population=len(DP_IDS),
        ),
        output=OutputConfig(dir=out, progress=False, plot=False),
    )


DP_IDS = client_ids(3)
DP_FLAGS = [
    "--seed", str(DP_SEED), "--rounds", str(DP_ROUNDS), "--fraction-fit", "1.0", "--min-fit-clients", "3",
    "--epochs", "1", "--batch-size", "32", "--lr", "0.1", "--no-evaluate",
    "--secure-aggregation", "--clip", str(CLIP), "--max-weight", "1",
    "--dp", "distributed", "--clipping-norm", str(C0), "--noise-multiplier", str(Z), "--adaptive-clipping",
    "--clipped-count-stddev", str(SIGMA_B), "--population", "3",
]  # fmt: skip


def test_distributed_dp_with_adaptive_clipping_over_tls_daemons_equals_the_simulation_within_its_noise(
    tmp_path: Path,
) -> None:
    """`fedcore server start --secure-aggregation --dp distributed --adaptive-clipping` with three TLS daemons.

    The DP noise comes from the OS's entropy on every client, so two runs of one recipe differ by exactly their
    noise: per coordinate, the difference of two independent sums of discrete Gaussian shares of standard
    deviation ``dp_noise_std`` (on the average) per round, ``sqrt(sum_r s_sim,r^2 + s_grpc,r^2)`` in all (the
    stated bound; adaptive clipping's C differs between the runs only through the count's noise, ~0.3% here, and
    the second round's training from models ~0.007 apart adds ~2%, measured). The updates are clipped to C ~ 0.5
    and the noise is z_delta C / m ~ 0.0034 on the average, so a run that lost, doubled or failed to clip updates
    would be far outside the bound (measured with 4 clients: a plain FedAvg run's model is 0.037 away, per
    coordinate std, 7x that bound; a run here: std 0.97x the bound, largest difference 2.9x).
    """
    config = _dp_config(tmp_path / "simulation")
    certs = tmp_path / "certs"
    init_certs(certs, clients=DP_IDS)  # what `fedcore certs init` writes (test_deploy_security runs the command)
    tokens = read_tokens(certs)
    options = task_options(config)
    state = tmp_path / "state"
    server = Proc("server", tls_server_args(0, state, certs, options, *DP_FLAGS, verbose=False), tmp_path)
    daemons: list[Proc] = []
    try:
        port = server.listening_port()
        daemons = [
            Proc(cid, tls_client_args(port, cid, i, len(DP_IDS), certs, tokens[cid], options), tmp_path)
            for i, cid in enumerate(DP_IDS)
        ]
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as the daemons (OMP_NUM_THREADS=1); while they start
        try:
            simulated = run_simulation(config, echo=lambda _: None)
        finally:
            torch.set_num_threads(threads)
        assert server.wait(150) == 0, server.text()[-4000:]
        for daemon in daemons:
            assert daemon.wait(30) == 0, daemon.text()[-3000:]
    finally:
        for proc in [server, *daemons]:
            proc.close()
    with (state / "history.csv").open() as fh:
        history = [row for row in csv.DictReader(fh) if int(row["round"]) > 0]
    assert [int(r["round"]) for r in history] == [1, 2] and [int(r["clients"]) for r in history] == [3, 3]
    # epsilon in the history is dp-accounting's for the settings (q = 3 / 3, z = 0.02, delta 1e-5), round by round
    for row in history:
        assert float(row["epsilon"]) == epsilon(
            noise_multiplier=Z, sampling_rate=1.0, rounds=int(row["round"]), delta=1e-5
        )
    # adaptive clipping stepped from the noisy count the secure sum revealed (gamma 0.5, eta 0.2, m 3)
    first = history[0]
    assert float(first["dp_clipping_norm"]) == C0
    assert float(history[1]["dp_clipping_norm"]) == pytest.approx(
        C0 * math.exp(-0.2 * (float(first["dp_unclipped"]) / 3 - 0.5)), rel=1e-12
    )
    final = load_checkpoint(state / "checkpoints" / f"round-{DP_ROUNDS:06d}.safetensors")
    assert final.aggregator_state["dp_clipping_norm"] > 0
    want = simulated.final.parameters
    assert list(final.parameters) == list(want)
    diff = np.concatenate([(final.parameters[n].astype(np.float64) - want[n]).ravel() for n in want])
    noise = [float(row["dp_noise_std"]) for row in history] + [
        float(s) for s in simulated.history["dp_noise_std"][simulated.history["round"] > 0]
    ]
    bound = math.sqrt(sum(s * s for s in noise))
    # each round's noise on the average: 3 shares of z_delta (C + sqrt(D) 2c / L) / sqrt(3), over m = 3, i.e.
    # z_delta C / 3 = 0.0034 at C = 0.5; four such terms (two rounds, two runs) with C ~ 0.5..0.55
    assert 0.0066 < bound < 0.0076
    assert diff.std() == pytest.approx(bound, rel=0.15)  # 650 values: the std within ~3% (one sigma)
    assert np.abs(diff).max() < 6 * bound
    assert abs(diff.mean()) < 5 * bound / math.sqrt(diff.size)  # OS-entropy noise: 5 sigma, ~1e-6 false failures
