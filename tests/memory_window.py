"""A test helper: live-memory growth per training step, measured with MemoryProbe inside a real Trainer.

A probe opened at step ``s`` and closed at step ``s + n`` counts what the ``n`` steps created and left
alive. Part of that is not growth but replacement: this step's gradients and batch, which the previous
step's (allocated before the probe, so never counted) made way for. A second probe over the first step
alone measures exactly that part, so ``(long.net - short.net) / (n - 1)`` is the growth per step.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from components import MemoryProbe


class GrowthWindow(pl.Callback):
    """Opens the probes after training step ``start`` and closes them ``steps`` steps later."""

    def __init__(self, start: int, steps: int, device: str = "cpu") -> None:
        if steps < 2:
            raise ValueError("steps must be >= 2")
        self.start, self.steps = start, steps
        self.long = MemoryProbe(device, trace=True)
        self.short = MemoryProbe(device)
        self.closed = False

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        step = trainer.global_step
        if step == self.start:
            self.long.__enter__()
            self.short.__enter__()
        elif step == self.start + 1:
            self.short.__exit__(None, None, None)
        elif step == self.start + self.steps:
            self.long.__exit__(None, None, None)
            self.closed = True
            trainer.should_stop = True

    @property
    def growth_bytes(self) -> int:
        """Bytes left alive by steps 2..n of the window, beyond one step's replacements."""
        if not self.closed:
            raise RuntimeError("the window never closed: train for at least start + steps steps")
        return self.long.net_bytes - self.short.net_bytes

    @property
    def growth_per_step(self) -> float:
        return self.growth_bytes / (self.steps - 1)
