"""The ``gan`` recipe's evaluation (``recipes/gan_quality.py``): the sample grid's shape, and evaluation that reads
only: the judge's Frechet distance and confidence, and the grid, leave every tensor they are given as it was (its
``_version`` and its values), and give plain floats with no graph. The control: an in-place write is seen."""

from __future__ import annotations

import pytest
import torch

from recipes.gan_quality import Judge, sample_grid

SHAPE = (1, 8, 8)


@pytest.mark.parametrize("channels", [1, 3])
def test_the_sample_grid_is_ten_by_ten_of_the_data_shape(channels: int) -> None:
    picture = sample_grid(torch.zeros(100, channels, 16, 16))
    assert picture.mode == ("L" if channels == 1 else "RGB")
    assert picture.size == (10 * 18 * 3, 10 * 18 * 3)  # a pixel of border each side; scaled to 400 or more across
    with pytest.raises(ValueError, match="square number"):
        sample_grid(torch.zeros(99, channels, 16, 16))


def test_evaluation_writes_nothing_it_is_given_and_returns_plain_floats() -> None:
    torch.manual_seed(0)
    judge = Judge("mlp", SHAPE, num_classes=10).eval()
    real, fake = torch.rand(200, *SHAPE) * 2 - 1, torch.rand(200, *SHAPE) * 2 - 1
    fake.requires_grad_()  # samples straight from a generator, as a caller might pass them
    before = {name: (t._version, t.detach().clone()) for name, t in {"real": real, "fake": fake}.items()}
    with torch.no_grad():
        distance = judge.frechet_distance(real, fake)
        confidence, rarest = judge.confidence(fake)
    sample_grid(fake[:100])
    for name, tensor in {"real": real, "fake": fake}.items():
        version, values = before[name]
        assert tensor._version == version and torch.equal(tensor.detach(), values), name
    assert all(type(x) is float for x in (distance, confidence, rarest)) and 0 <= rarest <= confidence <= 1
    real.mul_(1.0)  # the control: an in-place write moves the version counter the check reads
    assert real._version == before["real"][0] + 1
