"""A distributed checkpoint's ``.metadata`` is checked against its digest in ``digests.json`` like every shard
(``copy_correct.files.shard_digest``), not only parsed: one changed so that it still parses as checkpoint metadata and
names nothing unsafe (its two tensors' storage entries swapped, so ``torch.distributed.checkpoint`` loads each tensor's
numbers into the other without a word) is refused, in one line naming it. The control: with ``.metadata`` left out of
the digests, the same damaged directory verifies."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import copy_correct.files.shard_digest as _shard_digest
from copy_correct.files.shard_digest import check_metadata, verify_directory, write_digests
from copy_correct.lightning import ResumeState, check_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized")

WEIGHTS = {"w": torch.linspace(0, 1, 256), "b": torch.linspace(-1, 0, 256)}


def damaged_checkpoint(directory: Path) -> Path:
    """A distributed checkpoint as ``AtomicModelParallelStrategy`` writes it (in one process: shards, ``.metadata``,
    ``meta.pt``, ``digests.json``), then its ``.metadata`` rewritten with the storage entries of ``w`` and ``b``
    swapped: the same classes, the same shapes, other offsets."""
    dcp.save({"state_dict": dict(WEIGHTS)}, checkpoint_id=directory, no_dist=True)
    torch.save({"callbacks": {"ResumeState": ResumeState("alpha", 0).state_dict()}}, directory / "meta.pt")
    write_digests(directory)
    verify_directory(directory)
    path = directory / ".metadata"
    metadata = pickle.loads(path.read_bytes())  # written by dcp.save just now, and checked: a trusted pickle
    (w, where_w), (b, where_b) = sorted(metadata.storage_data.items(), key=lambda item: item[0].fqn, reverse=True)
    assert (w.fqn, b.fqn) == ("state_dict.w", "state_dict.b") and where_w.offset != where_b.offset
    metadata.storage_data[w], metadata.storage_data[b] = where_b, where_w
    path.write_bytes(pickle.dumps(metadata))
    return directory


def test_a_changed_metadata_that_still_parses_is_refused_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = damaged_checkpoint(tmp_path / "last.ckpt")
    metadata = directory / ".metadata"
    check_metadata(metadata)  # it parses, and names only checkpoint metadata's classes
    read = {"state_dict": {name: torch.zeros_like(t) for name, t in WEIGHTS.items()}}
    dcp.load(read, checkpoint_id=directory, no_dist=True)  # torch.distributed.checkpoint takes it: numbers swapped
    assert torch.equal(read["state_dict"]["w"], WEIGHTS["b"]) and torch.equal(read["state_dict"]["b"], WEIGHTS["w"])
    damaged = rf"{re.escape(str(metadata))} is damaged: [\d,]+ bytes of CRC-32 [0-9a-f]{{8}}, written as"
    for load in (lambda: verify_directory(directory), lambda: check_checkpoint(directory, "alpha", 0)):
        with pytest.raises(ValueError, match=damaged):
            load()

    # The control: .metadata left out of the digests (written and compared without it), the same damage verifies.
    files = _shard_digest._files
    monkeypatch.setattr(_shard_digest, "_files", lambda d: [p for p in files(d) if p.name != ".metadata"])
    verify_directory(damaged_checkpoint(tmp_path / "control.ckpt"))
