"""``EMAWeights(skip_nonfinite=True)`` in a real Trainer: a run whose weights turn NaN keeps a finite average, the
skipped count is logged once per epoch (one read of the counter), not per step, and the first epoch that skips warns
once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from copy_correct import EMA
from copy_correct.lightning import EMAWeights
from tests.lightning.test_ema_weights import Regressor, loader, trainer


class Diverging(Regressor):
    """The loss turns NaN at the 11th optimizer step: the weights are NaN from then on."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.trainer.global_step == 10 else loss


def test_a_diverging_run_keeps_a_finite_average_and_logs_the_skipped_count_once_per_epoch(
    tmp_path: Path, monkeypatch
) -> None:
    reads = []
    counted = EMA._skipped_count

    def skipped(ema: EMA) -> int:
        reads.append(ema.step)
        return counted(ema)

    monkeypatch.setattr(EMA, "_skipped_count", skipped)
    callback = EMAWeights(decay=0.9, skip_nonfinite=True)
    t = trainer(tmp_path, [callback], limit_val_batches=0)
    with pytest.warns(
        UserWarning, match=r"EMA: 6 update\(s\) skipped in epoch 1: the live weights held NaN or Inf"
    ) as w:
        t.fit(Diverging(), loader(), loader())  # 2 epochs of 8 steps (no validation: limit_val_batches=0)
    assert sum("skipped in epoch" in str(warning.message) for warning in w) == 1
    ema = callback.ema
    assert ema is not None and not torch.isfinite(ema.live_model.net[0].weight).all()
    assert all(torch.isfinite(v).all() for v in ema.shadow.values() if v.is_floating_point())
    assert t.callback_metrics["ema/skipped"].item() == 6  # steps 11 to 16
    assert reads == [8, 16]  # once per epoch

    control = EMAWeights(decay=0.9)  # without the guard: the average is NaN for good, and nothing is logged
    unguarded = trainer(tmp_path, [control], limit_val_batches=0)
    unguarded.fit(Diverging(), loader(), loader())
    assert control.ema is not None and not torch.isfinite(control.ema.shadow["net.0.weight"]).all()
    assert "ema/skipped" not in unguarded.callback_metrics
