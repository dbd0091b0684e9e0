"""The one entry point: ``python train.py +recipe=NAME [key=value ...]``; add ``-m`` to sweep.

Builds everything from the Hydra config (``conf/config.yaml`` plus ``conf/recipe/NAME.yaml``), trains,
and leaves in the run directory: ``metrics.csv``, ``checkpoints/``, ``summary.json`` and Hydra's
``.hydra/`` (the resolved config). A bad recipe name or hyperparameter stops before training with exit
status 2 and one line that names the key and what is allowed.
"""

from __future__ import annotations

import re
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hydra
from omegaconf import DictConfig

if TYPE_CHECKING:
    import lightning.pytorch as pl

CONF_DIR = Path(__file__).resolve().parent / "conf"
_RECIPE_ARG = re.compile(r"^\+{0,2}recipe=(?P<names>.*)$")
_HELP_FLAGS = {"-h", "--help", "--hydra-help", "--info", "-i"}

# Expected, not actionable: Hydra's run directory already holds .hydra/ when the CSV logger opens it, and
# Lightning 2.6 calls a torch pytree API that torch 2.13 deprecates.
warnings.filterwarnings("ignore", message=r"Experiment logs directory .* exists and is not empty")
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")


def available_recipes() -> list[str]:
    """Recipe names, from ``conf/recipe/*.yaml``."""
    return sorted(path.stem for path in (CONF_DIR / "recipe").glob("*.yaml"))


def recipe_argument_error(argv: list[str]) -> str | None:
    """The one-line complaint about the ``+recipe=`` argument in ``argv``, or None when it is fine."""
    if _HELP_FLAGS.intersection(argv):
        return None
    known = available_recipes()
    listing = ", ".join(known)
    names = [m["names"] for arg in argv if (m := _RECIPE_ARG.match(arg))]
    if not names:
        return f"no recipe given: run `python train.py +recipe=NAME` with NAME one of: {listing}"
    for name in ",".join(names).split(","):
        if name.strip() not in known:
            return f"unknown recipe {name.strip()!r}: recipe must be one of: {listing}"
    return None


def build(cfg: DictConfig) -> tuple[pl.Trainer, pl.LightningModule, pl.LightningDataModule | None]:
    """Seed, then instantiate the datamodule, model, callbacks, loggers and trainer named in ``cfg``."""
    import lightning.pytorch as pl
    from hydra.utils import instantiate

    pl.seed_everything(cfg.seed, workers=True)
    datamodule = instantiate(cfg.data) if cfg.get("data") is not None else None
    model = instantiate(cfg.model)
    callbacks = [instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c is not None]
    loggers = [instantiate(c) for c in (cfg.get("logger") or {}).values() if c is not None]
    trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False)
    return trainer, model, datamodule


def train(cfg: DictConfig) -> dict[str, Any]:
    """Build, fit, and return the final logged metrics as floats."""
    from hydra.errors import InstantiationException

    try:
        trainer, model, datamodule = build(cfg)
    except (InstantiationException, ValueError) as err:
        cause = err.__cause__ if isinstance(err, InstantiationException) and err.__cause__ else err
        print(f"error: {cause}", file=sys.stderr)
        sys.exit(2)
    trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
    if trainer.is_global_zero:
        print(f"outputs: {cfg.paths.output_dir} (metrics.csv, checkpoints/, summary.json)")
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    if cfg.get("recipe") is None:
        print(recipe_argument_error([]), file=sys.stderr)
        sys.exit(2)
    metrics = train(cfg)
    return metrics.get(cfg.recipe.get("monitor") or "")


if __name__ == "__main__":
    problem = recipe_argument_error(sys.argv[1:])
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    main()
