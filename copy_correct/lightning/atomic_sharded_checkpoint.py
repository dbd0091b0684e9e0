"""``AtomicModelParallelStrategy``: Lightning's ``ModelParallelStrategy`` (FSDP2) whose checkpoints, a directory of
shards or one file, are written whole beside their target and then put in its place in one step, so a kill at any
moment leaves either the previous checkpoint or the new one under the target's name, never parts of both.

Copy contract:

* New storage, on disk only: every rank writes its shards straight into ``.NAME.tmp-PID`` beside the target (rank 0's
  PID, broadcast) by Lightning's own save (``torch.distributed.checkpoint`` streams each shard from its storage to a
  file and ``fsync``-s it), rank 0 ``meta.pt`` last; nothing is held in memory beyond what that save holds. Rank 0
  then writes ``digests.json`` (size and CRC-32 of every file, ``copy_correct.files.shard_digest``: one more read, from
  the page cache), which resume and ``copy-correct posthoc`` verify.
* Put in place by rank 0: ``renameat2(RENAME_EXCHANGE)`` swaps it with the previous checkpoint (a directory, a file
  or a link) in one atomic rename, the previous one is removed and the parent ``fsync``-ed; every rank waits for that.
  Where the filesystem cannot exchange (``EINVAL``, ``ENOSYS``), the previous one is renamed aside to
  ``.NAME.old-PID`` first, with a warning. A one-file checkpoint over a file is the ``CheckpointIO`` plugin's write
  (``AtomicCheckpointIO``).
* Why: Lightning's own strategy writes the new shards over the old ones and ``meta.pt`` last, so a kill in between
  leaves a checkpoint of no step that loads without an error (the resume guide).
* An exception while writing removes the hidden directory and leaves the target as it was; a SIGKILL leaves the
  hidden directory, which nothing reads. A directory at the target that is not a distributed checkpoint (no
  ``meta.pt``) is refused (``IsADirectoryError``); paths that are not local files go through Lightning's own save.

Whether a checkpoint is a directory of shards is read from Lightning 2.6's private
``ModelParallelStrategy._save_distributed_checkpoint`` (``copy_correct.lightning._lightning_internals``); constructing
the strategy checks that it is there, and a Lightning without it is refused in one ``RuntimeError`` line naming it and
the version installed.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_warn

from copy_correct.files.atomic_save import fsync_directory
from copy_correct.files.shard_digest import write_digests
from copy_correct.lightning._lightning_internals import DISTRIBUTED_CHECKPOINT, check, saves_distributed_checkpoint
from copy_correct.lightning.resume import DISTRIBUTED_METADATA

__all__ = ["AtomicModelParallelStrategy"]

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_CANNOT_EXCHANGE = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP}


class AtomicModelParallelStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` whose local checkpoints are written beside their target and swapped in whole."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """``ModelParallelStrategy``'s arguments; refused where Lightning keeps no ``save_distributed_checkpoint``."""
        super().__init__(*args, **kwargs)
        check(type(self).__name__, self, [DISTRIBUTED_CHECKPOINT])

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        target = Path(self.broadcast(str(filepath)))
        staged = saves_distributed_checkpoint(self) or target.is_dir()
        if storage_options is not None or not staged or not isinstance(get_filesystem(filepath), LocalFileSystem):
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        if target.is_dir() and not (target / DISTRIBUTED_METADATA).is_file():
            raise IsADirectoryError(
                f"the checkpoint path {target} is a directory that is not a checkpoint: not replaced"
            )
        hidden = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        if self.global_rank == 0:
            _remove(hidden)  # a leftover of a killed writer whose PID this process now has
        hidden = Path(self.broadcast(str(hidden)))
        try:
            super().save_checkpoint(checkpoint, hidden)
            if self.global_rank == 0:
                _sync(hidden)
                put_in_place(hidden, target)
        except BaseException:
            if self.global_rank == 0:
                _remove(hidden)
            raise
        self.barrier("AtomicModelParallelStrategy.save_checkpoint")


def put_in_place(new: Path, target: Path) -> None:
    """Put ``new`` (a file or a directory) at ``target`` in one rename, removing what ``target`` held; ``new`` must be
    on the same filesystem (beside it). See the module docstring for filesystems that cannot exchange names."""
    if not os.path.lexists(target):
        os.rename(new, target)
    else:
        try:
            _exchange(new, target)
        except OSError as error:
            if error.errno not in _CANNOT_EXCHANGE:
                raise
            _two_renames(new, target)
        else:
            _remove(new)  # the previous checkpoint, now under the hidden name
    fsync_directory(target.parent)


def _exchange(a: Path, b: Path) -> None:
    """Swap the names ``a`` and ``b`` in one step (Linux ``renameat2(RENAME_EXCHANGE)``)."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None) if sys.platform == "linux" else None
    if renameat2 is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available", str(a))
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(a), None, str(b))


def _two_renames(new: Path, target: Path) -> None:
    rank_zero_warn(
        f"the filesystem of {target.parent} cannot exchange two names in one step: the previous checkpoint is "
        "renamed aside, then the new one renamed in; a kill between the two leaves the previous one under "
        f".{target.name}.old-PID"
    )
    aside = target.with_name(f".{target.name}.old-{os.getpid()}")
    _remove(aside)
    os.rename(target, aside)
    os.rename(new, target)
    _remove(aside)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()


def _sync(path: Path) -> None:
    """``fsync`` what the save left unsynced: ``meta.pt`` (``torch.distributed.checkpoint`` syncs its own files) and
    the directory, after writing the directory's ``digests.json`` (``write_digests``); a file (a one-file checkpoint)
    is synced, with its digests, by ``AtomicCheckpointIO``."""
    if path.is_dir():
        with open(path / DISTRIBUTED_METADATA, "rb+") as file:
            os.fsync(file.fileno())
        write_digests(path)
        fsync_directory(path)
