"""The ``gan`` recipe's evaluation (``recipes/gan_quality.py``): the sample grid's shape, and evaluation that reads
only: the judge's Frechet distance and confidence, and the grid, leave every tensor they are given as it was (its
``_version`` and its values), and give plain floats with no graph. The control: an in-place write is seen. Samples
that hold NaN or Inf never reach torchmetrics' FID, which crashes on them (the control, in a subprocess)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from copy_correct.lightning import NonFiniteTraining
from recipes.gan_quality import Judge, sample_grid
from tests.conftest import ROOT

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


CONTROL = """
import torch
from torchmetrics.image.fid import FrechetInceptionDistance
from recipes.gan_quality import Judge, _Features
torch.manual_seed(0)
judge = Judge("mlp", (1, 8, 8), num_classes=10).eval()
real = torch.rand(200, 1, 8, 8) * 2 - 1
fid = FrechetInceptionDistance(feature=_Features(judge))
with torch.no_grad():
    fid.update(real, real=True)
    fid.update(torch.full_like(real, {value}), real=False)
    print(fid.compute().item())
"""


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_samples_that_hold_nan_or_inf_never_reach_the_frechet_distance(value: float) -> None:
    """Refused in one line naming what the caller says they are (``NonFiniteTraining``, which train.py prints). The
    control: torchmetrics' FID given the same samples directly crashes the process (NaN: a segfault in LAPACK's
    DGEBAL, exit -11) or returns no finite distance (Inf)."""
    torch.manual_seed(0)
    judge = Judge("mlp", SHAPE, num_classes=10).eval()
    real = torch.rand(200, *SHAPE) * 2 - 1
    fake = real.clone()
    fake[7, 0, 3, 3] = value
    with torch.no_grad(), pytest.raises(NonFiniteTraining) as refused:
        judge.frechet_distance(real, fake, "the live generator's samples at global step 40")
    assert str(refused.value) == (
        "the live generator's samples at global step 40 hold NaN or Inf: the Frechet distance is not computed on them"
    )
    with torch.no_grad():
        assert math.isfinite(judge.frechet_distance(real, real.flip(0)))  # finite samples are measured as before

    control = subprocess.run(
        [sys.executable, "-c", CONTROL.format(value=f"float('{value}')")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    crashed = control.returncode != 0
    assert crashed or not math.isfinite(float(control.stdout.split()[-1])), (control.returncode, control.stdout)
