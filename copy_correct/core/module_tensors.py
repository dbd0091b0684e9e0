"""A module's parameters and buffers by ``state_dict`` name, looked up cheaply on every call.

Copy contract: holds references only; copies nothing. A buffer's owner module is held weakly, so a list of a
module's tensors kept in a cache keyed by that module (``copy_correct.target``) does not keep it alive.

Parameters are kept as objects: ``model.to(...)`` changes their data in place and keeps the object.
Buffers are kept as (owner module, name) and looked up on each call, because ``model.to(...)`` replaces
buffer objects. So a list built once stays right after the model moves, at the cost of one dict lookup
per buffer.

A sharded parameter (FSDP2's ``DTensor``) is kept as the object too, and ``resolve()`` returns this rank's shard
(``to_local()``, a view) taken on each call, about 1 µs a tensor. In torch 2.13 a shard keeps its storage across
training steps, evaluation forwards and FSDP2's gathering and resharding, but a conversion gives it a new one while
the Parameter object stays (``model.double().float()``: FSDP2 pads the converted shard again), and a view taken
once would go on writing into the old storage (``tests/distributed/test_sharded.py`` checks both).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator

import torch
from torch import nn

from copy_correct.core.checks import not_a_module
from copy_correct.core.sharding import is_sharded, local

__all__ = ["DATA_PTR", "TensorRefs", "state_entries", "unwrap"]


def unwrap(model: nn.Module, name: str = "model") -> nn.Module:
    """The module inside ``DistributedDataParallel`` / ``DataParallel`` (``.module``) and ``torch.compile``
    (``._orig_mod``) wrappers, however nested: the module whose ``state_dict`` names carry no wrapper prefix.

    Anything but a module (``model.parameters()``, a list of tensors, a ``state_dict``) is a one-line ``TypeError``
    naming the argument ``name``, found at no cost to a module: the attribute lookup a module makes anyway fails."""
    while True:
        if isinstance(model, _PARALLEL):
            model = model.module
            continue
        try:
            inner = model._modules.get("_orig_mod")  # not getattr: a miss costs a raise
        except AttributeError:
            raise TypeError(not_a_module(name, model)) from None
        if not isinstance(inner, nn.Module):
            return model
        model = inner


_PARALLEL = (nn.parallel.DistributedDataParallel, nn.DataParallel)
# A tensor's data pointer, what a storage replaced in place (``param.data = ...``, ``model.to``) changes and no module
# hook sees: ``list(map(DATA_PTR, tensors))``, about 80 ns a tensor.
DATA_PTR = torch.Tensor.data_ptr


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
    """An ordered list of a module's tensors: ``tensors()`` returns the current objects, ``resolve()`` what a
    foreach call writes (the same, or for sharded ones this rank's shards; call it under ``no_grad``)."""

    def __init__(self) -> None:
        self._tensors: list[torch.Tensor] = []
        self._buffers: list[tuple[int, weakref.ref[nn.Module], str]] = []
        self._sharded = False

    def append(self, tensor: torch.Tensor, owner: tuple[nn.Module, str] | None) -> None:
        if owner is not None:
            module, name = owner
            self._buffers.append((len(self._tensors), weakref.ref(module), name))
        self._sharded = self._sharded or is_sharded(tensor)
        self._tensors.append(tensor)

    def tensors(self) -> list[torch.Tensor]:
        if not self._buffers:
            return self._tensors
        tensors = list(self._tensors)
        for position, owner, name in self._buffers:
            module = owner()
            if module is None:
                raise RuntimeError(f"the module owning buffer {name!r} was freed; these tensor lists are stale")
            tensors[position] = module._buffers[name]
        return tensors

    def resolve(self) -> list[torch.Tensor]:
        tensors = self.tensors()
        return [local(t) for t in tensors] if self._sharded else tensors
