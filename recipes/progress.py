"""How a run shows its progress (``callbacks.progress_bar`` in ``conf/callbacks/default.yaml``): Lightning's bars on
a terminal, one line per epoch when the output goes to a file or a pipe.

A bar redraws itself several times a second with a carriage return: a terminal overwrites it in place, a file keeps
every redraw (tens of kilobytes per epoch). ``style=auto`` (the default) asks ``sys.stdout.isatty()`` in the process
that trains; ``style=bar`` or ``style=lines`` forces one. ``trainer.enable_progress_bar=false`` turns both off.
"""

from __future__ import annotations

import sys
import time

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ProgressBar, TQDMProgressBar

__all__ = ["STYLES", "EpochLines", "progress_bar"]

STYLES = ("auto", "bar", "lines")


def progress_bar(style: str = "auto", enabled: bool = True) -> ProgressBar | None:
    """The progress callback for ``style`` (``auto``: bars when stdout is a terminal, lines otherwise); ``None`` when
    not ``enabled`` (Lightning refuses a progress bar callback under ``enable_progress_bar=False``)."""
    if style not in STYLES:
        raise ValueError(f"style must be one of {', '.join(STYLES)}, got {style!r}")
    if not enabled:
        return None
    if style == "bar" or (style == "auto" and sys.stdout.isatty()):
        return TQDMProgressBar()
    return EpochLines()


class EpochLines(ProgressBar):
    """One line per training epoch on stdout, written when the epoch ends (after its validation, when it has one):
    the epoch, the optimizer steps so far, every metric the run has logged at epoch level (``trainer.callback_metrics``:
    the latest value of each) and the epoch's wall time in this process. Only global rank 0 writes.

    The clock starts at each epoch's start, and when training starts: a run resumed mid-epoch gets no
    ``on_train_epoch_start`` for the epoch it resumes (Lightning calls it only for an epoch it begins), so its first
    line gives the seconds since it started training, not since whenever its clock last read zero."""

    def __init__(self) -> None:
        super().__init__()
        self._enabled = True
        self._started = 0.0

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._started = time.perf_counter()

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._started = time.perf_counter()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._enabled:
            return
        # e.g. "epoch 3/15  step 138  train/loss 0.1234  val/acc 0.9556  4.1 s": the epoch counted from 1
        epochs = f"/{trainer.max_epochs}" if trainer.max_epochs and trainer.max_epochs > 0 else ""
        metrics = "".join(f"  {name} {float(value):.4g}" for name, value in trainer.callback_metrics.items())
        seconds = time.perf_counter() - self._started
        self.print(
            f"epoch {trainer.current_epoch + 1}{epochs}  step {trainer.global_step}{metrics}  {seconds:.1f} s",
            flush=True,
        )
