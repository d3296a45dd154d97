"""A GPT-style decoder whose blocks declare their own tensor-parallel plan; the models fedcore's examples train.

- :class:`CausalSelfAttention`: separate ``q``, ``k``, ``v`` projections and an output projection ``proj``;
  attention through ``F.scaled_dot_product_attention`` (flash / memory-efficient kernels on CUDA).
- :class:`MLP`: ``fc`` (``d -> 4d``), GELU, ``proj`` (``4d -> d``).
- :class:`Block`: pre-norm residual block ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))`` (GPT-2, Radford et
  al. 2019).
- :func:`gpt`: token and position embeddings, ``layers`` blocks, final norm and a language-model head over every
  position, as an ``nn.Sequential`` so the engine can cut it at ``blocks.<k>``; the head's weight is tied to
  the token embedding as in GPT-2 (``tie_embeddings``).

Tensor parallelism follows Megatron-LM (Shoeybi et al. 2019, section 3): in attention, ``q``, ``k`` and ``v``
are split column-wise (each rank computes ``heads / tp`` whole heads) and ``proj`` row-wise (its partial sums are
all-reduced); in the MLP, ``fc`` column-wise and ``proj`` row-wise. One all-reduce per sub-block in the forward
pass, one in the backward. Each module states this in ``tensor_parallel_plan(degree)``, in names local to it,
and :func:`fedcore.engine.tensor_parallel.model_plan` collects them. The forward passes read the number of heads
from the local width, so the same code runs unsplit and split.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.nn import functional as F

from fedcore.errors import ConfigError


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: ``(B, T, d) -> (B, T, d)``.

    Args:
        d_model: model width ``d``; must be a multiple of ``heads``.
        heads: attention heads; the head width is ``d // heads``.

    Raises:
        ConfigError: ``d_model`` is not a multiple of ``heads``.
    """

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        if d_model % heads:
            raise ConfigError(f"d_model ({d_model}) must be a multiple of heads ({heads})")
        self.heads = heads
        self.head_dim = d_model // heads
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # under tensor parallelism q, k, v hold this rank's heads only: the width says how many
        q, k, v = (layer(x).view(b, t, -1, self.head_dim).transpose(1, 2) for layer in (self.q, self.k, self.v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(att.transpose(1, 2).reshape(b, t, -1))

    def tensor_parallel_plan(self, degree: int) -> dict[str, ParallelStyle]:
        """Heads split over ``degree`` ranks: ``q``/``k``/``v`` column-wise, ``proj`` row-wise (Megatron-LM).

        Raises:
            ConfigError: ``degree`` does not divide the number of heads.
        """
        if self.heads % degree:
            raise ConfigError(
                f"tensor_parallel={degree} does not divide the {self.heads} attention heads; choose a degree that "
                "divides them"
            )
        return {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "proj": RowwiseParallel()}


class MLP(nn.Module):
    """``proj(gelu(fc(x)))`` with a hidden width of ``4 * d_model``: ``(..., d) -> (..., d)``."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))

    def tensor_parallel_plan(self, degree: int) -> dict[str, ParallelStyle]:
        """Hidden units split over ``degree`` ranks: ``fc`` column-wise, ``proj`` row-wise (Megatron-LM)."""
        return {"fc": ColwiseParallel(), "proj": RowwiseParallel()}


class Block(nn.Module):
    """Pre-norm transformer block: ``(B, T, d) -> (B, T, d)``; the norms stay replicated under tensor parallelism."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TokenEmbedding(nn.Module):
    """Token plus learned position embedding: ``(B, T)`` int64 -> ``(B, T, d)``; ``T <= seq_len``."""

    def __init__(self, vocab: int, d_model: int, seq_len: int) -> None:
        super().__init__()
        self.token = nn.Embedding(vocab, d_model)
        self.position = nn.Parameter(torch.zeros(seq_len, d_model))
        nn.init.normal_(self.position, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.token(x) + self.position[: x.shape[1]]


class LMHead(nn.Module):
    """Final norm and next-token logits at every position: ``(B, T, d) -> (B, T, vocab)`` (no bias)."""

    def __init__(self, d_model: int, vocab: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def gpt(
    *,
    vocab: int = 50304,
    d_model: int = 768,
    layers: int = 12,
    heads: int = 12,
    seq_len: int = 1024,
    tie_embeddings: bool = True,
) -> nn.Sequential:
    """A GPT-2-style language model; pipeline layers ``embed, blocks.0 .. blocks.<layers-1>, head``.

    The defaults are GPT-2 small (124M parameters with the vocabulary padded to 50304, a multiple of 64, as
    nanoGPT does). Input ``(B, T)`` int64 token ids, output ``(B, T, vocab)`` logits; train it with
    :func:`lm_loss`. With ``tie_embeddings`` the head's weight is the token embedding (one tensor, named
    ``embed.token.weight`` in ``state_dict``); the engine then refuses FSDP2 and a pipeline split between them.
    """
    embed = TokenEmbedding(vocab, d_model, seq_len)
    nn.init.normal_(embed.token.weight, std=0.02)  # GPT-2's scale, which a tied head needs
    head = LMHead(d_model, vocab)
    if tie_embeddings:
        head.out.weight = embed.token.weight
    blocks = nn.Sequential(*(Block(d_model, heads) for _ in range(layers)))
    return nn.Sequential(OrderedDict(embed=embed, blocks=blocks, head=head))


def lm_loss(output: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross-entropy with a sample's loss the mean over its positions (the engine's contract).

    Args:
        output: logits ``(B, T, vocab)`` (under bf16 autocast, ``cross_entropy`` runs in float32 by autocast's
            rules, without an extra copy of the logits).
        target: token ids ``(B, T)`` int64.
        reduction: ``"mean"`` (over samples, equal to the mean over all tokens) or ``"sum"`` (over samples).
    """
    tokens = F.cross_entropy(output.flatten(0, 1), target.flatten(), reduction="sum")
    if reduction == "sum":
        return tokens / target.shape[1]
    return tokens / target.numel()


def flops_per_token(model: nn.Module, *, seq_len: int) -> float:
    """Training FLOPs per token of a model from :func:`gpt`: ``6 N + 12 L d T`` (PaLM, Chowdhery et al. 2022,
    appendix B; nanoGPT's ``estimate_mfu``), where ``N`` counts the weights used in matrix products (the blocks,
    the final norm and the head's ``vocab x d``; not the position table, whose lookup costs nothing).

    Args:
        model: a model built by :func:`gpt`.
        seq_len: tokens per sample ``T`` (attention's ``QK^T`` and ``AV`` grow with it).
    """
    blocks = [m for m in model.get_submodule("blocks").children() if isinstance(m, Block)]
    head = model.get_submodule("head")
    d_model = blocks[0].attn.q.in_features
    n = sum(p.numel() for block in blocks for p in block.parameters()) + sum(p.numel() for p in head.parameters())
    return 6.0 * n + 12.0 * len(blocks) * d_model * seq_len
