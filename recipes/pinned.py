"""Recipe ``pinned``: pinned memory and host-to-device copies that overlap compute, on a data-bound image task.

    python train.py +recipe=pinned                          # with the prefetcher
    python train.py +recipe=pinned data.prefetch=false      # Lightning's copy, on the compute stream
    python train.py -m +recipe=pinned data.prefetch=true,false trainer=gpu   # compare, on a GPU

What it shows:
  * CPU workers upscale and augment the 8x8 digits into 64x64 images and hand over ``uint8``: a quarter
    of float32's bytes cross the bus. Conversion to float and normalisation happen after the copy.
  * ``make_loader`` pins only when an accelerator will receive the batches: pinning on a CPU-only machine
    buys nothing and warns.
  * With ``data.prefetch=true`` a ``DeviceDataLoader`` copies batch k+1 on a side stream while batch k
    computes, and normalises it there; Lightning's ``transfer_batch_to_device`` finds it already on the
    device and copies nothing. It is still a ``DataLoader``, so DDP's sampler is injected as usual.
  * With ``data.prefetch=false`` Lightning copies each batch on the compute stream just before the step
    (pinned, ``non_blocking``, but nothing to overlap with), and the data module's ``on_after_batch_transfer``
    normalises.
  * ``DataWaitMonitor`` logs ``perf/samples_per_s`` and ``perf/data_wait_fraction`` every epoch; both land
    in ``summary.json``.

On a CPU the batches stay where the workers made them: no copy, no pinning, the same code.

Change first: ``AugmentedDigits`` (your data set and its CPU augmentation) and the network in ``DigitsCNN``.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torchmetrics.classification import MulticlassAccuracy

from components import make_loader
from recipes.digits import DigitsDataModule

__all__ = ["AugmentedDigits", "DigitsCNN", "PinnedDigitsDataModule", "normalize"]

NUM_CLASSES = 10
MEAN, STD = 0.25, 0.28  # of the augmented training images, scaled to [0, 1]


def normalize(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``uint8`` images to normalised float32, on whatever device they are: a new tensor, the input untouched."""
    images, labels = batch
    return ((images.float() / 255.0).sub_(MEAN).div_(STD), labels)


def _check_geometry(size: int, max_shift: int) -> None:
    if size < 8:
        raise ValueError(f"data.size must be >= 8, got {size}")
    if not 0 <= max_shift < size:
        raise ValueError(f"data.max_shift must be in [0, data.size={size}), got {max_shift}")


class AugmentedDigits(Dataset):
    """sklearn's digits upscaled to ``size`` x ``size`` ``uint8`` images, randomly shifted and dimmed when ``augment``.

    Each item is made fresh by the worker that loads it (the source images are never written).
    """

    def __init__(
        self, images: torch.Tensor, labels: torch.Tensor, size: int = 64, max_shift: int = 6, augment: bool = True
    ) -> None:
        _check_geometry(size, max_shift)
        self.images = images.reshape(-1, 1, 8, 8)
        self.labels = labels
        self.size = size
        self.max_shift = max_shift if augment else 0
        self.augment = augment

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = F.interpolate(self.images[index : index + 1], size=(self.size, self.size), mode="bilinear")[0]
        if self.augment:
            s = self.max_shift
            dy, dx = torch.randint(0, 2 * s + 1, (2,)).tolist()
            image = F.pad(image, (s, s, s, s))[:, dy : dy + self.size, dx : dx + self.size]
            image = image * torch.empty(()).uniform_(0.7, 1.0)
        return (image * 255.0).round_().clamp_(0, 255).to(torch.uint8), self.labels[index]


class PinnedDigitsDataModule(DigitsDataModule):
    """Augmented 64x64 digits from CPU workers; ``prefetch`` switches the device prefetcher on or off.

    The split, the seeded and resumable training order and the argument checks are ``DigitsDataModule``'s.
    """

    def __init__(
        self,
        batch_size: int = 256,
        size: int = 64,
        max_shift: int = 6,
        prefetch: bool = True,
        num_workers: int = 2,
        val_fraction: float = 0.2,
        seed: int = 0,
    ) -> None:
        _check_geometry(size, max_shift)
        super().__init__(batch_size, val_fraction, seed, num_workers)
        self.prefetch = prefetch
        self.train_set = AugmentedDigits(*self.train_set.tensors, size=size, max_shift=max_shift, augment=True)
        self.val_set = AugmentedDigits(*self.val_set.tensors, size=size, max_shift=max_shift, augment=False)

    def on_after_batch_transfer(
        self, batch: tuple[torch.Tensor, torch.Tensor], dataloader_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Copy decision: without the prefetcher Lightning has just copied the uint8 batch; convert it here, on
        # the device. The prefetcher has already handed over normalised floats.
        return batch if self.prefetch else normalize(batch)

    def _loader(self, dataset: Dataset, **kwargs: object) -> DataLoader:
        # Copy decision: the device comes from the trainer, so under DDP each rank prefetches to its own GPU.
        device = self.trainer.strategy.root_device if self.trainer is not None else torch.device("cpu")
        return make_loader(
            dataset,
            self.batch_size,
            device=device,
            prefetch=self.prefetch,
            transform=normalize if self.prefetch else None,
            num_workers=self.num_workers,
            **kwargs,
        )


class DigitsCNN(pl.LightningModule):
    """A small CNN on the normalised 64x64 digits."""

    def __init__(self, width: int = 32, lr: float = 2e-3, weight_decay: float = 1e-4) -> None:
        super().__init__()
        if width < 1:
            raise ValueError(f"model.width must be >= 1, got {width}")
        if not lr > 0:
            raise ValueError(f"model.lr must be > 0, got {lr}")
        if weight_decay < 0:
            raise ValueError(f"model.weight_decay must be >= 0, got {weight_decay}")
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Conv2d(1, width, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(2 * width, 2 * width, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(4),
            nn.Flatten(),
            nn.Linear(2 * width * 16, NUM_CLASSES),
        )
        self.train_acc = MulticlassAccuracy(NUM_CLASSES, average="micro")
        self.val_acc = MulticlassAccuracy(NUM_CLASSES, average="micro")

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        logits = self(images)
        loss = F.cross_entropy(logits, labels)
        self.train_acc.update(logits.detach(), labels)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        images, labels = batch
        logits = self(images)
        self.val_acc.update(logits, labels)
        self.log("val/loss", F.cross_entropy(logits, labels), prog_bar=True, sync_dist=True)
        self.log("val/acc", self.val_acc, prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay, fused=True
        )
