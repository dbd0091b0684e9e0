"""Write checkpoints of post-hoc EMA weights, synthesized from a run's ``PostHocEMACallback`` snapshots.

    python -m scripts.posthoc_ema RUN_DIR --sigma-rel 0.08
    python -m scripts.posthoc_ema RUN_DIR --sigma-rel 0.05 0.08 0.12 --step 4000

RUN_DIR is the run's directory, or any directory above its one folder of snapshots (``power_ema/``, beside the
checkpoints). For each ``--sigma-rel`` the weights are the power-function EMA of that width at ``--step`` (default:
the last snapshot's), combined from the snapshots taken up to it (``copy_correct.synthesize``); the rest of the
checkpoint (hyperparameters, versions) comes from ``--checkpoint`` (default: the newest ``*.ckpt`` beside the
snapshots); so do a module's other weights where the snapshots are of one submodule (``module``: a GAN's
generator). Each is written, atomically, beside it as ``posthoc-ema-sigma0.080-step000004000.ckpt``, so that
``MyModule.load_from_checkpoint(path)`` returns the averaged model. Exit status 2, with one line, when there is
nothing to synthesize from.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from copy_correct import synthesize
from copy_correct._atomic_save import atomic_save
from copy_correct.posthoc_ema import load_snapshot, snapshot_paths

# What a checkpoint needs for load_from_checkpoint besides its weights (Lightning's own keys, where the run has them).
KEPT = ("pytorch-lightning_version", "hyper_parameters", "hparams_name", "hparams_type", "epoch")


def snapshot_dir(run_dir: Path) -> Path:
    """The one folder of unsharded snapshots under ``run_dir``."""
    found = sorted({p.parent for p in run_dir.rglob("power-ema-?????????.pt")})
    if len(found) != 1:
        what = "no PowerEMA snapshots" if not found else f"{len(found)} folders of snapshots ({found[0]}, ...)"
        raise ValueError(f"{run_dir} holds {what}: give the run's own directory")
    return found[0]


def base_checkpoint(directory: Path) -> Path:
    """The newest Lightning checkpoint in ``directory`` that this command did not write."""
    found = [p for p in directory.glob("*.ckpt") if not p.name.startswith("posthoc-ema-")]
    if not found:
        raise ValueError(f"no checkpoint (*.ckpt) in {directory} to take the hyperparameters from: give --checkpoint")
    return max(found, key=lambda p: p.stat().st_mtime)


def write(
    base: dict[str, Any], weights: dict[str, torch.Tensor], path: Path, meta: dict[str, Any], module: str | None = None
) -> None:
    """Write ``weights`` as the ``state_dict`` of a checkpoint made of ``base``'s ``KEPT`` keys; with ``module`` (the
    snapshots are of that submodule), the entries outside it come from ``base``'s ``state_dict``."""
    expected = set(base["state_dict"])
    if module is not None:
        expected = {name for name in expected if name.startswith(f"{module}.")}
    missing, unexpected = sorted(expected - set(weights)), sorted(set(weights) - expected)
    if missing or unexpected:
        raise ValueError(
            f"the snapshots are not of this checkpoint's module: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    if module is not None:
        weights = {**base["state_dict"], **weights}  # the submodule's averaged; the rest as the checkpoint has it
    checkpoint = {key: base[key] for key in KEPT if key in base}
    checkpoint.update(state_dict=weights, global_step=meta["step"], posthoc_ema=meta)
    atomic_save(checkpoint, path)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="the run's directory (its power_ema/ snapshots are found below it)")
    parser.add_argument("--sigma-rel", type=float, nargs="+", required=True, help="the EMA widths to synthesize")
    parser.add_argument("--step", type=int, default=None, help="the optimizer step (default: the last snapshot's)")
    parser.add_argument("--checkpoint", type=Path, default=None, help="the checkpoint to take the rest from")
    args = parser.parse_args(argv)
    try:
        snapshots = snapshot_dir(args.run_dir)
        paths = snapshot_paths(snapshots)
        states = [load_snapshot(p) for p in paths]  # memory-mapped: only the metadata is read here
        step = args.step if args.step is not None else max(int(s["step"]) for s in states)
        modules = {s.get("module") for s in states}
        if len(modules) > 1:
            raise ValueError(f"{snapshots} holds snapshots of different modules ({sorted(map(str, modules))})")
        module = modules.pop()
        source = args.checkpoint or base_checkpoint(snapshots.parent)
        # The run's own checkpoint: Lightning pickles hyperparameters of any type into it, so not weights_only.
        base = torch.load(source, map_location="cpu", mmap=True, weights_only=False)
        for sigma_rel in args.sigma_rel:
            weights = synthesize(paths, sigma_rel, step)
            path = source.parent / f"posthoc-ema-sigma{sigma_rel:.3f}-step{step:09d}.ckpt"
            meta = {"sigma_rel": sigma_rel, "step": step, "snapshots": str(snapshots), "module": module}
            write(base, weights, path, meta, module)
            print(path)
    except ValueError as error:
        print(f"posthoc_ema: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
