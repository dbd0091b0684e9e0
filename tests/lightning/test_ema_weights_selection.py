"""``EMAWeights`` and ``PostHocEMASnapshots`` take ``trainable_only`` and ``exclude`` as the averages do: with the
critic of a two-module LightningModule frozen, the average holds the generator's tensors alone, a checkpoint's weights
are the generator's average and the critic's live values, ``load_from_checkpoint`` returns them, and a resumed run
ends bit for bit as the uninterrupted one. The control: the same fit without the selection averages the critic too.
``EMAWeights(update_bn=True)`` recomputes the average's BatchNorm statistics before each EMA evaluation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.optim.swa_utils import update_bn as torch_update_bn

from copy_correct.lightning import EMAWeights, PostHocEMASnapshots
from tests.lightning.test_ema_weights import loader, trainer
from tests.lightning.test_ema_weights_module import TwoNets, part, same


class FrozenCritic(TwoNets):
    """``TwoNets`` whose critic is frozen from the start: only the generator trains."""

    def __init__(self) -> None:
        super().__init__()
        self.critic.requires_grad_(False)

    def on_validation_epoch_start(self) -> None:
        if isinstance(self.averager, EMAWeights):  # TwoNets records the EMA's average; snapshots have none to record
            super().on_validation_epoch_start()


def fit(directory: Path, callback: Any, *others: Any, epochs: int = 2, **resume: Any) -> FrozenCritic:
    torch.manual_seed(0)
    module = FrozenCritic()
    module.averager = callback
    trainer(directory, [callback, *others], max_epochs=epochs).fit(module, loader(), loader(64), **resume)
    return module


@pytest.mark.parametrize("selection", [{"trainable_only": True}, {"exclude": ("critic.",)}])
def test_the_callbacks_average_the_generator_alone_and_checkpoint_the_critics_live_values(
    selection: dict[str, Any], tmp_path: Path
) -> None:
    callback = EMAWeights(decay=0.9, **selection)
    trained = fit(tmp_path, callback, ModelCheckpoint(tmp_path, filename="last"))
    assert callback.ema is not None
    assert set(callback.ema.shadow) == {f"generator.{name}" for name in trained.generator.state_dict()}
    weights = torch.load(tmp_path / "last.ckpt", weights_only=True)["state_dict"]
    live = trained.state_dict()
    assert same(part(weights, "critic."), part(live, "critic."))
    assert same({k: v for k, v in weights.items() if k in callback.ema.shadow}, dict(callback.ema.shadow))
    assert not same(part(weights, "generator."), part(live, "generator."))  # the average, not the live weights
    loaded = FrozenCritic.load_from_checkpoint(tmp_path / "last.ckpt", weights_only=True)
    assert same(loaded.state_dict(), {**live, **callback.ema.shadow})

    everything = EMAWeights(decay=0.9)  # the control: without the selection the frozen critic is averaged too
    fit(tmp_path / "control", everything)
    assert everything.ema is not None and {n for n in everything.ema.shadow if n.startswith("critic.")}


def test_a_resumed_run_with_a_selection_ends_bit_for_bit_as_the_uninterrupted_one(tmp_path: Path) -> None:
    def run(directory: Path, **resume: Any) -> tuple[FrozenCritic, EMAWeights]:
        callback = EMAWeights(decay=0.9, trainable_only=True)
        save = ModelCheckpoint(directory, filename="{epoch}", save_top_k=-1)
        return fit(directory, callback, save, epochs=3, **resume), callback

    straight, averaged = run(tmp_path / "straight")
    resumed, again = run(tmp_path / "resumed", ckpt_path=tmp_path / "straight" / "epoch=0.ckpt")
    assert averaged.ema is not None and again.ema is not None
    assert same(resumed.state_dict(), straight.state_dict()) and same(again.ema.shadow, averaged.ema.shadow)


def test_posthoc_snapshots_hold_the_chosen_tensors_alone(tmp_path: Path) -> None:
    callback = PostHocEMASnapshots(snapshot_every=8, snapshot_dir=tmp_path / "snapshots", trainable_only=True)
    trained = fit(tmp_path, callback)
    snapshot = torch.load(sorted((tmp_path / "snapshots").glob("*.pt"))[-1], weights_only=True)
    expected = {f"generator.{name}" for name in trained.generator.state_dict()}
    assert all(set(profile) == expected for profile in snapshot["profiles"])


class Recorded(FrozenCritic):
    """Records the average's BatchNorm statistics at each EMA evaluation's start."""

    def __init__(self) -> None:
        super().__init__()
        self.critic.requires_grad_(True)
        self.statistics: list[torch.Tensor] = []

    def on_validation_epoch_start(self) -> None:
        assert isinstance(self.averager, EMAWeights) and self.averager.ema is not None
        if self.averager.ema.swapped:
            self.statistics.append(self.averager.ema.shadow["1.running_mean"].clone())


@pytest.mark.parametrize("update_bn", [True, False])
def test_update_bn_recomputes_the_averages_statistics_before_each_ema_evaluation(
    update_bn: bool, tmp_path: Path
) -> None:
    """``update_bn=True``: at each EMA evaluation of ``fit`` the average's statistics are those ``EMA.update_bn``
    computes over the train dataloader at that moment; the control (``False``) evaluates them as averaged."""
    torch.manual_seed(0)
    module = Recorded()
    callback = EMAWeights(decay=0.9, module="generator", update_bn=update_bn, evaluate="ema")
    module.averager = callback
    seen: list[torch.Tensor] = []

    class Expected(pl.Callback):
        def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            assert callback.ema is not None
            copy = callback.ema.export()
            torch_update_bn(trainer.train_dataloader, copy)
            seen.append(copy.state_dict()["1.running_mean"])

    trainer(tmp_path, [Expected(), callback], max_epochs=2).fit(module, loader(), loader(64))
    assert len(module.statistics) == 2
    same_as_recomputed = [torch.equal(a, b) for a, b in zip(module.statistics, seen, strict=True)]
    assert all(same_as_recomputed) if update_bn else not any(same_as_recomputed)
