"""Recipe `metrics`: no graph retention, proven by memory growth per step, with the classic leaks as controls.

Each control is the recipe's module with one line changed. Measured the same way (MemoryProbe's CPU
ledger inside a real Trainer), each leaks at least one hidden activation per step, the detached
variant of the same code does not, and GraphRetentionCheck names where the graph is held.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torchmetrics.classification import MulticlassAUROC

from copy_correct.lightning import GraphRetentionCheck, StepProbe
from copy_correct.probes import CopyAudit, GraphRetentionError
from copy_correct.probes._storage_events import human_bytes
from recipes.build import build
from recipes.data.digits import DigitsDataModule
from recipes.metrics import DigitsClassifier
from tests.conftest import DEVICES, QUIET, compose_config

HIDDEN = 128
BATCH = 16
ACTIVATION_BYTES = BATCH * HIDDEN * 4  # one hidden layer's output for one batch, float32
PROBE_GRAPH_BYTES = 2 * ACTIVATION_BYTES  # what a probe forward's graph saved: both hidden layers' outputs


def test_recipe_keeps_no_memory_over_200_steps(tmp_path: Path) -> None:
    """The recipe as configured (guard, checkpoints, metrics, logger) grows by <= 1 KiB over 200 steps."""
    cfg = compose_config(
        "+recipe=metrics", *QUIET, "trainer.max_steps=212", "trainer.max_epochs=100", output_dir=tmp_path
    )
    trainer, model, datamodule = build(cfg)
    window = StepProbe(start=10, steps=201, trace=True)
    trainer.callbacks.append(window)
    trainer.fit(model, datamodule=datamodule)
    print(f"recipe: growth over 200 steps {window.growth_bytes} B; {window.long.report()}")
    assert trainer.current_epoch >= 8  # the window spans epoch ends, validation and checkpoints
    assert window.growth_bytes <= 1024, window.long.report()


@pytest.mark.parametrize("device", DEVICES)
def test_optimizer_step_allocates_nothing(device: str) -> None:
    """The recipe's fused AdamW updates in place; the default AdamW, the control, allocates temporaries."""
    model = DigitsClassifier().to(device)
    fused = model.configure_optimizers()
    default = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for optimizer in (fused, default):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        optimizer.step()  # the first step creates the moment buffers
    with CopyAudit() as ours:
        fused.step()
    with CopyAudit() as control:
        default.step()
    assert ours.bytes_allocated == 0, ours.summary()
    assert ours.count(kind="write") >= 3 * len(list(model.parameters()))  # weights and both moments, in place
    if device == "cpu":  # CUDA's default is the foreach path, which allocates less but still allocates
        assert control.bytes_allocated >= 2 * sum(p.numel() * 4 for p in model.parameters())
    assert control.bytes_allocated > 0


# --- the controls: the recipe with one line changed ------------------------------------------------
#
# Each control watches the model's predictions on a fixed "probe" batch of validation images during
# training (to plot how they evolve, or score them at epoch end) and forgets `torch.no_grad()`. The loss
# never backpropagates through that forward, so every activation it saved for backward stays alive for
# as long as the result is kept. `detach=True` is the fix: the graph, and its activations, die at once.


class _ProbeBatchModule(DigitsClassifier):
    def __init__(self, detach: bool) -> None:
        super().__init__(hidden=HIDDEN)
        self.detach = detach
        self.probe_x, self.probe_y = DigitsDataModule(batch_size=BATCH).val_set[:BATCH]

    def probe_probs(self) -> torch.Tensor:
        probs = self(self.probe_x).softmax(dim=-1)
        return probs.detach() if self.detach else probs


class AppendsForEpochEnd(_ProbeBatchModule):
    """Keeps each step's probe predictions in a list for an epoch-end plot."""

    def __init__(self, detach: bool) -> None:
        super().__init__(detach)
        self.probe_history: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.probe_history.append(self.probe_probs())
        return super().training_step(batch, batch_idx)

    def on_train_epoch_end(self) -> None:
        self.probe_history.clear()


class ReturnsExtra(_ProbeBatchModule):
    """Returns the probe predictions beside the loss; a batch-end hook collects outputs for epoch end."""

    def __init__(self, detach: bool) -> None:
        super().__init__(detach)
        self.collected: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        return {"loss": super().training_step(batch, batch_idx), "probe_probs": self.probe_probs()}

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.collected.append(outputs["probe_probs"])


class FeedsListStateMetric(_ProbeBatchModule):
    """Scores the probe predictions with a list-state metric (AUROC without thresholds) at epoch end."""

    def __init__(self, detach: bool) -> None:
        super().__init__(detach)
        self.probe_auroc = MulticlassAUROC(10, thresholds=None)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.probe_auroc.update(self.probe_probs(), self.probe_y)
        return super().training_step(batch, batch_idx)


CONTROLS = {
    "append-to-list": (AppendsForEpochEnd, "module.probe_history[0]"),
    "return-extra": (ReturnsExtra, "outputs['probe_probs']"),
    "list-state-metric": (FeedsListStateMetric, "module.probe_auroc.preds[0]._base"),
}


class KeepsLossPathLogits(DigitsClassifier):
    """Keeps this step's own logits, whose graph the loss's backward has already run through."""

    def __init__(self, detach: bool) -> None:
        super().__init__(hidden=HIDDEN)
        self.detach = detach
        self.kept: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        self.kept.append(logits.detach() if self.detach else logits)
        return F.cross_entropy(logits, y)


def _fit(module: pl.LightningModule, callbacks: list[pl.Callback], max_steps: int) -> None:
    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.callbacks.extend(callbacks)
    trainer.fit(module, datamodule=DigitsDataModule(batch_size=BATCH))


def _growth_per_step(module: pl.LightningModule) -> float:
    window = StepProbe(start=3, steps=41)  # inside the first epoch (90 batches of 16)
    _fit(module, [window], max_steps=45)
    return window.growth_per_step


@pytest.mark.parametrize("name", CONTROLS)
def test_control_leaks_an_activation_per_step_and_its_fix_does_not(name: str) -> None:
    cls, _ = CONTROLS[name]
    leaking, fixed = _growth_per_step(cls(detach=False)), _growth_per_step(cls(detach=True))
    print(f"{name}: {leaking:.0f} B/step undetached, {fixed:.0f} B/step detached; activation {ACTIVATION_BYTES} B")
    assert leaking >= ACTIVATION_BYTES
    assert fixed < ACTIVATION_BYTES / 4  # what the fix keeps: the (small) values themselves
    assert round(leaking - fixed) == PROBE_GRAPH_BYTES  # what the guard reports for it (test_guard_names_the_leak)


def test_backward_frees_the_activations_of_a_kept_loss_path_tensor_but_not_its_graph() -> None:
    """Keeping this step's own undetached logits costs only the logits: backward already released every
    tensor saved on the loss's path. The graph's nodes stay (the guard still flags it), but the popular
    claim that such a list keeps each step's activations is wrong when backward ran through them."""
    logits_bytes = BATCH * 10 * 4
    leaking = _growth_per_step(KeepsLossPathLogits(detach=False))
    fixed = _growth_per_step(KeepsLossPathLogits(detach=True))
    print(f"loss-path logits: {leaking:.0f} B/step undetached, {fixed:.0f} B/step detached")
    assert leaking == fixed == logits_bytes
    with pytest.raises(GraphRetentionError, match=r"module\.kept\[0\] \(0 B\)\. A graph at 0 B"):
        _fit(KeepsLossPathLogits(detach=False), [GraphRetentionCheck()], max_steps=2)
    _fit(KeepsLossPathLogits(detach=False), [GraphRetentionCheck(min_bytes=1)], max_steps=2)  # nodes only: passes


@pytest.mark.parametrize("name", CONTROLS)
def test_guard_names_the_leak(name: str) -> None:
    """... and the bytes its graph keeps alive: the two hidden activations of the probe forward, what the control
    test measures each step to leave behind (its input, ``module.probe_x``, is held by the module: not counted)."""
    cls, path = CONTROLS[name]
    shown = rf"{re.escape(path)} \({re.escape(human_bytes(PROBE_GRAPH_BYTES))}\)"
    with pytest.raises(GraphRetentionError, match=rf"step 1: 1 tensor\(s\) .*: {shown}\."):
        _fit(cls(detach=False), [GraphRetentionCheck()], max_steps=3)
    _fit(cls(detach=True), [GraphRetentionCheck()], max_steps=3)  # control: the fix passes the guard


def test_guard_warn_mode_keeps_training() -> None:
    with pytest.warns(RuntimeWarning, match="autograd graph"):
        _fit(ReturnsExtra(detach=False), [GraphRetentionCheck(mode="warn")], max_steps=2)
