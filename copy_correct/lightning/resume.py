"""``ResumeState``: what a checkpoint needs, beyond Lightning's own state, to resume a run bit for bit, and whose run
it is.

Why: Lightning's checkpoint holds the module, the optimizers, the loop counters and each callback's state, but not the
global random number generators nor where the training data order stands, so a resumed run would draw other dropout
masks and noise and, from a plain shuffled ``DataLoader``, other batches. This callback adds both, and the recipe
name and seed when given them (``train.py`` does; a user's own Trainer takes ``ResumeState()``).

Copy contract (no tensor of the model is read or written; autograd sees nothing):

* New storage, in each checkpoint (``state_dict``): ``recipe``, ``seed`` and, one entry per rank, the states of
  torch's CPU generator, the current CUDA device's (when CUDA is in use), NumPy's and Python's ``random`` (``rng``),
  and the training loaders' order (``data_order``: ``TrainDataOrder``, in ``resume_data_order``). Tensors, numbers,
  strings and tuples only: it loads with ``weights_only=True``. Lightning writes rank 0's state, so the ranks' states
  are gathered first (one ``all_gather_object``): ranks seeded apart (``gan``) must not draw alike after a resume.
* Restored (``load_state_dict``, after refusing another recipe's or seed's checkpoint with a ``ValueError``) at
  ``on_train_start``, after the resumed run is built and sanity-checked and before its first epoch, where the
  uninterrupted run went on: each rank takes its own entry, and the data order is restored. A rank with no entry
  (more processes than wrote the checkpoint) keeps fresh states, with a warning that the resume is not exact.
* ``check_checkpoint(path, recipe, seed)`` reads the same stamp from a file or a distributed checkpoint's ``meta.pt``,
  each file checked against its digests first and loaded with ``weights_only=True``
  (``copy_correct.files.checked_load``, ``copy_correct.files.shard_digest``), so a wrong, damaged or crafted
  ``ckpt_path`` is refused in one line naming the file before anything is built.

The rest of a run's state belongs to whoever owns it (a module its environment, replay buffer and own generators).
What stays inexact is listed in the resume guide.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_warn

from copy_correct.files.checked_load import load_checked
from copy_correct.files.shard_digest import verify_directory
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
