"""The refusals of a file handed over to be loaded, each a ``ValueError`` whose message is one line naming the file:
``DamagedFile`` (its bytes do not match the digests written with it, or it is not what ``torch.save`` or
``torch.distributed.checkpoint`` wrote) and ``UnsafeFile`` (its pickle names something a ``weights_only`` load
refuses, so loading it otherwise could run code). ``copy_correct.checked_load`` says when each is raised."""

from __future__ import annotations

__all__ = ["DamagedFile", "UnsafeFile"]


class DamagedFile(ValueError):
    """A file that is not, or no longer, what ``torch.save`` (or ``torch.distributed.checkpoint``) wrote."""


class UnsafeFile(ValueError):
    """A file whose pickle names globals a ``weights_only`` load refuses: loading it otherwise could run code."""
