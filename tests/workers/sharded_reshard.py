"""A sharded ``EMA`` and ``PowerEMA`` saved at one world size by ``torch.distributed.checkpoint`` and loaded at
another (``tests/distributed/test_sharded_reshard.py``), each world size its own group of gloo processes on the CPU:

    python tests/workers/sharded_reshard.py OUT WORLD save          # train, dcp.save into OUT/ckpt-WORLD
    python tests/workers/sharded_reshard.py OUT WORLD load FROM     # dcp.load OUT/ckpt-FROM into a WORLD-rank model

``save`` also writes the averages gathered at that world size (``OUT/gathered-WORLD.pt``); ``load`` writes, from
rank 0, the averages it loaded gathered at its own (``OUT/loaded-FROM-to-WORLD.pt``), with the counters, the
averages before the load (the control) and the bytes of the shadow's shards each rank holds."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from copy_correct import EMA, PowerEMA
from copy_correct.averages.shadow import gathered
from tests.workers import end_rank
from tests.workers.sharded import batch, network, shard, train_step

STEPS = 5


def averages(world: int) -> tuple[nn.Module, EMA, PowerEMA]:
    model = shard(network(), init_device_mesh("cpu", (world,)))
    return model, EMA(model, decay=0.9), PowerEMA(model, sigma_rels=(0.05, 0.1))


def full(ema: EMA, power: PowerEMA) -> dict[str, Any]:
    """Both averages gathered into plain tensors (a collective: every rank calls it), and their counters."""
    return {
        "ema": ema.full_state_dict(),
        "power": [gathered(profile) for profile in power.profiles],
        "counters": (int(ema.step), ema.num_updates, power.step, power.updated_step),
    }


def save(rank: int, world: int, out: Path) -> None:
    model, ema, power = averages(world)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, foreach=True)
    for step in range(STEPS):
        train_step(model, optimizer, batch(rank, step))
        for buffer in model.buffers():  # rank 0's BatchNorm statistics on every rank, as the callbacks give them
            if buffer.is_floating_point():
                dist.broadcast(buffer, src=0)
        ema.update(model)
        power.update(model)
    dcp_save({"ema": ema.state_dict(), "power": power.state_dict()}, checkpoint_id=out / f"ckpt-{world}")
    state = full(ema, power)
    if rank == 0:
        torch.save(state, out / f"gathered-{world}.pt")


def load(rank: int, world: int, out: Path, source: int) -> None:
    _, ema, power = averages(world)
    untouched = full(ema, power)
    template = {"ema": ema.state_dict(), "power": power.state_dict()}
    dcp_load(template, checkpoint_id=out / f"ckpt-{source}")  # reshards into this world size's shards, in place
    ema.load_state_dict(template["ema"])
    power.load_state_dict(template["power"])
    held = torch.tensor([sum(t.to_local().nbytes for t in ema.shadow.values() if hasattr(t, "to_local"))])
    every = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(every, held)
    result = {**full(ema, power), "untouched": untouched, "held": [int(h) for h in every]}
    before = {name: t.clone() for name, t in result["ema"].items()}
    model = ema.live_model
    assert model is not None
    train_step(model, torch.optim.SGD(model.parameters(), lr=0.1, foreach=True), batch(rank, STEPS))
    ema.update(model)  # the average gathered above is new memory: this update leaves it as it was
    result["gathered_kept"] = all(torch.equal(before[name], t) for name, t in result["ema"].items())
    result["average_moved"] = any(not torch.equal(before[name], t) for name, t in ema.full_state_dict().items())
    if rank == 0:
        torch.save(result, out / f"loaded-{source}-to-{world}.pt")


def main(rank: int, out: Path, world: int, mode: str, source: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["TEST_PORT"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    if mode == "save":
        save(rank, world, out)
    else:
        load(rank, world, out, source)
    end_rank()


if __name__ == "__main__":
    out_dir, world_size, what = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    source_world = int(sys.argv[4]) if what == "load" else 0
    torch.multiprocessing.spawn(main, args=(out_dir, world_size, what, source_world), nprocs=world_size)
