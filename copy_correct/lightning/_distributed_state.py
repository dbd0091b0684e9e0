"""A callback's sharded tensors in Lightning's distributed checkpoints (``ModelParallelStrategy`` with
``save_distributed_checkpoint=True``, the default: a directory).

Lightning writes such a checkpoint's ``state_dict`` and optimizer states with ``torch.distributed.checkpoint``, every
rank its own shards, and the rest of it (the callbacks' states among it) with ``torch.save`` on rank 0 alone: a
``DTensor`` there would keep rank 0's shard only. So a callback puts its sharded tensors into the ``state_dict``
under keys of its own, its state names the keys, and on resume each rank reads its shards back from the directory.

Copy contract: ``store_under_keys`` puts the given tensors themselves into the checkpoint's ``state_dict`` (no copy:
Lightning writes them out); ``read_into`` fills the given holders in place from the directory, each rank its own
shards (no collective beyond ``torch.distributed.checkpoint.load``'s planning), and returns them.
"""

from __future__ import annotations

from collections.abc import Mapping
from os import PathLike

import torch

__all__ = ["names_keys", "read_into", "store_under_keys"]


def store_under_keys(
    weights: dict[str, torch.Tensor], tensors: Mapping[str, torch.Tensor], prefix: str
) -> dict[str, str]:
    """Put ``tensors`` into a distributed checkpoint's weights, each under ``PREFIX/NAME`` unless the weights already
    hold that very tensor under its name; return each name's key."""
    keys = {}
    for name, tensor in tensors.items():
        keys[name] = name if weights.get(name) is tensor else f"{prefix}/{name}"
        weights[keys[name]] = tensor
    return keys


def names_keys(value: object) -> bool:
    """Whether ``value`` is what ``store_under_keys`` returned: a non-empty mapping of names to keys."""
    return isinstance(value, Mapping) and bool(value) and all(isinstance(key, str) for key in value.values())


def read_into(
    holders: dict[str, torch.Tensor], keys: Mapping[str, str], path: str | PathLike[str] | None
) -> dict[str, torch.Tensor]:
    """``holders`` (spread as the tensors to restore), filled in place from the keys of the distributed checkpoint at
    ``path`` (every rank reads its shards); ``ValueError`` when no checkpoint is being read."""
    from torch.distributed.checkpoint import load

    if path is None:
        raise ValueError("the callback's state names tensors in a distributed checkpoint, but no checkpoint is read")
    load({"state_dict": {keys[name]: holder for name, holder in holders.items()}}, checkpoint_id=path)
    return holders
