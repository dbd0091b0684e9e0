"""``remove_stale_temporaries``: delete the temporary files that writers killed mid-save left behind.

``atomic_save`` (and so ``AtomicCheckpointIO`` and the post-hoc EMA snapshots) writes ``.NAME.tmp-PID`` beside its
target and renames it over the target; ``AtomicModelParallelStrategy`` writes a directory ``.NAME.tmp-PID``. A SIGKILL
during the write leaves that hidden entry behind, a checkpoint's size, which nothing reads. Here, an entry named
``.NAME.tmp-PID`` is stale when no process ``PID`` lives on this machine; only those are removed (files, and the
directories of a sharded save), in the directory and the folders below it. An entry of a live process, this one
included, is kept: it may be a save in progress. ``.NAME.old-PID`` (the previous distributed checkpoint set aside by
the two-rename fallback) is never touched: it may be the only whole checkpoint left.

The test is ``os.kill(PID, 0)``: a PID reused since by an unrelated live process keeps its file (the safe side), and
PIDs are of this machine, so call it where the writers ran (global rank 0 of a run on one machine, the usual case).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

__all__ = ["TEMPORARY", "is_live", "remove_stale_temporaries"]

TEMPORARY = re.compile(r"\..+\.tmp-(\d+)")  # the hidden name atomic_save and the sharded strategy write


def is_live(pid: int) -> bool:
    """Whether a process ``pid`` exists on this machine (one we may not signal counts)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OverflowError:  # larger than any PID
        return False
    return True


def remove_stale_temporaries(directory: str | os.PathLike[str]) -> list[tuple[Path, int]]:
    """Remove every ``.NAME.tmp-PID`` entry whose ``PID`` is no live process, in ``directory`` and below it (module
    docstring); each removed path with the bytes it held. A missing ``directory`` has none."""
    removed: list[tuple[Path, int]] = []
    root = Path(directory)
    if not root.is_dir():
        return removed
    for folder, subfolders, files in os.walk(root):
        for name in [*files, *subfolders]:
            match = TEMPORARY.fullmatch(name)
            if match is None or is_live(int(match[1])):
                continue
            path = Path(folder) / name
            size = _size(path)
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append((path, size))
        subfolders[:] = [s for s in subfolders if not TEMPORARY.fullmatch(s)]  # nor walk into a temporary directory
    return removed


def _size(path: Path) -> int:
    if not path.is_dir():
        return path.lstat().st_size
    return sum(Path(folder, f).lstat().st_size for folder, _, files in os.walk(path) for f in files)
