"""The models of the papers fedcore's demos reproduce.

- :class:`CNN`: McMahan et al. 2017 ("Communication-Efficient Learning of Deep Networks from Decentralized
  Data"), section 3: conv5x5(32) - maxpool2 - conv5x5(64) - maxpool2 - fc512 - softmax; with 'same' padding on
  28x28 inputs it has 1,663,370 parameters (the paper's count).
- :class:`MLP2NN`: the same paper's "2NN": two hidden layers of 200 ReLU units (199,210 parameters on 784 inputs).
- :class:`LogisticRegression`: multinomial logistic regression, the FedProx Synthetic model (Li et al. 2020).
- :class:`CharLSTM`: LEAF's Shakespeare baseline (Caldas et al. 2018): an 8-dimensional character embedding, two
  LSTM layers of 256 units, and logits of the next character from the last position.
- :func:`char_transformer`: a small pre-norm character transformer (``nn.Sequential(embed, blocks, head)``, which
  the parallel engine can cut at ``blocks.<k>`` into pipeline stages).

All return logits; the softmax is in the cross-entropy loss.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from fedcore.engine.transformer import Block, TokenEmbedding
from fedcore.errors import ConfigError


class CNN(nn.Module):
    """FedAvg paper CNN for ``(N, C, H, W)`` float32 images (H, W divisible by 4); returns ``(N, classes)`` logits."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 28) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 32, kernel_size=5, padding=2)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=5, padding=2)
        self.pool = nn.MaxPool2d(2)
        side = image_size // 4
        self.fc1 = nn.Linear(64 * side * side, 512)
        self.fc2 = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        return self.fc2(torch.relu(self.fc1(x)))


class MLP2NN(nn.Module):
    """FedAvg paper 2NN: flatten - fc200 - ReLU - fc200 - ReLU - fc(classes). Input ``(N, ...)`` float32."""

    def __init__(self, num_inputs: int = 784, num_classes: int = 10, hidden: int = 200) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(num_inputs, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class LogisticRegression(nn.Module):
    """Multinomial logistic regression: ``(N, features)`` float32 -> ``(N, classes)`` logits."""

    def __init__(self, num_features: int = 60, num_classes: int = 10) -> None:
        super().__init__()
        self.linear = nn.Linear(num_features, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.flatten(x, 1))


class CharLSTM(nn.Module):
    """LEAF's Shakespeare model (Caldas et al. 2018): embed each character in ``embed_dim`` dimensions, two stacked
    LSTM layers of ``hidden`` units, a linear layer from the last position's output to ``vocab`` logits.

    Input ``(N, T)`` integer character ids in ``0..vocab-1``; output ``(N, vocab)`` float32 logits of the next
    character. With the defaults and a vocabulary of 76 it has 818,860 parameters.
    """

    def __init__(self, vocab: int, embed_dim: int = 8, hidden: int = 256, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, embed_dim)
        self.lstm = nn.LSTM(embed_dim, hidden, num_layers=layers, batch_first=True)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output, _ = self.lstm(self.embed(x))
        return self.out(output[:, -1])


class CharHead(nn.Module):
    """Final norm and logits of the next character after the last position: ``(B, T, d) -> (B, vocab)``."""

    def __init__(self, d_model: int, vocab: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x[:, -1]))


def char_transformer(vocab: int, seq_len: int, d_model: int = 64, layers: int = 4, heads: int = 4) -> nn.Sequential:
    """A pre-norm character transformer: ``(N, seq_len)`` integer ids -> ``(N, vocab)`` next-character logits.

    Token plus learned position embedding, ``layers`` :class:`fedcore.engine.transformer.Block` (causal
    self-attention with ``heads`` heads, MLP of 4 ``d_model``), final norm and a linear head on the last position.
    Built as ``nn.Sequential(embed, blocks, head)``, so a parallel plan can split it at ``blocks.<k>``; the blocks
    declare how tensor parallelism splits them. With the defaults and a vocabulary of 76 over 80 characters:
    214,988 parameters.
    """
    return nn.Sequential(
        OrderedDict(
            embed=TokenEmbedding(vocab, d_model, seq_len),
            blocks=nn.Sequential(*(Block(d_model, heads) for _ in range(layers))),
            head=CharHead(d_model, vocab),
        )
    )


MODEL_NAMES = ("cnn", "2nn", "logreg", "char-lstm", "char-transformer")
TEXT_MODELS = ("char-lstm", "char-transformer")
"""The models of character sequences (inputs are integer ids, ``input_shape = (seq_len,)``)."""


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Build a model by name for inputs of ``input_shape`` (without the batch dimension).

    For the text models (:data:`TEXT_MODELS`) ``input_shape`` is ``(seq_len,)`` and ``num_classes`` is the
    vocabulary, of the inputs and of the predicted next character alike.

    Raises:
        ConfigError: unknown name, a CNN asked for non-image inputs, or a text model for inputs that are not
            1-D sequences.
    """
    num_inputs = 1
    for d in input_shape:
        num_inputs *= d
    if name == "cnn":
        if len(input_shape) != 3 or input_shape[1] != input_shape[2] or input_shape[1] % 4:
            raise ConfigError(
                f"the CNN needs square (C, H, W) images with H divisible by 4, got {input_shape}; choose model 2nn or "
                "logreg for this dataset"
            )
        return CNN(in_channels=input_shape[0], num_classes=num_classes, image_size=input_shape[1])
    if name == "2nn":
        return MLP2NN(num_inputs=num_inputs, num_classes=num_classes)
    if name == "logreg":
        return LogisticRegression(num_features=num_inputs, num_classes=num_classes)
    if name in TEXT_MODELS:
        if len(input_shape) != 1:
            raise ConfigError(
                f"{name} reads sequences of character ids, shape (seq_len,), got {input_shape}; use it with the "
                "shakespeare dataset"
            )
        if name == "char-lstm":
            return CharLSTM(vocab=num_classes)
        return char_transformer(num_classes, input_shape[0])
    raise ConfigError(f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}")
