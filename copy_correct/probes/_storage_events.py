"""Shared machinery of ``CopyAudit`` and ``MemoryProbe``: see every storage an op creates
and every tensor an op writes into.

Two interposition layers are entered together:

* a ``TorchDispatchMode`` sees each ATen op below autograd (forward and backward): an output whose
  storage belongs to none of the op's inputs is new storage; an argument the op's schema marks as
  written (``Tensor(a!)``) is an in-place write.
* a ``TorchFunctionMode`` sees ``Tensor.__deepcopy__``, whose storage is allocated in Python and
  reaches ATen only through ``set_``; it is reported as one op named ``deepcopy``. It also sees
  ``torch.tensor`` and ``torch.as_tensor`` from Python data, which build their storage below the
  dispatcher's Python key; each is reported as one op of that name.

Kernel-internal scratch memory (workspaces inside one op) is invisible at this level by design.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from contextlib import ExitStack
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from copy_correct.core.torch_internals import TorchDispatchMode, op_schema, tree_leaves

# In-place ops that change metadata (shape, strides, storage pointer), not data.
_METADATA_ONLY = frozenset(
    {
        "set_",
        "resize_",
        "resize_as_",
        "as_strided_",
        "detach_",
        "requires_grad_",
        "t_",
        "transpose_",
        "squeeze_",
        "unsqueeze_",
        "swapdims_",
        "swapaxes_",
    }
)

_FROM_DATA = (torch.tensor, torch.as_tensor)  # new storage from Python data, made below the Python key

_TORCH_DIR = f"{os.sep}torch{os.sep}"
_STDLIB = sysconfig.get_paths()["stdlib"]
_OWN_FILES = {
    os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
    for name in ("_storage_events.py", "copy_audit.py", "memory_probe.py")
}


@dataclass(frozen=True)
class TensorEvent:
    """One tensor touched by an op: ``kind`` is ``"alloc"`` (new storage) or ``"write"`` (in place)."""

    op: str
    kind: str
    nbytes: int
    device: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    where: str | None


def human_bytes(nbytes: int) -> str:
    """``1536`` -> ``'1.5 KiB'``; exact bytes below 1 KiB."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB"):
        if abs(value) < 1024:
            return f"{nbytes} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.2f} GiB"


def _op_name(func: Any) -> str:
    return func.overloadpacket.__name__


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _storage_of(t: torch.Tensor) -> torch.UntypedStorage | None:
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


def _caller() -> str | None:
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        stdlib = name.startswith(_STDLIB) and "site-packages" not in name
        inside = name in _OWN_FILES or stdlib
        if not inside and _TORCH_DIR not in name:
            return f"{name}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return None


def _written_args(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    written: list[torch.Tensor] = []
    for i, arg in enumerate(op_schema(func).arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        written.extend(x for x in tree_leaves(value) if isinstance(x, torch.Tensor))
    return written


class StorageEvents:
    """Context manager calling ``on_alloc(event, storage)`` and ``on_write(event)`` for each op.

    Subclasses override the two hooks. ``trace=True`` fills ``TensorEvent.where`` with the first
    stack frame outside torch (costly; off by default).
    """

    def __init__(self, *, trace: bool = False) -> None:
        self.trace = trace
        self._stack: ExitStack | None = None
        self._in_deepcopy = 0

    @property
    def active(self) -> bool:
        """True between entering and leaving the block."""
        return self._stack is not None

    def on_alloc(self, event: TensorEvent, storage: torch.UntypedStorage) -> None:
        """Called once per new storage created inside the block."""

    def on_write(self, event: TensorEvent) -> None:
        """Called once per tensor written in place inside the block."""

    def __enter__(self) -> StorageEvents:
        if self._stack is not None:
            raise RuntimeError(f"{type(self).__name__} is already active; it cannot be re-entered")
        stack = ExitStack()
        stack.enter_context(_FunctionLayer(self))
        stack.enter_context(_DispatchLayer(self))
        self._stack = stack
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()

    def _event(self, op: str, kind: str, t: torch.Tensor, nbytes: int) -> TensorEvent:
        where = _caller() if self.trace else None
        return TensorEvent(op, kind, nbytes, str(t.device), t.dtype, tuple(t.shape), where)

    def _dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        inputs: set[int] = set()
        for x in tree_leaves((args, kwargs)):
            if isinstance(x, torch.Tensor):
                storage = _storage_of(x)
                if storage is not None:
                    inputs.add(storage._cdata)
            elif isinstance(x, torch.UntypedStorage):
                inputs.add(x._cdata)
        out = func(*args, **kwargs)
        if self._in_deepcopy:
            return out
        name = _op_name(func)
        if op_schema(func).is_mutable and name not in _METADATA_ONLY:
            for t in _written_args(func, args, kwargs):
                if _nbytes(t):
                    self.on_write(self._event(name, "write", t, _nbytes(t)))
        seen: set[int] = set()
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = _storage_of(t)
            if storage is None or storage._cdata in inputs or storage._cdata in seen:
                continue
            seen.add(storage._cdata)
            if storage.nbytes():
                self.on_alloc(self._event(name, "alloc", t, storage.nbytes()), storage)
        return out

    def _from_data(self, func: Any, args: tuple, kwargs: dict) -> Any:
        out = func(*args, **kwargs)
        data = args[0] if args else kwargs.get("data")
        if isinstance(out, torch.Tensor) and not isinstance(data, (torch.Tensor, np.ndarray)) and not self._in_deepcopy:
            storage = _storage_of(out)
            if storage is not None and storage.nbytes():
                self.on_alloc(self._event(func.__name__, "alloc", out, storage.nbytes()), storage)
        return out

    def _deepcopy(self, func: Any, args: tuple, kwargs: dict) -> Any:
        self._in_deepcopy += 1
        try:
            out = func(*args, **kwargs)
        finally:
            self._in_deepcopy -= 1
        if self._in_deepcopy or not isinstance(out, torch.Tensor):
            return out
        # The copy's own storage, its `.grad` and tensors in its `__dict__` are deep-copied together.
        sources = {s._cdata for s in map(_storage_of, _tensor_parts(args[0])) if s is not None}
        for part in _tensor_parts(out):
            storage = _storage_of(part)
            if storage is not None and storage._cdata not in sources and storage.nbytes():
                sources.add(storage._cdata)
                self.on_alloc(self._event("deepcopy", "alloc", part, storage.nbytes()), storage)
        return out


def _tensor_parts(t: torch.Tensor) -> list[torch.Tensor]:
    extra = [v for v in getattr(t, "__dict__", {}).values() if isinstance(v, torch.Tensor)]
    return [t, *([t.grad] if t.grad is not None else []), *extra]


class _DispatchLayer(TorchDispatchMode):
    def __init__(self, owner: StorageEvents) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        return self.owner._dispatch(func, args, kwargs or {})


class _FunctionLayer(TorchFunctionMode):
    def __init__(self, owner: StorageEvents) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.Tensor.__deepcopy__:
            return self.owner._deepcopy(func, args, kwargs or {})
        if func in _FROM_DATA:
            return self.owner._from_data(func, args, kwargs or {})
        return func(*args, **(kwargs or {}))
