"""``IsolatedEvaluation``: a validation run by ``fit`` leaves the random generators where training left them: torch's,
NumPy's and Python's.

Lightning validates in the middle of training, on the generators training draws from. Making the validation
``DataLoader``'s iterator draws its base seed from torch's CPU generator (unless the loader has a ``generator`` of its
own), and whatever the evaluation code draws (``torch.randn`` in ``validation_step``, an augmentation of the validation
set made in the main process, dropout in a pass left in train mode) comes from the same generators. The batches after
a validation then get other dropout masks, latents and augmentations, so how often a run validates changes the
weights it ends with: the ``gan`` recipe trained 10 epochs ended elsewhere validating every 5 epochs than every 10.

Contract:

* At the end of every training batch (the callbacks' ``on_train_batch_end``, the last callback hook Lightning calls
  before it validates) it keeps the state of torch's CPU generator and, on a CUDA device, of that device's generator
  (``Generator.clone_state``: a generator object, no tensor, no device sync). When a validation that ``fit`` runs ends
  (the callbacks' ``on_validation_end``, before ``ModelCheckpoint``'s, which Lightning always calls last) it puts those
  states back. So everything in between is undone: the iterator's draw, the module's validation steps and
  ``on_validation_epoch_end``, the callbacks' evaluation hooks and ``EMAWeights``'s EMA pass; and a checkpoint saved
  at the end of the validation holds the generators as training left them, so a resume from it continues as the
  uninterrupted run does.
* NumPy's and Python's global generators (``np.random``, ``random``) are kept when the validation starts (the
  callbacks' ``on_validation_start``: nothing Lightning does before it draws from them) and put back when it ends, the
  same way: evaluation code that draws from them (noise, a shuffle, an augmentation made with NumPy) no longer moves the
  training that follows. Two reads of a few kB per validation, none per batch.
* Nothing else is touched: the weights, BatchNorm statistics and metric states are the module's (Lightning evaluates
  in eval mode); the validation draws what it draws, from the states training left.
* Outside what it restores: NumPy generators other than the global one (``np.random.default_rng()`` objects: their
  owner keeps them), other accelerators' generators, draws in a module's own
  ``on_train_batch_end`` (Lightning calls it after the callbacks': when a validation follows, they are undone too) and
  ``on_validation_end`` (called after the callbacks': kept). Lightning isolates its sanity check itself, and
  ``trainer.validate`` / ``trainer.test`` have no training to protect: they are left alone.
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
