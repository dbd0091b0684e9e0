"""``StepProbe``: what one steady-state training step copies, and how much memory each step leaves behind.

Copy contract: measures only; holds no tensor (CopyAudit keeps records, MemoryProbe weak references).

A Lightning callback for any LightningModule. After ``start`` training batches (optimizer state exists,
first-step allocations are done) it records one whole batch with ``CopyAudit``: forward, backward,
optimizer step, logging, every callback. Then it measures live-memory growth per step over the next
``steps`` batches with ``MemoryProbe``. A probe over ``n`` steps also counts replacements: this step's
gradients and batch took the place of the previous step's, which were allocated before the probe and so
never counted. A second probe over the first step alone measures exactly that part, so

    growth_per_step = (net over n steps - net over 1 step) / (n - 1)

is what each step leaves alive for good: zero for a loop that does not leak.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from copy_correct.probes._storage_events import human_bytes
from copy_correct.probes.copy_audit import CopyAudit
from copy_correct.probes.memory_probe import MemoryProbe

__all__ = ["StepProbe"]


class StepProbe(pl.Callback):
    """Audit one training batch, then measure memory growth per batch.

    Args:
        start: training batches to run before measuring (warm-up).
        steps: batches in the memory window (>= 2).
        stop: stop training once the window closes.
        trace: record where surviving storages were created (slower; see ``MemoryProbe.survivors``).
    """

    def __init__(self, start: int = 10, steps: int = 100, *, stop: bool = False, trace: bool = False) -> None:
        if start < 1:
            raise ValueError(f"start must be >= 1 (the first batch is warm-up), got {start}")
        if steps < 2:
            raise ValueError(f"steps must be >= 2, got {steps}")
        self.start, self.steps, self.stop, self.trace = start, steps, stop, trace
        self.audit = CopyAudit()
        self.long: MemoryProbe | None = None
        self.short: MemoryProbe | None = None
        self._batches = 0
        self.closed = False

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if self._batches == self.start:
            self.audit.__enter__()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        self._batches += 1
        done = self._batches - self.start  # batches finished since the audited one began
        if done == 1:
            self.audit.__exit__(None, None, None)
            self.long = MemoryProbe(pl_module.device, trace=self.trace).__enter__()
            self.short = MemoryProbe(pl_module.device).__enter__()
        elif done == 2 and self.short is not None:
            self.short.__exit__(None, None, None)
        elif done == self.steps + 1 and self.long is not None:
            self.long.__exit__(None, None, None)
            self.closed = True
            if self.stop:
                trainer.should_stop = True

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._close_open() and not self.closed:
            raise RuntimeError(
                f"StepProbe's window did not close: train for at least start + steps + 1 = "
                f"{self.start + self.steps + 1} batches in one fit"
            )

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._close_open()

    def _close_open(self) -> bool:
        """Leave any probe still active (innermost first), so no dispatch mode outlives the fit."""
        left_open = False
        for probe in (self.audit, self.short, self.long):
            if probe is not None and probe.active:
                probe.__exit__(None, None, None)
                left_open = True
        return left_open

    @property
    def growth_bytes(self) -> int:
        """Bytes left alive by batches 2..n of the window, beyond one batch's replacements."""
        if not self.closed or self.long is None or self.short is None:
            raise RuntimeError("StepProbe has not finished its window yet")
        return self.long.net_bytes - self.short.net_bytes

    @property
    def growth_per_step(self) -> float:
        """Live bytes each training batch leaves behind, averaged over the window."""
        return self.growth_bytes / (self.steps - 1)

    def report(self) -> str:
        """The audited batch's copies, and memory growth per step with the largest survivors."""
        lines = [f"one training batch (batch {self.start}):", self.audit.summary()]
        if self.closed and self.long is not None:
            lines += [
                f"memory over {self.steps} batches: growth {human_bytes(self.growth_bytes)} "
                f"({self.growth_per_step:.1f} B per batch)",
                self.long.report(),
            ]
        return "\n".join(lines)
