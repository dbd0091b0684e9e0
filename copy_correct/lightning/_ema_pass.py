"""``EMAPass``: one evaluation run of ``EMAWeights`` with the EMA weights in the module, and the two hooks by which
``evaluate="both"`` logs both passes' epoch-end metrics in one call (``held_back``, ``logged_with``).

Copy contract: the pass holds the average in the module through ``EMA.average_weights`` (one backup of the live
values for the pass, the live values back bit for bit on exit, an exception too; nothing written in the module
reaches the average). A checkpoint save steps out of the pass (``stepped_out``): the live weights back in the module
and every callback present for the save, the average in again after it. Nothing else here touches a tensor: the
suffixed logging renames the module's ``self.log`` calls, and the held-back metrics are the values Lightning logs.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from typing import Any

import lightning.pytorch as pl

from copy_correct.averages.ema import EMA
from copy_correct.lightning._lightning_internals import LogMetrics

__all__ = ["EMAPass", "held_back", "logged_with"]


class EMAPass:
    """One evaluation run with the EMA weights in the module (``suffix``: also logging under suffixed names, with
    no callback hooks), which a checkpoint save steps out of and back into."""

    def __init__(self, trainer: pl.Trainer, pl_module: pl.LightningModule, ema: EMA, suffix: str | None) -> None:
        self._trainer, self._module, self._ema, self._suffix = trainer, pl_module, ema, suffix
        self._stack = ExitStack()

    def __enter__(self) -> None:
        self._stack = ExitStack()
        self._stack.enter_context(self._ema.average_weights())
        if self._suffix is not None:
            self._stack.enter_context(_suffixed_logging(self._module, self._suffix))
            self._stack.enter_context(_quiet(self._trainer))

    def __exit__(self, *exc_info: Any) -> bool:
        return self._stack.__exit__(*exc_info)

    @contextmanager
    def stepped_out(self) -> Iterator[None]:
        """Live weights in the module, the average in the EMA, every callback back; the pass resumes after."""
        self._stack.close()
        try:
            yield
        finally:
            self.__enter__()


@contextmanager
def _suffixed_logging(pl_module: pl.LightningModule, suffix: str) -> Iterator[None]:
    """Every ``self.log(name, ...)`` of the module (and so ``log_dict``) logs ``name + suffix`` instead."""
    log = pl_module.log

    def log_with_suffix(name: str, *args: Any, **kwargs: Any) -> None:
        log(f"{name}{suffix}", *args, **kwargs)

    pl_module.log = log_with_suffix  # type: ignore[method-assign]
    try:
        yield
    finally:
        del pl_module.log


def held_back(held: dict[str, Any], log: LogMetrics) -> LogMetrics:
    """The epoch-end metrics of the EMA pass, kept from the loggers: Lightning's call that logs an evaluation epoch's
    metrics (``log``) only collects them into ``held``."""
    return held.update


def logged_with(held: Mapping[str, Any], log: LogMetrics) -> LogMetrics:
    """The live pass's epoch-end metrics logged with ``held`` beside them, in one call: one row of ``metrics.csv``."""

    def log_both(metrics: Mapping[str, Any]) -> None:
        log({**metrics, **held})

    return log_both


@contextmanager
def _quiet(trainer: pl.Trainer) -> Iterator[None]:
    """No callback hooks (checkpointing, early stopping, progress bars) during the EMA pass."""
    callbacks = trainer.callbacks
    trainer.callbacks = []
    try:
        yield
    finally:
        trainer.callbacks = callbacks
