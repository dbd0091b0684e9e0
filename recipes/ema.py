"""Recipe ``ema``: shadow weights that average out a noisy optimiser, evaluated beside the live ones.

    python train.py +recipe=ema                                       # the 8x8 digits, an MLP
    python train.py +recipe=ema data=images data.root=DIR             # your labelled images, a small CNN

What it shows: the optimiser is deliberately noisy (large constant learning rate, small batches), the setting in
which averaging pays, and every validation runs twice, with the EMA weights (``val/acc_ema``) and the live ones
(``val/acc``): ``summary.json`` holds both accuracies. This module holds no EMA code: the EMA is the callback
``callbacks.ema`` in ``conf/recipe/ema.yaml`` attaches, ``EMAWeights`` (``copy_correct/lightning/ema_weights.py``),
and it enters in four of that class's methods, in the order Lightning calls them:
  * ``on_fit_start``: ``EMA(pl_module, decay=...)`` (``copy_correct/averages/ema.py``), a shadow of every parameter and
    BatchNorm statistic in tensors of its own: no deep copy of the module, nothing added to ``parameters()`` or the
    optimiser.
  * ``on_train_batch_end``, after each optimizer step: ``ema.update(pl_module)``, one in-place ``_foreach_lerp_`` per
    dtype group under ``no_grad``: no allocation, no host sync, no graph.
  * ``_evaluate_with_ema``, around each validation loop's ``run``: ``with ema.average_weights(pl_module): run()``
    under suffixed names, then ``run()``: the swap is in place and restores the live weights bit for bit.
  * ``on_save_checkpoint``: the average becomes the checkpoint's ``state_dict`` (``load_from_checkpoint`` gives the
    averaged model), the live weights go into the callback's state, copied back in place when a fit resumes.

Sharded (``python train.py +recipe=ema trainer=fsdp``): ``configure_model`` shards the network with FSDP2
(``recipes/model_setup.py``), so each process holds 1/N of every weight, and ``EMAWeights`` keeps the average of its
own shards only, 1/N of the shadow, updated with no collective.

The other callbacks are ``conf/callbacks/default.yaml``'s, which every recipe has:
  * ``IsolatedEvaluation`` (``copy_correct/lightning/isolated_evaluation.py``): each validation's draws from torch's,
    NumPy's and Python's generators, both passes', are undone when it ends; the batches after it are not those of a
    plain Lightning run, and do not depend on how often the run validates or on ``evaluate``.
  * ``ResumeState`` (``copy_correct/lightning/resume.py``, ``resume_data_order.py``): copies of the generators' states
    and a record of the training order (a sampler between the loader and its own, drawing nothing) in every
    checkpoint, so a resumed run draws and batches as the uninterrupted one.
  * ``NonFiniteStop`` (``copy_correct/lightning/nonfinite_stop.py``): each loss copied on its device into a tensor
    made once, the weights read, never copied, every 50 batches and before each save.
  * ``ModelCheckpoint`` and ``LastCheckpoint`` (``copy_correct/lightning/last_checkpoint.py``) save through
    ``AtomicCheckpointIO`` (``atomic_checkpoint.py``): each storage, the shadow's too, streamed into a file beside the
    target and renamed over it. ``RunSummary``, ``StaleTemporaries``, the progress bar: read only.

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
