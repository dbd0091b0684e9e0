"""``DeviceDataLoader`` and ``make_loader``: a ``DataLoader`` whose batches come out on the device, prefetched.

Copy contract: ``DeviceDataLoader`` is a ``DataLoader`` (so Lightning still injects a
``DistributedSampler`` under DDP, re-creating it with the same arguments) whose iterator is a
``DevicePrefetcher``: each batch is copied once, from the pinned memory the loader's pin thread filled,
on a side stream that overlaps compute. Lightning's own ``transfer_batch_to_device`` then finds every
tensor already on its device, and ``.to`` returns the same tensor: no second copy.

``make_loader`` pins only when the batches go to an accelerator (so a CPU-only machine gets no
"pin_memory ... no accelerator" warning) and keeps workers alive between epochs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from copy_correct.loading.prefetch import Batch, DevicePrefetcher

__all__ = ["DeviceDataLoader", "make_loader"]


class _LoaderBatches:
    """The plain ``DataLoader`` iteration of a ``DeviceDataLoader`` (what the prefetcher wraps)."""

    def __init__(self, loader: DataLoader) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator[Batch]:
        return DataLoader.__iter__(self.loader)

    def __len__(self) -> int:
        return DataLoader.__len__(self.loader)


class DeviceDataLoader(DataLoader):
    """A ``DataLoader`` yielding batches already on ``device``, the next one's copy in flight.

    Takes every ``DataLoader`` argument, plus ``device`` and an optional on-device ``transform``
    (see ``DevicePrefetcher``). The side stream is made once per loader and reused every epoch.
    """

    def __init__(
        self,
        dataset: Dataset,
        *args: Any,
        device: torch.device | str = "cpu",
        transform: Callable[[Batch], Batch] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(dataset, *args, **kwargs)
        self.prefetcher = DevicePrefetcher(_LoaderBatches(self), device, transform)
        self.device = self.prefetcher.device
        self.transform = transform

    def __iter__(self) -> Iterator[Batch]:  # type: ignore[override]
        return iter(self.prefetcher)


def make_loader(
    dataset: Dataset,
    batch_size: int | None,
    *,
    device: torch.device | str = "cpu",
    prefetch: bool = True,
    transform: Callable[[Batch], Batch] | None = None,
    num_workers: int = 0,
    **kwargs: Any,
) -> DataLoader:
    """A loader for batches bound for ``device``: ``DeviceDataLoader`` when ``prefetch``, else a ``DataLoader``.

    ``batch_size=None``: the dataset's items are whole batches (``DataLoader``'s own meaning), handed on without
    collation. ``pin_memory`` is on exactly when ``device`` is an accelerator (a batch that is already pinned
    memory, such as a slice of a pinned tensor, is handed on as it is: ``Tensor.pin_memory`` copies only
    pageable memory); ``persistent_workers`` whenever there are workers. ``transform`` needs ``prefetch``
    (without it, apply it after your framework's copy). Other keyword arguments (``shuffle``, ``generator``,
    ``drop_last``…) go to the ``DataLoader``.
    """
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1 or None, got {batch_size}")
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")
    if transform is not None and not prefetch:
        raise ValueError("transform runs on the prefetcher's stream: it needs prefetch=True")
    device = torch.device(device)
    options: dict[str, Any] = {
        "batch_size": batch_size,
        "num_workers": num_workers,
        "pin_memory": device.type not in ("cpu", "meta"),
        "persistent_workers": num_workers > 0,
        **kwargs,
    }
    if prefetch:
        return DeviceDataLoader(dataset, device=device, transform=transform, **options)
    return DataLoader(dataset, **options)
