"""Recipe ``pinned``: pinned memory and host-to-device copies that overlap compute, on a data-bound image task.

    python train.py +recipe=pinned                          # with the prefetcher
    python train.py +recipe=pinned data.prefetch=false      # Lightning's copy, on the compute stream
    python train.py +recipe=pinned +pinned=gpu_scale trainer=gpu                     # where the copy matters
    python train.py +recipe=pinned +pinned=gpu_scale trainer=gpu data.prefetch=false # the same, copy not hidden

The copies are the data module's (``recipes/data/pinned_digits.py``, ``PinnedDigitsDataModule``); this file holds
the network they feed. What it shows:
  * Batches cross the bus as ``uint8``: a quarter of float32's bytes. Conversion to float and normalisation
    happen after the copy, on the device.
  * ``make_loader`` pins only when an accelerator will receive the batches: pinning on a CPU-only machine
    buys nothing and warns.
  * With ``data.prefetch=true`` a ``DeviceDataLoader`` copies batch k+1 on a side stream while batch k
    computes, and transforms it there; Lightning's ``transfer_batch_to_device`` finds it already on the
    device and copies nothing. It is still a ``DataLoader``, so DDP's sampler is injected as usual.
  * With ``data.prefetch=false`` Lightning copies each batch on the compute stream just before the step
    (pinned, ``non_blocking``, but nothing to overlap with), and the data module's ``on_after_batch_transfer``
    applies the same transform.
  * ``DataWaitMonitor`` logs ``perf/samples_per_s`` and ``perf/data_wait_fraction`` every epoch; both land
    in ``summary.json``.

Two sources of batches (``data.source``):
  * ``workers`` (default, quick on a CPU): CPU workers upscale, shift and dim each 8x8 digit into a 64x64
    image. A 64x64 batch is too small for its copy to matter on a GPU, and the workers set the pace there.
  * ``store`` (``+pinned=gpu_scale``: 3x224x224 images in batches of 2048, 308 MB each): the digits are
    rendered once into one ``uint8`` tensor, pinned once; every batch is a slice of it, so the host makes no
    copy at all and the one copy per batch is the host-to-device one, a real part of each step. Augmentation
    (per-image dimming, a per-batch shift) runs on the device, inside the transform.

On a CPU the batches stay where they were made: no copy, no pinning, the same code.

Change first: ``render_digits`` / ``AugmentedDigits`` in ``recipes/data/pinned_digits.py`` (your data and its
augmentation) and the network in ``DigitsCNN``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torchmetrics.classification import MulticlassAccuracy

__all__ = ["DigitsCNN", "GridMean"]

NUM_CLASSES = 10


class GridMean(nn.Module):
    """``nn.AdaptiveAvgPool2d(cells)``, computed as two small matrix products. Same windows, same means, any input
    size; unlike the pooling kernel, its CUDA backward is deterministic, and the recipe's GPU runs must be
    repeatable (``trainer.deterministic=true``) for its tests to compare them."""

    def __init__(self, cells: int) -> None:
        super().__init__()
        self.cells = cells
        self._weights: dict[tuple, torch.Tensor] = {}  # per (size, dtype, device), made on first use

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, cols = (self.weights(n, x) for n in x.shape[-2:])
        return torch.einsum("bchw,hi,wj->bcij", x, rows, cols)

    def weights(self, size: int, x: torch.Tensor) -> torch.Tensor:
        """(size, cells): column i averages window i, rows floor(i * size / cells) to ceil((i + 1) * size / cells)."""
        key = (size, x.dtype, x.device)
        if key not in self._weights:
            weights = torch.zeros(size, self.cells, dtype=x.dtype, device=x.device)
            for i in range(self.cells):
                start, end = i * size // self.cells, -(-(i + 1) * size // self.cells)
                weights[start:end, i] = 1.0 / (end - start)
            self._weights[key] = weights
        return self._weights[key]


class DigitsCNN(pl.LightningModule):
    """A small CNN on the normalised digits: a strided stem, two stride-2 convolutions, a 4x4 grid of means.
    ``classes`` and ``input_format`` say how to use the trained model on an image file (``recipes.inference``);
    ``train.py`` fills them from the data module, and the checkpoint keeps them in its hyperparameters."""

    def __init__(
        self,
        width: int = 32,
        lr: float = 2e-3,
        weight_decay: float = 1e-4,
        in_channels: int = 1,
        stem_stride: int = 2,
        classes: list[str] | None = None,
        input_format: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if classes is not None and len(classes) != NUM_CLASSES:
            raise ValueError(f"model.classes must name {NUM_CLASSES} classes, got {len(classes)}")
        if width < 1:
            raise ValueError(f"model.width must be >= 1, got {width}")
        if not lr > 0:
            raise ValueError(f"model.lr must be > 0, got {lr}")
        if weight_decay < 0:
            raise ValueError(f"model.weight_decay must be >= 0, got {weight_decay}")
        if stem_stride < 1:
            raise ValueError(f"model.stem_stride must be >= 1, got {stem_stride}")
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Conv2d(in_channels, width, stem_stride + 1, stride=stem_stride, padding=stem_stride // 2),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(2 * width, 2 * width, 3, stride=2, padding=1),
            nn.ReLU(),
            GridMean(4),
            nn.Flatten(),
            nn.Linear(2 * width * 16, NUM_CLASSES),
        )
        self.train_acc = MulticlassAccuracy(NUM_CLASSES, average="micro")
        self.val_acc = MulticlassAccuracy(NUM_CLASSES, average="micro")

    def configure_model(self) -> None:
        """Under ``trainer=fsdp`` (a device mesh from Lightning's ``ModelParallelStrategy``): shard the network with
        FSDP2, each layer with weights a unit of its own; every rank keeps 1/N of each weight. Otherwise: nothing."""
        if self.device_mesh is None or isinstance(self.net, FSDPModule):  # not sharded, or sharded already
            return
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, (nn.Conv2d, nn.Linear)):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

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
