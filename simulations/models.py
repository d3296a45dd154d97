"""The models of the papers fedcore's demos reproduce.

- :class:`CNN`: McMahan et al. 2017 ("Communication-Efficient Learning of Deep Networks from Decentralized
  Data"), section 3: conv5x5(32) - maxpool2 - conv5x5(64) - maxpool2 - fc512 - softmax; with 'same' padding on
  28x28 inputs it has 1,663,370 parameters (the paper's count).
- :class:`MLP2NN`: the same paper's "2NN": two hidden layers of 200 ReLU units (199,210 parameters on 784 inputs).
- :class:`LogisticRegression`: multinomial logistic regression, the FedProx Synthetic model (Li et al. 2020).

All return logits; the softmax is in the cross-entropy loss.
"""

from __future__ import annotations

import torch
from torch import nn

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


MODEL_NAMES = ("cnn", "2nn", "logreg")


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Build a model by name for inputs of ``input_shape`` (without the batch dimension).

    Raises:
        ConfigError: unknown name, or a CNN asked for non-image inputs.
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
    raise ConfigError(f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}")
