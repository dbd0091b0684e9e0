"""``IsolatedEvaluation``: a user's module (dropout in training, a plain shuffled ``DataLoader``, noise drawn in its
validation step from torch's, NumPy's or Python's generator) trains to the same weights, optimizer state and
generator states, bit for bit, whether it validates after every epoch, twice an epoch or once at the end (with
``EMAWeights``'s two evaluation passes: ``tests/lightning/test_ema_weights.py``); a checkpoint saved when a
validation ends holds the generators as the training batch before it left them. The control of each: the same runs
without the callback end elsewhere."""

from __future__ import annotations

import random
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from copy_correct.lightning import IsolatedEvaluation
from tests.conftest import DEVICES

ONCE = {"check_val_every_n_epoch": 3}  # of 3 epochs: once, at the end
OFTEN = {
    "every epoch": {"check_val_every_n_epoch": 1},
    "twice an epoch": {"val_check_interval": 2},  # of 4 batches
}


class UsersModule(pl.LightningModule):
    """Dropout in training, noise in validation (from the global generators), plain loaders of 32 rows."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 1))
        rows = torch.Generator().manual_seed(0)
        self.data = TensorDataset(torch.randn(32, 8, generator=rows), torch.randn(32, 1, generator=rows))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        noisy = x + 0.1 * torch.randn(x.shape, device=self.device)
        self.log("val/loss", F.mse_loss(self.net(noisy), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=8, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=16)


def fit(device: str, schedule: dict[str, Any], callbacks: list[pl.Callback]) -> dict[str, Any]:
    """The weights, optimizer state and generator states (CPU, and the device's) a 3-epoch fit ends with."""
    pl.seed_everything(0, verbose=False)
    module = UsersModule()
    trainer = pl.Trainer(
        accelerator=device, devices=1, max_epochs=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks, **schedule,
    )  # fmt: skip
    trainer.fit(module)
    ema = [c.ema.state_dict()["shadow"] for c in callbacks if getattr(c, "ema", None) is not None]  # EMAWeights's
    generators = [torch.get_rng_state(), *([torch.cuda.get_rng_state()] if device == "cuda" else [])]
    return {
        "weights": module.state_dict(),
        "optimizer": trainer.optimizers[0].state_dict()["state"],
        "ema": ema,
        "generators": generators,
    }


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    flat = [(x, y) for key in a for x, y in zip(_tensors(a[key]), _tensors(b[key]), strict=True)]
    return all(torch.equal(x, y) for x, y in flat)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    items = value.values() if isinstance(value, dict) else value
    return [t for item in items for t in _tensors(item)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("often", OFTEN)
def test_validating_often_trains_as_validating_once_and_the_control_does_not(device: str, often: str) -> None:
    schedule = OFTEN[often]
    once = fit(device, ONCE, [IsolatedEvaluation()])
    assert same(fit(device, schedule, [IsolatedEvaluation()]), once)
    assert not same(fit(device, schedule, []), once)  # the control: validation moved training


class GeneratorsAtBatchEnd(pl.Callback):
    """Records torch's CPU generator state after each training batch; stamps it into every checkpoint."""

    def __init__(self) -> None:
        self.at_batch_end: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.at_batch_end.append(torch.get_rng_state())

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        checkpoint["cpu_generator"] = torch.get_rng_state()


@pytest.mark.parametrize("isolated", [True, False], ids=["isolated", "control"])
def test_a_checkpoint_saved_when_validation_ends_holds_the_generator_training_left(
    isolated: bool, tmp_path: Any
) -> None:
    """``ModelCheckpoint(monitor=...)`` saves in ``on_validation_end``; Lightning calls it after every other callback,
    so after the restore: resuming from that checkpoint draws what the uninterrupted run draws next."""
    stamp = GeneratorsAtBatchEnd()
    best = ModelCheckpoint(tmp_path, monitor="val/loss", save_top_k=-1, filename="{epoch}")
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[best, stamp, *([IsolatedEvaluation()] if isolated else [])],
    )  # fmt: skip
    trainer.fit(UsersModule())
    saved = torch.load(tmp_path / "epoch=0.ckpt", weights_only=True)["cpu_generator"]
    assert torch.equal(saved, stamp.at_batch_end[-1]) == isolated


class NumpyUsersModule(UsersModule):
    """Noise from NumPy's and Python's global generators in validation, and from the same generators in training."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        jitter = torch.from_numpy(np.random.normal(0, 0.1, x.shape).astype(np.float32)) * random.random()
        return F.mse_loss(self.net(x + jitter.to(self.device)), y)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        noisy = x + torch.from_numpy(np.random.normal(0, 0.1, x.shape).astype(np.float32)).to(self.device)
        random.shuffle(list(range(8)))  # evaluation code's draw from Python's generator
        self.log("val/loss", F.mse_loss(self.net(noisy), y))


@pytest.mark.parametrize("isolated", [True, False], ids=["isolated", "control"])
def test_numpy_and_python_draws_in_validation_do_not_move_training(isolated: bool) -> None:
    """The control: without the callback, validating every epoch ends with other weights than validating once."""

    def weights(schedule: dict[str, Any]) -> dict[str, torch.Tensor]:
        pl.seed_everything(0, verbose=False)
        module = NumpyUsersModule()
        trainer = pl.Trainer(
            accelerator="cpu", max_epochs=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=[IsolatedEvaluation()] if isolated else [], **schedule,
        )  # fmt: skip
        trainer.fit(module)
        return {**module.state_dict(), "numpy": torch.from_numpy(np.random.get_state()[1].astype(np.int64)),
                "python": torch.tensor(random.getstate()[1])}  # fmt: skip

    once, often = weights(ONCE), weights(OFTEN["every epoch"])
    assert all(torch.equal(once[k], often[k]) for k in once) == isolated
