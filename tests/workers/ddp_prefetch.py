"""Run by tests/parts/test_prefetch.py: 2 CPU processes (gloo) iterate a DeviceDataLoader; each rank saves what it saw.

With ``control`` the training data is a bare DevicePrefetcher (not a DataLoader): Lightning cannot inject
its DistributedSampler, so every rank sees every sample.
"""

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from copy_correct import DeviceDataLoader, DevicePrefetcher
from recipes.process_group import end_process_group


class RecordIndices(pl.LightningModule):
    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out
        self.layer = nn.Linear(1, 1)
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        features, index = batch
        self.seen.append(index)
        return self.layer(features).pow(2).mean()

    def on_train_end(self) -> None:
        torch.save(torch.cat(self.seen), self.out / f"rank{self.global_rank}.pt")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class IndexData(pl.LightningDataModule):
    def __init__(self, control: bool) -> None:
        super().__init__()
        self.control = control
        self.data = TensorDataset(torch.randn(32, 1), torch.arange(32))

    def train_dataloader(self) -> DataLoader | DevicePrefetcher:
        device = self.trainer.strategy.root_device
        if self.control:
            return DevicePrefetcher(DataLoader(self.data, batch_size=4, shuffle=True), device)
        return DeviceDataLoader(self.data, batch_size=4, shuffle=True, device=device)


if __name__ == "__main__":
    out = Path(sys.argv[1])
    control = len(sys.argv) > 2 and sys.argv[2] == "control"
    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(RecordIndices(out), datamodule=IndexData(control))
    del trainer  # it holds the process group: freed with it, as train.py ends a run
    end_process_group()
