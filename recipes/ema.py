"""Recipe ``ema``: shadow weights that average out a noisy optimiser, evaluated beside the live ones.

    python train.py +recipe=ema

What it shows:
  * ``EMACallback`` keeps an exponential moving average of every parameter and BatchNorm statistic in
    tensors of its own: no deep copy of the module, nothing added to ``parameters()`` or the optimiser.
  * Each update is one in-place ``_foreach_lerp_`` per dtype group under ``no_grad``: no allocation,
    no host sync, no graph.
  * Every validation epoch runs twice, with the EMA weights (``val/acc_ema``) and the live ones
    (``val/acc``); the swap is in place and restores the live weights bit for bit.
  * The optimiser is deliberately noisy (large constant learning rate, small batches), the setting in
    which averaging pays: ``summary.json`` holds both accuracies.

Sharded (``python train.py +recipe=ema trainer=fsdp``): ``configure_model`` shards the network with FSDP2, so each
process holds 1/N of every weight, and ``EMACallback`` keeps the average of its own shards only, 1/N of the shadow,
updated with no collective.

Change first: the network in ``__init__``, and ``decay`` in ``conf/recipe/ema.yaml`` (about
``1 / (1 - decay)`` steps are averaged).
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torchmetrics.classification import MulticlassAccuracy

__all__ = ["NoisyDigitsClassifier"]

NUM_CLASSES = 10
NUM_FEATURES = 64


class NoisyDigitsClassifier(pl.LightningModule):
    """An MLP with BatchNorm on sklearn digits, trained by SGD at a constant, deliberately high rate."""

    def __init__(self, hidden: int = 256, lr: float = 0.2, momentum: float = 0.9) -> None:
        super().__init__()
        if hidden < 1:
            raise ValueError(f"model.hidden must be >= 1, got {hidden}")
        if not lr > 0:
            raise ValueError(f"model.lr must be > 0, got {lr}")
        if not 0 <= momentum < 1:
            raise ValueError(f"model.momentum must be in [0, 1), got {momentum}")
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(NUM_FEATURES, hidden),
            nn.BatchNorm1d(hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.BatchNorm1d(hidden),
            nn.ReLU(),
            nn.Linear(hidden, NUM_CLASSES),
        )
        self.val_acc = MulticlassAccuracy(NUM_CLASSES, average="micro")

    def configure_model(self) -> None:
        """Under ``trainer=fsdp`` (Lightning's ``ModelParallelStrategy``, which gives the module a device mesh):
        shard the network with FSDP2. Under any other trainer there is no mesh and nothing changes."""
        if self.device_mesh is None or isinstance(self.net, FSDPModule):  # not sharded, or sharded already
            return
        mesh = self.device_mesh["data_parallel"]
        # Copy decision: each Linear is a unit of its own, gathered for its forward and freed after it; the root
        # keeps the rest (BatchNorm's weights). Every rank keeps 1/N of each weight, and EMACallback 1/N of the
        # average: the average of a shard is the shard of the average, so updating it sends nothing.
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        # Runs twice per epoch under EMACallback: with the EMA weights swapped in (logged as `val/..._ema`),
        # then with the live weights. Nothing here needs to know which.
        x, y = batch
        logits = self(x)
        self.val_acc.update(logits, y)
        self.log("val/loss", F.cross_entropy(logits, y), prog_bar=True, sync_dist=True)
        self.log("val/acc", self.val_acc, prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        sharded = self.device_mesh is not None  # DTensor parameters have no fused SGD kernel: foreach over the shards
        h = self.hparams
        return torch.optim.SGD(self.parameters(), lr=h.lr, momentum=h.momentum, fused=not sharded, foreach=sharded)
