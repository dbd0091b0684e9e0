"""The exceptions a user catches, where importing them loads nothing but this package's tensor parts (no Lightning).

Copy contract: none; no tensor is touched.
"""

from __future__ import annotations

__all__ = ["CheckpointMismatch"]


class CheckpointMismatch(ValueError):
    """A checkpoint whose state does not fit the run restoring it: an EMA checkpointed for other shapes, shards or
    placement (``copy_correct.lightning.EMACallback``), another environment's run (the ``dqn`` recipe). Raised while
    Lightning restores the checkpoint, on every rank; ``train.py`` turns it into one line and exit status 2."""
