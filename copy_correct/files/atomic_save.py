"""``atomic_save``: ``torch.save`` into a temporary file beside the target, ``fsync``, then ``os.replace`` over it.

Copy contract: ``torch.save`` streams each tensor's bytes from its storage into the file (a CUDA storage through the
host); no serialised copy of the whole object is held in memory. The temporary file ``.NAME.tmp-PID`` lives in the
target's own directory, so the rename stays within one filesystem and is atomic: a reader, or a crash at any moment,
sees the old file or the new one under the target's name, never a part of one. An exception while writing removes the
temporary file and leaves the target as it was; a SIGKILL leaves the hidden temporary file behind, which nothing
reads. The directory is ``fsync``-ed after the rename so that the rename survives a power loss.

Digest contract: ``torch.save`` writes straight into the temporary file (its own per-record CRC-32 off); the CRC-32
of every byte it wrote is then read back from the file and sealed into the archive's comment before the ``fsync``
(``copy_correct.files.digest.seal``), so ``verify_file`` can tell a damaged file from a whole one. A file of 16 MiB or
more is ``fsync``-ed once in a second thread while its digest is computed (the disk's time hides the digest's), and
once more after the seal (a page and the size).

Disk full: a write, flush or ``fsync`` refused with ``ENOSPC`` (or ``EDQUOT``) raises ``DiskFull`` (an ``OSError``,
``copy_correct.files.disk_full``): one line naming the target, the bytes it needs at least (its tensors' storages), the
bytes written when the filesystem refused more and the bytes free, after the temporary file is removed and with the
target as it was. ``torch.save`` alone reports it as ``RuntimeError: [enforce fail at inline_container.cc:...] .
unexpected pos``, the ``ENOSPC`` only in the exception's context.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from copy_correct.files.digest import seal, torch_crc32
from copy_correct.files.disk_full import FULL, disk_full

__all__ = ["atomic_save", "fsync_directory"]

_OVERLAP = 16 << 20  # files of this many bytes or more: the first fsync in a second thread, beside the digest


def atomic_save(obj: Any, path: str | os.PathLike[str]) -> Path:
    """Write ``torch.save(obj)`` to ``path`` atomically, with its digests (see the module docstring); the path
    written. ``DiskFull`` when the filesystem has no room for it."""
    target = Path(path)
    temporary = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(temporary, "w+b") as file, torch_crc32(False):
            torch.save(obj, file)
            file.flush()
            if os.fstat(file.fileno()).st_size >= _OVERLAP:
                with ThreadPoolExecutor(1, thread_name_prefix="copy-correct-fsync") as thread:
                    synced = thread.submit(os.fsync, file.fileno())
                    seal(file)
                    synced.result()
            else:
                seal(file)
            os.fsync(file.fileno())
        os.replace(temporary, target)
    except BaseException as error:
        written = _size(temporary)  # what reached the file
        temporary.unlink(missing_ok=True)
        code = _full(error)
        if code is not None:
            raise disk_full(target, code, written, _tensor_bytes(obj)) from error
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


def _full(error: BaseException) -> int | None:
    """The errno of a full filesystem behind ``error`` (itself, its causes and contexts), else None."""
    seen: list[BaseException | None] = [error]
    while seen:
        current = seen.pop()
        if isinstance(current, OSError) and current.errno in FULL:
            return current.errno
        if current is not None:
            seen += [current.__cause__, current.__context__]
    return None


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _tensor_bytes(obj: Any) -> int | None:
    """The bytes of the distinct tensor storages in ``obj`` (nested mappings, lists, tuples): what the file needs at
    least; None where there are none."""
    storages: dict[tuple[str, int], int] = {}
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            storages[(str(item.device), storage.data_ptr())] = storage.nbytes()
        elif isinstance(item, Mapping):
            stack += item.values()
        elif isinstance(item, (list, tuple)):
            stack += item
    return sum(storages.values()) or None
