"""The built-in tasks: useful at first launch, with no download."""

from __future__ import annotations

import torch
from multilane.engine.tasks.base import ArrayData, Task
from multilane.engine.tasks.causal_lm import CausalLMTask
from multilane.engine.tasks.charlm import CharLMTask
from multilane.engine.tasks.digits_file import load_digits
from multilane.engine.tasks.imagefolder import ImageFolderTask
from pydantic import BaseModel, ConfigDict, Field
from torch import nn
from torch.nn import functional as F


class _Params(BaseModel):
    model_config = ConfigDict(extra="forbid")


def accuracy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output.argmax(dim=-1) == target).float().mean()


class LinearParams(_Params):
    samples: int = Field(1000, ge=2, le=10_000_000, description="Number of synthetic samples")
    noise: float = Field(0.1, ge=0.0, description="Standard deviation of the noise added to y")
    data_seed: int = Field(0, ge=0, description="Seed of the synthetic data")


class LinearTask(Task):
    """The seed article's example: Linear(10, 1) with MSE, on y = Xw + b + noise."""

    name = "linear"
    description = "Linear(10, 1) regression on synthetic y = Xw + noise (the seed article's model)"
    Params = LinearParams
    metric = "r2"

    def build_model(self) -> nn.Module:
        return nn.Linear(10, 1)

    def data(self) -> ArrayData:
        p = self.params
        g = torch.Generator().manual_seed(p.data_seed)
        x = torch.randn(p.samples, 10, generator=g)
        w = torch.randn(10, 1, generator=g)
        y = x @ w + 0.5 + p.noise * torch.randn(p.samples, 1, generator=g)
        return ArrayData(x, y)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output, target)

    def metrics(self, output: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        residual = ((output - target) ** 2).sum()
        total = ((target - target.mean()) ** 2).sum().clamp_min(1e-12)
        return {"r2": 1 - residual / total, "rmse": F.mse_loss(output, target).sqrt()}


class DigitsParams(_Params):
    channels: int = Field(16, ge=1, le=512, description="Channels of the first convolution (the second has twice)")
    hidden: int = Field(64, ge=1, le=4096, description="Width of the hidden fully connected layer")


class DigitsNet(nn.Module):
    def __init__(self, channels: int, hidden: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(2 * channels * 16, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class DigitsTask(Task):
    """A small CNN on the 1,797 8×8 handwritten digits that ship inside scikit-learn."""

    name = "digits"
    description = "Small CNN on scikit-learn's 8×8 handwritten digits (1,797 real images), accuracy"
    Params = DigitsParams
    metric = "accuracy"

    def build_model(self) -> nn.Module:
        return DigitsNet(self.params.channels, self.params.hidden)

    def data(self) -> ArrayData:
        images, labels = load_digits()
        x = torch.tensor(images, dtype=torch.float32).unsqueeze(1) / 16.0
        return ArrayData(x, torch.tensor(labels, dtype=torch.long))

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, target)

    def metrics(self, output: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"accuracy": accuracy(output, target)}


class MlpParams(_Params):
    features: int = Field(64, ge=1, le=65536, description="Input features")
    width: int = Field(256, ge=1, le=65536, description="Hidden width (raise it to keep big GPUs busy)")
    depth: int = Field(3, ge=1, le=64, description="Hidden layers")
    classes: int = Field(10, ge=2, le=100_000, description="Output classes")
    samples: int = Field(8192, ge=2, le=100_000_000, description="Number of synthetic samples")
    data_seed: int = Field(0, ge=0, description="Seed of the synthetic data and its teacher network")


def mlp(features: int, width: int, depth: int, classes: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    d = features
    for _ in range(depth):
        layers += [nn.Linear(d, width), nn.GELU()]
        d = width
    layers.append(nn.Linear(d, classes))
    return nn.Sequential(*layers)


class MlpTask(Task):
    """Synthetic classification labelled by a random teacher network; scale width and depth at will."""

    name = "mlp"
    description = "MLP on synthetic data labelled by a random teacher; width and depth scale (benchmarks)"
    Params = MlpParams
    metric = "accuracy"

    def build_model(self) -> nn.Module:
        p = self.params
        return mlp(p.features, p.width, p.depth, p.classes)

    def data(self) -> ArrayData:
        p = self.params
        g = torch.Generator().manual_seed(p.data_seed)
        x = torch.randn(p.samples, p.features, generator=g)
        teacher = nn.Linear(p.features, p.classes)
        with torch.no_grad():
            teacher.weight.copy_(torch.randn(p.classes, p.features, generator=g))
            teacher.bias.zero_()
            y = teacher(x).argmax(dim=-1)
        return ArrayData(x, y)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, target)

    def metrics(self, output: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"accuracy": accuracy(output, target)}


BUILTIN_TASKS: dict[str, type[Task]] = {
    t.name: t for t in (DigitsTask, LinearTask, MlpTask, CharLMTask, ImageFolderTask, CausalLMTask)
}
