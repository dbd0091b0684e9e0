"""``MemoryProbe``: peak and net memory of a block of code, with one meaning on CPU and CUDA.

Copy contract: the probe copies nothing. On CPU (and meta) it holds weak references only, so it never
keeps a tensor alive; on CUDA it reads the caching allocator's counters.

    with MemoryProbe("cpu") as probe:
        for _ in range(200):
            train_step()
    assert probe.net_bytes <= 1024, probe.report()

``peak_bytes`` is the highest live total reached inside the block above the level at entry;
``net_bytes`` is what is still live at exit (or now, while inside) above that level.

* CUDA: ``torch.cuda.memory_allocated`` / ``max_memory_allocated`` of the probe's device. Entering
  resets that device's peak statistics (an enclosing probe first takes note of its peak so far, so
  nested probes stay right). Memory freed inside the block that was allocated before it counts
  negative, as the allocator sees it.
* Other devices: a live-storage ledger. Every storage that an ATen op (or ``deepcopy``) creates inside
  the block on the probe's device is counted until its last reference dies (a weak-reference finalizer
  tells), so a slice that keeps a big buffer alive keeps all of it counted. Storage allocated before the
  block is ignored, also when freed inside it; storage made outside ATen (``torch.tensor([...])``,
  ``torch.from_numpy``) and scratch space inside one kernel are not seen.
  ``torch.cuda.max_memory_allocated()`` returns 0 without a GPU, which is why the CPU needs this.
"""

from __future__ import annotations

import weakref
from types import TracebackType

import torch

from components._storage_events import StorageEvents, TensorEvent, human_bytes

__all__ = ["MemoryProbe"]

_ACTIVE_ON_CUDA: dict[torch.device, list[MemoryProbe]] = {}  # open CUDA probes per device, outermost first


class MemoryProbe:
    """Context manager giving ``.peak_bytes`` and ``.net_bytes`` above the level at entry.

    Args:
        device: the device whose memory is measured (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"meta"``).
        trace: on the ledger, record where each surviving storage was created (see ``survivors``).
    """

    def __init__(self, device: str | torch.device = "cpu", *, trace: bool = False) -> None:
        device = torch.device(device)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError("MemoryProbe('cuda') needs a CUDA device and none is available")
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self._ledger = _Ledger(device, trace=trace) if device.type != "cuda" else None
        self._start = 0
        self._peak = 0
        self._net: int | None = None
        self._active = False

    @property
    def active(self) -> bool:
        """True between entering and leaving the block."""
        return self._active

    @property
    def uses_allocator(self) -> bool:
        """True on CUDA (allocator statistics), False elsewhere (live-storage ledger)."""
        return self._ledger is None

    def __enter__(self) -> MemoryProbe:
        if self._active:
            raise RuntimeError("MemoryProbe is already active; it cannot be re-entered")
        self._active = True
        self._net = None
        if self._ledger is None:
            torch.cuda.synchronize(self.device)
            for outer in _ACTIVE_ON_CUDA.setdefault(self.device, []):  # keep their peaks across our reset
                outer._peak = max(outer._peak, outer._read()[0])
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
            self._peak = 0
            _ACTIVE_ON_CUDA[self.device].append(self)
        else:
            self._ledger.reset()
            self._ledger.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._ledger is None:
            torch.cuda.synchronize(self.device)
            _ACTIVE_ON_CUDA[self.device].remove(self)
        else:
            self._ledger.__exit__(exc_type, exc, tb)
        peak, self._net = self._read()
        self._peak = max(self._peak, peak)
        if self._ledger is not None:
            self._ledger.stop_tracking()
        self._active = False

    def _read(self) -> tuple[int, int]:
        """(peak, net) above the entry level, now (on CUDA, since the device's peak was last reset)."""
        if self._ledger is None:
            peak = torch.cuda.max_memory_allocated(self.device) - self._start
            return peak, torch.cuda.memory_allocated(self.device) - self._start
        return self._ledger.peak, self._ledger.live

    @property
    def peak_bytes(self) -> int:
        """Highest live bytes above the entry level, inside the block (so far, while inside)."""
        return max(self._peak, self._read()[0]) if self._active else self._peak

    @property
    def net_bytes(self) -> int:
        """Live bytes above the entry level: at exit, or now while inside."""
        if self._active:
            return self._read()[1]
        if self._net is None:
            raise RuntimeError("MemoryProbe was never entered")
        return self._net

    @property
    def survivors(self) -> list[TensorEvent]:
        """Ledger only: the storages created inside that were still alive at exit (or now)."""
        if self._ledger is None:
            raise RuntimeError("survivors are only tracked by the CPU ledger, not on CUDA")
        return list(self._ledger.survivors)

    def report(self) -> str:
        """One line of figures, plus the largest survivors on the ledger."""
        how = "CUDA allocator" if self._ledger is None else "storage ledger"
        line = (
            f"MemoryProbe({self.device}, {how}): peak {human_bytes(self.peak_bytes)}, net {human_bytes(self.net_bytes)}"
        )
        if self._ledger is None or not self.survivors:
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
