"""``copy-correct posthoc``: checkpoints of post-hoc EMA weights, synthesized from a run's ``PostHocEMASnapshots``
snapshots, that ``MyModule.load_from_checkpoint(path)`` reads (``copy_correct.cli`` parses the command line).

    copy-correct posthoc RUN_DIR --sigma-rel 0.08
    copy-correct posthoc RUN_DIR --sigma-rel 0.05 0.08 0.12 --step 4000

RUN_DIR is the run's directory, its folder of snapshots (``power_ema/``) or any directory above it
(``copy_correct.averages.posthoc.snapshot_folder``). For each ``--sigma-rel`` (a width given twice is written once; two
that would share a file name are refused) the weights are the power-function EMA of that width at ``--step`` (default:
the last snapshot's; from the first snapshot's to the last's: ``copy_correct.averages.posthoc.target_step``), combined
from the snapshots up to it (``copy_correct.synthesize``); the rest of the checkpoint (hyperparameters, versions, a
module's other weights where the snapshots are of one submodule) comes from ``--checkpoint`` (default: the newest
``*.ckpt`` beside the snapshots). Each is written atomically beside it as ``posthoc-ema-sigma0.080-step000004000.ckpt``
and its path printed.

Copy contract: the files read are only read, checked against the digests written with them and loaded with
``weights_only=True`` (``copy_correct.files.checked_load``; ``read_checkpoint`` for a directory), so nothing in them
runs and damage is refused in one line naming the file (``DamagedFile``, ``UnsafeFile``). The synthesized tensors are
new CPU tensors with no graph, the ``state_dict`` of a new checkpoint dict beside the checkpoint's kept entries (the
other weights its own tensors, not copied). A sharded run's snapshot is its ranks' files (``snapshot_sets``: the world
size may change where the run was resumed at another), joined tensor by tensor as their layout says (``Shard(dim=0)``
over W ranks: concatenated in rank order) while the combination reads it, one joined tensor at a time (the sum is
element by element, so the result is the one rank-by-rank shards would give); a distributed checkpoint is read whole
in this one process. The output is one file of full weights either way. Nothing to synthesize from, a step out of
the snapshots' range, or a missing snapshot of the history up to the step
(``copy_correct.averages.snapshot_history``), is a ``ValueError`` naming the path, the steps or the file, raised
before anything is written (the command: exit status 2, one line).
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from copy_correct.averages.posthoc import load_snapshot, snapshot_folder, snapshot_paths, synthesize, target_step
from copy_correct.averages.snapshot_history import check_snapshot_history
from copy_correct.files.atomic_save import atomic_save
from copy_correct.files.checked_load import hyperparameter_classes, load_checked
from copy_correct.files.digest import torch_crc32
from copy_correct.files.shard_digest import verify_directory

__all__ = ["join_shards", "posthoc", "read_checkpoint", "snapshot_sets"]

# What a checkpoint needs for load_from_checkpoint besides its weights (Lightning's own keys, where the run has them).
KEPT = ("pytorch-lightning_version", "hyper_parameters", "hparams_name", "hparams_type", "epoch")


SHARD_FILE = re.compile(r"power-ema-(\d{9})-rank(\d+)of(\d+)\.pt")
SHARD_LAYOUT = re.compile(r"Shard\(dim=(\d+)\) over a mesh of (\d+) ranks?")


def snapshot_sets(directory: Path) -> list[list[Path]]:
    """The snapshots in ``directory`` by step, each the files that hold it: an unsharded model's one file, or the W
    files of a sharded one's ranks (``rank{r}of{W}``: W may change along a run resumed at another world size). A
    ``ValueError`` naming the step for a snapshot whose ranks are not all there, or written at two world sizes."""
    files: dict[int, list[tuple[int, int, Path]]] = {}
    for path in snapshot_paths(directory):
        files.setdefault(int(path.name[10:19]), []).append((0, 1, path))
    for path in sorted(directory.glob("power-ema-*-rank*of*.pt")):
        match = SHARD_FILE.fullmatch(path.name)
        if match is not None:
            files.setdefault(int(match[1]), []).append((int(match[2]), int(match[3]), path))
    sets = []
    for step, found in sorted(files.items()):
        worlds = sorted({world for _, world, _ in found})
        if len(worlds) > 1 or any(path.name == f"power-ema-{step:09d}.pt" for *_, path in found[1:]):
            raise ValueError(f"{directory} holds the snapshot of step {step} twice, of world sizes {worlds}: one run's")
        ranks = sorted(rank for rank, _, _ in found)
        if ranks != list(range(worlds[0])):
            missing = sorted(set(range(worlds[0])) - set(ranks))
            raise ValueError(
                f"{directory} holds the snapshot of step {step} of ranks {ranks} of {worlds[0]} only (rank "
                f"{missing[0] if missing else ranks[0]}'s file is missing or twice): every rank writes one file per "
                "snapshot"
            )
        sets.append([path for _, _, path in sorted(found)])
    return sets


class JoinedProfile(Mapping[str, torch.Tensor]):
    """One profile of a snapshot from its ranks' shards: each tensor joined when it is read (``join_one``), so a
    synthesis holds one joined tensor at a time."""

    def __init__(self, shards: list[Mapping[str, torch.Tensor]], layouts: Mapping[str, str]) -> None:
        self.shards, self.layouts = shards, layouts

    def __getitem__(self, name: str) -> torch.Tensor:
        return join_one(name, [rank[name] for rank in self.shards], self.layouts[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self.shards[0])

    def __len__(self) -> int:
        return len(self.shards[0])


def joined_snapshot(states: list[Mapping[str, Any]]) -> Mapping[str, Any]:
    """A snapshot of full tensors from its ranks' states (in rank order; one state: an unsharded model's, as it is)."""
    if len(states) == 1 and "layout" not in states[0]:
        return states[0]
    first = states[0]
    count = len(first["profiles"])
    profiles = [JoinedProfile([s["profiles"][k] for s in states], first["layout"]) for k in range(count)]
    return {key: v for key, v in first.items() if key not in ("rank", "world_size", "layout")} | {"profiles": profiles}


def join_one(name: str, shards: list[torch.Tensor], spread: str) -> torch.Tensor:
    """A full tensor from its shards in rank order, as its layout says: one not sharded is rank 0's; one sharded on
    dim D of a mesh of W ranks is its shards concatenated on D."""
    if spread == "not sharded":
        return shards[0]
    match = SHARD_LAYOUT.fullmatch(spread)
    if match is None or int(match[2]) != len(shards):
        raise ValueError(f"{name!r} is spread as {spread}: only Shard(dim=D) over one mesh of all ranks is joined")
    return torch.cat(shards, dim=int(match[1]))


def join_shards(shards: list[dict[str, torch.Tensor]], layouts: Mapping[str, str]) -> dict[str, torch.Tensor]:
    """Full tensors from each rank's shards (``shards[r]``, by name), as each tensor's layout says (``join_one``)."""
    return {name: join_one(name, [rank[name] for rank in shards], layouts[name]) for name in shards[0]}


def read_checkpoint(path: Path) -> dict[str, Any]:
    """A Lightning checkpoint as one dict: a file as it is; a distributed checkpoint (a directory) converted in this
    one process (its shards joined), its ``meta.pt`` merged in. Entries a callback stored in the weights under its
    own key (``KEY/...``: an average's shards in a distributed checkpoint) are left out of the ``state_dict``.

    Nothing in it runs: a file is checked against its digests and loaded with ``weights_only=True``, the
    hyperparameters' classes allowed by name (``copy_correct.files.checked_load.hyperparameter_classes``); a directory
    is checked against its ``digests.json`` and its ``.metadata`` parsed safely before ``torch.distributed.checkpoint``
    reads it (``copy_correct.files.shard_digest``). ``DamagedFile``/``UnsafeFile`` (``ValueError``s) naming the file
    otherwise."""
    if path.is_dir():
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        verify_directory(path)
        with tempfile.TemporaryDirectory() as scratch, torch_crc32(True):  # the joined file, with its digests
            dcp_to_torch_save(path, Path(scratch) / "full.pt")
            checkpoint = load_checked(Path(scratch) / "full.pt", allow=hyperparameter_classes())
        checkpoint |= load_checked(path / "meta.pt", allow=hyperparameter_classes())
    else:
        checkpoint = load_checked(path, mmap=True, allow=hyperparameter_classes())
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        raise ValueError(f"{path} is not a Lightning checkpoint: it has no state_dict")
    owners = tuple(f"{key}/" for key in checkpoint.get("callbacks", {}))
    checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if not k.startswith(owners)}
    return checkpoint


def base_checkpoint(directory: Path) -> Path:
    """The newest Lightning checkpoint (a file, or a distributed checkpoint's directory) in ``directory`` that this
    command did not write."""
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


def posthoc(
    run_dir: str | os.PathLike[str],
    sigma_rels: list[float],
    step: int | None = None,
    checkpoint: str | os.PathLike[str] | None = None,
) -> list[Path]:
    """Write one checkpoint per width of ``sigma_rels``, each once (module docstring); their paths, in the order the
    widths are first given."""
    widths = list(dict.fromkeys(sigma_rels))  # a width given twice is one file, written once
    names: dict[str, float] = {}
    for sigma_rel in widths:
        other = names.setdefault(f"{sigma_rel:.3f}", sigma_rel)
        if other != sigma_rel:
            raise ValueError(
                f"sigma_rel {other} and {sigma_rel} would both be written as posthoc-ema-sigma{sigma_rel:.3f}-...: "
                "give widths that differ in the first 3 decimals"
            )
    snapshots = snapshot_folder(run_dir)
    sets = snapshot_sets(snapshots)
    # Each file read once: checked against its digests and memory-mapped (only the metadata is read here).
    opened = {path: load_snapshot(path) for paths in sets for path in paths}
    states = [joined_snapshot([opened[path] for path in paths]) for paths in sets]
    step = target_step((int(s["step"]) for s in states), step)  # the run's range: before the checkpoint is read
    # A history with a snapshot missing (a resumed run's directory without the earlier ones) would still solve.
    check_snapshot_history(snapshots, step, states=opened)
    modules = {s.get("module") for s in states}
    if len(modules) > 1:
        raise ValueError(f"{snapshots} holds snapshots of different modules ({sorted(map(str, modules))})")
    module = modules.pop()
    source = Path(checkpoint) if checkpoint is not None else base_checkpoint(snapshots.parent)
    base = read_checkpoint(source)
    written = []
    for sigma_rel in widths:
        weights = synthesize(states, sigma_rel, step)
        path = source.parent / f"posthoc-ema-sigma{sigma_rel:.3f}-step{step:09d}.ckpt"
        meta = {"sigma_rel": sigma_rel, "step": step, "snapshots": str(snapshots), "module": module}
        write(base, weights, path, meta, module)
        written.append(path)
    return written
