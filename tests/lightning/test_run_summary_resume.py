"""``RunSummary`` after a resume into another directory: ``best`` is the better of the crashed run's best (with the
score its checkpoint recorded) and the resumed run's, as an uninterrupted run's; the control, what Lightning's
``ModelCheckpoint`` holds there (and what the summary copied before), is the crashed run's file with no score."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from copy_correct.lightning import LastCheckpoint, RunSummary


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val/loss", nn.functional.mse_loss(self.net(batch[0]), batch[1]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def loader() -> DataLoader:
    data = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=data)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16)


def fit(run: Path, epochs: int, ckpt_path: Path | None = None) -> tuple[pl.Trainer, dict[str, Any]]:
    """The checkpoints and summary of conf/callbacks/default.yaml, in ``run``; the trainer and ``summary.json``."""
    torch.manual_seed(0)
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=epochs, logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, callbacks=[
            ModelCheckpoint(run / "checkpoints", "epoch{epoch:03d}", monitor="val/loss", auto_insert_metric_name=False),
            LastCheckpoint(run / "checkpoints"), RunSummary(run, recipe="test", seed=0),
        ],
    )  # fmt: skip
    trainer.fit(Regressor(), loader(), loader(), ckpt_path=ckpt_path)
    return trainer, json.loads((run / "summary.json").read_text())


def test_a_resumed_runs_best_is_the_better_of_both_runs_with_its_score(tmp_path: Path) -> None:
    _, crashed = fit(tmp_path / "crashed", epochs=2)
    _, straight = fit(tmp_path / "straight", epochs=3)
    last = tmp_path / "crashed" / "checkpoints" / "last.ckpt"

    started = time.perf_counter()
    trainer, at_end = fit(tmp_path / "at_end", epochs=2, ckpt_path=last)  # resumed where it ended: no new best
    took = time.perf_counter() - started
    assert at_end["checkpoints"]["best"] == crashed["checkpoints"]["best"]
    assert at_end["checkpoints"]["best_score"] == crashed["checkpoints"]["best_score"] is not None
    assert at_end["checkpoints"]["last"] == str(last)  # it wrote none: its state is the one it resumed from
    assert at_end["wall_s"] < took
    callback = trainer.checkpoint_callback  # the control: Lightning's best, what the summary used to copy
    assert callback.best_model_path == crashed["checkpoints"]["best"] and callback.best_model_score is None

    _, resumed = fit(tmp_path / "resumed", epochs=3, ckpt_path=last)
    assert resumed["checkpoints"]["best_score"] == straight["checkpoints"]["best_score"]
    assert Path(resumed["checkpoints"]["best"]).name == Path(straight["checkpoints"]["best"]).name
    assert Path(resumed["checkpoints"]["last"]) == tmp_path / "resumed" / "checkpoints" / "last.ckpt"
