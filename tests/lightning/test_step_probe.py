"""StepProbe: one audited batch and memory growth per batch, in a real Trainer; and the report script."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from copy_correct.lightning import StepProbe

ROOT = Path(__file__).resolve().parents[2]


class Tiny(pl.LightningModule):
    def __init__(self, keep: bool) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 8)
        self.keep = keep
        self.kept: list[torch.Tensor] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        out = self.layer(batch[0])
        if self.keep:
            self.kept.append(out.detach().clone())  # 4 x 8 float32 = 128 B per batch, kept for good
        return out.square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(module: pl.LightningModule, probe: StepProbe, max_steps: int) -> None:
    loader = DataLoader(TensorDataset(torch.randn(400, 8)), batch_size=4)
    trainer = pl.Trainer(
        max_steps=max_steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu",
    )  # fmt: skip
    trainer.callbacks.append(probe)
    trainer.fit(module, loader)


@pytest.mark.parametrize(("keep", "growth"), [(False, 0), (True, 128)])
def test_growth_per_step_is_what_each_batch_keeps(keep: bool, growth: int) -> None:
    probe = StepProbe(start=2, steps=11, stop=True)
    _fit(Tiny(keep), probe, max_steps=50)
    assert probe.closed
    assert probe.growth_per_step == growth
    assert probe.audit.count("addmm") == 1  # the audited batch's forward
    assert "memory over 11 batches" in probe.report()


def test_window_that_cannot_close_is_a_clear_error_and_leaves_no_mode_active() -> None:
    probe = StepProbe(start=2, steps=20)
    with pytest.raises(RuntimeError, match="did not close"):
        _fit(Tiny(False), probe, max_steps=5)
    assert probe.long is not None and not probe.long.active and not probe.audit.active


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="start"):
        StepProbe(start=0)
    with pytest.raises(ValueError, match="steps"):
        StepProbe(steps=1)
