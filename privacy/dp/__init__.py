"""Client-level differential privacy for federated training: DP-FedAvg (McMahan et al. 2018) with fixed or
adaptive clipping (Andrew et al. 2021), in central or distributed mode, accounted with dp-accounting.

- :mod:`privacy.dp.mechanism`: clipping, Gaussian noise, adaptive clipping, noise shares (pure math).
- :mod:`privacy.dp.aggregator`: the server's aggregator (central: clip + noise; distributed: sum of shares).
- :mod:`privacy.dp.distributed`: the ``dp-clip`` client mod (clip + noise share on the client).
- :mod:`privacy.dp.accounting`: epsilon after r rounds (RDP or PLD).
- :mod:`privacy.dp.config`: the ``[privacy]`` table and :func:`~privacy.dp.config.apply_dp`.
"""
