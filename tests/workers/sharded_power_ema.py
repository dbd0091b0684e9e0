"""Run by tests/distributed/test_sharded_power_ema.py: 2 gloo processes train an FSDP2-sharded network with a
``PowerEMA`` (snapshots every 2 steps), beside an unsharded replica given the gathered weights and this rank's buffers
after every step, with a ``PowerEMA`` of its own; each rank saves what the tests check (tensors and plain values):

* the profiles gathered (``full_tensor()``, for the test only) and the replica's, and the local shards' shapes;
* the collectives and bytes of an update;
* the snapshot files, the post-hoc EMA synthesized from this rank's files (and the collectives it issued), gathered,
  and the replica's synthesized from its own;
* a ``PowerEMA`` loaded from the replica's full state, gathered; what ``load_state_dict`` says to a state spread
  otherwise, and ``synthesize`` to the snapshots of both ranks together.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from copy_correct import PowerEMA, synthesize
from copy_correct.averages.posthoc import snapshot_paths
from copy_correct.probes import CollectiveProbe, CopyAudit
from tests.workers import end_rank
from tests.workers.sharded import batch, cpu, full, mirror, network, shard, train_step

STEPS = 7  # snapshots at 2, 4, 6; the last update writes none


def gathered(state: dict[str, torch.Tensor], like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Plain local shards (``synthesize``'s result) made whole, spread as ``like``'s tensors are (every rank calls)."""
    out = {}
    for name, shard_or_whole in state.items():
        spread = like[name]
        if isinstance(spread, DTensor):
            shard_or_whole = DTensor.from_local(
                shard_or_whole, spread.device_mesh, spread.placements, shape=spread.shape, stride=spread.stride()
            ).full_tensor()
        out[name] = shard_or_whole.clone()
    return out


def checks(rank: int, out: Path) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2,))
    replica = network()
    model = shard(network(), mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ema = PowerEMA(model, snapshot_every=2, snapshot_dir=out / "sharded")
    reference = PowerEMA(replica, snapshot_every=2, snapshot_dir=out / f"replica{rank}")
    for step in range(1, STEPS + 1):
        train_step(model, optimizer, batch(rank, step))
        mirror(replica, model)
        if step == STEPS:
            with CollectiveProbe() as collectives, CopyAudit() as audit:
                ema.update()
        else:
            ema.update()
        reference.update()
    dist.barrier()  # every rank's snapshots written
    with CollectiveProbe() as synthesis:
        shards = synthesize(snapshot_paths(out / "sharded", rank=rank), 0.08)
    loaded = PowerEMA(model)
    loaded.load_state_dict(reference.state_dict())  # full plain tensors: each rank copies its part
    replicated = {
        "sigma_rels": list(ema.sigma_rels),
        "step": ema.step,
        "updated_step": ema.updated_step,
        "profiles": [
            {k: DTensor.from_local(full(v), mesh, [Replicate()]) if isinstance(v, DTensor) else v for k, v in p.items()}
            for p in ema.state_dict()["profiles"]
        ],
    }
    try:
        loaded.load_state_dict(replicated)
        refusal = ""
    except ValueError as error:
        refusal = str(error)
    try:
        synthesize(out / "sharded", 0.08)
        mixed = ""
    except ValueError as error:
        mixed = str(error)
    try:
        synthesize([*snapshot_paths(out / "sharded", rank=0), *snapshot_paths(out / "sharded", rank=1)], 0.08)
        both = ""
    except ValueError as error:
        both = str(error)
    return {
        "profiles": [cpu({k: full(v) for k, v in p.items()}) for p in ema.profiles],
        "reference": [cpu(p) for p in reference.profiles],
        "local_shapes": {k: tuple(v.to_local().shape) for k, v in ema.profiles[0].items() if isinstance(v, DTensor)},
        "update_collectives": collectives.count,
        "update_bytes": audit.bytes_allocated,
        "files": sorted(p.name for p in (out / "sharded").iterdir()),
        "synthesized": gathered(shards, ema.profiles[0]),
        "synthesis_collectives": synthesis.count,
        "expected": synthesize(out / f"replica{rank}", 0.08),
        "loaded": [cpu({k: full(v) for k, v in p.items()}) for p in loaded.profiles],
        "refusal": refusal,
        "directory_refusal": mixed,
        "both_ranks_refusal": both,
    }


def main(rank: int, out: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["TEST_PORT"])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    results = checks(rank, out)
    torch.save(results, out / f"rank{rank}.pt")
    end_rank()


if __name__ == "__main__":
    torch.multiprocessing.spawn(main, args=(Path(sys.argv[1]),), nprocs=2)
