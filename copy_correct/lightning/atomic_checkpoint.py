"""``AtomicCheckpointIO``: checkpoints written straight to a temporary file beside their target, then renamed
over it, so a kill at any moment leaves either the old checkpoint or the new one, never a part of one.

Copy contract:

* No serialised copy in memory: ``torch.save`` streams the checkpoint into ``.NAME.tmp-PID`` in the target's own
  directory, each tensor's bytes from its storage to the file (a CUDA storage through the host; nothing allocated on
  the device), sealed with the CRC-32 of every byte (``atomic_save``). The file is ``fsync``-ed, ``os.replace``-d
  over the target (atomic within one filesystem, which the temporary file shares with its target by construction),
  and the directory ``fsync``-ed so the rename survives a power loss.
* Why: Lightning's own ``TorchCheckpointIO`` serialises the whole checkpoint into a ``BytesIO`` first (host memory of
  about the checkpoint's size: the resume guide measures it), then moves a file from the system's temporary
  directory into place, a copy and not atomic when ``TMPDIR`` is another filesystem (a ``tmpfs`` ``/tmp``).
* An exception while writing removes the temporary file and leaves the target as it was; a SIGKILL leaves the
  hidden temporary file, which nothing reads. The writer's PID in the name keeps two processes writing one path
  apart: each renames a whole checkpoint, the last wins. A full filesystem is one ``DiskFull`` line
  (``copy_correct.files.disk_full``), the temporary file removed. Paths that are not local files (``s3://...``) go
  through Lightning's own implementation.

Loading (``load_checkpoint``, what ``trainer.fit(ckpt_path=...)`` reads through) first checks a local file against its
digests (``copy_correct.files.digest.verify_file``: ``DamagedFile``, one line naming the file, for a damaged, cut
short or foreign file), then is Lightning's, with ``weights_only`` as the trainer passes it (``train.py``: ``True``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem

from copy_correct.files.atomic_save import atomic_save
from copy_correct.files.digest import verify_file

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
