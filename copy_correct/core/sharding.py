"""Sharded (FSDP2, ``DTensor``) tensors as this rank's shard: what the foreach writers work on.

Copy contract: ``local``, ``from_local`` and ``layout`` copy nothing (``local`` is ``DTensor.to_local()``, a plain
tensor view of the rank's shard; call it under ``no_grad``, where the view of a parameter can be written in place;
``from_local`` wraps a shard as a ``DTensor`` sharing its storage); ``reshard``
frees memory and copies nothing; ``local_part`` returns a view or a new tensor of this rank's part of a full
tensor, taken locally (no collective).

Why ``reshard`` exists: FSDP2 keeps a module's parameters gathered ("unsharded") after a forward it does not
follow with a backward (the root module after any evaluation forward, every module with
``reshard_after_forward=False``), and its next forward uses that gathered copy as it is. A write into the shards
meanwhile (swapping in an average, updating a target network) would then not be seen. ``reshard(module)`` drops
the gathered copies, so the next forward gathers the shards as they are now. It is local: no collective.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["from_local", "fsdp_modules", "is_sharded", "layout", "local", "local_part", "reshard"]

# Not imported here: torch.distributed.tensor and torch.distributed.fsdp take seconds to import (sympy comes with them)
# and a process that never imported them holds no DTensor and no FSDP2 module. So each check looks them up only where
# the process has imported them (FSDP2 and its users do), and `import copy_correct.averages.ema` stays as light as
# `import torch`.
_DTENSOR, _FSDP = "torch.distributed.tensor", "torch.distributed.fsdp"


def is_sharded(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ``DTensor`` (a sharded or replicated tensor spread over a device mesh)."""
    module = sys.modules.get(_DTENSOR)
    return module is not None and isinstance(t, module.DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` as a plain tensor (``to_local()``, a view), or ``t`` itself when it is plain."""
    return t.to_local() if is_sharded(t) else t


def from_local(shard: torch.Tensor, like: DTensor) -> DTensor:
    """A ``DTensor`` whose local tensor is ``shard`` (no copy), spread as ``like`` is."""
    return sys.modules[_DTENSOR].DTensor.from_local(
        shard, like.device_mesh, like.placements, shape=like.shape, stride=like.stride()
    )


def layout(t: torch.Tensor) -> str:
    """How ``t`` is spread: ``"Shard(dim=0) over a mesh of 2 ranks"``, or ``"not sharded"``."""
    if not is_sharded(t):
        return "not sharded"
    mesh = t.device_mesh
    ranks = "x".join(str(n) for n in mesh.shape)
    placements = ", ".join(repr(p) for p in t.placements)
    return f"{placements} over a mesh of {ranks} rank{'s' if mesh.size() > 1 else ''}"


def local_part(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's part of the full tensor ``full``, spread as ``like`` (a ``DTensor`` of ``full``'s shape) is;
    each rank takes its own part of the ``full`` it holds, so nothing is sent."""
    from torch.distributed.tensor import distribute_tensor

    part = distribute_tensor(full.to(like.device), like.device_mesh, like.placements, src_data_rank=None)
    return part.to_local()


def fsdp_modules(module: nn.Module) -> list[nn.Module]:
    """The FSDP2 modules in ``module`` (itself included): what ``reshard`` drops the gathered parameters of."""
    fsdp = sys.modules.get(_FSDP)
    return [] if fsdp is None else [m for m in module.modules() if isinstance(m, fsdp.FSDPModule)]


def reshard(module: nn.Module | list[nn.Module]) -> None:
    """Drop the gathered parameters of every FSDP2 module in ``module`` (or in a list from ``fsdp_modules``, which
    a caller on a hot path builds once); local, see the module docstring."""
    for m in fsdp_modules(module) if isinstance(module, nn.Module) else module:
        m.reshard()
