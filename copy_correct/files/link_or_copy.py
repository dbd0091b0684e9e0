"""``link_or_copy``: put a file under a second name, as a hard link where the filesystem allows, else as a copy.

A hard link shares the file's bytes (no space, no time; deleting either name leaves the other whole; ``os.replace``
over either name replaces that name only). Where the two names are on different filesystems, or the filesystem has no
hard links, the bytes are copied into a temporary ``.NAME.tmp-PID`` beside the target, ``fsync``-ed and renamed over
it, as ``atomic_save`` writes: a kill leaves the target absent or whole, never torn.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Literal

from copy_correct.files.atomic_save import fsync_directory

__all__ = ["link_or_copy"]

# What os.link raises where it cannot link: another filesystem, none supported, not permitted, too many links.
CANNOT_LINK = {errno.EXDEV, errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.EACCES}


def link_or_copy(source: str | os.PathLike[str], target: str | os.PathLike[str]) -> Literal["link", "copy"]:
    """Make ``target`` hold ``source``'s bytes (module docstring); which way it did. ``target`` must not exist."""
    source, target = Path(source), Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
        return "link"
    except OSError as err:
        if err.errno not in CANNOT_LINK:
            raise
    temporary = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        with open(source, "rb") as reading, open(temporary, "wb") as writing:
            shutil.copyfileobj(reading, writing, 1 << 20)
            writing.flush()
            os.fsync(writing.fileno())
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    fsync_directory(target.parent)
    return "copy"
