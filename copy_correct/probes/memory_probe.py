"""``MemoryProbe``: peak and net memory of a block of code, with one meaning on every device.

Copy contract: the probe copies nothing and holds weak references only, so it never keeps a tensor alive.

    with MemoryProbe("cpu") as probe:     # or "cuda", "cuda:1", "meta": the same figures for the same code
        for _ in range(200):
            train_step()
    assert probe.net_bytes <= 1024, probe.report()

**The definition, on every device:** ``net_bytes`` is the size of the storage created inside the block on the
probe's device that is still alive at exit, and ``peak_bytes`` the most of it alive at once inside the block;
memory that existed before the block never counts, not even when the block frees it.

So ``a = a * 0.5 + b * 0.5`` nets the new ``a`` (the old one was there before), ``del old_tensor`` nets 0,
an in-place ``a.lerp_(b, 0.5)`` nets 0, and a slice that keeps a big buffer alive keeps all of it counted.
This is what a leak check needs: a loop that keeps nothing it makes nets 0 whatever it frees.

How: a live-storage ledger. Every storage that an ATen op, ``torch.tensor(...)`` or ``deepcopy`` creates
inside the block on the probe's device is counted, at its storage's byte size, until its last reference
dies (a weak-reference finalizer tells), on whichever thread made it (autograd's backward threads
included). The CUDA caching allocator's counters are not used: they count the frees of older tensors too,
and round every block up to 512 bytes. Not seen, on any device: scratch space inside one kernel (cuBLAS
and cuDNN workspaces) and memory that libraries take outside torch's ops (NCCL buffers, ``from_numpy``).
"""

from __future__ import annotations

import weakref
from types import TracebackType

import torch

from copy_correct.probes._storage_events import StorageEvents, TensorEvent, human_bytes

__all__ = ["MemoryProbe"]


class MemoryProbe:
    """Context manager giving ``.peak_bytes`` and ``.net_bytes`` of the storage created inside the block.

    Args:
        device: the device whose memory is measured (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"meta"``).
        trace: record where each surviving storage was created (see ``survivors``).
    """

    def __init__(self, device: str | torch.device = "cpu", *, trace: bool = False) -> None:
        device = torch.device(device)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError("MemoryProbe('cuda') needs a CUDA device and none is available")
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self._ledger = _Ledger(device, trace=trace)
        self._peak = 0
        self._net: int | None = None

    @property
    def active(self) -> bool:
        """True between entering and leaving the block."""
        return self._ledger.active

    def __enter__(self) -> MemoryProbe:
        if self.active:
            raise RuntimeError("MemoryProbe is already active; it cannot be re-entered")
        self._net = None
        self._ledger.reset()
        self._ledger.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._ledger.__exit__(exc_type, exc, tb)
        self._peak, self._net = self._ledger.peak, self._ledger.live
        self._ledger.stop_tracking()

    @property
    def peak_bytes(self) -> int:
        """The most bytes created inside the block alive at once (so far, while inside)."""
        return self._ledger.peak if self.active else self._peak

    @property
    def net_bytes(self) -> int:
        """Bytes created inside the block and still alive: at exit, or now while inside."""
        if self.active:
            return self._ledger.live
        if self._net is None:
            raise RuntimeError("MemoryProbe was never entered")
        return self._net

    @property
    def survivors(self) -> list[TensorEvent]:
        """The storages created inside that were still alive at exit (or now)."""
        return list(self._ledger.survivors)

    def report(self) -> str:
        """One line of figures, plus the largest survivors."""
        line = f"MemoryProbe({self.device}): peak {human_bytes(self.peak_bytes)}, net {human_bytes(self.net_bytes)}"
        if not self.survivors:
            return line
        top = sorted(self.survivors, key=lambda e: -e.nbytes)[:10]
        rows = [f"  {human_bytes(e.nbytes):>10}  {e.op} {list(e.shape)} {e.dtype} {e.where or ''}" for e in top]
        return "\n".join([line, f"  {len(self.survivors)} storage(s) created inside are alive:", *rows])


class _Ledger(StorageEvents):
    """Live bytes of storages created on one device while active, freed through weak finalizers."""

    def __init__(self, device: torch.device, *, trace: bool) -> None:
        super().__init__(trace=trace)
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.live = 0
        self.peak = 0
        self._alive: dict[int, tuple[weakref.finalize, TensorEvent]] = {}

    @property
    def survivors(self) -> list[TensorEvent]:
        return [event for _, event in self._alive.values()]

    def on_alloc(self, event: TensorEvent, storage: torch.UntypedStorage) -> None:
        if storage.device != self.device or storage._cdata in self._alive:
            return
        key = storage._cdata
        self._alive[key] = (weakref.finalize(storage, self._freed, key, event.nbytes), event)
        self.live += event.nbytes
        self.peak = max(self.peak, self.live)

    def _freed(self, key: int, nbytes: int) -> None:
        if self._alive.pop(key, None) is not None:
            self.live -= nbytes

    def stop_tracking(self) -> None:
        """Detach the finalizers so storages freed after the block cost nothing; keep the figures."""
        for finalizer, _ in self._alive.values():
            finalizer.detach()
