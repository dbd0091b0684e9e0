"""``RunSummary``: a Lightning callback writing ``summary.json``, the one file later figures are read from.

Copy contract: logged values are read with ``float()`` after training has ended (one host sync per
metric, once); nothing is kept from the training loop.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

__all__ = ["RunSummary"]


class RunSummary(pl.Callback):
    """At the end of ``fit``, write ``dirpath/summary.json``.

    It holds the final value of every logged metric (``trainer.callback_metrics`` and
    ``trainer.logged_metrics``), the recipe name and seed, step and epoch counts, wall time,
    and the checkpoint paths. Only global rank 0 writes.
    """

    def __init__(self, dirpath: str | Path, recipe: str, seed: int | None, filename: str = "summary.json") -> None:
        self.path = Path(dirpath) / filename
        self.recipe = recipe
        self.seed = seed
        self._started = time.perf_counter()

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._started = time.perf_counter()

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank != 0:
            return
        metrics = {**_floats(trainer.logged_metrics), **_floats(trainer.callback_metrics)}
        checkpoint = trainer.checkpoint_callback
        summary: dict[str, Any] = {
            "recipe": self.recipe,
            "seed": self.seed,
            "metrics": dict(sorted(metrics.items())),
            "global_step": trainer.global_step,
            "epochs": trainer.current_epoch,
            "wall_s": round(time.perf_counter() - self._started, 3),
            "checkpoints": {
                "best": getattr(checkpoint, "best_model_path", "") or None,
                "best_score": _floats({"score": checkpoint.best_model_score})["score"]
                if getattr(checkpoint, "best_model_score", None) is not None
                else None,
                "last": _last_checkpoint(trainer),
            },
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(summary, indent=2) + "\n")


def _last_checkpoint(trainer: pl.Trainer) -> str | None:
    """The newest checkpoint kept: a checkpoint callback's ``last_model_path``, or the file of one without a
    monitor (its top 1 is the newest)."""
    for callback in trainer.checkpoint_callbacks:
        path = getattr(callback, "last_model_path", "")
        if not path and getattr(callback, "monitor", "") is None:
            path = getattr(callback, "best_model_path", "")
        if path:
            return path
    return None


def _floats(metrics: dict[str, Any]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for key, value in metrics.items():
        number = float(value.item() if isinstance(value, torch.Tensor) else value)
        out[key] = number if math.isfinite(number) else None
    return out
