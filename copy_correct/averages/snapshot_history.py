"""``snapshot_gaps``/``check_snapshot_history``: whether a folder of ``PowerEMA`` snapshots holds a profile's whole
history, from its first snapshot on, and if not, which snapshot is missing.

A post-hoc EMA is combined from every snapshot up to its step (``copy_correct.synthesize``); with some of them gone
(a resumed run's directory holding only its own: 12 of 23 files) it still solves, exits 0, and gives another average
(6 tensors off by 5.9e-07), with no sign of the loss. Here:

* A snapshot written by ``PostHocEMASnapshots`` names the step of the snapshot before it in its history (``previous``;
  0 for the first), carried across a resume in the callback's checkpoint state. The history up to a step is the chain
  from the latest snapshot at or before it back to 0: a link to a step with no file is a gap, named with the step
  missing and the file that needs it. A final snapshot (``"final": True``, taken when a fit ends) is a link like any
  other, and a later one skips it (it is removed when the resumed run writes the next).
* Snapshots without ``previous`` (written before it existed, or by ``PowerEMA.save_snapshot`` alone) are checked by
  their schedule, where they have one: when every non-final step is a multiple of the smallest distance between two
  of them (``snapshot_every``'s files), each multiple up to the last should be there, from that distance on. This
  finds a history that starts late or misses one in the middle; steps of no one schedule (saved by hand at steps 100,
  250, 400) or a single file give no verdict.

Only names and metadata are used: each file is opened with ``load_snapshot`` (memory-mapped), unless the caller has
opened it already and passes its state (``states``, by path), so nothing is read twice. A sharded run's history is
its rank 0's files, across the world sizes of a run resumed at another; that each step has every rank's file is
``copy_correct.averages.posthoc_command.snapshot_sets``'s check.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from copy_correct.averages.posthoc import load_snapshot, snapshot_paths

__all__ = ["check_snapshot_history", "snapshot_gaps"]


def snapshot_gaps(
    directory: str | os.PathLike[str], step: int | None = None, states: Mapping[Path, Mapping[str, Any]] | None = None
) -> list[str]:
    """One line per gap in the history of the snapshots in ``directory`` up to ``step`` (default: the latest), in step
    order; ``[]`` when it is whole (module docstring). A folder with no snapshot has no gap. ``states``: snapshot
    states already loaded, by path (the rest are loaded here)."""
    folder = Path(directory)
    # A sharded run's history is followed through its rank 0's files, of every world size it ran at (each step's other
    # ranks are checked with it: ``posthoc_command.snapshot_sets``).
    groups = [snapshot_paths(folder), snapshot_paths(folder, rank=0)]
    gaps: list[str] = []
    for paths in groups:
        gaps += _gaps(folder, paths, step, states or {})
    return gaps


def check_snapshot_history(
    directory: str | os.PathLike[str], step: int | None = None, states: Mapping[Path, Mapping[str, Any]] | None = None
) -> None:
    """A ``ValueError`` naming the first gap (and how many there are) when the snapshots in ``directory`` do not hold
    the whole history up to ``step``; nothing when they do. ``states`` as for ``snapshot_gaps``."""
    gaps = snapshot_gaps(directory, step, states)
    if gaps:
        more = f" (and {len(gaps) - 1} more)" if len(gaps) > 1 else ""
        raise ValueError(
            f"{gaps[0]}{more}: the post-hoc average would leave those steps out; a resumed run's directory holds the "
            "earlier snapshots only when PostHocEMASnapshots carried them over (give the directory that has them)"
        )


def _gaps(folder: Path, paths: list[Path], step: int | None, loaded: Mapping[Path, Mapping[str, Any]]) -> list[str]:
    states = {}
    for path in paths:
        state = loaded[path] if path in loaded else load_snapshot(path)
        states[int(state["step"])] = (path, state)
    steps = sorted(t for t in states if step is None or t <= step)
    at = steps[-1] if steps else 0
    while at > 0 and "previous" in states[at][1]:  # follow the links back to 0
        path, state = states[at]
        previous = int(state["previous"])
        if previous > 0 and previous not in states:
            return [f"{folder}: the snapshot of step {previous}, which {path.name} follows, is missing"]
        at = previous
    if at == 0:
        return []
    # Snapshots that name no previous one: by their schedule, those at or before the one the links reached.
    scheduled = [t for t in steps if t <= at and not states[t][1].get("final", False)]
    every = min((b - a for a, b in itertools.pairwise(scheduled)), default=0)
    if not every or any(t % every for t in scheduled):
        return []  # one file, or steps of no one schedule (saved by hand): nothing to tell a gap by
    missing = [t for t in range(every, scheduled[-1], every) if t not in states]
    if not missing:
        return []
    shown = ", ".join(map(str, missing[:5])) + (", ..." if len(missing) > 5 else "")
    return [f"{folder}: {len(missing)} snapshots of a schedule of every {every} steps are missing (steps {shown})"]
