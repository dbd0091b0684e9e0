"""``LastCheckpoint``: the resume point, ``last.ckpt``, written at the end of every training epoch, every
``every_n_train_steps`` optimizer steps and every ``train_time_interval`` of training, so that it holds the final
state when ``fit`` ends whatever the interval, and a long first epoch has a resume point before it ends.

Why not a ``ModelCheckpoint``: Lightning allows one trigger per instance (``every_n_train_steps``, ``every_n_epochs``
or ``train_time_interval``), and a step interval turns its epoch-end save off: with ``every_n_train_steps=7`` a
20-step fit left ``last.ckpt`` at step 14. This callback has all three triggers and no monitor (it keeps the newest,
one file); the best checkpoint by a metric stays a ``ModelCheckpoint``'s job.

Contract:

* Saves through ``trainer.save_checkpoint`` (so through the trainer's checkpoint IO: atomically with
  ``AtomicCheckpointIO``), never twice for one optimizer step, never before the first step, only while fitting (not
  under ``fast_dev_run``). It is a Lightning ``Checkpoint``, which Lightning calls after every other callback and after
  the LightningModule's own ``on_train_epoch_end``: the state saved is the state the hooks left.
* At a batch's end only when that batch made an optimizer step (a step-interval save, as Lightning's, and a time save
  alike): within ``accumulate_grad_batches``, half-accumulated gradients are no state a checkpoint keeps, so a save
  there would not resume exactly.
* The time trigger counts seconds of this process's training since its last save of any kind (``time.monotonic``),
  from ``on_train_start``. Under several processes rank 0's clock decides: one ``strategy.broadcast`` of a bool at
  each batch end that stepped (as Lightning's ``train_time_interval`` does at each batch end); with one process no
  collective.
* No state of its own in the checkpoint: a resumed run's saves go to its own ``dirpath``.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Checkpoint

__all__ = ["LastCheckpoint"]

clock = time.monotonic  # the time trigger's clock, in seconds (a test may put a clock of its own here)


class LastCheckpoint(Checkpoint):
    """Write ``dirpath/FILENAME.ckpt`` at every training epoch's end, every ``every_n_train_steps`` optimizer steps
    (``None`` or 0: none by step) and every ``train_time_interval`` of training (seconds or a ``timedelta``; ``None``:
    none by time; 0: after every optimizer step); see the module docstring. ``dirpath`` defaults to ``checkpoints/``
    in the trainer's ``default_root_dir``. ``last_model_path``: the file, once this fit wrote it."""

    def __init__(
        self,
        dirpath: str | Path | None = None,
        filename: str = "last",
        every_n_train_steps: int | None = None,
        train_time_interval: float | timedelta | None = None,
        save_weights_only: bool = False,
    ) -> None:
        if every_n_train_steps is not None and not (_is_int(every_n_train_steps) and every_n_train_steps >= 0):
            raise ValueError(f"every_n_train_steps must be an integer >= 0 or None, got {every_n_train_steps!r}")
        interval = train_time_interval
        seconds = interval.total_seconds() if isinstance(interval, timedelta) else interval
        if seconds is not None and not (_is_number(seconds) and seconds >= 0):
            raise ValueError(f"train_time_interval must be a number of seconds >= 0 or None, got {interval!r}")
        if not filename or "/" in filename:
            raise ValueError(f"filename must be a file name without a directory, got {filename!r}")
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.filename = filename
        self.every_n_train_steps = every_n_train_steps or None  # 0, as for ModelCheckpoint: none by step
        self.train_time_interval = float(seconds) if seconds is not None else None
        self.save_weights_only = save_weights_only
        self.last_model_path = ""
        self._saved_step = -1  # the optimizer step of the last save (this fit's, or the one resumed from)
        self._saved_at = 0.0  # clock() at the last save, or of the start of training
        self._batch_start_step = 0

    @property
    def path(self) -> Path:
        """The file written (``dirpath`` resolved when ``fit`` starts)."""
        if self.dirpath is None:
            raise RuntimeError("LastCheckpoint.path before setup: dirpath comes from the trainer")
        return self.dirpath / f"{self.filename}.ckpt"

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.dirpath is None:
            self.dirpath = Path(trainer.default_root_dir) / "checkpoints"

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._saved_step = trainer.global_step  # a resumed run's checkpoint already holds this step
        self._saved_at = clock()

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batch_start_step = trainer.global_step

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step == self._batch_start_step:  # no optimizer step in this batch: mid-accumulation
            return
        by_step = self.every_n_train_steps is not None and step % self.every_n_train_steps == 0
        by_time = False
        if self.train_time_interval is not None:
            by_time = trainer.strategy.broadcast(clock() - self._saved_at >= self.train_time_interval)
        if by_step or by_time:
            self._save(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._save(trainer)

    def _save(self, trainer: pl.Trainer) -> None:
        if trainer.fast_dev_run or trainer.sanity_checking or trainer.global_step in (0, self._saved_step):
            return
        path = self.path
        trainer.save_checkpoint(path, self.save_weights_only)
        self._saved_step = trainer.global_step
        self._saved_at = clock()
        self.last_model_path = str(path)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
