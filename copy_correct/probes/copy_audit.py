"""``CopyAudit``: a record of every op that materialises new storage or writes into existing storage.

Copy contract: the audit itself copies nothing and holds no reference to any tensor (records keep
names, sizes and dtypes only), so it can stay open around a whole training step.

    with CopyAudit() as audit:
        ema.update(model)
    assert audit.bytes_allocated == 0, audit.summary()

What counts as an allocation: any ATen op whose output storage is none of its inputs' storages
(``clone``, ``_to_copy`` from ``.to(dtype)`` or ``.to(other_device)``, ``contiguous()`` and a
``reshape`` that cannot be a view (both appear as ``clone``), arithmetic like ``a * b``, factory ops),
plus ``copy.deepcopy`` of a tensor or buffer (op name ``deepcopy``; a deep-copied ``Parameter``
appears as ``clone``). Views (``view``, ``t``, slicing, ``detach``, ``state_dict()`` entries) are not
recorded: they share storage. What counts as a write: every tensor an op's schema marks as mutated
(``copy_``, ``lerp_``, ``add_``, ``_foreach_lerp_`` once per tensor in its lists, ``out=`` arguments);
metadata-only in-place ops (``set_``, ``resize_``, ``t_``…) are not writes.

Works on CPU, CUDA and meta tensors; sees forward and backward ops alike, and ``torch.tensor`` /
``torch.as_tensor`` from Python data (op names ``tensor``, ``as_tensor``). Memory that ``torch.from_numpy``
shares with NumPy and scratch space inside one kernel are not seen.
"""

from __future__ import annotations

from collections import Counter

import torch

from copy_correct.probes._storage_events import StorageEvents, TensorEvent, human_bytes

__all__ = ["CopyAudit", "TensorEvent"]


class CopyAudit(StorageEvents):
    """Context manager recording allocations and in-place writes as ``TensorEvent`` records in ``.ops``.

    Args:
        trace: also record, per op, the first stack frame outside torch (``TensorEvent.where``).
    """

    def __init__(self, *, trace: bool = False) -> None:
        super().__init__(trace=trace)
        self.ops: list[TensorEvent] = []

    def on_alloc(self, event: TensorEvent, storage: torch.UntypedStorage) -> None:
        self.ops.append(event)

    def on_write(self, event: TensorEvent) -> None:
        self.ops.append(event)

    @property
    def allocations(self) -> list[TensorEvent]:
        """Records of new storage, in order."""
        return [e for e in self.ops if e.kind == "alloc"]

    @property
    def writes(self) -> list[TensorEvent]:
        """Records of in-place writes into existing storage, in order."""
        return [e for e in self.ops if e.kind == "write"]

    @property
    def bytes_allocated(self) -> int:
        """Total size of all new storages created inside the block (freed or not)."""
        return sum(e.nbytes for e in self.ops if e.kind == "alloc")

    @property
    def bytes_written(self) -> int:
        """Total size of all tensors written in place inside the block."""
        return sum(e.nbytes for e in self.ops if e.kind == "write")

    def count(self, name: str | None = None, kind: str | None = None) -> int:
        """Number of records of op ``name`` (``"clone"``, ``"aten.copy_"``…) and/or ``kind``.

        ``kind`` is ``"alloc"`` or ``"write"``; ``None`` matches any.
        """
        if kind not in (None, "alloc", "write"):
            raise ValueError(f"kind must be 'alloc', 'write' or None, got {kind!r}")
        if name is not None:
            name = name.removeprefix("aten.").removeprefix("torch.")
        return sum(1 for e in self.ops if (name is None or e.op == name) and (kind is None or e.kind == kind))

    def summary(self) -> str:
        """A table of ops by kind, calls and bytes, largest first."""
        calls: Counter[tuple[str, str]] = Counter()
        size: Counter[tuple[str, str]] = Counter()
        for e in self.ops:
            calls[(e.kind, e.op)] += 1
            size[(e.kind, e.op)] += e.nbytes
        lines = [
            f"CopyAudit: {self.count(kind='alloc')} allocations ({human_bytes(self.bytes_allocated)}), "
            f"{self.count(kind='write')} in-place writes ({human_bytes(self.bytes_written)})"
        ]
        for key, nbytes in sorted(size.items(), key=lambda kv: (-kv[1], kv[0])):
            kind, op = key
            lines.append(f"  {kind:5}  {op:28} x{calls[key]:<6} {human_bytes(nbytes):>10}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()
