"""``GraphRetentionCheck``: ``GraphRetentionGuard``'s check after every training batch of a Lightning run.

Copy contract: reads only, as the guard does (``copy_correct.probes.graph_guard``): it names each path that holds
a graph and detaches nothing.

After every ``every_n_steps``-th training batch it searches ``outputs`` (what ``training_step`` returned: Lightning
detaches ``"loss"`` but passes every other key on as it is, so an undetached extra reaches every callback and
anything that stores it) and ``module`` (the LightningModule's attributes, submodules, and torchmetrics states: list
states such as ``AUROC(thresholds=None).preds`` keep whatever they are fed). The Trainer the module points back to
is not entered.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from copy_correct.probes.graph_guard import GraphRetentionGuard

__all__ = ["GraphRetentionCheck"]


class GraphRetentionCheck(pl.Callback):
    """Fail (or warn about) a run the training batch a graph outlives its step, naming each path and its bytes.

    Args:
        mode: ``"raise"`` (stop with ``GraphRetentionError``) or ``"warn"`` (a ``RuntimeWarning``).
        every_n_steps: check every n-th batch (1 = every batch). A check walks every attribute of the module tree:
            measured at about 0.3 ms for the ``metrics`` recipe's module on a 2-core CPU.
        min_bytes: as ``GraphRetentionGuard``'s: a graph fails the check only if it keeps this many bytes alive.
    """

    def __init__(self, mode: str = "raise", every_n_steps: int = 1, min_bytes: int = 0) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.guard = GraphRetentionGuard(mode=mode, min_bytes=min_bytes)
        self.every_n_steps = every_n_steps

    def find(self, outputs: Any, pl_module: pl.LightningModule) -> list[str]:
        """Paths of graph-carrying tensors in ``outputs`` and ``pl_module`` (what one check looks at)."""
        return self.guard.find(outputs=outputs, module=pl_module)

    def on_train_batch_end(
        self, trainer: pl.Trainer | None, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Check ``outputs`` and ``module`` every ``every_n_steps`` batches. The step shown is the trainer's
        ``global_step``; called by hand with ``trainer=None``, it is ``batch_idx``."""
        if batch_idx % self.every_n_steps:
            return
        self.guard.check(batch_idx if trainer is None else trainer.global_step, outputs=outputs, module=pl_module)
