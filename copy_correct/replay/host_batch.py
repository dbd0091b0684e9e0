"""Where a replay buffer's ``sample`` gathers a batch on the host, and how the batch reaches the device asked for.

For a CUDA device the batch is gathered into pinned (page-locked) host memory and copied with ``non_blocking=True``: a
DMA the host does not wait for, ordered on the current stream before any kernel that reads the batch (stable-baselines3
copies from pageable memory, a copy the host waits for). Pinned blocks come from torch's caching host allocator, which
hands a block out again only once the copies that read it have finished (it records an event on the copy's stream), so
a batch gathered into a recycled block never overwrites one still in flight. For any other device the batch is gathered
into ordinary (numpy) memory and, off the CPU, copied with ``.to(device)``.

Copy contract: ``empty`` allocates new host memory on every call (pinned: from torch's cache); ``taken`` gathers a
field's rows into it and ``held`` copies an array made for the batch into it where it must be pinned (else the array is
the batch's, as it is); none of them shares memory with a buffer's storage. ``moved`` makes one copy of each tensor on
the device (none for the CPU) and keeps no reference to the host tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["empty", "held", "moved", "taken"]


def empty(shape: Sequence[int], dtype: np.dtype, pinned: bool) -> tuple[np.ndarray, torch.Tensor]:
    """New host memory for one field of a batch, as a numpy array and a tensor over the same bytes; ``pinned``:
    page-locked, for a copy to a CUDA device."""
    if pinned:
        tensor = torch.empty(tuple(shape), dtype=torch.from_numpy(np.empty(0, dtype)).dtype, pin_memory=True)
        return tensor.numpy(), tensor
    array = np.empty(tuple(shape), dtype=dtype)
    return array, torch.from_numpy(array)


def taken(field: np.ndarray, rows: np.ndarray, pinned: bool) -> torch.Tensor:
    """``field``'s ``rows`` gathered into new host memory (``pinned``: page-locked, for a copy to a CUDA device)."""
    if not pinned:
        return torch.from_numpy(field.take(rows, axis=0))
    array, out = empty((len(rows), *field.shape[1:]), field.dtype, pinned)
    field.take(rows, axis=0, out=array, mode="clip")  # rows are in range: clip skips numpy's buffering
    return out


def held(array: np.ndarray, pinned: bool) -> torch.Tensor:
    """``array`` (new memory already) as a batch's tensor: itself, or a copy in page-locked memory (``pinned``)."""
    if not pinned:
        return torch.from_numpy(array)
    into, out = empty(array.shape, array.dtype, pinned)
    into[...] = array
    return out


def moved(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """``batch`` on ``device``: as it is on the CPU, else each tensor copied there, without a wait on the host when it
    comes from pinned memory (``non_blocking=True``; the stream orders the copy before the kernels that read it)."""
    if device.type == "cpu":
        return {name: tensor.cpu() for name, tensor in batch.items()}  # from a device buffer: a copy the host waits for
    return {name: tensor.to(device, non_blocking=True) for name, tensor in batch.items()}
