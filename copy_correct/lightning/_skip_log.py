"""``SkipLog``: an average's skipped-update count (``skip_nonfinite``), logged once per training epoch, with one warning
line the first time an epoch skips. The count is read at epoch end only (on a GPU, one sync per epoch), never per
step; every rank counts the same (the same parameters, rank 0's buffers), so rank 0 logs and warns."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn

__all__ = ["SkipLog"]


class SkipLog:
    """Logs ``key`` (``"ema/skipped"``) for an average called ``what`` (``"EMA"``), from the count it is given."""

    def __init__(self, key: str, what: str) -> None:
        self.key, self.what = key, what
        self._seen = 0  # the count at the last epoch's end
        self._warned = False

    def resumed(self, skipped: int) -> None:
        """The count a resumed average starts from: its skips are not this run's."""
        self._seen = skipped

    def epoch_end(self, pl_module: pl.LightningModule, skipped: int) -> None:
        """Log ``skipped`` (the count so far) for the epoch; warn the first time it grew over an epoch."""
        pl_module.log(self.key, float(skipped), on_step=False, on_epoch=True, rank_zero_only=True)
        if skipped > self._seen and not self._warned:
            self._warned = True
            rank_zero_warn(
                f"{self.what}: {skipped - self._seen} update(s) skipped in epoch {pl_module.current_epoch}: the live "
                f"weights held NaN or Inf, and the average kept its value ({self.key} counts them; warned once)"
            )
        self._seen = skipped
