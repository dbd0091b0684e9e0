"""Benchmark an EMA update compiled into the training step: ``EMA(model, traceable=True)`` inside a
``torch.compile(..., fullgraph=True)`` step, against the same step run eagerly and against the peers' EMAs inside a
compiled step, in one process; write the table to docs/benchmarks.md.

    python -m benchmarks.compiled_ema                             # CPU, inductor: an MLP of width 1024, 4 layers
    python -m benchmarks.compiled_ema --quick --output /tmp/b.md  # a smoke run: a small MLP, the aot_eager backend

The step is what follows ``backward``: plain SGD on the gradients (one ``_foreach_add_``), then the EMA update (decay
0.999 with each library's warm-up). Contenders:

* ours, compiled: ``torch.compile(step, fullgraph=True)`` with ``ema.update(model)`` of ``EMA(model, traceable=True)``
* ours, eager: the same step uncompiled, with ``EMA(model)`` (host counters), the reference row
* the step without an EMA, compiled and eager: what the update adds
* timm ``ModelEmaV3(use_warmup=True).update(model, step=n)``, diffusers ``EMAModel(use_ema_warmup=True).step(...)``,
  ema-pytorch ``EMA(...).update()``: each inside ``torch.compile(step)`` (no ``fullgraph``: they break the graph)

Columns: the compiles over the first 20 steps (a backend that counts them; Dynamo gives up recompiling after its
limit, 8, and runs the function eagerly from then on), then the time of a step (median over interleaved rounds,
after those 20) and its time over the eager step with our EMA. A peer that is not installed gets a row that says why.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from itertools import count
from pathlib import Path
from types import FunctionType, ModuleType
from typing import Any

import torch
import torch._dynamo
from torch import nn

from benchmarks.peers import Missing, label, load, timm_model_ema
from benchmarks.report import cpu_header, median_ms, parse_args, write_section
from copy_correct import EMA

ROOT = Path(__file__).resolve().parents[1]
DECAY = 0.999
WARM_STEPS = 20
OURS, EAGER = "copy_correct EMA(traceable=True), compiled step", "copy_correct EMA, eager step"


class CountingBackend:
    """A ``torch.compile`` backend that hands the graph to ``backend`` and counts the compiles."""

    def __init__(self, backend: str) -> None:
        self.backend = torch._dynamo.lookup_backend(backend)
        self.compiles = 0

    def __call__(self, graph: torch.fx.GraphModule, inputs: list[Any]) -> Callable[..., Any]:
        self.compiles += 1
        return self.backend(graph, inputs)


def network(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*layers)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    return model


def own_code(fn: Callable[[], None]) -> Callable[[], None]:
    """``fn`` with a code object of its own: Dynamo keeps its compiles, and its limit on them, per code object, and
    the steps made by one closure share one."""
    return FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def sgd_step(model: nn.Module) -> Callable[[], None]:
    params = list(model.parameters())

    def sgd() -> None:
        with torch.no_grad():
            torch._foreach_add_(params, [p.grad for p in params], alpha=-1e-3)

    return sgd


def peer_updates(model: nn.Module) -> tuple[dict[str, Callable[[], object]], dict[str, str]]:
    """``({row: the peer's update}, {row: why it cannot run here})``."""
    params = list(model.parameters())

    def timm(module: ModuleType) -> Callable[[], object]:
        averaged, steps = module.ModelEmaV3(model, decay=DECAY, use_warmup=True), count(1)
        return lambda: averaged.update(model, step=next(steps))

    def diffusers(module: ModuleType) -> Callable[[], object]:
        averaged = module.EMAModel(params, decay=DECAY, use_ema_warmup=True, foreach=True)
        return lambda: averaged.step(params)

    def ema_pytorch(module: ModuleType) -> Callable[[], object]:
        return module.EMA(model, beta=DECAY, update_after_step=0, update_every=1, use_foreach=True).update

    peers = [
        (timm_model_ema(), "timm", "ModelEmaV3, compiled step", timm),
        (load("diffusers.training_utils", "diffusers"), "diffusers", "EMAModel, compiled step", diffusers),
        (load("ema_pytorch", "ema-pytorch"), "ema-pytorch", "EMA, compiled step", ema_pytorch),
    ]
    updates, not_run = {}, {}
    for module, distribution, what, build in peers:
        if isinstance(module, Missing):
            not_run[label(distribution, what)] = str(module)
        else:
            updates[label(distribution, what)] = build(module)
    return updates, not_run


def contenders(model: nn.Module, backend: str) -> tuple[dict[str, Callable[[], object]], dict[str, int], dict]:
    """``({row: one step}, {row: compiles over the first WARM_STEPS steps}, {row: why it cannot run})``; every
    compiled row has been run WARM_STEPS times."""
    sgd = sgd_step(model)
    traced, host = EMA(model, decay=DECAY, traceable=True), EMA(model, decay=DECAY)

    def with_update(update: Callable[[], object]) -> Callable[[], None]:
        def step() -> None:
            sgd()
            update()

        return step

    peers, not_run = peer_updates(model)
    compiled: dict[str, tuple[Callable[[], None], bool]] = {
        OURS: (with_update(lambda: traced.update(model)), True),
        "SGD alone, compiled step": (sgd, True),
        **{name: (with_update(update), False) for name, update in peers.items()},
    }
    steps: dict[str, Callable[[], object]] = {EAGER: with_update(lambda: host.update(model)), "SGD alone, eager": sgd}
    compiles = {EAGER: 0, "SGD alone, eager": 0}
    for name, (fn, fullgraph) in compiled.items():
        counting = CountingBackend(backend)
        steps[name] = torch.compile(own_code(fn), fullgraph=fullgraph, backend=counting)
        for _ in range(WARM_STEPS):
            steps[name]()
        compiles[name] = counting.compiles
    return steps, compiles, not_run


def table(width: int, depth: int, backend: str, budget: float) -> str:
    model = network(width, depth)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    steps, compiles, not_run = contenders(model, backend)
    ms = median_ms(steps, torch.device("cpu"), budget)
    lines = [
        f"An MLP of width {width}, {depth} layers: {weights / 1e6:.1f} MB of float32 weights; the backend {backend}.",
        "",
        f"| contender | compiles in the first {WARM_STEPS} steps | step ms | time / eager step with our EMA |",
        "| --- | ---: | ---: | ---: |",
    ]
    lines += [f"| {name} | {compiles[name]} | {ms[name]:.3f} | {ms[name] / ms[EAGER]:.2f}x |" for name in steps]
    lines += [f"| {name} | not run: {why} | | |" for name, why in not_run.items()]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args, _, budget = parse_args(__doc__, argv, 4.0, ROOT / "docs" / "benchmarks.md")
    width, depth, backend = (64, 2, "aot_eager") if args.quick else (1024, 4, "inductor")
    text = table(width, depth, backend, budget)
    print(text, flush=True)
    header = cpu_header("benchmarks.compiled_ema", args, __doc__)
    write_section(args.output, "compiled-ema-cpu", "EMA compiled into the step (cpu)", header, text)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
