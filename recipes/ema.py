"""Recipe ``ema``: shadow weights that average out a noisy optimiser, evaluated beside the live ones.

    python train.py +recipe=ema                                       # the 8x8 digits, an MLP
    python train.py +recipe=ema data=images data.root=DIR             # your labelled images, a small CNN

The optimiser is deliberately noisy (a large constant learning rate, small batches), the setting in which averaging
pays; every validation runs twice, with the EMA weights (``val/acc_ema``) and with the live ones (``val/acc``).

Copy decisions: this module holds no EMA code. The average is the callback ``callbacks.ema``, ``EMAWeights``: a
shadow of every parameter and BatchNorm statistic in tensors of its own, made once (nothing added to ``parameters()``
or the optimiser); updated in place after each optimizer step, outside autograd (one ``_foreach_lerp_`` per dtype
group under ``no_grad``); copied in for each validation's EMA pass, the live weights then restored bit for bit.

Callbacks (``conf/recipe/ema.yaml``, then ``conf/callbacks/default.yaml``'s; files in ``copy_correct/lightning/``):
  * ``EMAWeights``, ``ema_weights.py``: the average, as above.
  * every recipe's: ``IsolatedEvaluation`` (``isolated_evaluation.py``), ``ResumeState`` (``resume.py``),
    ``NonFiniteStop`` (``nonfinite_stop.py``), ``LastCheckpoint`` (``last_checkpoint.py``) and Lightning's
    ``ModelCheckpoint`` through ``AtomicCheckpointIO`` (``atomic_checkpoint.py``), ``RunSummary``
    (``run_summary.py``), ``StaleTemporaries`` (``stale_temporaries.py``), the progress bar (``recipes/progress.py``).

The four ``EMAWeights`` methods where it enters, the checkpoints, sharding and the callbacks: ``docs/recipes/ema.md``.

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
from torchmetrics.classification import MulticlassAccuracy

from recipes.model_setup import at_least_one, check_args, check_classes, shard_layers
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
        check_classes(classes, num_classes, f"model.num_classes={num_classes}")
        at_least_one(hidden=hidden, conv_width=conv_width)
        check_args([("lr", lr, lr > 0, "> 0"), ("momentum", momentum, 0 <= momentum < 1, "in [0, 1)")])
        self.save_hyperparameters()
        if pick_network(network, shape) == "conv":
            self.net: nn.Module = ConvClassifier(shape, conv_width, num_classes)
        else:
            self.net = MLPClassifier(shape, hidden, num_classes, batch_norm=True)
        self.val_acc = MulticlassAccuracy(num_classes, average="micro")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def configure_model(self) -> None:
        """Under ``trainer=fsdp`` (Lightning's ``ModelParallelStrategy``, which gives the module a device mesh):
        shard the network with FSDP2. Under any other trainer there is no mesh and nothing changes."""
        # Copy decision: each Linear or Conv2d is a unit of its own, gathered for its forward and freed after it; the
        # root keeps the rest (BatchNorm's weights). Every rank keeps 1/N of each weight, and EMAWeights 1/N of the
        # average: the average of a shard is the shard of the average, so updating it sends nothing.
        shard_layers(self, self.net, (nn.Linear, nn.Conv2d))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        sharded = self.device_mesh is not None  # DTensor parameters have no fused SGD kernel: foreach over the shards
        h = self.hparams
        return torch.optim.SGD(self.parameters(), lr=h.lr, momentum=h.momentum, fused=not sharded, foreach=sharded)

    # -- The training step: plain SGD; EMAWeights averages the weights after it --

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        # Copy decision: nothing of the average here. EMAWeights updates its shadow after the optimizer step, in place
        # under no_grad, so the average is in neither this step's graph nor the optimiser.
        self.log("train/loss", loss, prog_bar=True)  # Lightning keeps a detached value
        return loss

    # -- Validation --

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        # Runs twice per epoch under EMAWeights: with the EMA weights swapped in (logged as `val/..._ema`),
        # then with the live weights. Nothing here needs to know which.
        x, y = batch
        logits = self(x)
        self.val_acc.update(logits, y)
        self.log("val/loss", F.cross_entropy(logits, y), prog_bar=True, sync_dist=True)
        self.log("val/acc", self.val_acc, prog_bar=True)
