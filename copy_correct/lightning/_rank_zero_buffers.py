"""Rank 0's floating buffers (BatchNorm statistics) copied into every rank's module, as DDP does before a forward.

Under DDP each rank's forward updates its own BatchNorm statistics and DDP copies rank 0's to the others only at the
next forward; FSDP2 never does. An average taken of them on each rank then differs by rank, and a distributed
checkpoint keeps one copy of a tensor that is not sharded, as if all ranks held the same. ``RankZeroBuffers.sync``
gives every rank rank 0's now: what the averaging callbacks do before each update.

Copy contract: per (dtype, device) group of floating buffers, one flat tensor and views of it shaped like them,
built on the first ``sync`` (the module's buffers looked up by owner and name at each call, since ``module.to(...)``
replaces buffer objects); each ``sync`` copies the buffers into the flat tensor, broadcasts it from rank 0 (one
collective per group) and copies it back into the buffers in place. Nothing is allocated after the first call. With
one process, or no process group, it does nothing.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from copy_correct.core.flat import flat_views
from copy_correct.core.foreach_writes import foreach_copy_
from copy_correct.core.module_tensors import TensorRefs, state_entries

__all__ = ["RankZeroBuffers"]


class RankZeroBuffers:
    """Built empty; ``sync(trainer, module)`` before each update. Not pickled (``None`` in a copy's state)."""

    def __init__(self) -> None:
        self._groups: list[tuple[TensorRefs, torch.Tensor, list[torch.Tensor]]] | None = None

    def sync(self, trainer: pl.Trainer, module: torch.nn.Module) -> None:
        if trainer.world_size == 1 or not (dist.is_available() and dist.is_initialized()):
            return
        if self._groups is None:
            self._groups = _flat_buffers(module)
        with torch.no_grad():
            for refs, flat, views in self._groups:
                buffers = refs.resolve()
                foreach_copy_(views, buffers)
                dist.broadcast(flat, src=0)
                foreach_copy_(buffers, views)


def _flat_buffers(module: torch.nn.Module) -> list[tuple[TensorRefs, torch.Tensor, list[torch.Tensor]]]:
    """Per (dtype, device): the floating buffers' refs, one flat tensor, and views of it shaped like them."""
    groups: dict[tuple, list[tuple[torch.Tensor, tuple]]] = {}
    for _, tensor, owner in state_entries(module):
        if owner is not None and tensor.is_floating_point():
            groups.setdefault((tensor.dtype, tensor.device), []).append((tensor, owner))
    out = []
    for members in groups.values():
        refs = TensorRefs()
        for tensor, owner in members:
            refs.append(tensor, owner)
        out.append((refs, *flat_views([t for t, _ in members])))
    return out
