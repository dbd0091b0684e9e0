"""A module's parameters and buffers by ``state_dict`` name, looked up cheaply on every call.

Copy contract: holds references only; copies nothing.

Parameters are kept as objects: ``model.to(...)`` changes their data in place and keeps the object.
Buffers are kept as (owner module, name) and looked up on each call, because ``model.to(...)`` replaces
buffer objects. So a list built once stays right after the model moves, at the cost of one dict lookup
per buffer.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["TensorRefs", "state_entries"]


def state_entries(model: nn.Module, include_buffers: bool = True) -> Iterator[tuple[str, torch.Tensor, tuple | None]]:
    """(state_dict name, tensor, (owner, buffer name) or None for a parameter), in state_dict order."""
    params = {id(p) for p in model.parameters()}
    owners: dict[str, tuple[nn.Module, str]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name in module._buffers:
            owners[f"{prefix}.{name}" if prefix else name] = (module, name)
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in params:
            yield name, tensor, None
        elif include_buffers and name in owners:
            yield name, tensor, owners[name]


class TensorRefs:
    """An ordered list of a module's tensors whose ``resolve()`` returns the current objects."""

    def __init__(self) -> None:
        self._tensors: list[torch.Tensor] = []
        self._buffers: list[tuple[int, nn.Module, str]] = []

    def append(self, tensor: torch.Tensor, owner: tuple[nn.Module, str] | None) -> None:
        if owner is not None:
            self._buffers.append((len(self._tensors), *owner))
        self._tensors.append(tensor)

    def resolve(self) -> list[torch.Tensor]:
        if not self._buffers:
            return self._tensors
        tensors = list(self._tensors)
        for position, owner, name in self._buffers:
            tensors[position] = owner._buffers[name]
        return tensors
