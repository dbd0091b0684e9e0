"""``AtomicCheckpointIO``: checkpoints written straight to a temporary file beside their target, then renamed
over it, so a kill at any moment leaves either the old checkpoint or the new one, never a part of one.

Copy contract:

* ``torch.save`` streams the checkpoint into ``.NAME.tmp-PID`` in the target's own directory: each tensor's
  bytes go from its storage to the file (a CUDA storage through the host; nothing is allocated on the
  device). No serialised copy of the whole checkpoint is held in memory.
  The file is flushed and ``fsync``-ed, then ``os.replace``-d over the target (a rename, atomic within one
  filesystem, which the temporary file shares with its target by construction), and the directory is
  ``fsync``-ed so the rename survives a power loss.
* Lightning's own ``TorchCheckpointIO`` serialises the whole checkpoint into a ``BytesIO`` first (host
  memory of 1.13x the checkpoint's size, measured with ``tracemalloc``; for a GPU model, host memory the
  size of its GPU state), writes that to a file in the system's temporary directory and moves it into place:
  a move that copies, so is not atomic, when ``TMPDIR`` is on another filesystem than the checkpoint (a
  ``tmpfs`` ``/tmp``).
* An exception while writing removes the temporary file and leaves the target as it was. A SIGKILL leaves
  the target as it was and the hidden temporary file behind, which nothing reads. The writer's PID in the
  name keeps two processes that write one path by mistake from writing into one temporary file: each
  renames a whole checkpoint, and the last rename wins.
* The file is written with ``torch.save``'s CRC-32 of every record on (``atomic_save``), and a full filesystem is one
  ``DiskFull`` line (``copy_correct.disk_full``) with the temporary file removed and the previous checkpoint as it was.
* Paths that are not local files (``s3://...``) go through Lightning's own implementation.

Loading (``load_checkpoint``, what ``trainer.fit(ckpt_path=...)`` reads through) first checks a local file against its
digests (``copy_correct._file_digest.verify_file``: ``DamagedFile``, one line naming the file, for a damaged, cut
short or foreign file), then is Lightning's, with ``weights_only`` as the trainer passes it (``train.py``: ``True``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem

from copy_correct._atomic_save import atomic_save
from copy_correct._file_digest import verify_file

__all__ = ["AtomicCheckpointIO"]


class AtomicCheckpointIO(TorchCheckpointIO):
    """A ``CheckpointIO`` plugin (``Trainer(plugins=[AtomicCheckpointIO()])``) whose local writes are atomic
    renames of a file streamed beside the target."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        if storage_options is not None or not isinstance(get_filesystem(path), LocalFileSystem):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        atomic_save(checkpoint, path)

    def load_checkpoint(self, path: str | Path, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Lightning's load (``map_location``, ``weights_only`` as given) of a file whose digests are checked first."""
        if isinstance(get_filesystem(path), LocalFileSystem) and Path(path).is_file():
            verify_file(path)
        return super().load_checkpoint(path, *args, **kwargs)
