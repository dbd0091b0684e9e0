"""Post-hoc EMA (EDM2): the power-function EMA of any ``sigma_rel`` at a step the ``PowerEMA`` snapshots span.

Copy contract:

* Shared, read only: the snapshots. A file is checked against the CRC-32 digest written with it (one read, no copy),
  then opened with ``torch.load(..., mmap=True, weights_only=True)`` (``load_checked``): its tensors are read-only
  memory maps, paged in while a tensor is combined and evictable after. Snapshot states given as mappings are only
  read.
* New storage: ``synthesize`` returns new CPU tensors by ``state_dict`` name (tied names get one tensor): each floating
  tensor is ``sum_i c_i * snapshot_i[name]`` accumulated in float64 and cast to the snapshots' dtype, integer buffers
  are copied from the latest snapshot used. Any number of snapshots costs about one model (the result) plus one
  float64 accumulator the size of the largest tensor.
* Autograd sees nothing: the tensors are plain (no ``requires_grad``, no graph); ``model.load_state_dict(result)``
  copies them into a model.
* Why tensor by tensor: the combination is linear, so a rank's snapshot files of a sharded model combine into that
  rank's shards (``to_local()``'s shapes) with no gather and no collective; snapshots of different ranks or spreads
  are refused together.

The coefficients (``synthesis_coefficients``; the maths is ``copy_correct.averages.power_function.solve_coefficients``)
are float64 least squares on the profiles' closed-form inner products, normalised to sum to 1, snapshots after the
target step left out. The step (``target_step``) lies between the first snapshot's and the last's: at a snapshot's step
the fit is exact, between two it is the best fit from those before it (the steps since the earlier one are in no file);
before the first or past the last (a step the run may never have reached) is a one-line ``ValueError`` naming both
steps. ``snapshot_folder`` finds a run's one folder of snapshots (``power_ema/``); a bad argument raises one line
naming it before any file is read.
"""

from __future__ import annotations

import numbers
import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from copy_correct.averages.power_ema import SNAPSHOT_FORMAT
from copy_correct.averages.power_function import sigma_rel_to_gamma, solve_coefficients
from copy_correct.files.checked_load import load_checked

__all__ = [
    "SNAPSHOT_PATTERNS",
    "load_snapshot",
    "snapshot_folder",
    "snapshot_paths",
    "synthesis_coefficients",
    "synthesize",
    "target_step",
]

Snapshot = str | os.PathLike | Mapping[str, Any]  # a snapshot file's path, or a snapshot state (PowerEMA.snapshot())
# The files PowerEMA.save_snapshot writes: of an unsharded model, and of each rank of a sharded one.
SNAPSHOT_PATTERNS = ("power-ema-?????????.pt", "power-ema-?????????-rank*of*.pt")


def snapshot_paths(directory: str | os.PathLike[str], rank: int | None = None) -> list[Path]:
    """The snapshot files ``PowerEMA.save_snapshot`` wrote in ``directory``, by step (temporary files left out): of
    an unsharded model, or with ``rank``, that rank's of a sharded one."""
    pattern = "power-ema-?????????.pt" if rank is None else f"power-ema-?????????-rank{rank}of*.pt"
    return sorted(Path(directory).glob(pattern))


def snapshot_folder(path: str | os.PathLike[str]) -> Path:
    """The one folder of snapshot files (``SNAPSHOT_PATTERNS``) that is ``path`` or lies below it: a run's directory
    gives its ``power_ema/``. A ``ValueError`` naming ``path`` and the patterns when there is none, naming the
    folders when there are several."""
    path = Path(path)
    files = f"files {' or '.join(SNAPSHOT_PATTERNS)}, which PostHocEMASnapshots writes into power_ema/"
    if not path.is_dir():
        what = "is a file" if path.exists() else "does not exist"
        raise ValueError(f"no PowerEMA snapshots at {path}: it {what} ({files}): give the run's directory")
    if any(next(path.glob(pattern), None) for pattern in SNAPSHOT_PATTERNS):
        return path
    found = sorted({p.parent for pattern in SNAPSHOT_PATTERNS for p in path.rglob(pattern)})
    if not found:
        raise ValueError(f"no PowerEMA snapshots in {path} or below it ({files}): give the run's directory")
    if len(found) > 1:
        raise ValueError(f"{path} holds {len(found)} folders of snapshots ({found[0]}, {found[1]}, ...): give one")
    return found[0]


def load_snapshot(path: str | os.PathLike[str]) -> Mapping[str, Any]:
    """A snapshot file, memory-mapped (its tensors are read from the file when used), checked to be one: against the
    digests written with it first, then loaded with ``weights_only=True`` (``copy_correct.files.checked_load``:
    ``DamagedFile``/``UnsafeFile``, ``ValueError``s naming the file)."""
    return _checked(load_checked(path, mmap=True), str(path))


def synthesis_coefficients(
    snapshots: Iterable[Mapping[str, Any]], sigma_rel: float, step: int | None = None
) -> list[tuple[int, float, Mapping[str, torch.Tensor], float]]:
    """``(step, sigma_rel, profile, coefficient)`` for each profile stored in the snapshots' states (``snapshot()``'s
    or ``load_snapshot``'s), the coefficients those of the profile ``sigma_rel`` at ``step`` (default: the latest
    snapshot's): ``copy_correct.averages.power_function.solve_coefficients``'s, 0 for snapshots after ``step``; a
    ``ValueError`` for a step before the first snapshot or past the last (``target_step``)."""
    profiles = [
        (int(state["step"]), float(sigma), profile)
        for state in snapshots
        for profile, sigma in zip(state["profiles"], state["sigma_rels"], strict=True)
    ]
    if not profiles:
        raise ValueError("no snapshot to reconstruct from")
    meta = [(t, sigma) for t, sigma, _ in profiles]
    coefficients = solve_coefficients(meta, target_step([t for t, _ in meta], step), sigma_rel)
    return [(t, sigma, profile, float(c)) for (t, sigma, profile), c in zip(profiles, coefficients, strict=True)]


def target_step(steps: Iterable[int], step: int | None = None) -> int:
    """The step to synthesize at from snapshots of ``steps``: ``step``, or the last snapshot's when ``None``. A
    ``ValueError`` naming both steps for one before the first snapshot or past the last (module docstring)."""
    steps = sorted(steps)
    if not steps:
        raise ValueError("no snapshot to reconstruct from")
    if step is None:
        return steps[-1]
    if step > steps[-1]:
        raise ValueError(
            f"step {step} is past the last snapshot, of step {steps[-1]}: no snapshot holds the steps after it (give "
            f"a step up to {steps[-1]})"
        )
    if step < steps[0]:
        raise ValueError(
            f"step {step} is before the first snapshot, of step {steps[0]}: no snapshot holds the steps up to it "
            f"(give a step from {steps[0]} to {steps[-1]})"
        )
    return step


def synthesize(
    snapshots: str | os.PathLike[str] | Iterable[Snapshot], sigma_rel: float, step: int | None = None
) -> dict[str, torch.Tensor]:
    """The power-function EMA of ``sigma_rel`` at optimizer step ``step`` (default: the latest snapshot's), as a
    ``state_dict`` of new CPU tensors, from snapshots: a run's directory or its folder of snapshots
    (``snapshot_folder``), or a list of paths and snapshot states (``PowerEMA.snapshot()``). Snapshots after ``step``
    are not used; a step before the first snapshot or past the last is refused (``target_step``).
    ``TypeError``/``ValueError`` naming the argument for bad arguments (module docstring)."""
    _check_arguments(snapshots, sigma_rel, step)
    if isinstance(snapshots, (str, os.PathLike)):
        directory = snapshot_folder(snapshots)
        snapshots = snapshot_paths(directory)
        if not snapshots and any(directory.glob("power-ema-*-rank*.pt")):
            raise ValueError(
                f"{directory} holds the snapshots of a sharded model: synthesize each rank's shards from its own "
                "files, synthesize(snapshot_paths(directory, rank=r), ...)"
            )
    states = [_state(s, i) for i, s in enumerate(snapshots)]
    if not states:
        raise ValueError("snapshots is empty: no snapshot to reconstruct from")
    spreads = {(s.get("rank"), s.get("world_size"), repr(s.get("layout"))) for s in states}
    if len(spreads) > 1:
        ranks = sorted({f"rank {rank} of {world}" if rank is not None else "unsharded" for rank, world, _ in spreads})
        raise ValueError(f"the snapshots are of different shards ({', '.join(ranks)}): combine one rank's at a time")
    used = [(t, profile, c) for t, _, profile, c in synthesis_coefficients(states, sigma_rel, step) if c != 0.0]
    latest = max(used, key=lambda u: u[0])[1]
    names = list(latest)
    for _, profile, _ in used:
        if list(profile) != names:
            raise ValueError("the snapshots hold different tensors (names): they are not of one model")
    out: dict[str, torch.Tensor] = {}
    made: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # (reference, result): a storage kept, not reused
    with torch.no_grad():
        for name in names:
            reference = latest[name]
            key = (reference.untyped_storage().data_ptr(), reference.storage_offset(), reference.shape)
            if key not in made or reference.numel() == 0:  # tied names share storage; empty tensors share nothing
                made[key] = (reference, _combine(name, reference, ((profile[name], c) for _, profile, c in used)))
            out[name] = made[key][1]
    return out


def _check_arguments(snapshots: Any, sigma_rel: Any, step: Any) -> None:
    if isinstance(snapshots, (Mapping, bytes)) or not isinstance(snapshots, (str, os.PathLike, Iterable)):
        raise TypeError(
            "snapshots must be a run's directory, its folder of snapshots, or a list of snapshot paths and states, "
            f"got {type(snapshots).__name__} {snapshots!r:.60}"
        )
    sigma_rel_to_gamma(sigma_rel)  # "sigma_rel must be a number in (0, ...)"
    if step is not None and (isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 1):
        raise ValueError(
            f"step must be an integer >= 1 (an optimizer step), or None for the latest snapshot's, got {step!r}"
        )


def _state(snapshot: Any, index: int) -> Mapping[str, Any]:
    if isinstance(snapshot, Mapping):
        return _checked(snapshot, f"snapshot {index}")
    if isinstance(snapshot, (str, os.PathLike)):
        return load_snapshot(snapshot)
    raise TypeError(
        f"snapshots[{index}] must be a snapshot file's path or a snapshot state, got {type(snapshot).__name__}"
    )


def _combine(name: str, reference: torch.Tensor, terms: Iterable[tuple[torch.Tensor, float]]) -> torch.Tensor:
    if not reference.is_floating_point():
        return reference.clone()  # integer buffers (step counts): the latest snapshot's
    total = torch.zeros(reference.shape, dtype=torch.float64)
    for tensor, coefficient in terms:
        if tensor.shape != reference.shape:
            raise ValueError(f"{name!r} is {tuple(tensor.shape)} in one snapshot, {tuple(reference.shape)} in another")
        total.add_(tensor, alpha=coefficient)
    return total.to(reference.dtype)


def _checked(state: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(state, Mapping) or state.get("format") != SNAPSHOT_FORMAT:
        raise ValueError(f"{where} is not a PowerEMA snapshot (format {SNAPSHOT_FORMAT!r})")
    return state


if __name__ == "__main__":  # python -m copy_correct.averages.posthoc: a library module, not the command
    print(
        "copy_correct.averages.posthoc is not a command: run `copy-correct posthoc RUN_DIR --sigma-rel 0.08`",
        file=sys.stderr,
    )
    sys.exit(2)
