"""``LastCheckpoint``: ``last.ckpt`` holds the final state when fit ends whatever the step interval (a
``ModelCheckpoint`` with a step interval, the control, stops at the last multiple: step 14 of 20), a time interval
gives a resume point before the first epoch ends (the control without it: none), time saves are made only at a batch
that made an optimizer step, and a run resumed from one ends bit for bit as the uninterrupted one (the control, a
save in the middle of gradient accumulation, ends elsewhere)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from copy_correct.lightning import LastCheckpoint, ResumeState
from copy_correct.lightning import last_checkpoint as last_checkpoint_module

BATCHES = 20  # one epoch


class Regressor(pl.LightningModule):
    """Dropout and a shuffled loader: a resume that is not exact shows in the weights."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.ReLU(), nn.Linear(8, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class Clock(pl.Callback):
    """A clock for ``LastCheckpoint``'s time trigger that advances one second per training batch (a callback of its
    own, which Lightning calls before any checkpoint callback); it also notes each save's step and batch, and, with
    ``copies``, copies the file saved into ``copies/STEP.ckpt``."""

    def __init__(self, copies: Path | None = None) -> None:
        self.now = 0.0
        self.batch = -1
        self.saves: list[tuple[int, int]] = []  # (global step, batch index in the epoch)
        self.copies = copies

    def __call__(self) -> float:
        return self.now

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.now += 1.0
        self.batch = args[-1]

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: Any) -> None:
        self.saves.append((trainer.global_step, self.batch))


def loader() -> DataLoader:
    data = torch.Generator().manual_seed(0)
    items = TensorDataset(torch.randn(BATCHES * 4, 4, generator=data), torch.randn(BATCHES * 4, 1, generator=data))
    return DataLoader(items, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1))


def fit(
    directory: Path, checkpoint: pl.Callback, *, epochs: int = 1, accumulate: int = 1, clock: Clock | None = None,
    ckpt_path: Path | None = None,
) -> pl.Trainer:  # fmt: skip
    torch.manual_seed(0 if ckpt_path is None else 7)  # a resumed run's generators come from the checkpoint
    callbacks = [c for c in (clock, ResumeState(), checkpoint) if c is not None]
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=epochs, accumulate_grad_batches=accumulate, logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=directory, callbacks=callbacks,
    )  # fmt: skip
    if clock is not None and clock.copies is not None:
        save, copies = trainer.save_checkpoint, clock.copies

        def save_and_copy(path: Any, weights_only: bool = False, storage_options: Any = None) -> None:
            save(path, weights_only, storage_options)
            copies.mkdir(exist_ok=True)
            shutil.copy(path, copies / f"{trainer.global_step}.ckpt")

        trainer.save_checkpoint = save_and_copy  # type: ignore[method-assign]
    trainer.fit(Regressor(), loader(), ckpt_path=ckpt_path)
    return trainer


def saved_step(path: Path) -> int:
    return torch.load(path, weights_only=True)["global_step"]


def test_with_a_step_interval_last_holds_the_final_step_where_a_model_checkpoint_stops_at_the_last_multiple(
    tmp_path: Path,
) -> None:
    clock = Clock()
    fit(tmp_path / "ours", LastCheckpoint(tmp_path / "ours", every_n_train_steps=7), clock=clock)
    assert [step for step, _ in clock.saves] == [7, 14, 20]
    assert saved_step(tmp_path / "ours" / "last.ckpt") == BATCHES

    control = ModelCheckpoint(  # the old conf/callbacks/default.yaml last_checkpoint, with the interval of issue 39
        tmp_path / "control", "last", save_top_k=1, save_on_train_epoch_end=True, enable_version_counter=False,
        every_n_train_steps=7,
    )  # fmt: skip
    fit(tmp_path / "control", control)
    assert saved_step(tmp_path / "control" / "last.ckpt") == 14  # the last 6 steps lost


def test_a_time_interval_saves_before_the_first_epoch_ends_and_only_after_an_optimizer_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = Clock()
    monkeypatch.setattr(last_checkpoint_module, "clock", clock)
    fit(tmp_path / "timed", LastCheckpoint(tmp_path / "timed", train_time_interval=5), epochs=2, accumulate=2,
        clock=clock)  # fmt: skip
    # 2 s per optimizer step (2 batches): a save once 5 s passed since the last one, and at each epoch's end (step 10)
    assert [step for step, _ in clock.saves] == [3, 6, 9, 10, 13, 16, 19, 20]
    assert all(batch % 2 == 1 for _, batch in clock.saves)  # each at the batch that stepped (or the epoch's last)

    control = Clock()  # the control: no time interval, the first resume point is the first epoch's end
    monkeypatch.setattr(last_checkpoint_module, "clock", control)
    fit(tmp_path / "untimed", LastCheckpoint(tmp_path / "untimed"), epochs=2, accumulate=2, clock=control)
    assert [step for step, _ in control.saves] == [10, 20]


class SavesMidAccumulation(LastCheckpoint):
    """The control: a time trigger that does not wait for the optimizer step (every batch counts as one)."""

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._batch_start_step = -1


@pytest.mark.parametrize("control", [False, True])
def test_a_run_resumed_from_a_time_save_mid_epoch_ends_bit_for_bit(
    control: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kind = SavesMidAccumulation if control else LastCheckpoint
    clock = Clock(copies=tmp_path / "copies")
    monkeypatch.setattr(last_checkpoint_module, "clock", clock)
    uninterrupted = fit(tmp_path / "a", kind(tmp_path / "a", train_time_interval=5), epochs=2, accumulate=2,
                        clock=clock)  # fmt: skip
    step, batch = clock.saves[0]  # the first time save, in the first epoch
    assert step < BATCHES // 2 and batch == (4 if control else 5)  # the control's: half-way through a step
    monkeypatch.setattr(last_checkpoint_module, "clock", Clock())
    resumed = fit(tmp_path / "b", LastCheckpoint(tmp_path / "b"), epochs=2, accumulate=2,
                  ckpt_path=tmp_path / "copies" / f"{step}.ckpt")  # fmt: skip
    weights = [dict(t.lightning_module.state_dict()) for t in (uninterrupted, resumed)]
    assert resumed.global_step == uninterrupted.global_step == BATCHES
    same = all(torch.equal(weights[0][name], tensor) for name, tensor in weights[1].items())
    assert same != control  # exact from a save after a step; the half-accumulated gradient lost in the control


def test_bad_settings_are_refused_naming_the_argument() -> None:
    with pytest.raises(ValueError, match=r"^every_n_train_steps must be an integer >= 0 or None, got -1$"):
        LastCheckpoint(every_n_train_steps=-1)
    assert LastCheckpoint(every_n_train_steps=0).every_n_train_steps is None  # as ModelCheckpoint's 0: none by step
    with pytest.raises(ValueError, match=r"^train_time_interval must be a number of seconds >= 0 or None, got 'x'$"):
        LastCheckpoint(train_time_interval="x")  # type: ignore[arg-type]
