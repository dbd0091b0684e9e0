"""Recipe ``pinned``: pinned memory and host-to-device copies that overlap compute, on a data-bound image task.

    python train.py +recipe=pinned                          # with the prefetcher
    python train.py +recipe=pinned data.prefetch=false      # Lightning's copy, on the compute stream
    python train.py +recipe=pinned +pinned=gpu_scale trainer=gpu                     # where the copy matters
    python train.py +recipe=pinned +pinned=gpu_scale trainer=gpu data.prefetch=false # the same, copy not hidden

Copy decisions, in the data module that feeds this network (``recipes/data/pinned_digits.py``): batches cross the bus
as ``uint8`` (a quarter of float32's bytes) and become normalised floats on the device; they are pinned only when an
accelerator receives them; with ``data.prefetch=true`` a ``DeviceDataLoader`` copies batch k+1 on a side stream while
batch k computes, so ``training_step`` gets a batch already on the device and Lightning copies nothing; with
``data.source=store`` (``+pinned=gpu_scale``) every batch is a slice of one store, rendered and pinned once. On a CPU
the batches stay where they were made: no copy, no pinning, the same code.

Callbacks (``conf/recipe/pinned.yaml``, then ``conf/callbacks/default.yaml``'s; files in ``copy_correct/lightning/``):
  * ``DataWaitMonitor``, ``data_wait.py``: ``perf/samples_per_s`` and ``perf/data_wait_fraction``, from host clocks.
  * every recipe's: ``IsolatedEvaluation`` (``isolated_evaluation.py``), ``ResumeState`` (``resume.py``),
    ``NonFiniteStop`` (``nonfinite_stop.py``), ``LastCheckpoint`` (``last_checkpoint.py``) and Lightning's
    ``ModelCheckpoint`` through ``AtomicCheckpointIO`` (``atomic_checkpoint.py``), ``RunSummary``
    (``run_summary.py``), ``StaleTemporaries`` (``stale_temporaries.py``), the progress bar (``recipes/progress.py``).

The two sources, sharding (``trainer=fsdp``), what each callback copies and the figures: ``docs/recipes/pinned.md``.

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


class DigitsCNN(pl.LightningModule):
    """A small CNN on the normalised digits: a strided stem, two stride-2 convolutions, a 4x4 grid of means
    (``GridMean``, below). ``classes`` and ``input_format`` say how to use the trained model on an image file
    (``recipes.inference``); ``train.py`` fills them from the data module, and the checkpoint keeps them in its
    hyperparameters."""

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

    # -- The training step: the batch arrives on the device, normalised --

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        # Copy decision: nothing here copies the batch. On an accelerator the prefetcher copied it (uint8, from pinned
        # memory) on its side stream while the last step computed, and transformed it there; with data.prefetch=false
        # Lightning copied it on this stream and the data module's on_after_batch_transfer transformed it.
        images, labels = batch
        logits = self(images)
        loss = F.cross_entropy(logits, labels)
        self.train_acc.update(logits.detach(), labels)  # Copy decision: detached, so the metric holds no graph
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    # -- Validation --

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        images, labels = batch
        logits = self(images)
        self.val_acc.update(logits, labels)
        self.log("val/loss", F.cross_entropy(logits, labels), prog_bar=True, sync_dist=True)
        self.log("val/acc", self.val_acc, prog_bar=True)


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
