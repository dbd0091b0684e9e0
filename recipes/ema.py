"""Recipe ``ema``: shadow weights that average out a noisy optimiser, evaluated beside the live ones.

    python train.py +recipe=ema                                       # the 8x8 digits, an MLP
    python train.py +recipe=ema data=images data.root=DIR             # your labelled images, a small CNN

What it shows:
  * ``EMAWeights`` keeps an exponential moving average of every parameter and BatchNorm statistic in
    tensors of its own: no deep copy of the module, nothing added to ``parameters()`` or the optimiser.
  * Each update is one in-place ``_foreach_lerp_`` per dtype group under ``no_grad``: no allocation,
    no host sync, no graph.
  * Every validation epoch runs twice, with the EMA weights (``val/acc_ema``) and the live ones
    (``val/acc``); the swap is in place and restores the live weights bit for bit.
  * The optimiser is deliberately noisy (large constant learning rate, small batches), the setting in
    which averaging pays: ``summary.json`` holds both accuracies.

Sharded (``python train.py +recipe=ema trainer=fsdp``): ``configure_model`` shards the network with FSDP2, so each
process holds 1/N of every weight, and ``EMAWeights`` keeps the average of its own shards only, 1/N of the shadow,
updated with no collective.

The network follows the data (``model.network``, ``recipes/networks.py``): an MLP with BatchNorm for the 8x8 digits,
a small CNN for square images whose side is 4, 5, 6 or 7 times a power of two, 16 or more; ``train.py`` fills
``model.image_shape`` and ``model.num_classes`` from the data module.

Change first: the data (``data=images data.root=DIR``, one subfolder per class; keys in ``conf/data/images.yaml``)
and ``decay`` in ``conf/recipe/ema.yaml`` (about ``1 / (1 - decay)`` steps are averaged); then the networks in
``recipes/networks.py``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torchmetrics.classification import MulticlassAccuracy

from recipes.networks import ConvClassifier, MLPClassifier, image_shape_of, pick_network

__all__ = ["NoisyClassifier"]


class NoisyClassifier(pl.LightningModule):
    """A classifier with BatchNorm (``recipes.networks``: an MLP or a small CNN, by ``network``), trained by SGD at a
    constant, deliberately high rate. ``image_shape`` and ``num_classes`` describe the data, ``classes`` and
    ``input_format`` how to use the trained model on an image file (``recipes.inference``); ``train.py`` fills them
    from the data module, and the checkpoint keeps them in its hyperparameters."""

    def __init__(
        self,
        image_shape: tuple[int, int, int] | None = None,
        num_classes: int | None = None,
        network: str = "auto",
        hidden: int = 256,
        conv_width: int = 32,
        lr: float = 0.2,
        momentum: float = 0.9,
        classes: list[str] | None = None,
        input_format: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        shape = image_shape_of(image_shape)
        if num_classes is None or num_classes < 2:
            raise ValueError(
                f"recipe ema classifies, and the data has {'no labels' if num_classes is None else '1 class'}: put "
                "each class's images in a subfolder of data.root (two classes at least)"
            )
        if classes is not None and len(classes) != num_classes:
            raise ValueError(f"model.classes must name model.num_classes={num_classes} classes, got {len(classes)}")
        for name, value in {"hidden": hidden, "conv_width": conv_width}.items():
            if value < 1:
                raise ValueError(f"model.{name} must be >= 1, got {value}")
        if not lr > 0:
            raise ValueError(f"model.lr must be > 0, got {lr}")
        if not 0 <= momentum < 1:
            raise ValueError(f"model.momentum must be in [0, 1), got {momentum}")
        self.save_hyperparameters()
        if pick_network(network, shape) == "conv":
            self.net: nn.Module = ConvClassifier(shape, conv_width, num_classes)
        else:
            self.net = MLPClassifier(shape, hidden, num_classes, batch_norm=True)
        self.val_acc = MulticlassAccuracy(num_classes, average="micro")

    def configure_model(self) -> None:
        """Under ``trainer=fsdp`` (Lightning's ``ModelParallelStrategy``, which gives the module a device mesh):
        shard the network with FSDP2. Under any other trainer there is no mesh and nothing changes."""
        if self.device_mesh is None or isinstance(self.net, FSDPModule):  # not sharded, or sharded already
            return
        mesh = self.device_mesh["data_parallel"]
        # Copy decision: each Linear or Conv2d is a unit of its own, gathered for its forward and freed after it; the
        # root keeps the rest (BatchNorm's weights). Every rank keeps 1/N of each weight, and EMAWeights 1/N of the
        # average: the average of a shard is the shard of the average, so updating it sends nothing.
        for layer in self.net.modules():
            if isinstance(layer, (nn.Linear, nn.Conv2d)):
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
        # Runs twice per epoch under EMAWeights: with the EMA weights swapped in (logged as `val/..._ema`),
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
