"""The networks the ``gan`` and ``ema`` recipes pick from the data's shape (``model.network``: ``auto``, ``mlp``,
``conv``), with their widths as config keys.

* ``mlp``: the digits networks, on the flattened pixels; any image shape.
* ``conv``: DCGAN's generator and discriminator (Radford et al., 2016; the PyTorch examples' ``dcgan``), a small
  strided CNN classifier; square images whose side is 4, 5, 6 or 7 times a power of two, 16 or more (16, 20, 24,
  28, 32, 40, 48, 56, 64, 80, ...). DCGAN's networks start (or end) at a ``start`` x ``start`` side, ``start`` =
  side / 2**k between 4 and 7, doubled (halved) k times; at 64 that is DCGAN's 4x4 and 4 doublings, layer for layer.
* ``auto``: ``conv`` where the images allow it, ``mlp`` otherwise (the 8x8 digits).

Every image tensor here is ``(N, C, H, W)``; a batch of flat pixels (the digits loader's ``(N, 64)``) is viewed in
that shape first. No network here copies its input: ``flatten``, ``unflatten`` and ``view`` share storage.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import pairwise

import torch
from torch import nn

__all__ = [
    "NETWORKS",
    "ConvClassifier",
    "ConvDiscriminator",
    "ConvGenerator",
    "MLPClassifier",
    "MLPDiscriminator",
    "MLPGenerator",
    "dcgan_init",
    "has_batch_norm",
    "image_shape_of",
    "conv_sides_near",
    "pick_network",
]

NETWORKS = ("auto", "mlp", "conv")
ImageShape = tuple[int, int, int]


def image_shape_of(image_shape: Sequence[int] | None) -> ImageShape:
    """``image_shape`` as a tuple ``(channels, height, width)``; ``ValueError`` naming ``model.image_shape`` when it is
    missing or of another length (``train.py`` fills it from the data module; a model built by hand passes it)."""
    if image_shape is None or len(image_shape) != 3:
        raise ValueError(
            f"model.image_shape must be (channels, height, width), got {image_shape}: train.py fills it from the "
            "data module; pass it when you build the model yourself"
        )
    channels, height, width = image_shape
    return channels, height, width


def pick_network(network: str, image_shape: ImageShape) -> str:
    """``mlp`` or ``conv`` for ``model.network`` and images of ``image_shape``; ``ValueError`` naming the key when
    ``conv`` is asked of images it cannot take."""
    if network not in NETWORKS:
        raise ValueError(f"model.network must be one of {', '.join(NETWORKS)}, got {network!r}")
    fits = _conv_plan(image_shape) is not None
    if network == "auto":
        return "conv" if fits else "mlp"
    if network == "conv" and not fits:
        _, height, width = image_shape
        sides = " or ".join(str(side) for side in conv_sides_near(min(height, width)))
        raise ValueError(
            f"model.network=conv needs square images whose side is 4, 5, 6 or 7 times a power of two, 16 or more "
            f"(16, 20, 24, 28, 32, 40, 48, 56, 64, 80, ...); the data's are {height}x{width}: use model.network=mlp, "
            f"or, with data=images, data.image_size={sides} data.resize=true"
        )
    return network


def _conv_plan(image_shape: ImageShape) -> tuple[int, int] | None:
    """``(start, stages)``: the side is ``start * 2**stages`` with ``start`` in 4..7 and ``stages`` >= 2, the times
    DCGAN's networks double (halve) the side from (down to) ``start`` x ``start``; ``None`` for images they cannot
    take (not square, or another side)."""
    _, height, width = image_shape
    stages = max(height.bit_length() - 3, 0)  # 4 <= height / 2**stages < 8
    if height != width or stages < 2 or height % 2**stages:
        return None
    return height >> stages, stages


def conv_sides_near(side: int) -> list[int]:
    """The sides the convolutional networks take nearest ``side``: ``side`` itself if they take it, else the largest
    below and the smallest above it (16 alone below 16)."""
    if _conv_plan((1, side, side)):
        return [side]
    below = [s for s in range(16, side) if _conv_plan((1, s, s))]
    above = next(s for s in range(max(side + 1, 16), 2 * side + 17) if _conv_plan((1, s, s)))
    return [below[-1], above] if below else [above]


def _plan(image_shape: ImageShape) -> tuple[int, int]:
    plan = _conv_plan(image_shape)
    if plan is None:
        raise ValueError(
            "the convolutional networks need a square image whose side is 4, 5, 6 or 7 times a power of two, 16 or "
            f"more, got {image_shape}"
        )
    return plan


def has_batch_norm(module: nn.Module) -> bool:
    """Whether a forward of ``module`` in training mode normalises with statistics of the batch it is given."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())


def dcgan_init(module: nn.Module) -> None:
    """DCGAN's initialisation: convolution weights from N(0, 0.02), BatchNorm scales from N(1, 0.02), zero shifts."""
    for m in module.modules():
        if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)):
            nn.init.normal_(m.weight, 0.0, 0.02)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.normal_(m.weight, 1.0, 0.02)
            nn.init.zeros_(m.bias)


class MLPGenerator(nn.Module):
    """Latent vectors to images through two hidden layers of ``hidden`` units; ``tanh`` output in [-1, 1]."""

    def __init__(self, latent: int, hidden: int, image_shape: ImageShape) -> None:
        super().__init__()
        self.image_shape = tuple(image_shape)
        self.net = nn.Sequential(
            nn.Linear(latent, hidden), nn.LeakyReLU(0.2), nn.Linear(hidden, hidden), nn.LeakyReLU(0.2),
            nn.Linear(hidden, math.prod(image_shape)), nn.Tanh(),
        )  # fmt: skip

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(z).unflatten(1, self.image_shape)


class MLPDiscriminator(nn.Module):
    """Images to one logit each, through two hidden layers of ``hidden`` units with dropout."""

    def __init__(self, image_shape: ImageShape, hidden: int, dropout: float) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(math.prod(image_shape), hidden), nn.LeakyReLU(0.2), nn.Dropout(dropout),
            nn.Linear(hidden, hidden), nn.LeakyReLU(0.2), nn.Dropout(dropout),
            nn.Linear(hidden, 1),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.flatten(1)).squeeze(1)


class ConvGenerator(nn.Module):
    """DCGAN's generator: a transposed convolution to ``start`` x ``start`` (4x4 for a power-of-two side, 6x6 for 48),
    then one doubling of the side per stage (BatchNorm, ReLU), ``width`` channels next to the image, ``tanh`` output
    in [-1, 1]."""

    def __init__(self, latent: int, width: int, image_shape: ImageShape) -> None:
        super().__init__()
        start, stages = _plan(image_shape)
        channels = [width * 2**i for i in reversed(range(stages))]  # 64x64 and width 64: 512, 256, 128, 64
        layers: list[nn.Module] = [
            nn.ConvTranspose2d(latent, channels[0], start, 1, 0, bias=False), nn.BatchNorm2d(channels[0]),
            nn.ReLU(True),
        ]  # fmt: skip
        for c_in, c_out in pairwise(channels):
            layers += [nn.ConvTranspose2d(c_in, c_out, 4, 2, 1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(True)]
        layers += [nn.ConvTranspose2d(channels[-1], image_shape[0], 4, 2, 1, bias=False), nn.Tanh()]
        self.net = nn.Sequential(*layers)
        dcgan_init(self)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(z[:, :, None, None])


class ConvDiscriminator(nn.Module):
    """DCGAN's discriminator: strided convolutions halving the side down to ``start`` x ``start`` (BatchNorm after all
    but the first, LeakyReLU), ``width`` channels next to the image, then one ``start`` x ``start`` convolution to a
    logit."""

    def __init__(self, image_shape: ImageShape, width: int) -> None:
        super().__init__()
        start, stages = _plan(image_shape)
        channels = [width * 2**i for i in range(stages)]
        layers: list[nn.Module] = [nn.Conv2d(image_shape[0], channels[0], 4, 2, 1, bias=False), nn.LeakyReLU(0.2, True)]
        for c_in, c_out in pairwise(channels):
            layers += [nn.Conv2d(c_in, c_out, 4, 2, 1, bias=False), nn.BatchNorm2d(c_out), nn.LeakyReLU(0.2, True)]
        layers += [nn.Conv2d(channels[-1], 1, start, 1, 0, bias=False)]
        self.net = nn.Sequential(*layers)
        dcgan_init(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).flatten()


class MLPClassifier(nn.Module):
    """Images to ``num_classes`` logits through two hidden layers; ``body`` gives the penultimate features."""

    def __init__(self, image_shape: ImageShape, hidden: int, num_classes: int, batch_norm: bool = False) -> None:
        super().__init__()
        self.num_features = hidden

        def norm() -> list[nn.Module]:
            return [nn.BatchNorm1d(hidden)] if batch_norm else []

        self.body = nn.Sequential(
            nn.Flatten(), nn.Linear(math.prod(image_shape), hidden), *norm(), nn.ReLU(),
            nn.Linear(hidden, hidden), *norm(), nn.ReLU(),
        )  # fmt: skip
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class ConvClassifier(nn.Module):
    """A small CNN: 3x3 convolutions of stride 2 (BatchNorm, ReLU) doubling the channels from ``width`` until the
    side is 4 or less, global average pooling, a linear head; ``body`` gives the pooled features."""

    def __init__(self, image_shape: ImageShape, width: int, num_classes: int) -> None:
        super().__init__()
        channels, side, layers = image_shape[0], min(image_shape[1:]), []
        out = width
        while True:
            layers += [nn.Conv2d(channels, out, 3, 2, 1, bias=False), nn.BatchNorm2d(out), nn.ReLU(True)]
            channels, side = out, (side + 1) // 2
            if side <= 4:
                break
            out *= 2
        self.num_features = channels
        self.body = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))
