"""The ``gan`` recipe's evaluation: the judge network, the Frechet distance in its features, and sample grids.

The judge is trained once on real training images when a run starts (seeded, ``Judge.fit``): a classifier of their
labels when the data has labels, otherwise an autoencoder (features that must reconstruct the image). Its
penultimate features give a Frechet distance (torchmetrics' ``FrechetInceptionDistance`` with the judge as the
feature extractor); with labels it also rates samples by its confidence and by the share of its rarest class.

Copy contract: evaluation reads only. The judge's features and predictions are computed under the caller's
``no_grad`` (Lightning's validation), ``SAMPLE_CHUNK`` images at a time; figures leave as Python floats, the grid as
a new ``uint8`` array on the host. Nothing here writes a tensor it is given. Images that hold a NaN or an Inf never
reach the Frechet distance (``NonFiniteTraining``, which ``train.py`` prints as one line).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn
from torchmetrics.image.fid import FrechetInceptionDistance

from copy_correct.lightning import NonFiniteTraining
from recipes.networks import ConvClassifier, MLPClassifier

__all__ = ["GRID", "SAMPLE_CHUNK", "Judge", "sample_grid"]

GRID = 10  # samples.png is a GRID x GRID grid of samples
SAMPLE_CHUNK = 1024  # generated and judged this many at a time


class Judge(nn.Module):
    """The evaluation network: a classifier of the real images' labels, or, without labels, an autoencoder whose
    head reconstructs the image from the features. ``body`` (its penultimate features) feeds the Frechet distance."""

    def __init__(self, network: str, image_shape: tuple[int, int, int], num_classes: int | None) -> None:
        super().__init__()
        outputs = num_classes or math.prod(image_shape)  # unlabelled: the head reconstructs the pixels
        self.net = (
            MLPClassifier(image_shape, 128, outputs) if network == "mlp" else ConvClassifier(image_shape, 32, outputs)
        )
        self.num_classes, self.num_features = num_classes, self.net.num_features

    @property
    def body(self) -> nn.Module:
        return self.net.body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def fit(self, images: torch.Tensor, labels: torch.Tensor | None, epochs: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        optimizer = torch.optim.Adam(self.parameters(), lr=1e-3)
        with torch.enable_grad():
            for _ in range(epochs):
                for index in torch.randperm(len(images), generator=generator).split(64):
                    x = images[index]
                    if labels is None:
                        loss = F.mse_loss(torch.tanh(self(x)), x.flatten(1))
                    else:
                        loss = F.cross_entropy(self(x), labels[index])
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    optimizer.step()
        self.eval()

    def frechet_distance(self, real: torch.Tensor, fake: torch.Tensor, what: str = "the samples") -> float:
        """The Frechet distance between ``real`` and ``fake`` images in this network's penultimate features;
        ``NonFiniteTraining`` naming ``what`` (``fake``) when either holds a NaN or an Inf, before torchmetrics sees
        them: its matrix square root of NaN covariances crashed the process (a segfault in LAPACK's DGEBAL), and one
        of infinite ones is no distance either. One host read per call (``compute`` reads one anyway)."""
        for images, name in ((real, "the real images"), (fake, what)):
            if not torch.isfinite(images).all():
                raise NonFiniteTraining(f"{name} hold NaN or Inf: the Frechet distance is not computed on them")
        fid = FrechetInceptionDistance(feature=_Features(self)).to(real.device)
        for chunk in real.split(SAMPLE_CHUNK):
            fid.update(chunk, real=True)
        for chunk in fake.split(SAMPLE_CHUNK):
            fid.update(chunk, real=False)
        return fid.compute().item()

    def confidence(self, samples: torch.Tensor) -> tuple[float, float]:
        """The mean confidence of this classifier's predictions on ``samples`` and the share of its rarest predicted
        class (mode collapse shows as a class near 0)."""
        probs = torch.cat([self(chunk).softmax(dim=1) for chunk in samples.split(SAMPLE_CHUNK)])
        counts = torch.bincount(probs.argmax(dim=1), minlength=self.num_classes)
        return probs.max(dim=1).values.mean().item(), (counts.min() / len(samples)).item()


class _Features(nn.Module):
    """The judge's penultimate layer as a torchmetrics feature extractor."""

    def __init__(self, judge: Judge) -> None:
        super().__init__()
        self.judge = judge
        self.num_features = judge.num_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.judge.body(x)


def sample_grid(samples: torch.Tensor) -> Image.Image:
    """Images in [-1, 1], ``(N, C, H, W)`` with N a square, as one picture: a grid with a pixel of black around each
    image, scaled up by a whole factor (nearest neighbour) until it is 400 pixels or more across."""
    rows = math.isqrt(len(samples))
    if rows * rows != len(samples) or samples.shape[1] not in (1, 3):
        raise ValueError(f"sample_grid needs a square number of 1- or 3-channel images, got {tuple(samples.shape)}")
    pixels = ((samples.detach().float() + 1) * 127.5).clamp(0, 255).to(torch.uint8).cpu().numpy()
    channels, height, width = pixels.shape[1:]
    pixels = np.pad(pixels, ((0, 0), (0, 0), (1, 1), (1, 1))).reshape(rows, rows, channels, height + 2, width + 2)
    grid = pixels.transpose(0, 3, 1, 4, 2).reshape(rows * (height + 2), rows * (width + 2), channels)
    picture = Image.fromarray(grid[:, :, 0] if channels == 1 else grid)
    scale = max(1, math.ceil(400 / picture.width))
    return picture.resize((picture.width * scale, picture.height * scale), Image.NEAREST)
