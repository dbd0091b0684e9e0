"""Whether a model changed under an average built on it: a tensor replaced, added, removed, reshaped or moved.

Copy contract: none; reads names, shapes, devices and object identities, never a tensor's values.

An average pairs each of its tensors with a tensor of the model once, at construction. A model changed afterwards
(timm's ``reset_classifier``, a new head assigned, ``module.weight = nn.Parameter(...)``) would otherwise be averaged
stale: the old head's parameters, no longer in the model, updated on, the new ones never. ``changes`` compares the
model as it is now with the pairs, entry by entry (a walk over ``state_dict`` names: microseconds per tensor), and
``ModelWatch`` says when that walk is worth making in the hot path: every assignment of a parameter, buffer or
submodule to any module goes through ``nn.Module.__setattr__``/``register_*``, whose global registration hooks
(installed once, on the first watch) raise a process-wide count (a buffer only when it is new, removed or of another
shape, dtype or device: one reassigned alike each step is looked up by name anyway); an update compares one integer
with the count it saw last and walks the model only when something, somewhere, was registered since. What no hook
sees (``param.data = other_shape``, ``del module.head``) is found by the walk that ``average_weights``, ``copy_to`` and
``export`` always make, and that an update makes when a live tensor's data pointer changed
(``copy_correct.averages.shadow``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

__all__ = ["Entry", "ModelWatch", "changes"]

_registrations = [0]  # how many parameters, buffers and submodules were assigned to any module (hooks installed)
_hooks: list[Any] = []


def _count(*_: Any) -> None:
    _registrations[0] += 1


def _count_buffer(module: nn.Module, name: str, buffer: torch.Tensor | None) -> None:
    """A buffer counts when it is new, removed, or of another shape, dtype or device than the one it replaces: a
    buffer assigned anew each step (torch's ``AveragedModel`` does ``self.n_averaged += 1``) is looked up by name at
    every update anyway, and must not make every update walk the model."""
    old = module._buffers.get(name)
    if (
        old is None
        or buffer is None
        or (old.shape, old.dtype, old.device) != (buffer.shape, buffer.dtype, buffer.device)
    ):
        _registrations[0] += 1


class ModelWatch:
    """``stale()``: whether anything was registered on any module since the last ``seen()`` (one integer compare)."""

    def __init__(self) -> None:
        if not _hooks:
            modules = nn.modules.module
            _hooks.extend(
                (
                    modules.register_module_parameter_registration_hook(_count),
                    modules.register_module_buffer_registration_hook(_count_buffer),
                    modules.register_module_module_registration_hook(_count),
                )
            )
        self._seen = _registrations[0]

    def stale(self) -> bool:
        return self._seen != _registrations[0]

    def seen(self) -> None:
        self._seen = _registrations[0]


class Entry(NamedTuple):
    """One tensor of the model as an average was built on it: its name, the Parameter object (``None`` for a buffer,
    which ``model.to`` replaces and is looked up by name), its device and dtype, and its average's shape."""

    name: str
    parameter: torch.Tensor | None
    device: torch.device
    dtype: torch.dtype
    shape: torch.Size


def changes(model_now: Iterable[tuple[str, torch.Tensor, Any]], entries: Sequence[Entry]) -> str | None:
    """How the model differs from ``entries``, in one line naming the first tensors that differ; ``None`` when it
    does not. ``model_now``: its entries that the average would keep now (``selection.Chosen.now``: name, tensor,
    owner). Tied tensors (several names for one tensor) are entries of their own."""
    now = {name: (tensor, owner is None) for name, tensor, owner in model_now}
    kept = {entry.name for entry in entries}
    added = [name for name in now if name not in kept]
    removed = [entry.name for entry in entries if entry.name not in now]
    if added or removed:
        what = [f"{name!r} added" for name in added[:3]] + [f"{name!r} removed" for name in removed[:3]]
        return _changed(", ".join(what))
    for name, parameter, device, dtype, shape in entries:
        tensor, is_parameter = now[name]
        if is_parameter != (parameter is not None) or (parameter is not None and tensor is not parameter):
            return _changed(f"{name!r} was replaced by another {'Parameter' if is_parameter else 'tensor'}")
        if tensor.shape != shape:
            return _changed(f"{name!r} is {tuple(tensor.shape)} now, its average {tuple(shape)}")
        if tensor.device != device or tensor.dtype != dtype:
            return _changed(f"{name!r} moved from {device}/{dtype} to {tensor.device}/{tensor.dtype}")
    return None


def _changed(what: str) -> str:
    return (
        f"the model changed under its average: {what} (a new head, reset_classifier, a Parameter assigned, a storage "
        "replaced through .data?); nothing was written; the average cannot follow it: build a new one for the changed "
        "model (load_average its old state where the names still fit)"
    )
