"""``PostHocEMASnapshots(skip_nonfinite=True)`` in a real Trainer whose loss turns NaN: the profiles stay finite, the
skipped count is logged, read once per epoch, and the first epoch that skips warns once; a resumed run counts only
its own skips in that warning. The control, without the guard: NaN profiles, nothing logged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from copy_correct import PowerEMA, skipped_updates
from copy_correct.averages.posthoc import snapshot_paths
from copy_correct.lightning import PostHocEMASnapshots
from copy_correct.lightning._skip_log import SkipLog
from tests.lightning import test_posthoc_ema_snapshots
from tests.lightning.test_posthoc_ema_snapshots import Regressor, fit


class Diverging(Regressor):
    """The loss turns NaN at the 5th optimizer step: the weights are NaN from then on."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.trainer.global_step == 4 else loss


def skip_warnings(record: pytest.WarningsRecorder) -> list[str]:
    return [str(w.message) for w in record if "skipped in epoch" in str(w.message)]


def test_the_callback_skips_and_logs_the_count_once_per_epoch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reads = []
    counted, saved = PowerEMA._skipped_count, PowerEMA.state_dict
    saving = []

    def skipped(ema: PowerEMA) -> int:
        if not saving:  # a checkpoint's state reads the count too, once per save
            reads.append(ema.step)
        return counted(ema)

    def state_dict(ema: PowerEMA) -> dict[str, Any]:
        saving.append(True)
        try:
            return saved(ema)
        finally:
            saving.pop()

    monkeypatch.setattr(PowerEMA, "_skipped_count", skipped)
    monkeypatch.setattr(PowerEMA, "state_dict", state_dict)
    monkeypatch.setattr(test_posthoc_ema_snapshots, "Regressor", Diverging)  # what fit trains
    callback = PostHocEMASnapshots(snapshot_every=4, skip_nonfinite=True)
    warning = r"PowerEMA: 2 update\(s\) skipped in epoch 0: the live weights held NaN or Inf"
    with pytest.warns(UserWarning, match=warning) as record:
        trainer = fit(tmp_path / "guarded", [callback], epochs=2)  # 2 epochs of 6 optimizer steps
    assert len(skip_warnings(record)) == 1  # epoch 1 skipped 6 more: warned once
    ema = callback.power_ema
    assert ema is not None and ema.skip_nonfinite and not torch.isfinite(ema._model.net[0].weight).all()
    assert all(torch.isfinite(v).all() for p in ema.profiles for v in p.values() if v.is_floating_point())
    assert trainer.callback_metrics["posthoc_ema/skipped"].item() == 8  # steps 5 to 12
    assert reads == [6, 12]  # once per epoch
    assert [p.name for p in snapshot_paths(tmp_path / "guarded" / "checkpoints" / "power_ema")] == [
        "power-ema-000000004.pt"  # every later snapshot holds the profiles of step 4, under that name
    ]

    control = PostHocEMASnapshots(snapshot_every=4)  # without the guard: NaN, nothing logged
    unguarded = fit(tmp_path / "control", [control], epochs=2)
    assert control.power_ema is not None and not torch.isfinite(control.power_ema.profiles[0]["net.0.weight"]).all()
    assert "posthoc_ema/skipped" not in unguarded.callback_metrics


class Spikes(pl.Callback):
    """A NaN in the first weight after the optimizer steps in ``steps``, seen by the callbacks after this one (the
    PostHocEMASnapshots's update), taken out before the next batch: a run that recovers (its checkpoints finite)."""

    def __init__(self, steps: set[int]) -> None:
        self.steps = steps
        self._kept: torch.Tensor | None = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step in self.steps and self._kept is None:
            self.steps = self.steps - {trainer.global_step}
            with torch.no_grad():
                self._kept = pl_module.net[0].weight[0, 0].clone()
                pl_module.net[0].weight[0, 0] = float("nan")

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self._kept is not None:
            with torch.no_grad():
                pl_module.net[0].weight[0, 0] = self._kept
            self._kept = None


def test_a_resumed_run_warns_of_its_own_skips(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first fit (steps 1 to 6) skips steps 4 and 5 and warns of them; the resumed one (steps 7 to 12) skips 8, 9
    and 10 and warns of those 3, logging the count of the whole run (5). The control: a log that is not told the
    resumed count warns of 5."""
    steps = {4, 5, 8, 9, 10}
    with pytest.warns(UserWarning, match=r"PowerEMA: 2 update\(s\) skipped in epoch 0"):
        fit(tmp_path / "first", [Spikes(steps), PostHocEMASnapshots(snapshot_every=4, skip_nonfinite=True)], epochs=1)
    last = tmp_path / "first" / "checkpoints" / "last.ckpt"
    resumed = PostHocEMASnapshots(snapshot_every=4, skip_nonfinite=True)
    with pytest.warns(UserWarning, match=r"PowerEMA: 3 update\(s\) skipped in epoch 1") as record:
        trainer = fit(tmp_path / "resumed", [Spikes(steps), resumed], epochs=2, ckpt_path=last)
    assert len(skip_warnings(record)) == 1
    assert trainer.callback_metrics["posthoc_ema/skipped"].item() == 5
    assert resumed.power_ema is not None and (skipped_updates(resumed.power_ema), resumed.power_ema.applied_step) == (
        5,
        12,
    )
    assert all(torch.isfinite(v).all() for p in resumed.power_ema.profiles for v in p.values() if v.is_floating_point())

    monkeypatch.setattr(SkipLog, "resumed", lambda self, skipped: None)
    with pytest.warns(UserWarning, match=r"PowerEMA: 5 update\(s\) skipped in epoch 1"):
        control = PostHocEMASnapshots(snapshot_every=4, skip_nonfinite=True)
        fit(tmp_path / "control", [Spikes(steps), control], epochs=2, ckpt_path=last)
