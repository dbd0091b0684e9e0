"""``NonFiniteStop``: a run whose loss or weights turn NaN or Inf stops, naming the step, before any checkpoint holds
them; the last good checkpoint (``last.ckpt`` included) is left as it was.

Copy contract: it only reads; nothing it reads is written, no tensor of the module is copied, and autograd sees
nothing. New storage: one preallocated tensor of ``every_n_steps`` losses (the loss's dtype and device).

* After every training batch, the loss the step returned (``outputs["loss"]`` or a tensor output) is copied on its
  device into that tensor: one copy kernel, no host sync, no allocation. A module that optimises by hand and returns
  nothing (the ``gan`` and ``dqn`` recipes) has no loss here: its weights, which a non-finite loss turns non-finite at
  the optimizer's step, are read at the checks.
* At a check: those losses (one host read) and every floating parameter and buffer of the module (one ``aminmax``
  each, whose ends are NaN or Inf exactly when an element is). A check runs every ``every_n_steps`` training
  batches, at the start of every validation (before a metric or the ``gan`` recipe's FID sees the weights), before
  every checkpoint is saved (``on_save_checkpoint``, called before anything is written: raising there writes
  nothing), and when training ends. Under several processes the decision is all-reduced at each check
  (``reduce_boolean_decision``), so every rank stops together.

Why per batch a copy and not a read: a read would sync the device every step; the measured cost is in the bad-input
guide (``python -m benchmarks.nonfinite_stop``). It raises ``NonFiniteTraining`` (a ``RuntimeError``) with one line:
the epoch, batch and global step of the first non-finite loss, exact; or for weights, the names of up to three
non-finite tensors and the steps between which they turned. ``train.py`` prints it as ``error: ...``, exit status 3.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

from copy_correct.core.checks import integer

__all__ = ["NonFiniteStop", "NonFiniteTraining"]


class NonFiniteTraining(RuntimeError):
    """The training loss or the weights hold NaN or Inf: the run stopped before a checkpoint held them."""


class NonFiniteStop(pl.Callback):
    """Stop a run at the first non-finite training loss or weight, before any checkpoint is written with it.

    Args:
        every_n_steps: check (read the loss flag and the weights) every n-th training batch, besides the start of each
            validation, each checkpoint save and the end of training. 1 reads the device every batch.
    """

    def __init__(self, every_n_steps: int = 50) -> None:
        self.every_n_steps = integer("every_n_steps", every_n_steps, 1)
        self._batches: list[tuple[int, int, int]] = []  # (global step, epoch, batch) of each batch since the check
        self._losses: torch.Tensor | None = None  # (every_n_steps,) on the loss's device, in its dtype: their losses
        self._good: tuple[int, int, int] | None = None  # where the last check found everything finite
        self._last: tuple[int, int, int] | None = None  # the last training batch a check has seen

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        loss = loss.detach() if isinstance(loss, torch.Tensor) else None
        losses = self._losses
        if loss is not None and losses is not None and (losses.device, losses.dtype) != (loss.device, loss.dtype):
            self.check(trainer, pl_module)  # a loss of another device or dtype (not seen in practice): read these first
            losses = self._losses = None
        self._batches.append((trainer.global_step, trainer.current_epoch, batch_idx))
        if loss is not None:
            if losses is None:
                losses = self._losses = torch.zeros(self.every_n_steps, dtype=loss.dtype, device=loss.device)
            # One copy on the device (of the largest magnitude, for a loss that is not a scalar): no host sync.
            losses[len(self._batches) - 1] = loss if loss.ndim == 0 else loss.abs().amax()
        if len(self._batches) >= self.every_n_steps:
            self.check(trainer, pl_module)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.check(trainer, pl_module)

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        self.check(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.check(trainer, pl_module)

    def check(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Read the loss flag and the weights; ``NonFiniteTraining`` if either (on any rank) is not finite."""
        count = len(self._batches)
        finite = torch.isfinite(self._losses[:count]).tolist() if self._losses is not None else []  # the sync
        first = finite.index(False) if False in finite else -1
        weights = nonfinite_weights(pl_module)
        here = first >= 0 or bool(weights)
        anywhere = trainer.strategy.reduce_boolean_decision(here, all=False) if trainer.world_size > 1 else here
        self._last = self._batches[-1] if self._batches else self._last
        now = (trainer.global_step, *self._last[1:]) if self._last else None
        if first >= 0:
            raise NonFiniteTraining(
                f"the training loss was NaN or Inf at {_where(self._batches[first])}: stopped there, before any "
                "checkpoint held it"
            )
        if weights:
            since = f"finite at {_where(self._good)}, " if self._good else ""
            raise NonFiniteTraining(
                f"the weights hold NaN or Inf at {_where(now)} ({since}{', '.join(weights[:3])}"
                f"{' and more' if len(weights) > 3 else ''}): stopped before any checkpoint held them"
            )
        if anywhere:
            raise NonFiniteTraining(f"another rank's loss or weights hold NaN or Inf at {_where(now)}: stopped")
        self._batches.clear()
        if self._losses is not None:
            self._losses.zero_()
        self._good = now


def nonfinite_weights(module: torch.nn.Module) -> list[str]:
    """The names of ``module``'s floating parameters and buffers (a checkpoint's weights) that hold a NaN or an Inf
    (this rank's shard of a sharded one), in the module's order. One ``aminmax`` per tensor (both ends propagate a
    NaN, and an infinite element is one of them; measured 3x faster on CPU than ``torch._foreach_norm`` of order inf,
    and allocating nothing the size of the weights, as ``_foreach_abs`` would), then one stack and one host read per
    device for all of them."""
    tensors = [*module.named_parameters(), *module.named_buffers()]
    named = [(name, t.to_local() if hasattr(t, "to_local") else t) for name, t in tensors]
    named = [(name, t.detach()) for name, t in named if t.is_floating_point() and t.numel()]
    by_device: dict[torch.device, list[int]] = {}
    for i, (_, tensor) in enumerate(named):
        by_device.setdefault(tensor.device, []).append(i)
    bad = []
    for indices in by_device.values():
        ends = torch.stack([torch.stack(torch.aminmax(named[i][1])) for i in indices])  # (tensors, 2): low, high
        finite = torch.isfinite(ends).all(dim=1).tolist()
        bad += [i for i, ok in zip(indices, finite, strict=True) if not ok]
    return [named[i][0] for i in sorted(bad)]


def _where(step: tuple[int, int, int] | None) -> str:
    if step is None:
        return "the start of training, before its first batch"
    global_step, epoch, batch = step
    return f"epoch {epoch}, batch {batch} (global step {global_step})"
