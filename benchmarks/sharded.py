"""Benchmark a sharded EMA against the gather-based one, per rank, at world sizes 1, 2 and 4; write the table to
docs/benchmarks.md.

    python -m benchmarks.sharded                 # CPU processes over gloo; updates docs/benchmarks.md
    python -m benchmarks.sharded --quick --output /tmp/b.md   # a smoke run: a small model, world sizes 1 and 2

The model: ``benchmarks/ema.py``'s transformer blocks (28.3M float32 parameters in 48 tensors, 113 MB), each block and
the root sharded with FSDP2's ``fully_shard`` over the ranks (``Shard(0)``). Contenders, each keeping an EMA of it:

* ``copy_correct.EMA``: the shadow of this rank's shards, updated by foreach calls on the local shards.
* ``GatheredEMA`` (below): the peers' way, the proposal in Lightning issue 21414 and Composer's EMA, which summon the
  full parameters on every update. It keeps a full shadow on every rank, and every update gathers every full
  parameter (``DTensor.full_tensor()``, an all-gather each) and averages it into the shadow. It is also the control
  of ``tests/distributed/test_sharded.py``.
* ``BareLerp`` (below): the floor, the arithmetic of a sharded update alone (one ``torch._foreach_lerp_`` of the
  local shards into copies of them). Ours against it is what our bookkeeping costs; the bare lerp at N against N=1
  is how far this machine lets any sharded update fall with N.

Measured per rank, in the same processes, one thread each: the shadow's bytes (``MemoryProbe`` around the EMA's
construction) and their ratio to the full shadow's bytes / N; the collectives one update issues and the bytes they
carry (``CollectiveProbe``); the most memory an update creates (``MemoryProbe`` peak); and the update time, the
median over interleaved rounds, twice: with all ranks starting together after a barrier, as in training, and (ours
and the bare lerp: a gather needs every rank) with the ranks taking turns, each alone on the machine, as each would
be on a device of its own. Tables give the largest (slowest) rank's figure, and for time its ratio to world size 1
of the same contender; 1/N is the ideal. Ranks running together share the machine's memory bandwidth, and at world
size 4 on a machine with fewer than 4 cores its cores too.
"""

from __future__ import annotations

import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import date
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.ema import Block, transformer_model
from benchmarks.report import command_line, parse_args, write_section
from copy_correct import EMA
from copy_correct.core.sharding import is_sharded, local
from copy_correct.probes import CollectiveProbe, MemoryProbe

ROOT = Path(__file__).resolve().parents[1]

DECAY = 0.999
OURS = "copy_correct.EMA (sharded)"
BARE = "bare foreach lerp of the local shards"
GATHERED = "GatheredEMA (gathers per update)"
ALONE = (OURS, BARE)  # the contenders each rank can run without the others


class GatheredEMA:
    """The control: a full shadow of every parameter on every rank; each update all-gathers every full parameter
    (``DTensor.full_tensor()``) and averages it into the shadow. Parameters only."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        self.decay = decay
        self.params = list(model.parameters())
        with torch.no_grad():  # a copy of its own (on a mesh of one rank, full_tensor() is the shard itself)
            self.shadow = [_full(p).clone() for p in self.params]

    def update(self) -> None:
        with torch.no_grad():
            torch._foreach_lerp_(self.shadow, [_full(p) for p in self.params], 1.0 - self.decay)


class BareLerp:
    """The floor: the arithmetic of a sharded update and nothing else, one ``torch._foreach_lerp_`` of this rank's
    shards (``to_local()``) into copies of them; no grouping, no checks, no version bookkeeping, no buffers."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        self.decay = decay
        self.params = list(model.parameters())
        with torch.no_grad():
            self.shadow = [local(p).clone() for p in self.params]

    def update(self) -> None:
        with torch.no_grad():
            torch._foreach_lerp_(self.shadow, [local(p) for p in self.params], 1.0 - self.decay)


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if is_sharded(p) else p.detach()


def small_model() -> nn.Module:
    """Two blocks of width 64 (0.1M parameters): for ``--quick``."""
    return nn.Sequential(Block(64), Block(64))


def sharded(make: Callable[[], nn.Module]) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = make()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def timed(fns: dict[str, Callable[[], object]], budget_s: float) -> dict[str, float]:
    """Milliseconds per call on this rank: the median over interleaved rounds (at least 3, then until the budget is
    spent; every rank stops after the same round). ``"together"``: all ranks start each contender at once, after a
    barrier, as in training; ``"alone"``: the ranks take turns while the others wait, so none shares the machine's
    cores and memory bandwidth with another (as on a device of its own); for the local contenders only (``ALONE``),
    the gather needs every rank at once."""
    samples: dict[str, list[float]] = {f"{name} together": [] for name in fns}
    samples.update({f"{name} alone": [] for name in ALONE})
    for fn in fns.values():  # warm up
        fn()
    began = time.perf_counter()
    while True:
        for name, fn in fns.items():
            dist.barrier()
            start = time.perf_counter()
            fn()
            samples[f"{name} together"].append((time.perf_counter() - start) * 1e3)
        for turn in range(dist.get_world_size()):
            dist.barrier()
            if turn == dist.get_rank():
                for name in ALONE:
                    start = time.perf_counter()
                    fns[name]()
                    samples[f"{name} alone"].append((time.perf_counter() - start) * 1e3)
        rounds = len(samples[f"{OURS} alone"])
        done = torch.tensor(float(rounds >= 3 and time.perf_counter() - began >= budget_s))
        dist.all_reduce(done, op=dist.ReduceOp.MAX)
        if done.item():
            return {name: statistics.median(values) for name, values in samples.items()}


def rank_main(rank: int, world: int, port: str, quick: bool, budget_s: float, out: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    model = sharded(small_model if quick else transformer_model)
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # DTensor: the full tensor's
    with MemoryProbe("cpu") as probe:
        ema = EMA(model, decay=DECAY)
    shadow = {OURS: probe.net_bytes}
    with MemoryProbe("cpu") as probe:
        bare = BareLerp(model, decay=DECAY)
    shadow[BARE] = probe.net_bytes
    with MemoryProbe("cpu") as probe:
        gathered = GatheredEMA(model, decay=DECAY)
    shadow[GATHERED] = probe.net_bytes
    updates: dict[str, Callable[[], object]] = {
        OURS: lambda: ema.update(model),
        BARE: bare.update,
        GATHERED: gathered.update,
    }
    result: dict[str, Any] = {"full_bytes": full_bytes, "tensors": len(list(model.parameters()))}
    for name, update in updates.items():
        with CollectiveProbe() as collectives, MemoryProbe("cpu") as memory:
            update()
        result[name] = {
            "shadow_bytes": shadow[name], "collectives": collectives.count, "collective_bytes": collectives.nbytes,
            "update_peak_bytes": memory.peak_bytes,
        }  # fmt: skip
    result["ms"] = timed(updates, budget_s)
    torch.save(result, out / f"world{world}_rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    # FSDP2's state keeps the group, so gloo's threads outlive destroy_process_group; one dropping a tensor with Python
    # state while a normal exit finalizes the interpreter aborts the rank (SIGABRT, "terminate called without an
    # active exception"). Ending without finalizing leaves them nothing to touch; the results file is closed.
    sys.stdout.flush()
    os._exit(0)


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def table(results: dict[int, list[dict[str, Any]]]) -> str:
    first = next(iter(results.values()))[0]
    lines = [
        f"**transformer blocks, {first['full_bytes'] / 4e6:.1f}M float32 parameters in {first['tensors']} tensors**"
        f" ({first['full_bytes'] / 1e6:.0f} MB), sharded over N ranks; per rank, the largest figure over the ranks",
        "",
        "| contender | N | shadow MB per rank | shadow / (full / N) | collectives per update "
        "| MB into collectives per update | update peak MB | update ms, ranks together (/ N=1) "
        "| update ms, each rank alone (/ N=1) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]

    def ms(world: int, key: str) -> float:
        return max(rank["ms"][key] for rank in results[world])

    for name in (OURS, BARE, GATHERED):
        for world, ranks in results.items():
            figures = [rank[name] for rank in ranks]
            shadow = max(f["shadow_bytes"] for f in figures)
            together = (
                f"{ms(world, f'{name} together'):.2f} ({ms(world, f'{name} together') / ms(1, f'{name} together'):.2f})"
            )
            alone = "n/a: a gather needs every rank"
            if name in ALONE:
                alone = f"{ms(world, f'{name} alone'):.2f} ({ms(world, f'{name} alone') / ms(1, f'{name} alone'):.2f})"
            lines.append(
                f"| {name} | {world} | {shadow / 1e6:.1f} | {shadow / (first['full_bytes'] / world):.3f} "
                f"| {max(f['collectives'] for f in figures)} | {max(f['collective_bytes'] for f in figures) / 1e6:.1f} "
                f"| {max(f['update_peak_bytes'] for f in figures) / 1e6:.1f} | {together} | {alone} |"
            )
    overhead = ", ".join(
        f"N={world}: {ms(world, f'{OURS} alone') / ms(world, f'{BARE} alone'):.2f}" for world in results
    )
    lines += [
        "",
        f"Ours alone against the bare lerp of the same shards alone (1.00: no cost beyond the arithmetic): {overhead}.",
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args, device, budget = parse_args(__doc__, argv, 20.0, ROOT / "docs" / "benchmarks.md")
    if device.type != "cpu":
        print("error: benchmarks.sharded runs CPU processes over gloo; --device must be cpu", file=sys.stderr)
        return 2
    worlds = (1, 2) if args.quick else (1, 2, 4)
    results: dict[int, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        for world in worlds:
            torch.multiprocessing.spawn(rank_main, args=(world, free_port(), args.quick, budget, out), nprocs=world)
            results[world] = [torch.load(out / f"world{world}_rank{r}.pt", weights_only=True) for r in range(world)]
            print(f"world size {world}: done", flush=True)
    body = table(results)
    print(body, flush=True)
    header = (
        f"Measured {date.today()} on cpu, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, one "
        f"thread per rank, gloo, torch {torch.__version__}, with `{command_line('benchmarks.sharded', args)}`."
    )
    write_section(args.output, "sharded-cpu", "Sharded EMA update, per rank (cpu, gloo)", header, body)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
