"""``ResumeState``: what a checkpoint needs, beyond Lightning's own state, to resume a run bit for bit, and
whose run it is.

Lightning's checkpoint holds the module, the optimizers, the loop counters and each callback's state, but
not the global random number generators nor where the training data order stands: a resumed run would draw other
dropout masks and other noise than the run it continues, and, from a plain shuffled ``DataLoader``, other batches.
This callback adds both; with the recipe name and seed the run was started with when it is given them (``train.py``
does; a user's own Trainer takes ``ResumeState()``).

* ``state_dict()`` (taken when a checkpoint is written) holds ``recipe``, ``seed`` (``None`` without them) and, one
  entry per rank, under ``rng`` the states of torch's CPU generator, the current CUDA device's generator (when CUDA
  is in use), NumPy's global generator and Python's ``random``, and under ``data_order`` the training loaders'
  order (``TrainDataOrder``, in ``resume_data_order``). Tensors, numbers, strings and tuples only, so the checkpoint
  loads with ``torch.load(..., weights_only=True)``. Lightning takes every rank's checkpoint state and writes rank
  0's, so under a multi-process strategy the ranks' states are gathered to every rank first (one
  ``all_gather_object``): ranks draw different numbers where a recipe seeds them apart (the ``gan`` recipe does),
  and one rank's states restored on all would make them draw alike after a resume.
* ``load_state_dict``, given a recipe, refuses another recipe's or seed's checkpoint (``ValueError``); it keeps the
  states until ``on_train_start``, after the resumed run is built and sanity-checked (both may draw from the
  generators) and before its first epoch starts, as the uninterrupted run's next one did after the checkpoint. Each
  rank then takes its own entry, and the data order is restored (see ``resume_data_order``: mid-epoch, the rest of
  the interrupted epoch is replayed). A rank the checkpoint has no entry for (resumed on more processes than it was
  written by) keeps its fresh states, with a warning that the resume is not bit-exact.
* ``check_checkpoint(path, recipe, seed)`` reads the same stamp from a file (checked against the CRC-32 digests
  written with it, then loaded memory-mapped, ``weights_only=True``: ``copy_correct.checked_load``), or from a
  distributed checkpoint's ``meta.pt`` (the directory Lightning's ``ModelParallelStrategy`` writes: the shards
  through ``torch.distributed.checkpoint``, everything else in ``meta.pt``; every file checked against the
  ``digests.json`` ``AtomicModelParallelStrategy`` writes, ``.metadata`` parsed safely: ``copy_correct._shard_digest``),
  so a wrong, damaged or crafted ``ckpt_path`` is refused in one line naming the file before anything is built.

The rest of a run's state belongs to whoever owns it: a module its environment, replay buffer and generators of its
own, a data module whatever it keeps besides its loaders' generators. Resumption is then exact from checkpoints taken
anywhere in an epoch; what stays inexact (draws inside ``DataLoader`` workers after a mid-epoch resume, persistent
workers, loaders that cannot be instrumented) is listed in ``resume_data_order``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_warn

from copy_correct._shard_digest import verify_directory
from copy_correct.checked_load import load_checked
from copy_correct.lightning.resume_data_order import TrainDataOrder
from copy_correct.lightning.rng_state import get_rng_state, set_rng_state

__all__ = [
    "DISTRIBUTED_METADATA",
    "ResumeState",
    "check_checkpoint",
    "get_rng_state",
    "set_rng_state",
]

DISTRIBUTED_METADATA = "meta.pt"  # Lightning's name for the non-tensor part of a distributed checkpoint directory


def _check_owner(state: Mapping[str, Any], recipe: str, seed: int | None) -> None:
    theirs = state["recipe"]
    if theirs is None:
        raise ValueError(f"it holds a run of no recipe (a ResumeState without one), not of {recipe!r}")
    if theirs != recipe:
        raise ValueError(f"it holds a run of recipe {theirs!r}, not {recipe!r}: resume it with +recipe={theirs}")
    if state["seed"] != seed:
        raise ValueError(f"it holds a run with seed={state['seed']}, not seed={seed}: resume with that run's overrides")


def check_checkpoint(path: str | Path, recipe: str, seed: int | None) -> None:
    """Raise ``ValueError`` unless ``path`` is a checkpoint that ``ResumeState`` stamped with this recipe and seed: a
    file, or a distributed checkpoint directory (``meta.pt`` and ``torch.distributed.checkpoint``'s ``.metadata``),
    whole (its digests match) and safe to load (``weights_only=True``; ``.metadata``'s pickle names only metadata)."""
    path = Path(path)
    if path.is_dir():
        if not ((path / DISTRIBUTED_METADATA).is_file() and (path / ".metadata").is_file()):
            raise ValueError(
                f"it is a directory without {DISTRIBUTED_METADATA} and .metadata, not a distributed checkpoint"
            )
        verify_directory(path)
        path = path / DISTRIBUTED_METADATA
    checkpoint = load_checked(path, mmap=True)  # DamagedFile, UnsafeFile: ValueErrors naming the file
    state = checkpoint.get("callbacks", {}).get(ResumeState.__qualname__) if isinstance(checkpoint, dict) else None
    if state is None:
        raise ValueError("it has no ResumeState stamp (not written by train.py), so its recipe cannot be checked")
    _check_owner(state, recipe, seed)


class ResumeState(pl.Callback):
    """Every rank's global generator states and training data order in each checkpoint, restored on resume; with a
    ``recipe`` (``train.py`` passes it and the ``seed``), the checkpoints are stamped and another run's are refused.
    A user's own Trainer needs no arguments: ``ResumeState()``."""

    def __init__(self, recipe: str | None = None, seed: int | None = None) -> None:
        self.recipe = recipe
        self.seed = seed
        self.data_order = TrainDataOrder()
        self._trainer: pl.Trainer | None = None
        self._pending: tuple[list[Mapping[str, Any]], list[Any] | None] | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = trainer
        self._pending = None  # a state loaded by an earlier trainer.validate(ckpt_path=...) is not this fit's

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.data_order.teardown()

    def state_dict(self) -> dict[str, Any]:
        own = (get_rng_state(), self.data_order.state_dict(self._trainer))
        ranks: list[Any] = [own]
        if self._trainer is not None and self._trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, own)
        return {
            "recipe": self.recipe, "seed": self.seed,
            "rng": [rng for rng, _ in ranks], "data_order": [order for _, order in ranks],
        }  # fmt: skip

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.recipe is not None:
            _check_owner(state_dict, self.recipe, self.seed)
        self._pending = (state_dict["rng"], state_dict.get("data_order"))  # none in a checkpoint of an older version

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pending, self._pending = self._pending, None
        order = None
        if pending is not None:
            saved, orders = pending
            if trainer.world_size > len(saved):
                rank_zero_warn(
                    f"the checkpoint holds generator states for {len(saved)} process(es), this run has "
                    f"{trainer.world_size}: ranks {len(saved)} and above keep fresh ones, so the resume is not "
                    "bit-exact"
                )
            if trainer.global_rank < len(saved):
                set_rng_state(saved[trainer.global_rank])
                order = orders[trainer.global_rank] if orders is not None else None
        self.data_order.on_train_start(trainer, order)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.data_order.instrument(trainer)  # loaders reloaded for this epoch (reload_dataloaders_every_n_epochs)
