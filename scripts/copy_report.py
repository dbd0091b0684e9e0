"""Report what one training step of a recipe copies, and how much memory each step leaves behind.

    python -m scripts.copy_report +recipe=metrics
    python -m scripts.copy_report +recipe=metrics --start 20 --steps 200 model.hidden=512

Composes the recipe's config like ``train.py`` (any override works), trains in a temporary directory
until the measurement window closes, and prints the ``StepProbe`` report: every allocation and in-place
write of one steady-state training batch (forward, backward, optimizer, logging, callbacks), then live
memory growth per batch with the largest surviving storages. Exit status 1 when memory grows by more than
``--max-growth`` bytes per batch.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from hydra import compose, initialize_config_dir

from copy_correct.lightning import StepProbe
from recipes.build import build
from recipes.launch import CONF_DIR, recipe_argument_error

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--start", type=int, default=10, help="warm-up batches before measuring (default 10)")
    parser.add_argument("--steps", type=int, default=100, help="batches in the memory window (default 100)")
    parser.add_argument("--max-growth", type=float, default=16.0, help="allowed bytes per batch (default 16)")
    args, overrides = parser.parse_known_args(argv)
    problem = recipe_argument_error(overrides)
    if problem:
        parser.error(problem)
    probe = StepProbe(args.start, args.steps, stop=True, trace=True)
    with tempfile.TemporaryDirectory() as out, initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            "config",
            overrides=[
                f"paths.output_dir={out}",
                "trainer.max_epochs=-1",
                f"trainer.max_steps={args.start + args.steps + 2}",
                "trainer.enable_progress_bar=false",
                "trainer.enable_model_summary=false",
                *overrides,
            ],
        )
        trainer, model, datamodule = build(cfg)
        trainer.callbacks.append(probe)
        trainer.fit(model, datamodule=datamodule)
    print(probe.report())
    if probe.growth_per_step > args.max_growth:
        print(f"memory grows by {probe.growth_per_step:.0f} B per batch (allowed: {args.max_growth:.0f})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
