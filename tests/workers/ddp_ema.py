"""Run by tests/lightning/test_ema_weights.py: 2 CPU processes (gloo) train with EMAWeights; each rank saves its
shadow."""

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from copy_correct.lightning import EMAWeights
from copy_correct.lightning._rank_zero_buffers import RankZeroBuffers
from recipes.process_group import end_process_group
from tests.lightning.test_ema_weights import Regressor


class SaveShadow(pl.Callback):
    def __init__(self, ema: EMAWeights, out: Path) -> None:
        self.ema, self.out = ema, out

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self.ema.ema is not None
        torch.save(dict(self.ema.ema.shadow), self.out / f"rank{trainer.global_rank}.pt")


class NoSync(RankZeroBuffers):
    def sync(self, trainer: pl.Trainer, module: torch.nn.Module) -> None:
        pass


class WithoutBufferSync(EMAWeights):
    """The control: each rank averages its own BatchNorm statistics."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._broadcast = NoSync()


if __name__ == "__main__":
    out = Path(sys.argv[1])
    control = len(sys.argv) > 2 and sys.argv[2] == "control"
    pl.seed_everything(0)
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(256, 8, generator=generator), torch.randn(256, 1, generator=generator))
    ema = (WithoutBufferSync if control else EMAWeights)(decay=0.9)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[ema, SaveShadow(ema, out)],
    )  # fmt: skip
    trainer.fit(Regressor(), DataLoader(data, batch_size=16))
    del trainer  # it holds the process group: freed with it, as train.py ends a run
    end_process_group()
