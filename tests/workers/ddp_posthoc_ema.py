"""Run by tests/lightning/test_posthoc_ema_snapshots.py: 2 CPU processes (gloo, DDP) train with PostHocEMASnapshots
and a ModelCheckpoint; each rank saves its step counters, its profiles and whether it writes snapshots."""

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from copy_correct.lightning import PostHocEMASnapshots
from recipes.process_group import end_process_group
from tests.lightning.test_posthoc_ema_snapshots import Regressor, loader


class SaveProfiles(pl.Callback):
    def __init__(self, callback: PostHocEMASnapshots, out: Path) -> None:
        self.callback, self.out = callback, out

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        ema = self.callback.power_ema
        assert ema is not None
        state = {"step": ema.step, "writes": self.callback.writes, "profiles": [dict(p) for p in ema.profiles]}
        torch.save(state, self.out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    out = Path(sys.argv[1])
    pl.seed_everything(0)
    callback = PostHocEMASnapshots(snapshot_every=2)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, accumulate_grad_batches=2, logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
        callbacks=[callback, SaveProfiles(callback, out), ModelCheckpoint(dirpath=out / "checkpoints")],
    )  # fmt: skip
    trainer.fit(Regressor(), loader())
    del trainer  # it holds the process group: freed with it, as train.py ends a run
    end_process_group()
