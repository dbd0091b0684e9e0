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

On a CPU the batches stay where they were made: no copy, no pinning, the same code. Sharded (``trainer=fsdp``):
``configure_model`` shards the network with FSDP2 (``recipes/model_setup.py``).

Callbacks (``conf/recipe/pinned.yaml``, then ``conf/callbacks/default.yaml``'s, which every recipe has):
  * ``DataWaitMonitor`` (``copy_correct/lightning/data_wait.py``): host clocks and each batch's first dimension;
    holds no tensor, copies nothing.
  * ``ResumeState`` (``copy_correct/lightning/resume.py``, ``resume_data_order.py``): copies of the generators' states
    and a record of the loaders' order in every checkpoint. With ``data.num_workers`` > 0 it discards Lightning's
    first training iterator (its workers already hold the first epoch's indices) and makes a recorded one: the first
    epoch's order, and every draw after it, are not a plain Lightning run's, and the same again after a resume.
  * ``IsolatedEvaluation`` (``copy_correct/lightning/isolated_evaluation.py``): each validation's draws from torch's,
    NumPy's and Python's generators (the validation loader's base seed, its workers' seeds) are undone when it ends:
    the epochs after it shuffle and shift as if it had not run.
  * ``NonFiniteStop`` (``copy_correct/lightning/nonfinite_stop.py``): each loss copied on its device into a tensor
    made once; the weights read, never copied, every 50 batches and before each save.
  * ``ModelCheckpoint`` and ``LastCheckpoint`` (``copy_correct/lightning/last_checkpoint.py``), written through
    ``AtomicCheckpointIO`` (``atomic_checkpoint.py``): every storage streamed once into a file beside the target and
    renamed over it. ``RunSummary``, ``StaleTemporaries``, the progress bar: read only.

Change first: ``render_digits`` / ``AugmentedDigits`` in ``recipes/data/pinned_digits.py`` (your data and its
augmentation) and the network in ``DigitsCNN``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from recipes.model_setup import at_least_one, check_args, check_classes, shard_layers

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
        check_classes(classes, NUM_CLASSES)
        at_least_one(width=width)
        check_args([("lr", lr, lr > 0, "> 0"), ("weight_decay", weight_decay, weight_decay >= 0, ">= 0")])
        at_least_one(stem_stride=stem_stride)
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

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images)

    def configure_model(self) -> None:
        """Under ``trainer=fsdp``: shard the network with FSDP2, each layer with weights a unit of its own; every rank
        keeps 1/N of each weight. Otherwise: nothing."""
        shard_layers(self, self.net, (nn.Conv2d, nn.Linear))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay, fused=True
        )

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
