"""The exceptions a user catches, where importing them loads nothing but this package's tensor parts (no Lightning),
``check_exists``, the loaders' first check of a path handed over (``MissingFile``), and ``first_line``, what their
one-line messages quote of an error met on the way.

Copy contract: none; no tensor is touched.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

__all__ = ["CheckpointMismatch", "DamagedFile", "MissingFile", "UnsafeFile", "check_exists", "first_line"]


class CheckpointMismatch(ValueError):
    """A checkpoint whose state does not fit the run restoring it: an EMA checkpointed for other shapes, shards or
    placement (``copy_correct.lightning.EMAWeights``), another environment's run (the ``dqn`` recipe). Raised while
    Lightning restores the checkpoint, on every rank; ``train.py`` turns it into one line and exit status 2."""


class DamagedFile(ValueError):
    """A file handed over to be loaded that is not, or no longer, what ``torch.save`` (or
    ``torch.distributed.checkpoint``) wrote: its bytes do not match the digests written with it, or it is no such
    archive. The message is one line naming the file; ``copy_correct.files.checked_load`` says when it is raised."""


class UnsafeFile(ValueError):
    """A file handed over to be loaded whose pickle names globals a ``weights_only`` load refuses: loading it otherwise
    could run code. The message is one line naming the file and the names."""


class MissingFile(FileNotFoundError, DamagedFile):
    """A file (or a distributed checkpoint's directory) handed over to be loaded that is not there: a
    ``FileNotFoundError`` (``errno`` ``ENOENT``, ``filename`` the path) and a ``DamagedFile``, so that ``except
    FileNotFoundError`` and ``except DamagedFile`` (or ``ValueError``) both catch it. The message is one line naming
    the path."""

    def __str__(self) -> str:
        return f"{self.filename} does not exist" if self.filename is not None else super().__str__()


def check_exists(path: str | os.PathLike[str]) -> Path:
    """``path`` as a ``Path``, or ``MissingFile`` naming it when nothing is there (a broken link included)."""
    path = Path(path)
    if not path.exists():
        raise MissingFile(errno.ENOENT, "no such file or directory", str(path))
    return path


def first_line(error: BaseException) -> str:
    """The first line of ``error``'s message, or its type's name when it has none: what a one-line message quotes."""
    return (str(error).strip() or type(error).__name__).splitlines()[0]
