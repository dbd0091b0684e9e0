"""``DataWaitMonitor``: samples per second, and the share of training time spent waiting for the next batch.

Copy contract: reads only host clocks and the batch's first dimension; holds no tensor, makes no copy.

Per training epoch it logs ``perf/samples_per_s`` (samples over the epoch's wall time, from the first
batch's start to the last batch's end, after one device synchronisation at epoch end so queued GPU work
is counted; under DDP the sum over ranks) and ``perf/data_wait_fraction``: the time between one batch's
end and the next batch's start (fetching from the loader and Lightning's transfer to the device) over
that wall time (under DDP the ranks' mean). The first batch
of an epoch is the clock's start, so worker start-up is not counted. Times are host times: on a GPU a
copy queued asynchronously costs the host nothing, and is seen here only when it delays the step.
"""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import torch

__all__ = ["DataWaitMonitor"]


def _batch_size(batch: Any) -> int:
    while isinstance(batch, (list, tuple)) and batch:
        batch = batch[0]
    if isinstance(batch, dict) and batch:
        return _batch_size(next(iter(batch.values())))
    return int(batch.shape[0]) if isinstance(batch, torch.Tensor) and batch.dim() else 1


class DataWaitMonitor(pl.Callback):
    """Logs ``perf/samples_per_s`` and ``perf/data_wait_fraction`` at the end of every training epoch."""

    def __init__(self) -> None:
        self._start: float | None = None
        self._last_end: float | None = None
        self._wait = 0.0
        self._samples = 0

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = self._last_end = None
        self._wait = 0.0
        self._samples = 0

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        if self._start is None:
            self._start = now
        elif self._last_end is not None:
            self._wait += now - self._last_end

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._samples += _batch_size(batch)
        self._last_end = time.perf_counter()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._start is None:
            return
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)  # once per epoch, so the rate counts the queued GPU work
        elapsed = time.perf_counter() - self._start
        # Under DDP: the job's throughput (summed over ranks) and the ranks' mean waiting share.
        pl_module.log("perf/samples_per_s", self._samples / elapsed, sync_dist=True, reduce_fx="sum")
        pl_module.log("perf/data_wait_fraction", self._wait / elapsed, sync_dist=True)
