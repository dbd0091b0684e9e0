"""Files: what the package writes and what it reads back from a user.

* ``atomic_save``: ``torch.save`` into a temporary file beside the target, sealed with the CRC-32 of its bytes
  (``digest``), ``fsync``-ed and renamed over it; a full disk is one line (``disk_full``). ``link_or_copy`` brings a
  file into a run's folder, ``stale_temporaries`` removes what killed writers left.
* ``checked_load``: ``load_checked`` and ``verify_checkpoint``, a file handed over checked against its digests
  (``digest``; a distributed checkpoint's directory: ``shard_digest``) before ``torch.load(weights_only=True)``.

Copy contract: bytes only. A save streams each storage's bytes into the file (no serialised copy held); a check reads
the file once, holding no copy of it; nothing here makes a tensor but ``load_checked``'s load.
"""

from copy_correct.files.checked_load import load_checked, verify_checkpoint

__all__ = ["load_checked", "verify_checkpoint"]
