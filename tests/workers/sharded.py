"""Run by tests/distributed/test_sharded.py: 2 gloo processes train FSDP2-sharded networks with an ``EMA`` and a target
network, beside unsharded replicas that get the same weights after every step; each rank saves what the tests check.

Every rank trains on its own batches; after each optimizer step the replica's parameters are set to the gathered
full parameters (``full_tensor()``, for the test only) and its buffers to this rank's, so the replica's EMA and
target are "the unsharded run with the same data order". Saved per rank (tensors and plain values only):

* ``ema``: gathered average and the replica's; local shard shapes; the shadow's bytes (``MemoryProbe``) and the
  gather-based control's; bytes and collectives of ``update`` and of the control's update; ``average_weights``
  outputs, aliasing, guards, nesting, exceptions, and the control without ``reshard``; the ``to_local()`` storages
  across steps; ``export``/``full_state_dict``; a ``torch.distributed.checkpoint`` round trip; what
  ``load_state_dict`` says to states spread otherwise (and the control with the check switched off); what a fused
  SGD step says to sharded parameters.
* ``target``: gathered targets and the replica's after hard and soft updates; collectives and bytes of each update;
  the target's forward after an update, and the control without ``reshard``; the refusals.
* ``mixed``: a ``MixedPrecisionPolicy(param_dtype=bfloat16)`` model's shadow dtype, the sharded parameters' dtype,
  and the average against the replica's.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.sharded import GatheredEMA
from copy_correct import EMA, hard_update, make_target, soft_update
from copy_correct.core.sharding import local, local_part
from copy_correct.probes import CollectiveProbe, MemoryProbe, shares_storage, storage_key
from tests.workers import end_rank

STEPS = 6


def network() -> nn.Module:
    """Uneven shards on 2 ranks (33 rows: 17 and 16; 5: 3 and 2) and an empty one (1 row: rank 1 has none)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 33), nn.BatchNorm1d(33), nn.ReLU(), nn.Linear(33, 5), nn.ReLU(), nn.Linear(5, 1)
    )  # fmt: skip


def shard(model: nn.Module, mesh: DeviceMesh, **kwargs: Any) -> nn.Module:
    """Each Linear its own FSDP2 unit, the root the rest (BatchNorm's parameters)."""
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(1000 * step + rank))


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model.train()
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def mirror(replica: nn.Module, model: nn.Module) -> None:
    """The replica gets the sharded model's gathered parameters and this rank's buffers (test only)."""
    with torch.no_grad():
        for r, m in zip(replica.state_dict(keep_vars=True).values(), model.state_dict().values(), strict=True):
            r.copy_(full(m))


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def same_state(a: nn.Module, b: nn.Module) -> bool:
    """Whether two networks hold the same values (gathered: every rank takes part)."""
    return all(
        torch.equal(full(x), full(y)) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


def cpu(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in state.items()}


def local_storages(model: nn.Module) -> list[int]:
    with torch.no_grad():
        return [storage_key(p.to_local()) for p in model.parameters()]


def ema_checks(rank: int, mesh: DeviceMesh, directory: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    replica = network()
    model = shard(network(), mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before_first_forward = local_storages(model)
    with MemoryProbe("cpu") as ours_memory:
        ema = EMA(model, decay=0.9)
    with MemoryProbe("cpu") as control_memory:
        gathered = GatheredEMA(model, decay=0.9)
    reference = EMA(replica, decay=0.9)
    out["shadow_bytes"], out["control_shadow_bytes"] = ours_memory.net_bytes, control_memory.net_bytes
    out["local_shapes"] = {k: tuple(v.to_local().shape) for k, v in ema.shadow.items() if hasattr(v, "to_local")}
    with torch.no_grad():
        out["shard_shapes"] = {k: tuple(p.to_local().shape) for k, p in model.named_parameters()}
    out["full_shapes"] = {k: tuple(v.shape) for k, v in replica.state_dict().items()}
    out["buffer_bytes"] = sum(b.numel() * b.element_size() for b in model.buffers())
    out["update_collectives"], out["control_collectives"] = [], []
    out["update_peak"], out["control_peak"], out["control_collective_bytes"] = [], [], []
    storages = []
    for step in range(STEPS):
        train_step(model, optimizer, batch(rank, step))
        storages.append(local_storages(model))
        mirror(replica, model)
        with CollectiveProbe() as probe, MemoryProbe("cpu") as memory:
            ema.update(model)
        out["update_collectives"].append(probe.count)
        out["update_peak"].append(memory.peak_bytes)
        reference.update(replica)
        with CollectiveProbe() as probe, MemoryProbe("cpu") as memory:
            gathered.update()
        out["control_collectives"].append(probe.count)
        out["control_collective_bytes"].append(probe.nbytes)
        out["control_peak"].append(memory.peak_bytes)
    with torch.no_grad():
        cached = [p.to_local() for p in model.parameters()]  # the control: views taken once
    model.double().float()  # the same Parameter objects, each shard in new storage
    train_step(model, optimizer, batch(rank, STEPS))
    mirror(replica, model)
    ema.update(model)
    reference.update(replica)
    with torch.no_grad():
        out["cached_views_stale"] = [
            not shares_storage(c, p.to_local()) for c, p in zip(cached, model.parameters(), strict=True)
        ]
    out["storages"] = {
        "before first forward": before_first_forward, "steps": storages, "after double().float()": local_storages(model)
    }  # fmt: skip
    out["gathered"] = cpu(ema.full_state_dict())
    out["reference"] = cpu(reference.shadow)
    out["live"] = cpu(replica.state_dict())

    # average_weights: the root keeps its gathered parameters after an evaluation forward
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(7))
    model.eval()
    with torch.no_grad():
        live_out = model(x)
        out["root_gathered_after_eval_forward"] = not hasattr(model[1].weight, "to_local")
        with ema.average_weights(model):
            average_out = model(x)
            with ema.average_weights(model):
                nested_out = model(x)
            model.reshard()  # the sharded parameters registered again, to compare with
            shadow_apart = all(
                storage_key(ema.shadow[k].to_local()) != storage_key(p.to_local()) for k, p in model.named_parameters()
            )
            inside_state = cpu({k: full(v) for k, v in ema.state_dict()["shadow"].items()})
            guards = []
            for call in (lambda: ema.update(model), lambda: ema.copy_to()):
                try:
                    call()
                    guards.append("accepted")
                except RuntimeError as err:
                    guards.append(str(err).split(":")[0])
        after_out = model(x)
        try:
            with ema.average_weights(model):
                raise KeyError("boom")
        except KeyError:
            pass
        after_exception_out = model(x)
        averaged_replica = copy.deepcopy(replica).eval()
        averaged_replica.load_state_dict(reference.shadow)
        live_replica = copy.deepcopy(replica).eval()
        out["swap"] = {
            "live": live_out, "average": average_out, "nested": nested_out, "after": after_out,
            "after_exception": after_exception_out, "replica_average": averaged_replica(x),
            "replica_live": live_replica(x), "shadow_apart": shadow_apart, "inside_state": inside_state,
            "guards": guards, "swapped_after": ema.swapped,
        }  # fmt: skip
        model(x)  # the root gathers its parameters again
        # the control: no reshard, and so no changed-model check (which walks the model as its shards)
        no_reshard = mock.patch("copy_correct.averages.ema.reshard", lambda module: None)
        no_check = mock.patch.object(ema, "_check_model", lambda module: None)
        with no_reshard, no_check, ema.average_weights(model):
            out["swap"]["without_reshard"] = model(x)
        model.reshard()

    # export: a plain module's state_dict, gathered on request
    try:
        ema.export()
        out["export"] = "accepted"
    except RuntimeError as err:
        out["export"] = str(err)
    plain = network()
    plain.load_state_dict(ema.full_state_dict())
    out["plain_from_full"] = cpu(plain.state_dict())

    # torch.distributed.checkpoint round trip of EMA.state_dict, into a fresh EMA of another sharded model
    dcp_save({"ema": ema.state_dict()}, checkpoint_id=directory / "ema_dcp")
    other = EMA(shard(network(), mesh), decay=0.9)
    template = {"ema": other.state_dict()}
    dcp_load(template, checkpoint_id=directory / "ema_dcp")
    other.load_state_dict(template["ema"])
    out["dcp_round_trip"] = cpu(other.full_state_dict())
    out["dcp_counters"] = (int(other.step), other.num_updates)

    # whole states load at any spread (each rank cuts its part); DTensors spread otherwise are refused, naming both
    single = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicas", "shards"))["shards"]  # 1 rank per mesh
    one_rank = EMA(shard(network(), single), decay=0.9)
    hybrid = init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard"))  # HSDP: (Replicate, Shard(0))
    by_replica_groups = EMA(shard(network(), hybrid), decay=0.9)
    unsharded = EMA(network(), decay=0.9)
    full_state = {**ema.state_dict(), "shadow": ema.full_state_dict()}  # as a single-file checkpoint holds it
    outcomes, loaded = {}, {}
    for name, target, state in [
        ("world size 1 -> 2", ema, {**one_rank.state_dict(), "shadow": one_rank.full_state_dict()}),
        ("world size 2 -> 1", one_rank, full_state),
        ("FSDP -> HSDP", by_replica_groups, ema.state_dict()),
        ("unsharded -> sharded", ema, unsharded.state_dict()),
        ("sharded -> unsharded", unsharded, full_state),
        ("sharded DTensors -> unsharded", unsharded, ema.state_dict()),
    ]:
        expected = {k: full(v).clone() for k, v in state["shadow"].items()}
        try:
            target.load_state_dict(state)
            outcomes[name] = "accepted"
            loaded[name] = all(torch.equal(expected[k], v) for k, v in target.full_state_dict().items())
        except ValueError as err:
            outcomes[name] = str(err)
    out["refusals"], out["loaded_whole"] = outcomes, loaded

    model.train()
    model(x).sum().backward()
    try:  # the ema recipe steps with foreach when sharded: this is why
        torch.optim.SGD(model.parameters(), lr=0.1, fused=True).step()
        out["fused_sgd"] = "accepted"
    except NotImplementedError as err:
        out["fused_sgd"] = str(err)
    return out


def target_checks(rank: int, mesh: DeviceMesh) -> dict[str, Any]:
    out: dict[str, Any] = {}
    online = network()
    target = make_target(online)  # before sharding: FSDP2 forbids deep copies of sharded modules
    replica_online, replica_target = copy.deepcopy(online), copy.deepcopy(target)
    for module in (online, target):
        shard(module, mesh)
    try:
        make_target(online)
        out["make_target_sharded"] = "accepted"
    except ValueError as err:
        out["make_target_sharded"] = str(err)
    twin = shard(network(), mesh)
    with torch.no_grad():
        for t in twin.state_dict().values():
            local(t).add_(1)  # other weights and statistics than online's
    differed = not same_state(twin, online)
    with CollectiveProbe() as probe:
        made = make_target(online, into=twin)
    out["into"] = {
        "differed": differed, "returned": made is twin, "collectives": probe.count, "training": twin.training,
        "requires_grad": any(p.requires_grad for p in twin.parameters()),
        "gathered": (cpu({k: full(v) for k, v in twin.state_dict().items()}),
                     cpu({k: full(v) for k, v in online.state_dict().items()})),
    }  # fmt: skip
    out["target_requires_grad"] = any(p.requires_grad for p in target.parameters())
    optimizer = torch.optim.SGD(online.parameters(), lr=0.1)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(9))
    out["collectives"], out["peak"], out["states"] = {}, {}, {}
    for step in range(3):
        train_step(online, optimizer, batch(rank, step))
        mirror(replica_online, online)
        with torch.no_grad():
            target(x)  # a forward without backward: the target's root keeps its gathered parameters
        updates = {
            "hard": (lambda: hard_update(target, online), lambda: hard_update(replica_target, replica_online)),
            "soft": (
                lambda: soft_update(target, online, 0.3),
                lambda: soft_update(replica_target, replica_online, 0.3),
            ),
        }
        for kind, (update, replica_update) in updates.items():
            with CollectiveProbe() as probe, MemoryProbe("cpu") as memory:
                update()
            replica_update()
            out["collectives"].setdefault(kind, []).append(probe.count)
            out["peak"].setdefault(kind, []).append(memory.peak_bytes)
            out["states"].setdefault(kind, []).append(
                (cpu({k: full(v) for k, v in target.state_dict().items()}), cpu(replica_target.state_dict()))
            )
    online.eval()
    with torch.no_grad():
        target(x)
        hard_update(target, online)
        out["forward_after_hard_update"] = (target(x), online(x))
        target(x)
        online.reshard()
        for p in online.parameters():
            p.to_local().add_(1.0)
        with mock.patch.object(FSDPModule, "reshard", lambda self: None):  # the control: no reshard before writing
            hard_update(target, online)
        out["forward_without_reshard"] = (target(x), online(x))
    target.reshard()
    online.reshard()
    with CollectiveProbe() as probe, torch.no_grad():  # the probe sees a gather-based soft update's collectives
        for t, o in zip(target.parameters(), online.parameters(), strict=True):
            t.to_local().copy_(local_part(t.full_tensor().lerp(o.full_tensor(), 0.3), t))
    out["gathered_update_collectives"] = probe.count
    refusals = {}
    lopsided = shard(network(), init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard")))
    for name, (t, o) in {"sharded otherwise": (lopsided, online), "unsharded target": (network(), online)}.items():
        try:
            hard_update(t, o)
            refusals[name] = "accepted"
        except ValueError as err:
            refusals[name] = str(err)
    out["refusals"] = refusals
    return out


def mixed_precision_checks(rank: int, mesh: DeviceMesh) -> dict[str, Any]:
    torch.manual_seed(0)
    replica = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    model = copy.deepcopy(replica)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ema, reference = EMA(model, decay=0.9), EMA(replica, decay=0.9)
    for step in range(3):
        model(batch(rank, step)).float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        mirror(replica, model)
        ema.update(model)
        reference.update(replica)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), ema.average_weights(model):
        average_out = model(x)
    averaged = copy.deepcopy(replica)
    averaged.load_state_dict(reference.shadow)
    with torch.no_grad():
        bf16_out = averaged.to(torch.bfloat16)(x.to(torch.bfloat16))
    return {
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "shadow_dtypes": sorted({str(t.dtype) for t in ema.shadow.values()}),
        "gathered": cpu(ema.full_state_dict()),
        "reference": cpu(reference.shadow),
        "average_out": average_out,
        "bf16_out": bf16_out,
    }


def main(rank: int, out: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["TEST_PORT"])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2,))
    results = {
        "ema": ema_checks(rank, mesh, out),
        "target": target_checks(rank, mesh),
        "mixed": mixed_precision_checks(rank, mesh),
    }
    torch.save(results, out / f"rank{rank}.pt")
    end_rank()


if __name__ == "__main__":
    torch.multiprocessing.spawn(main, args=(Path(sys.argv[1]),), nprocs=2)
