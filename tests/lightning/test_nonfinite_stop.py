"""``NonFiniteStop``: a loss or weights turned NaN or Inf stop the run naming the step, before a checkpoint holds them,
so ``last.ckpt`` keeps the last good state; the control, the same run without it, writes NaN weights over ``last.ckpt``.
A loss is flagged on its device every batch and read only at a check; with no loss to read (manual optimisation), the
weights are read at each check and before every save."""

from __future__ import annotations

import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from copy_correct.lightning import NonFiniteStop, NonFiniteTraining
from copy_correct.lightning.nonfinite_stop import nonfinite_weights
from tests.cuda_sync import no_host_sync

BATCHES = 4  # per epoch


class Diverging(pl.LightningModule):
    """A linear regression whose loss is multiplied by Inf at training batch ``bad`` (counted over the run): its
    gradients, then its weights, turn NaN. ``manual``: optimised by hand, returning nothing, as the gan and dqn recipes
    are."""

    def __init__(self, bad: int, manual: bool = False) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)
        self.bad, self.seen = bad, 0
        self.automatic_optimization = not manual

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor | None:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y) * (math.inf if self.seen == self.bad else 1.0)
        self.seen += 1
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return None

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(8 * BATCHES, 4, generator=g), torch.randn(8 * BATCHES, 1)), 8)


def fit(tmp_path: Path, module: Diverging, stop: NonFiniteStop | None, epochs: int = 3) -> pl.Trainer:
    last = ModelCheckpoint(dirpath=tmp_path, filename="last", monitor=None, save_on_train_epoch_end=True)
    trainer = pl.Trainer(
        max_epochs=epochs, callbacks=[c for c in (stop, last) if c is not None], logger=False,
        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
    )  # fmt: skip
    trainer.fit(module)
    return trainer


def last_weights(tmp_path: Path) -> tuple[int, dict[str, torch.Tensor]]:
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=True)
    return checkpoint["epoch"], checkpoint["state_dict"]


@pytest.mark.parametrize("manual", [False, True], ids=["loss returned", "manual optimisation"])
def test_a_run_that_turns_nonfinite_stops_and_keeps_its_last_good_checkpoint(tmp_path: Path, manual: bool) -> None:
    bad = BATCHES + 2  # epoch 1, batch 2: after epoch 0's last.ckpt was written
    with pytest.raises(NonFiniteTraining) as stopped:
        fit(tmp_path, Diverging(bad, manual), NonFiniteStop(every_n_steps=50))
    if manual:  # no loss to read: the weights, at the save that epoch 1's end would have written
        assert "the weights hold NaN or Inf at epoch 1, batch 3" in str(stopped.value), stopped.value
        assert "finite at epoch 0, batch 3" in str(stopped.value) and "net.weight, net.bias" in str(stopped.value)
    else:  # the loss's own batch, exactly, though the flag was read only at the save
        assert str(stopped.value).startswith("the training loss was NaN or Inf at epoch 1, batch 2 (global step 7)")
    epoch, weights = last_weights(tmp_path)
    assert epoch == 0 and all(torch.isfinite(w).all() for w in weights.values())

    # The control: the same run without the stop trains on, and last.ckpt ends up holding NaN weights.
    control = tmp_path / "control"
    fit(control, Diverging(bad, manual), None)
    epoch, weights = last_weights(control)
    assert epoch == 2 and not all(torch.isfinite(w).all() for w in weights.values())


def test_the_flag_is_read_at_the_cadence_so_a_run_stops_within_every_n_steps(tmp_path: Path) -> None:
    """Diverged at batch 1: with a check every 2 batches, the run stops at batch 1's end, in epoch 0, before any save;
    the control, a check every 50, reads it only at epoch 0's save, which it stops."""
    module = Diverging(bad=1)
    with pytest.raises(NonFiniteTraining, match=r"at epoch 0, batch 1 \(global step 2\)"):
        fit(tmp_path, module, NonFiniteStop(every_n_steps=2))
    assert module.seen == 2 and not (tmp_path / "last.ckpt").exists()
    module = Diverging(bad=1)
    with pytest.raises(NonFiniteTraining, match=r"at epoch 0, batch 1 \(global step 2\)"):
        fit(tmp_path / "control", module, NonFiniteStop(every_n_steps=50))
    assert module.seen == BATCHES and not (tmp_path / "control" / "last.ckpt").exists()


def test_a_finite_run_is_left_alone(tmp_path: Path) -> None:
    trainer = fit(tmp_path, Diverging(bad=-1), NonFiniteStop(every_n_steps=1))
    assert trainer.global_step == 3 * BATCHES and last_weights(tmp_path)[0] == 2


def test_nonfinite_weights_names_parameters_and_buffers_in_module_order() -> None:
    module = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 1))
    assert nonfinite_weights(module) == []
    with torch.no_grad():
        module[2].bias.fill_(-math.inf)
        module[0].weight[1, 2] = math.nan
        module[1].running_var[0] = math.inf
    assert nonfinite_weights(module) == ["0.weight", "2.bias", "1.running_var"]  # parameters first, then buffers


def test_every_n_steps_is_checked() -> None:
    with pytest.raises(ValueError, match="every_n_steps must be >= 1, got 0"):
        NonFiniteStop(every_n_steps=0)
    with pytest.raises(TypeError, match="every_n_steps must be an integer >= 1, got str '5'"):
        NonFiniteStop(every_n_steps="5")


class Stub:
    """The trainer as the hooks read it: one process, at global step 0 of epoch 0."""

    global_step, current_epoch, world_size, sanity_checking = 0, 0, 1, False


def test_a_loss_of_another_dtype_reads_the_earlier_ones_first_and_keeps_its_batch() -> None:
    stop, module = NonFiniteStop(every_n_steps=10), nn.Linear(2, 1)
    for batch in range(3):
        stop.on_train_batch_end(Stub(), module, {"loss": torch.tensor(1.0)}, None, batch)
    stop.on_train_batch_end(Stub(), module, torch.tensor(math.nan, dtype=torch.float64), None, 3)
    assert stop._losses is not None and stop._losses.dtype == torch.float64
    with pytest.raises(NonFiniteTraining, match=r"^the training loss was NaN or Inf at epoch 0, batch 3 \(global"):
        stop.check(Stub(), module)


def test_weights_found_before_the_first_batch_say_so() -> None:
    module = nn.Linear(2, 1)
    with torch.no_grad():
        module.bias.fill_(math.inf)
    with pytest.raises(NonFiniteTraining, match=r"^the weights hold NaN or Inf at the start of training, before its"):
        NonFiniteStop().check(Stub(), module)
    NonFiniteStop().check(Stub(), nn.Linear(2, 1))  # the control: finite weights pass


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")
def test_a_batch_between_checks_does_not_sync_the_device() -> None:
    """On CUDA, the per-batch flagging reads nothing back: it runs in sync-debug mode "error"."""

    stop, loss = NonFiniteStop(every_n_steps=1000), torch.tensor(1.0, device="cuda")
    stop.on_train_batch_end(Stub(), None, {"loss": loss}, None, 0)  # the first batch makes the 0-dim flags
    with no_host_sync():
        for batch in range(1, 10):
            stop.on_train_batch_end(Stub(), None, {"loss": loss * math.nan if batch == 5 else loss}, None, batch)
    assert stop._losses is not None and torch.isfinite(stop._losses[:10]).tolist() == [i != 5 for i in range(10)]
