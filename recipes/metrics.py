"""Recipe ``metrics``: log loss and accuracy every step without keeping a single autograd graph alive.

    python train.py +recipe=metrics

Copy decisions, in ``training_step``: ``self.log`` stores a detached value; the metric objects are updated with
``.detach()``ed tensors (shared storage, no graph: a list-state metric such as ``AUROC(thresholds=None)`` keeps every
batch it is fed, and would keep one graph per batch); the step returns only the loss (any other tensor in its output
reaches every callback undetached); no ``.item()`` (the host would wait for the device every batch). The optimizer is
fused AdamW: its step allocates nothing.

Callbacks (``conf/recipe/metrics.yaml``, then ``conf/callbacks/default.yaml``'s; files in ``copy_correct/lightning/``):
  * ``GraphRetentionCheck``, ``graph_guard.py``: after every training batch, fails the run naming any tensor of the
    step's outputs, the module or the metric states that holds a graph; it reads only, detaches nothing.
  * every recipe's: ``IsolatedEvaluation`` (``isolated_evaluation.py``), ``ResumeState`` (``resume.py``),
    ``NonFiniteStop`` (``nonfinite_stop.py``), ``LastCheckpoint`` (``last_checkpoint.py``) and Lightning's
    ``ModelCheckpoint`` through ``AtomicCheckpointIO`` (``atomic_checkpoint.py``), ``RunSummary``
    (``run_summary.py``), ``StaleTemporaries`` (``stale_temporaries.py``), the progress bar (``recipes/progress.py``).

Sharding (``trainer=fsdp``), what each callback copies, the figures and the tests: ``docs/recipes/metrics.md``.

Change first: the network in ``__init__`` and the metrics you need.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy, MulticlassAUROC

from recipes.model_setup import at_least_one, check_args, check_classes, shard_layers

__all__ = ["DigitsClassifier"]

NUM_CLASSES = 10
NUM_FEATURES = 64


class DigitsClassifier(pl.LightningModule):
    """An MLP on the 64 pixels of sklearn digits, with torchmetrics accuracy and AUROC. ``classes`` and
    ``input_format`` say how to use the trained model on an image file (``recipes.inference``); ``train.py`` fills
    them from the data module, and the checkpoint keeps them in its hyperparameters."""

    def __init__(
        self,
        hidden: int = 128,
        lr: float = 3e-3,
        weight_decay: float = 1e-4,
        classes: list[str] | None = None,
        input_format: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        check_classes(classes, NUM_CLASSES)
        at_least_one(hidden=hidden)
        check_args([("lr", lr, lr > 0, "> 0"), ("weight_decay", weight_decay, weight_decay >= 0, ">= 0")])
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(NUM_FEATURES, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, NUM_CLASSES),
        )
        self.train_loss = MeanMetric()
        self.train_acc = MulticlassAccuracy(NUM_CLASSES, average="micro")
        self.val_acc = MulticlassAccuracy(NUM_CLASSES, average="micro")
        self.val_auroc = MulticlassAUROC(NUM_CLASSES, thresholds=None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def configure_model(self) -> None:
        """Under ``trainer=fsdp``: shard the network with FSDP2, each Linear a unit of its own; every rank keeps 1/N of
        each weight. Otherwise: nothing."""
        shard_layers(self, self.net, (nn.Linear,))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # Copy decision: the fused kernel updates weights and moments in place; the default (per-tensor)
        # CPU path allocates two temporaries the size of every parameter each step.
        return torch.optim.AdamW(
            self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay, fused=True
        )

    # -- The training step: every logged value and metric state without a graph --

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        # Copy decision: `self.log` detaches for us; metrics get `.detach()` values (shared storage, no
        # graph), so no metric state can ever hold this step's graph.
        self.log("train/loss", loss, prog_bar=True)
        self.train_loss.update(loss.detach())
        self.train_acc.update(logits.detach(), y)
        # Metric objects are reduced (and synchronised across DDP ranks) once, at epoch end.
        self.log("train/loss_epoch", self.train_loss, on_step=False, on_epoch=True)
        self.log("train/acc", self.train_acc, on_step=False, on_epoch=True)
        # Copy decision: only the loss goes out; any other tensor returned here would reach every callback undetached.
        return loss

    # -- Validation --

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        # Validation runs under `torch.inference_mode()`, so nothing here carries a graph; the list state
        # of `val_auroc` grows by one batch of probabilities per step and is freed by its epoch-end reset.
        self.val_acc.update(logits, y)
        self.val_auroc.update(logits.softmax(dim=-1), y)
        self.log("val/loss", F.cross_entropy(logits, y), prog_bar=True, sync_dist=True)
        self.log("val/acc", self.val_acc, prog_bar=True)
        self.log("val/auroc", self.val_auroc)
