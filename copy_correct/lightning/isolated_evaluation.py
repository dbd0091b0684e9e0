"""``IsolatedEvaluation``: a validation run by ``fit`` leaves the random generators where training left them: torch's,
NumPy's and Python's.

Why: Lightning validates in the middle of training, on the generators training draws from (the validation loader's
iterator draws its base seed from torch's CPU generator unless it has its own; ``torch.randn`` in ``validation_step``,
a main-process augmentation or dropout left in train mode draw too). The batches after a validation then get other
masks, latents and augmentations, so how often a run validates would change the weights it ends with.

Copy contract:

* New storage, a few kB per validation, none per batch: at every training batch's end (``on_train_batch_end``, the
  last callback hook before Lightning validates) the state of torch's CPU generator and, on a CUDA device, that
  device's (``Generator.clone_state``: a generator object, no tensor, no device sync); at the validation's start,
  NumPy's and Python's global generators' states.
* Written back when a validation that ``fit`` runs ends (``on_validation_end``, before ``ModelCheckpoint``'s): every
  draw in between is undone (the iterator's, the module's validation steps, the callbacks' evaluation hooks,
  ``EMAWeights``'s EMA pass), and a checkpoint saved then holds the generators as training left them.
* Shared and untouched: the weights, BatchNorm statistics and metric states are the module's; autograd sees nothing.
* Outside what it restores: NumPy ``default_rng()`` objects (their owner keeps them), other accelerators' generators,
  draws in a module's own ``on_train_batch_end`` (undone when a validation follows) and ``on_validation_end`` (kept).
  Lightning isolates its sanity check itself, and ``trainer.validate`` / ``trainer.test`` are left alone.
"""

from __future__ import annotations

import random
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch

__all__ = ["IsolatedEvaluation"]


class IsolatedEvaluation(pl.Callback):
    """Restores torch's CPU generator and the module's CUDA device's generator at the end of each validation that
    ``fit`` runs, to their states at the end of the training batch before it; and NumPy's and Python's global
    generators to their states when it started."""

    def __init__(self) -> None:
        self._generators: list[torch.Generator] = []
        self._kept: list[torch.Generator] | None = None
        self._host: tuple[Any, Any] | None = None  # Python's and NumPy's global generator states

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        device = pl_module.device
        self._generators = [torch.default_generator]
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            self._generators.append(torch.cuda.default_generators[index])

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._kept = [generator.clone_state() for generator in self._generators]

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._kept is not None and not trainer.sanity_checking:
            self._host = (random.getstate(), np.random.get_state())

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._kept is None or trainer.sanity_checking:
            return
        for generator, kept in zip(self._generators, self._kept, strict=True):
            generator.set_state(kept.get_state())
        if self._host is not None:
            random.setstate(self._host[0])
            np.random.set_state(self._host[1])
        self._kept, self._host = None, None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._kept, self._host = None, None
