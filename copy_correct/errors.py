"""The exceptions a user catches, where importing them loads nothing but this package's tensor parts (no Lightning).

Copy contract: none; no tensor is touched.
"""

from __future__ import annotations

__all__ = ["CheckpointMismatch", "DamagedFile", "UnsafeFile"]


class CheckpointMismatch(ValueError):
    """A checkpoint whose state does not fit the run restoring it: an EMA checkpointed for other shapes, shards or
    placement (``copy_correct.lightning.EMAWeights``), another environment's run (the ``dqn`` recipe). Raised while
    Lightning restores the checkpoint, on every rank; ``train.py`` turns it into one line and exit status 2."""


class DamagedFile(ValueError):
    """A file handed over to be loaded that is not, or no longer, what ``torch.save`` (or
    ``torch.distributed.checkpoint``) wrote: its bytes do not match the digests written with it, or it is no such
    archive. The message is one line naming the file; ``copy_correct.checked_load`` says when it is raised."""


class UnsafeFile(ValueError):
    """A file handed over to be loaded whose pickle names globals a ``weights_only`` load refuses: loading it otherwise
    could run code. The message is one line naming the file and the names."""
