"""``RunSummary``: a Lightning callback writing ``summary.json``, the one file later figures are read from.

Copy contract: logged values are read with ``float()`` after training has ended (one host sync per
metric, once); nothing is kept from the training loop.

After a resume into another directory (``train.py ... ckpt_path=``), Lightning's ``ModelCheckpoint`` keeps the
resumed run's ``best_model_path`` (a file in the crashed run's directory) but not its score, and its best is the best
since the resume. The summary's ``best`` is the better of the two, each with its score: the crashed run's best as the
checkpoint resumed from recorded it (read in ``on_load_checkpoint``; it may lie in that run's directory) and the best
this run wrote; a path without a score is never given. ``last`` is the newest checkpoint this fit wrote, or the
checkpoint it resumed from when it wrote none. ``wall_s`` is this process's time from ``on_fit_start``.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

__all__ = ["RunSummary"]


class RunSummary(pl.Callback):
    """At the end of ``fit``, write ``dirpath/summary.json``.

    It holds the final value of every logged metric (``trainer.callback_metrics`` and
    ``trainer.logged_metrics``), the recipe name and seed, step and epoch counts, wall time,
    and the checkpoint paths (after a resume: see the module docstring). Only global rank 0 writes.
    """

    def __init__(self, dirpath: str | Path, recipe: str, seed: int | None, filename: str = "summary.json") -> None:
        self.path = Path(dirpath) / filename
        self.recipe = recipe
        self.seed = seed
        self._started = time.perf_counter()
        self._resumed_best: tuple[str, float] | None = None  # the best of the run resumed from, with its score

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Note the resumed run's best checkpoint and score, as the monitored ``ModelCheckpoint`` saved them."""
        callback = _monitored(trainer)
        state = checkpoint.get("callbacks", {}).get(callback.state_key, {}) if callback is not None else {}
        path, score = state.get("best_model_path"), _finite(state.get("best_model_score"))
        self._resumed_best = (str(path), score) if path and score is not None else None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._started = time.perf_counter()

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank != 0:
            return
        metrics = {**_floats(trainer.logged_metrics), **_floats(trainer.callback_metrics)}
        best, best_score = self._best(trainer)
        summary: dict[str, Any] = {
            "recipe": self.recipe,
            "seed": self.seed,
            "metrics": dict(sorted(metrics.items())),
            "global_step": trainer.global_step,
            "epochs": trainer.current_epoch,
            "wall_s": round(time.perf_counter() - self._started, 3),
            "checkpoints": {
                "best": best,
                "best_score": best_score,
                "last": _last_checkpoint(trainer),
            },
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(summary, indent=2) + "\n")

    def _best(self, trainer: pl.Trainer) -> tuple[str | None, float | None]:
        """The best checkpoint and its score (module docstring); without a monitor, the newest file this run wrote
        and no score; ``(None, None)`` when there is none."""
        callback = _monitored(trainer)
        if callback is None:
            unmonitored = trainer.checkpoint_callback
            path = getattr(unmonitored, "best_model_path", "")
            return (path, None) if path and _written_here(path, unmonitored) else (None, None)
        score = _finite(callback.best_model_score)
        ours = (callback.best_model_path, score) if score is not None and callback.best_model_path else None
        candidates = [c for c in (self._resumed_best, ours) if c is not None]  # the resumed one first: kept on ties
        if not candidates:
            return None, None
        pick = min if callback.mode == "min" else max
        return pick(candidates, key=lambda candidate: candidate[1])


def _monitored(trainer: pl.Trainer) -> ModelCheckpoint | None:
    """The first ``ModelCheckpoint`` with a monitor: the one whose best is the run's best."""
    return next((c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint) and c.monitor), None)


def _written_here(path: str, callback: Any) -> bool:
    """Whether ``path`` is in ``callback``'s folder (not a file of a run resumed from, which Lightning keeps)."""
    dirpath = getattr(callback, "dirpath", None)
    return dirpath is not None and Path(path).resolve().parent == Path(dirpath).resolve()


def _last_checkpoint(trainer: pl.Trainer) -> str | None:
    """The newest checkpoint this fit wrote: a checkpoint callback's ``last_model_path``, or the file of one without a
    monitor (its top 1 is the newest); else the checkpoint it resumed from (it wrote none since)."""
    for callback in trainer.checkpoint_callbacks:
        path = getattr(callback, "last_model_path", "")
        if not path and getattr(callback, "monitor", "") is None:
            path = getattr(callback, "best_model_path", "")
        if path and _written_here(path, callback):
            return path
    return str(trainer.ckpt_path) if trainer.ckpt_path else None


def _finite(value: Any) -> float | None:
    """``value`` as a float when it is a finite number (a tensor or a number), else None."""
    if value is None:
        return None
    number = float(value.item() if isinstance(value, torch.Tensor) else value)
    return number if math.isfinite(number) else None


def _floats(metrics: dict[str, Any]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for key, value in metrics.items():
        number = float(value.item() if isinstance(value, torch.Tensor) else value)
        out[key] = number if math.isfinite(number) else None
    return out
