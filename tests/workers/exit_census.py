"""A callback the multi-process ``train.py`` tests add with ``+callbacks.exit_census``: each rank records, at its exit,
whether its process group is still initialized and which of gloo's threads still run (``DIRPATH/exit{R}.pt``,
``tests.workers.record_exit_census``)."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl

from tests.workers import record_exit_census


class ExitCensus(pl.Callback):
    def __init__(self, dirpath: str) -> None:
        self.dirpath = Path(dirpath)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.dirpath.mkdir(parents=True, exist_ok=True)
        record_exit_census(self.dirpath / f"exit{trainer.global_rank}.pt")
