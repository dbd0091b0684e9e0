"""Run by tests/atlas/test_aliased_writes.py, once per rank (``RANK``, ``WORLD_SIZE``=2, ``TEST_PORT``): a gloo group
of two processes shards the atlas's 4x6 tensor by rows into a DTensor and measures ``to_local`` and ``full_tensor``.

Saved per rank as ``OUT/rank{r}.pt``: the local shard and whether it is the DTensor's own storage and what reading it
allocated; the gathered whole, whether it shares the shard's storage, the collectives that gathered it and what they
carried; then the DTensor's first column after a write to the gathered copy (the control) and after one to the shard.
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from copy_correct.probes import CollectiveProbe, CopyAudit, shares_storage
from tests.workers import end_rank


def main(rank: int, out: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["TEST_PORT"])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    whole = torch.arange(1, 25, dtype=torch.float32).reshape(4, 6)
    d = distribute_tensor(whole, mesh, [Shard(0)])
    with CopyAudit() as audit:
        local = d.to_local()
    with CollectiveProbe() as probe:
        full = d.full_tensor()
    saved = {
        "local": local.clone(),
        "local_shape": list(local.shape),
        "local_is_shard": local.untyped_storage().data_ptr() == d.to_local().untyped_storage().data_ptr(),
        "local_shares_source": shares_storage(local, whole),
        "local_allocated": audit.bytes_allocated,
        "full": full.clone(),
        "full_shape": list(full.shape),
        "full_shares_local": shares_storage(full, local),
        "full_storage_bytes": full.untyped_storage().nbytes(),
        "full_contiguous": full.is_contiguous(),
        "gathers": [c.op for c in probe.collectives],
        "gathered_bytes": probe.nbytes,
    }
    full.fill_(0.0)  # the control: the gathered copy is the caller's own
    saved["after_full_write"] = d.full_tensor()[:, 0].tolist()
    local.add_(100.0)  # the shard is the DTensor's: every rank's write shows in the next gather
    saved["after_local_write"] = d.full_tensor()[:, 0].tolist()
    torch.save(saved, out / f"rank{rank}.pt")
    end_rank()


if __name__ == "__main__":
    main(int(os.environ["RANK"]), Path(sys.argv[1]))
