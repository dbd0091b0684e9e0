"""``PostHocEMACallback(skip_nonfinite=True)`` in a real Trainer whose loss turns NaN: the profiles stay finite and
the skipped count is logged, read once per epoch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from copy_correct import PowerEMA
from copy_correct.lightning import PostHocEMACallback
from copy_correct.posthoc_ema import snapshot_paths
from tests.lightning import test_posthoc_ema_callback
from tests.lightning.test_posthoc_ema_callback import Regressor, fit


class Diverging(Regressor):
    """The loss turns NaN at the 5th optimizer step: the weights are NaN from then on."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.trainer.global_step == 4 else loss


def test_the_callback_skips_and_logs_the_count_once_per_epoch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reads = []
    counted = PowerEMA.skipped.fget

    def skipped(ema: PowerEMA) -> int:
        reads.append(ema.step)
        return counted(ema)

    monkeypatch.setattr(PowerEMA, "skipped", property(skipped))
    monkeypatch.setattr(test_posthoc_ema_callback, "Regressor", Diverging)  # what fit trains
    callback = PostHocEMACallback(snapshot_every=4, skip_nonfinite=True)
    trainer = fit(tmp_path / "guarded", [callback], epochs=2)  # 2 epochs of 6 optimizer steps
    ema = callback.power_ema
    assert ema is not None and not torch.isfinite(ema._model.net[0].weight).all()
    assert all(torch.isfinite(v).all() for p in ema.profiles for v in p.values() if v.is_floating_point())
    assert trainer.callback_metrics["posthoc_ema/skipped"].item() == 8  # steps 5 to 12
    assert reads == [6, 12]  # once per epoch
    assert [p.name for p in snapshot_paths(tmp_path / "guarded" / "checkpoints" / "power_ema")] == [
        "power-ema-000000004.pt"  # every later snapshot holds the profiles of step 4, under that name
    ]

    control = PostHocEMACallback(snapshot_every=4)  # without the guard: NaN profiles, nothing logged
    unguarded = fit(tmp_path / "control", [control], epochs=2)
    assert control.power_ema is not None and not torch.isfinite(control.power_ema.profiles[0]["net.0.weight"]).all()
    assert "posthoc_ema/skipped" not in unguarded.callback_metrics
