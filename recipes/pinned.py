"""Recipe ``pinned``: pinned memory and host-to-device copies that overlap compute, on a data-bound image task.

    python train.py +recipe=pinned                          # with the prefetcher
    python train.py +recipe=pinned data.prefetch=false      # Lightning's copy, on the compute stream
    python train.py +recipe=pinned +pinned=gpu_scale trainer=gpu                     # where the copy matters
    python train.py +recipe=pinned +pinned=gpu_scale trainer=gpu data.prefetch=false # the same, copy not hidden

What it shows:
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

Change first: ``render_digits`` / ``AugmentedDigits`` (your data and its augmentation) and the network in
``DigitsCNN``.
"""

from __future__ import annotations

from collections.abc import Iterator

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.utils.data import DataLoader, Dataset, Sampler
from torchmetrics.classification import MulticlassAccuracy

from components import make_loader
from recipes.digits import DigitsDataModule

__all__ = [
    "AugmentedDigits",
    "DigitsCNN",
    "GridMean",
    "PinnedDigitsDataModule",
    "RandomWindows",
    "StoreWindows",
    "augment_on_device",
    "normalize",
    "render_digits",
]

NUM_CLASSES = 10
MEAN, STD = 0.25, 0.28  # of the augmented training images, scaled to [0, 1]
SOURCES = ("workers", "store")
Batch = tuple[torch.Tensor, torch.Tensor]


def normalize(batch: Batch) -> Batch:
    """``uint8`` images to normalised float32, on whatever device they are: a new tensor, the input untouched."""
    images, labels = batch
    return ((images.float() / 255.0).sub_(MEAN).div_(STD), labels)


def augment_on_device(batch: Batch, max_shift: int) -> Batch:
    """``normalize``, then dim each image at random and shift the batch by up to ``max_shift`` pixels, where the
    batch is (on the GPU: inside the prefetcher's side stream). The shift is drawn on the host: no sync."""
    images, labels = normalize(batch)
    dim = torch.empty(images.shape[0], 1, 1, 1, device=images.device).uniform_(0.7, 1.0)
    images = images.mul_(dim)  # after normalisation the background is negative: dimming moves it toward 0 too
    if max_shift:
        dy, dx = torch.randint(-max_shift, max_shift + 1, (2,)).tolist()
        images = images.roll((dy, dx), dims=(2, 3))
    return images, labels


def _check_geometry(size: int, max_shift: int, channels: int) -> None:
    if size < 8:
        raise ValueError(f"data.size must be >= 8, got {size}")
    if not 0 <= max_shift < size:
        raise ValueError(f"data.max_shift must be in [0, data.size={size}), got {max_shift}")
    if channels not in (1, 3):
        raise ValueError(f"data.channels must be 1 or 3, got {channels}")


def _upscale(images: torch.Tensor, size: int, channels: int, generator: torch.Generator | None) -> torch.Tensor:
    """8x8 digits in [0, 1] -> ``channels`` x ``size`` x ``size`` floats in [0, 1]; 3 channels get a random tint."""
    image = F.interpolate(images.reshape(-1, 1, 8, 8), size=(size, size), mode="bilinear")
    if channels == 1:
        return image
    tint = torch.empty(image.shape[0], channels, 1, 1).uniform_(0.5, 1.0, generator=generator)
    return image * tint


def render_digits(
    images: torch.Tensor,
    labels: torch.Tensor,
    picks: torch.Tensor,
    size: int,
    channels: int,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The digits ``picks`` indexes, rendered once into one ``uint8`` tensor (3 channels: a random tint each), in
    chunks, so the float temporaries stay small however many are rendered."""
    store = torch.empty(len(picks), channels, size, size, dtype=torch.uint8)
    for start in range(0, len(picks), 256):
        chunk = picks[start : start + 256]
        store[start : start + len(chunk)] = (_upscale(images[chunk], size, channels, generator) * 255).round_()
    return store, labels[picks]


class AugmentedDigits(Dataset):
    """sklearn's digits upscaled to ``size`` x ``size`` ``uint8`` images, randomly shifted and dimmed when ``augment``.

    Each item is made fresh by the worker that loads it (the source images are never written).
    """

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        size: int = 64,
        max_shift: int = 6,
        augment: bool = True,
        channels: int = 1,
    ) -> None:
        _check_geometry(size, max_shift, channels)
        self.images = images.reshape(-1, 1, 8, 8)
        self.labels = labels
        self.size = size
        self.max_shift = max_shift if augment else 0
        self.augment = augment
        self.channels = channels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> Batch:
        image = _upscale(self.images[index : index + 1], self.size, self.channels, None)[0]
        if self.augment:
            s = self.max_shift
            dy, dx = torch.randint(0, 2 * s + 1, (2,)).tolist()
            image = F.pad(image, (s, s, s, s))[:, dy : dy + self.size, dx : dx + self.size]
            image = image * torch.empty(()).uniform_(0.7, 1.0)
        return (image * 255.0).round_().clamp_(0, 255).to(torch.uint8), self.labels[index]


class StoreWindows(Dataset):
    """Whole batches as slices of one rendered store: ``dataset[start]`` is ``store[start : start + batch_size]``.

    Copy contract: every batch is a view of the store (pinned once, so every batch is pinned memory); the
    loader's collation and pinning hand it on unchanged, so the one copy a batch costs is the one to the device.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, batch_size: int) -> None:
        self.images, self.labels, self.batch_size = images, labels, batch_size

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, start: int) -> Batch:
        end = start + self.batch_size
        return self.images[start:end], self.labels[start:end]


class RandomWindows(Sampler[int]):
    """``count`` window starts per epoch, uniform over the store, drawn from ``generator`` (seeded, resumable)."""

    def __init__(self, size: int, batch_size: int, count: int, generator: torch.Generator) -> None:
        self.last_start, self.count, self.generator = size - batch_size, count, generator

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[int]:
        return iter(torch.randint(self.last_start + 1, (self.count,), generator=self.generator).tolist())


class PinnedDigitsDataModule(DigitsDataModule):
    """Digits as ``uint8`` images from CPU workers or from a pinned store; ``prefetch`` switches the prefetcher.

    The split, the seeded and resumable training order and the argument checks are ``DigitsDataModule``'s.
    ``store_size`` and ``batches_per_epoch`` apply to ``source="store"`` only.
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
        source: str = "workers",
        channels: int = 1,
        store_size: int = 8192,
        batches_per_epoch: int = 50,
    ) -> None:
        _check_geometry(size, max_shift, channels)
        if source not in SOURCES:
            raise ValueError(f"data.source must be one of {', '.join(SOURCES)}, got {source!r}")
        if source == "store" and store_size < batch_size:
            raise ValueError(f"data.store_size must be >= data.batch_size={batch_size}, got {store_size}")
        if batches_per_epoch < 1:
            raise ValueError(f"data.batches_per_epoch must be >= 1, got {batches_per_epoch}")
        super().__init__(batch_size, val_fraction, seed, num_workers)
        self.prefetch, self.source, self.max_shift, self.seed = prefetch, source, max_shift, seed
        self.image_shape = (channels, size, size)  # what the batches hold, not the digits' (1, 8, 8)
        self.size, self.channels, self.store_size, self.batches_per_epoch = (
            size,
            channels,
            store_size,
            batches_per_epoch,
        )
        if source == "workers":
            geometry = {"size": size, "max_shift": max_shift, "channels": channels}
            self.train_set = AugmentedDigits(*self.train_set.tensors, augment=True, **geometry)
            self.val_set = AugmentedDigits(*self.val_set.tensors, augment=False, **geometry)

    def setup(self, stage: str) -> None:
        if self.source != "store" or isinstance(self.train_set, StoreWindows):
            return
        # Copy decision: render once, pin once (only for an accelerator); every batch is then a slice, copied
        # once, to the device. Re-rendering or re-pinning per batch would cost the host a copy of every batch.
        render = torch.Generator().manual_seed(self.seed)
        images, labels = self.train_set.tensors
        train = render_digits(images, labels, torch.randint(len(labels), (self.store_size,), generator=render),
                              self.size, self.channels, render)  # fmt: skip
        images, labels = self.val_set.tensors
        val = render_digits(images, labels, torch.arange(len(labels)), self.size, self.channels, render)
        if self._device().type not in ("cpu", "meta"):
            train, val = (tuple(t.pin_memory() for t in split) for split in (train, val))
        self.train_set = StoreWindows(*train, self.batch_size)
        self.val_set = StoreWindows(*val, self.batch_size)

    def train_dataloader(self) -> DataLoader:
        if self.source == "store":
            windows = RandomWindows(self.store_size, self.batch_size, self.batches_per_epoch, self.shuffle)
            return self._loader(self.train_set, training=True, sampler=windows)
        return self._loader(self.train_set, training=True, shuffle=True, generator=self.shuffle)

    def val_dataloader(self) -> DataLoader:
        if self.source == "store":
            return self._loader(self.val_set, training=False, sampler=range(0, len(self.val_set), self.batch_size))
        return self._loader(self.val_set, training=False, shuffle=False)

    def transform(self, batch: Batch, training: bool) -> Batch:
        """What a batch needs on the device: augmentation for training batches of the store, normalisation always."""
        return augment_on_device(batch, self.max_shift) if training and self.source == "store" else normalize(batch)

    def on_after_batch_transfer(self, batch: Batch, dataloader_idx: int) -> Batch:
        # Copy decision: without the prefetcher Lightning has just copied the uint8 batch; transform it here, on
        # the device. The prefetcher has already handed over the transformed batch.
        if self.prefetch:
            return batch
        return self.transform(batch, training=self.trainer is not None and self.trainer.training)

    def _device(self) -> torch.device:
        return self.trainer.strategy.root_device if self.trainer is not None else torch.device("cpu")

    def _loader(self, dataset: Dataset, training: bool, **kwargs: object) -> DataLoader:  # type: ignore[override]
        # Copy decision: the device comes from the trainer, so under DDP each rank prefetches to its own GPU.
        whole_batches = self.source == "store"  # the dataset's items are whole batches: no collation copy
        return make_loader(
            dataset,
            None if whole_batches else self.batch_size,
            device=self._device(),
            prefetch=self.prefetch,
            transform=(lambda batch: self.transform(batch, training)) if self.prefetch else None,
            num_workers=0 if whole_batches else self.num_workers,
            **kwargs,
        )


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
    """A small CNN on the normalised digits: a strided stem, two stride-2 convolutions, a 4x4 grid of means."""

    def __init__(
        self, width: int = 32, lr: float = 2e-3, weight_decay: float = 1e-4, in_channels: int = 1, stem_stride: int = 2
    ) -> None:
        super().__init__()
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
