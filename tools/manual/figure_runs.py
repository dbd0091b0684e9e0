"""Recipe runs for the manual's figures: built from the project's configuration exactly as ``train.py`` builds them,
trained in this process, with a progress bar, and read back from the run's own ``metrics.csv``.

``run_recipe(["+recipe=ema", "seed=1"], directory)`` is ``python train.py +recipe=ema seed=1`` writing into
``directory``, plus the callbacks a figure needs to watch the run (they only read).
"""

from __future__ import annotations

import csv
import logging
import math
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig
from tqdm import tqdm

from recipes.build import build, ignore_expected_warnings
from recipes.launch import CONF_DIR

QUIET = ("trainer.enable_progress_bar=false", "trainer.enable_model_summary=false")


def compose_config(overrides: Sequence[str], output_dir: Path) -> DictConfig:
    """The config ``python train.py OVERRIDES`` builds, writing into ``output_dir``."""
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=[f"paths.output_dir={output_dir}", *overrides])


class RunProgress(pl.Callback):
    """A tqdm bar over a run's training batches, showing the metrics the recipe puts in its progress bar."""

    def __init__(self, description: str) -> None:
        self.description = description
        self.bar: tqdm | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        total = trainer.estimated_stepping_batches
        self.bar = tqdm(total=int(total) if math.isfinite(total) else None, desc=self.description, unit="step")

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.bar is not None:
            self.bar.update(1)
            shown = {k: f"{float(v):.3g}" for k, v in list(trainer.progress_bar_metrics.items())[:3]}
            self.bar.set_postfix(shown, refresh=False)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.bar is not None:
            self.bar.close()


@dataclass
class Run:
    """A finished run: its command, its module and trainer, and what it logged."""

    command: str
    trainer: pl.Trainer
    model: pl.LightningModule
    rows: list[dict[str, str]]

    def series(self, key: str, x: str = "epoch") -> list[tuple[float, float]]:
        """``(x, value)`` for every logged row holding ``key``; epochs count from 1."""
        points = [(float(row[x]), float(row[key])) for row in self.rows if row.get(key) not in (None, "")]
        return [(px + 1, value) for px, value in points] if x == "epoch" else points


def run_recipe(
    overrides: Sequence[str],
    directory: Path,
    callbacks: Sequence[pl.Callback] = (),
    description: str = "",
    replace_model: Callable[[pl.LightningModule], pl.LightningModule] | None = None,
) -> Run:
    """Train the run ``python train.py OVERRIDES`` describes, in ``directory`` (emptied first). ``replace_model``, when
    given, swaps the configured module for another (a test's control: the recipe with one line changed)."""
    if directory.exists():
        shutil.rmtree(directory)
    cfg = compose_config([*overrides, *QUIET], directory)
    ignore_expected_warnings()
    lightning_log = logging.getLogger("lightning.pytorch")
    level = lightning_log.level
    lightning_log.setLevel(logging.WARNING)  # the bar replaces Lightning's own lines
    try:
        trainer, model, datamodule = build(cfg)
        if replace_model is not None:
            model = replace_model(model)
        trainer.callbacks.extend([*callbacks, RunProgress(description or " ".join(overrides))])
        trainer.fit(model, datamodule=datamodule)
    finally:
        lightning_log.setLevel(level)
    metrics = directory / "metrics.csv"
    rows = list(csv.DictReader(metrics.open())) if metrics.exists() else []
    return Run("python train.py " + " ".join(overrides), trainer, model, rows)
