"""``recipes/networks.py``: DCGAN's networks take every square side that is 4 to 7 times a power of two, 16 or more (48
as well as 64), layer for layer DCGAN's at 64; ``model.network=conv`` on images they cannot take is one line that
names only overrides that work."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from recipes.networks import ConvDiscriminator, ConvGenerator, conv_sides_near, pick_network

TAKEN = [16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128]


def _layers(module: nn.Module) -> list[tuple[str, list[tuple[int, ...]]]]:
    return [
        (type(m).__name__, [tuple(p.shape) for p in m.parameters()]) for m in module.modules() if not list(m.children())
    ]


@pytest.mark.parametrize("side", TAKEN)
def test_the_convolutional_networks_make_and_judge_images_of_each_side_they_take(side: int) -> None:
    generator, discriminator = ConvGenerator(16, 4, (1, side, side)), ConvDiscriminator((1, side, side), 4)
    images = generator(torch.randn(2, 16))
    assert images.shape == (2, 1, side, side) and discriminator(images).shape == (2,)
    assert pick_network("auto", (1, side, side)) == "conv"


def test_at_64_they_are_the_pytorch_examples_dcgan_layer_for_layer() -> None:
    """The reference: ``Generator`` and ``Discriminator`` of the PyTorch examples' ``dcgan/main.py`` (nz 100, ngf and
    ndf 64, 3 channels); a 48x48 generator, which starts at 6x6, is another network (the control)."""
    nz, nc, f = 100, 3, 64
    generator = nn.Sequential(
        nn.ConvTranspose2d(nz, f * 8, 4, 1, 0, bias=False), nn.BatchNorm2d(f * 8), nn.ReLU(True),
        nn.ConvTranspose2d(f * 8, f * 4, 4, 2, 1, bias=False), nn.BatchNorm2d(f * 4), nn.ReLU(True),
        nn.ConvTranspose2d(f * 4, f * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(f * 2), nn.ReLU(True),
        nn.ConvTranspose2d(f * 2, f, 4, 2, 1, bias=False), nn.BatchNorm2d(f), nn.ReLU(True),
        nn.ConvTranspose2d(f, nc, 4, 2, 1, bias=False), nn.Tanh(),
    )  # fmt: skip
    discriminator = nn.Sequential(
        nn.Conv2d(nc, f, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, True),
        nn.Conv2d(f, f * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(f * 2), nn.LeakyReLU(0.2, True),
        nn.Conv2d(f * 2, f * 4, 4, 2, 1, bias=False), nn.BatchNorm2d(f * 4), nn.LeakyReLU(0.2, True),
        nn.Conv2d(f * 4, f * 8, 4, 2, 1, bias=False), nn.BatchNorm2d(f * 8), nn.LeakyReLU(0.2, True),
        nn.Conv2d(f * 8, 1, 4, 1, 0, bias=False),
    )  # fmt: skip
    assert _layers(ConvGenerator(nz, f, (nc, 64, 64))) == _layers(generator)
    assert _layers(ConvDiscriminator((nc, 64, 64), f)) == _layers(discriminator)
    assert _layers(ConvGenerator(nz, f, (nc, 48, 48))) != _layers(generator)


@pytest.mark.parametrize("shape", [(1, 8, 8), (3, 12, 12), (3, 18, 18), (3, 36, 36), (1, 100, 100), (3, 16, 32)])
def test_images_they_cannot_take_get_mlps_or_one_line_naming_overrides_that_work(shape: tuple[int, int, int]) -> None:
    assert pick_network("auto", shape) == "mlp"
    with pytest.raises(ValueError) as refused:
        pick_network("conv", shape)
    message = str(refused.value)
    assert "\n" not in message and "model.network=mlp" in message and "data.resize=true" in message, message
    sides = conv_sides_near(min(shape[1:]))
    assert f"data.image_size={' or '.join(map(str, sides))} data.resize=true" in message, message
    assert all(pick_network("conv", (shape[0], side, side)) == "conv" for side in sides)
    assert pick_network("mlp", shape) == "mlp"
