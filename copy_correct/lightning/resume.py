"""``ResumeState``: what a checkpoint needs, beyond Lightning's own state, to resume a run bit for bit, and
whose run it is.

Lightning's checkpoint holds the module, the optimizers, the loop counters and each callback's state, but
not the global random number generators: a resumed run would draw other dropout masks and other noise than
the run it continues. This callback adds them, with the recipe name and seed the run was started with.

* ``state_dict()`` (taken when a checkpoint is written) holds ``recipe``, ``seed`` and, under ``rng``, one
  entry per rank: the states of torch's CPU generator, the current CUDA device's generator (when CUDA is in
  use), NumPy's global generator and Python's ``random``. Tensors, numbers, strings and tuples only, so the
  checkpoint loads with ``torch.load(..., weights_only=True)``. Lightning takes every rank's checkpoint state
  and writes rank 0's, so under a multi-process strategy the ranks' states are gathered to every rank first
  (one ``all_gather_object``): ranks draw different numbers where a recipe seeds them apart (the ``gan``
  recipe does), and one rank's states restored on all would make them draw alike after a resume.
* ``load_state_dict`` refuses another recipe's or seed's checkpoint (``ValueError``) and keeps the generator
  states until ``on_train_start``, after the resumed run is built and sanity-checked (both may draw from the
  generators) and before its first epoch starts, as the uninterrupted run's next one did after the checkpoint.
  Each rank then takes its own entry. A rank the checkpoint has no entry for (resumed on more processes than
  it was written by) keeps its fresh states, with a warning that the resume is not bit-exact.
* ``check_checkpoint(path, recipe, seed)`` reads the same stamp from a file (loaded memory-mapped,
  ``weights_only=True``), or from a distributed checkpoint's ``meta.pt`` (the directory Lightning's
  ``ModelParallelStrategy`` writes: the shards through ``torch.distributed.checkpoint``, everything else in
  ``meta.pt``), so a wrong ``ckpt_path`` is refused before anything is built.

The rest of a run's state belongs to whoever owns it: the data module keeps its shuffle generator's state,
a module its environment, replay buffer and generators of its own. Resumption is exact from checkpoints
taken where that state is complete: at the end of an epoch for a shuffled ``DataLoader`` (Lightning starts a
plain loader's epoch over), after any batch for a loader whose items are only a clock.
"""

from __future__ import annotations

import random
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_warn

__all__ = [
    "DISTRIBUTED_METADATA",
    "ResumeState",
    "check_checkpoint",
    "get_rng_state",
    "set_rng_state",
]

DISTRIBUTED_METADATA = "meta.pt"  # Lightning's name for the non-tensor part of a distributed checkpoint directory


def get_rng_state() -> dict[str, Any]:
    """The global generators' states: torch CPU, CUDA (current device, when initialised), NumPy, Python."""
    _, key, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"key": torch.from_numpy(key.astype(np.int64)), "pos": pos, "gauss": (has_gauss, cached_gaussian)},
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what ``get_rng_state`` returned (the CUDA state only where CUDA is available)."""
    torch.set_rng_state(state["torch"])
    numpy = state["numpy"]
    np.random.set_state(("MT19937", numpy["key"].numpy().astype(np.uint32), numpy["pos"], *numpy["gauss"]))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _check_owner(state: Mapping[str, Any], recipe: str, seed: int | None) -> None:
    theirs = state["recipe"]
    if theirs != recipe:
        raise ValueError(f"it holds a run of recipe {theirs!r}, not {recipe!r}: resume it with +recipe={theirs}")
    if state["seed"] != seed:
        raise ValueError(f"it holds a run with seed={state['seed']}, not seed={seed}: resume with that run's overrides")


def check_checkpoint(path: str | Path, recipe: str, seed: int | None) -> None:
    """Raise ``ValueError`` unless ``path`` is a checkpoint that ``ResumeState`` stamped with this recipe and seed: a
    file, or a distributed checkpoint directory (``meta.pt`` and ``torch.distributed.checkpoint``'s ``.metadata``)."""
    path = Path(path)
    if path.is_dir():
        if not ((path / DISTRIBUTED_METADATA).is_file() and (path / ".metadata").is_file()):
            raise ValueError(
                f"it is a directory without {DISTRIBUTED_METADATA} and .metadata, not a distributed checkpoint"
            )
        path = path / DISTRIBUTED_METADATA
    if not zipfile.is_zipfile(path):
        raise ValueError("it is not a checkpoint: not the zip archive torch.save writes (truncated, or another format)")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # a pickled object weights_only refuses, a damaged archive: the same to the user
        first_line = (str(err).strip() or type(err).__name__).splitlines()[0]
        raise ValueError(f"it does not load with torch.load(weights_only=True): {first_line}") from err
    state = checkpoint.get("callbacks", {}).get(ResumeState.__qualname__) if isinstance(checkpoint, dict) else None
    if state is None:
        raise ValueError("it has no ResumeState stamp (not written by train.py), so its recipe cannot be checked")
    _check_owner(state, recipe, seed)


class ResumeState(pl.Callback):
    """Stamps checkpoints with ``recipe`` and ``seed`` and every rank's global generator states; restores each
    rank's own."""

    def __init__(self, recipe: str, seed: int | None) -> None:
        self.recipe = recipe
        self.seed = seed
        self._trainer: pl.Trainer | None = None
        self._pending_rng: list[Mapping[str, Any]] | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        own = get_rng_state()
        ranks: list[Any] = [own]
        if self._trainer is not None and self._trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, own)
        return {"recipe": self.recipe, "seed": self.seed, "rng": ranks}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        _check_owner(state_dict, self.recipe, self.seed)
        self._pending_rng = state_dict["rng"]

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._pending_rng is None:
            return
        saved, self._pending_rng = self._pending_rng, None
        if trainer.world_size > len(saved):
            rank_zero_warn(
                f"the checkpoint holds generator states for {len(saved)} process(es), this run has "
                f"{trainer.world_size}: ranks {len(saved)} and above keep fresh ones, so the resume is not bit-exact"
            )
        if trainer.global_rank < len(saved):
            set_rng_state(saved[trainer.global_rank])
