"""``atomic_save``: ``torch.save`` into a temporary file beside the target, ``fsync``, then ``os.replace`` over it.

Copy contract: ``torch.save`` streams each tensor's bytes from its storage into the file (a CUDA storage through the
host); no serialised copy of the whole object is held in memory. The temporary file ``.NAME.tmp-PID`` lives in the
target's own directory, so the rename stays within one filesystem and is atomic: a reader, or a crash at any moment,
sees the old file or the new one under the target's name, never a part of one. An exception while writing removes the
temporary file and leaves the target as it was; a SIGKILL leaves the hidden temporary file behind, which nothing
reads. The directory is ``fsync``-ed after the rename so that the rename survives a power loss.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

__all__ = ["atomic_save", "fsync_directory"]


def atomic_save(obj: Any, path: str | os.PathLike[str]) -> Path:
    """Write ``torch.save(obj)`` to ``path`` atomically (see the module docstring); the path written."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        with open(temporary, "wb") as file:
            torch.save(obj, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    fsync_directory(target.parent)
    return target


def fsync_directory(path: Path) -> None:
    """``fsync`` a directory, so the renames in it survive a power loss."""
    directory = os.open(path, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
