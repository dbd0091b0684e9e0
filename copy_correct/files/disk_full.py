"""``DiskFull``: a file that did not fit on its filesystem, as one line naming the path, the bytes it needed (or
had written when the filesystem refused more) and the bytes free.

``atomic_save`` (and so ``AtomicCheckpointIO``, ``PowerEMA.save_snapshot``) raises it in place of what a full disk
otherwise surfaces as, after removing its temporary file, with the target left as it was (the last good checkpoint
untouched): ``torch.save`` turns the ``OSError(ENOSPC)`` of a write into ``RuntimeError: [enforce fail at
inline_container.cc:...] . unexpected pos ...``, with the ``ENOSPC`` only in the exception's context. It is an
``OSError`` (``errno.ENOSPC``, or ``errno.EDQUOT`` for a quota), so code that handles ``OSError`` still does.
``train.py`` prints it as ``error: ...`` and exits non-zero (``disk_full_line``), as it does for a full disk met by
another writer (Lightning's ``CSVLogger`` writing ``hparams.yaml``), which raises a plain ``OSError``.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

__all__ = ["FULL", "DiskFull", "disk_full", "disk_full_line"]

FULL = frozenset({errno.ENOSPC, errno.EDQUOT})  # the errors of a filesystem (or a quota) with no room left


class DiskFull(OSError):
    """A write refused for want of space; ``str()`` is the one-line message."""

    def __init__(self, code: int, message: str, path: Path) -> None:
        super().__init__(code, message, str(path))
        self.message = message

    def __str__(self) -> str:
        return self.message


def disk_full(path: Path, code: int, written: int, needed: int | None) -> DiskFull:
    """The ``DiskFull`` of ``path``, whose write stopped after ``written`` bytes; ``needed`` where it is known (at
    least the tensors' bytes); the free space read from ``shutil.disk_usage`` of its directory now."""
    try:
        free = f"{shutil.disk_usage(path.parent).free:,} bytes free"
    except OSError:
        free = "free space unknown"
    need = f"; it needs at least {max(needed, written):,} (its tensors' bytes)" if needed is not None else ""
    return DiskFull(
        code,
        f"no space left to write {path} ({os.strerror(code)}): {written:,} bytes written when the filesystem refused "
        f"more{need}; {free} on it; the temporary file is removed and {path.name} is as it was",
        path,
    )


def disk_full_line(error: BaseException, directory: str | os.PathLike[str]) -> str | None:
    """The one line to show for ``error`` when it is a full disk: a ``DiskFull``'s own message, or for another
    ``OSError`` of ``FULL`` (another writer's) the error with the space free in ``directory``; None otherwise."""
    if isinstance(error, DiskFull):
        return str(error)
    if not isinstance(error, OSError) or error.errno not in FULL:
        return None
    try:
        free = f"{shutil.disk_usage(directory).free:,} bytes free"
    except OSError:
        free = "free space unknown"
    where = f" writing {error.filename}" if error.filename else ""
    return f"no space left{where} ({os.strerror(error.errno)}): {free} in {directory}"
