"""The ``pinned`` recipe's data: sklearn's digits as ``uint8`` images, made by CPU workers or sliced from one pinned
store, and moved to the device by the prefetcher (``data.prefetch=true``) or by Lightning.

Copy contract:
  * Batches cross the bus as ``uint8``: a quarter of float32's bytes. ``normalize`` and ``augment_on_device`` make
    new float tensors after the copy, on the device; the batch they are given is not written.
  * ``make_loader`` pins only when an accelerator will receive the batches (pinning on a CPU-only machine buys
    nothing and warns). With ``prefetch`` the loader is a ``DeviceDataLoader``: batch k+1 is copied on a side stream
    while batch k computes, and transformed there; without it, ``on_after_batch_transfer`` applies the same
    transform after Lightning's copy.
  * ``source="store"``: the digits are rendered once into one ``uint8`` tensor, pinned once; every batch is a view
    of it (``StoreWindows``), so the host copies nothing and the one copy per batch is the one to the device.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Sampler

from copy_correct import make_loader
from recipes.data.digits import DigitsDataModule

__all__ = [
    "AugmentedDigits",
    "PinnedDigitsDataModule",
    "RandomWindows",
    "StoreWindows",
    "augment_on_device",
    "normalize",
    "render_digits",
]

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

    Each item is made fresh by the worker that loads it (the source images are never written). Without ``augment``
    (validation) an item is the same every time and draws nothing from the global generators: a 3-channel image's tint
    comes from a generator seeded with its index.
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
        # Unaugmented (validation): each image tinted alike every time, from a generator of its own; never the global
        # generator, which training draws from.
        tint = None if self.augment or self.channels == 1 else torch.Generator().manual_seed(index)
        image = _upscale(self.images[index : index + 1], self.size, self.channels, tint)[0]
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

    @property
    def input_format(self) -> dict[str, Any]:
        """How a batch row is made from an image file, for ``recipes.inference.load_image``: ``normalize``'s scaling."""
        return {"image_shape": list(self.image_shape), "mean": MEAN, "std": STD, "flat": False}

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
