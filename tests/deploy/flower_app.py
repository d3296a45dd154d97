"""A Flower client app written the way Flower's quickstarts write one, untouched by fedcore: a ``NumPyClient``,
a ``client_fn(context)`` that reads ``context.node_config["partition-id"]`` and ``["num-partitions"]`` (no
``.get`` fallback) and ``context.run_config``, and ``app = ClientApp(client_fn=client_fn)``.

fedcore runs it through the two module-level factories at the end (``--task tests.deploy.flower_app:factory``).
"""

from __future__ import annotations

import numpy as np
from flwr.client import ClientApp, NumPyClient
from flwr.common import Context

from client.flower import flower_task_factory

FEATURES = 4
TOTAL = 120  # examples in the whole (synthetic) data set


def load_data(partition_id: int, num_partitions: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Partition ``partition_id`` of ``num_partitions`` equal IID shares, split 80/20 into train and test."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(TOTAL, FEATURES)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5, 0.0], np.float32) + 0.3).astype(np.float32)
    share = np.array_split(np.arange(TOTAL), num_partitions)[partition_id]
    cut = int(0.8 * len(share))
    return x[share[:cut]], y[share[:cut]], x[share[cut:]], y[share[cut:]]


class LinearClient(NumPyClient):
    """Least-squares linear regression by full-batch gradient descent: a weight vector and a 0-d bias."""

    def __init__(self, data: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], lr: float) -> None:
        self.x, self.y, self.x_test, self.y_test = data
        self.lr = lr

    def get_parameters(self, config):  # type: ignore[no-untyped-def]
        return [np.zeros(FEATURES, np.float32), np.array(0.0, np.float32)]

    def fit(self, parameters, config):  # type: ignore[no-untyped-def]
        w, b = parameters
        for _ in range(int(config["local_epochs"])):
            err = self.x @ w + b - self.y
            w = (w - self.lr * 2 * self.x.T @ err / len(self.y)).astype(np.float32)
            b = b - np.float32(self.lr) * np.float32(2 * err.mean())  # a 0-d array minus a scalar: a numpy scalar
        return [w, b], len(self.y), {}

    def evaluate(self, parameters, config):  # type: ignore[no-untyped-def]
        w, b = parameters
        mse = np.mean((self.x_test @ w + b - self.y_test) ** 2)
        return float(mse), len(self.y_test), {"mse": mse}


def client_fn(context: Context):  # type: ignore[no-untyped-def]
    partition_id = context.node_config["partition-id"]
    num_partitions = context.node_config["num-partitions"]
    lr = context.run_config["lr"]
    return LinearClient(load_data(int(partition_id), int(num_partitions)), float(lr)).to_client()


app = ClientApp(client_fn=client_fn)


def server_fn(context: Context):  # type: ignore[no-untyped-def]
    """A server-side client: evaluates the global model on the last 20 examples only."""
    x, y, _, _ = load_data(0, 1)
    return LinearClient((x, y, x[-20:], y[-20:]), 0.0)


def fedavg_by_hand(rounds: int, local_epochs: int, lr: float, num_partitions: int = 2) -> list[np.ndarray]:
    """The global model after ``rounds`` of FedAvg over equal partitions (equal weights: the plain mean of the
    clients' fits), computed with the client code alone; float64 sums cast back, as fedcore keeps the model."""
    w, b = np.zeros(FEATURES, np.float32), np.array(0.0, np.float32)
    for _ in range(rounds):
        fits = [LinearClient(load_data(i, num_partitions), lr).fit([w, b], {"local_epochs": local_epochs})[0]
                for i in range(num_partitions)]  # fmt: skip
        w = (sum(f[0].astype(np.float64) for f in fits) / num_partitions).astype(np.float32)
        b = np.array(sum(np.float64(f[1]) for f in fits) / num_partitions, np.float32)
    return [w, b]


# the server gets partition 0 of 1 (the whole data) unless it names its own client
factory = flower_task_factory(client_fn)
factory_with_server_fn = flower_task_factory(client_fn, server_fn=server_fn)
