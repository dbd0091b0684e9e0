"""Run by tests/distributed/test_sharded.py on a GPU: one process (NCCL) trains an FSDP2 network sharded over a mesh of
one rank on ``cuda:0`` beside an unsharded replica. ``EMA.update`` on the local shards must not synchronise with the
host (``torch.cuda.set_sync_debug_mode("error")`` raises on a sync) nor issue a collective, and must equal the
replica's."""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from copy_correct import EMA
from copy_correct.probes import CollectiveProbe
from tests.workers.sharded import batch, mirror, network, shard, train_step


def main(out: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["TEST_PORT"])
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    replica = network().cuda()
    model = shard(copy.deepcopy(replica), init_device_mesh("cuda", (1,)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ema, reference = EMA(model, decay=0.9), EMA(replica, decay=0.9)
    collectives = []
    for step in range(3):
        train_step(model, optimizer, batch(0, step).cuda())
        mirror(replica, model)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with CollectiveProbe() as probe:
                ema.update(model)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        collectives.append(probe.count)
        reference.update(replica)
    gathered = {k: v.cpu() for k, v in ema.full_state_dict().items()}
    torch.save(
        {
            "collectives": collectives,
            "gathered": gathered,
            "reference": {k: v.cpu() for k, v in reference.shadow.items()},
        },
        out / "cuda.pt",
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
