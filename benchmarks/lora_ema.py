"""Benchmark the EMA of a LoRA-adapted transformer block: ``EMA(model, trainable_only=True)`` (the adapters and the
norms that train, nothing of the frozen base) against a shadow of everything and the peers' ways to leave the base
out, in one process; write the table to docs/benchmarks.md.

    python -m benchmarks.lora_ema                             # CPU: a block of width 1024, adapters of rank 16
    python -m benchmarks.lora_ema --quick --output /tmp/b.md  # a smoke run with a small block

The model: a pre-norm transformer block (query, key, value and output projections and a 4x MLP, each an
``nn.Linear`` frozen with a trainable low-rank update ``B @ A`` beside it, and two trainable ``LayerNorm``s).
Contenders, each keeping a float32 average and updating it once per call:

* ``copy_correct.EMA(model, trainable_only=True)``: ``ema.update(model)``, the reference row, ``ours``
* ``copy_correct.EMA(model)``: a shadow of every tensor, the frozen base's copy included (today's default)
* ema-pytorch ``EMA(model, ..., ignore_names=<the frozen parameters' names>, use_foreach=True)``: ``.update()``; it
  deep-copies the whole model and skips the names given
* diffusers ``EMAModel(<the parameters that require grad>, foreach=True)``: ``.step(<the same>)``, the parameters
  handed over by the caller (its ``module``, ``copy_to`` and checkpoints then know nothing of the base)
* timm ``ModelEmaV3(model)``: ``.update(model, step=n)``; a deep copy of everything, every tensor averaged

Columns: the memory each made when built (``MemoryProbe``: the storage it created and holds), the time of an update
(median over interleaved rounds), and its time over ours. A peer that is not installed gets a row that says why.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from itertools import count
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from benchmarks.peers import Missing, label, load, timm_model_ema
from benchmarks.report import cpu_header, median_ms, parse_args, write_section
from copy_correct import EMA
from copy_correct.probes import MemoryProbe

ROOT = Path(__file__).resolve().parents[1]
DECAY = 0.999
OURS, FULL = "copy_correct EMA(trainable_only=True)", "copy_correct EMA (every tensor)"


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` and a trainable low-rank update beside it (LoRA): ``base(x) + x A^T B^T``."""

    def __init__(self, width_in: int, width_out: int, rank: int) -> None:
        super().__init__()
        self.base = nn.Linear(width_in, width_out).requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, width_in) / width_in)
        self.lora_b = nn.Parameter(torch.zeros(width_out, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.lora_a.T @ self.lora_b.T


class Block(nn.Module):
    """A pre-norm transformer block whose linear layers are all ``LoRALinear``."""

    def __init__(self, width: int, rank: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.q, self.k, self.v, self.o = (LoRALinear(width, width, rank) for _ in range(4))
        self.up, self.down = LoRALinear(width, 4 * width, rank), LoRALinear(4 * width, width, rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        attention = nn.functional.scaled_dot_product_attention(self.q(h), self.k(h), self.v(h))
        x = x + self.o(attention)
        return x + self.down(nn.functional.gelu(self.up(self.norm2(x))))


def contenders(model: nn.Module) -> tuple[dict[str, Callable[[], object]], dict[str, int], dict[str, str]]:
    """``({row: one update}, {row: bytes it made when built}, {row: why it cannot run here})``."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    builders: dict[str, Callable[[], Callable[[], object]]] = {
        OURS: lambda: (lambda ema: lambda: ema.update(model))(EMA(model, decay=DECAY, trainable_only=True)),
        FULL: lambda: (lambda ema: lambda: ema.update(model))(EMA(model, decay=DECAY)),
    }
    not_run: dict[str, str] = {}

    def ema_pytorch(module: ModuleType) -> Callable[[], object]:
        return module.EMA(
            model, beta=DECAY, update_after_step=0, update_every=1, ignore_names=frozen, use_foreach=True
        ).update

    def diffusers(module: ModuleType) -> Callable[[], object]:
        averaged = module.EMAModel(trainable, decay=DECAY, foreach=True)
        return lambda: averaged.step(trainable)

    def timm(module: ModuleType) -> Callable[[], object]:
        averaged, steps = module.ModelEmaV3(model, decay=DECAY), count(1)
        return lambda: averaged.update(model, step=next(steps))

    peers = [
        (load("ema_pytorch", "ema-pytorch"), "ema-pytorch", "EMA(ignore_names=the frozen ones)", ema_pytorch),
        (load("diffusers.training_utils", "diffusers"), "diffusers", "EMAModel(the trainable parameters)", diffusers),
        (timm_model_ema(), "timm", "ModelEmaV3 (every tensor)", timm),
    ]
    for module, distribution, what, build in peers:
        if isinstance(module, Missing):
            not_run[label(distribution, what)] = str(module)
        else:
            builders[label(distribution, what)] = lambda build=build, module=module: build(module)
    fns, made = {}, {}
    for name, build in builders.items():
        with MemoryProbe("cpu") as probe:
            fns[name] = build()
        made[name] = probe.net_bytes
    return fns, made, not_run


def table(width: int, rank: int, budget: float) -> str:
    torch.manual_seed(0)
    model = Block(width, rank)
    adapters = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    everything = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    fns, made, not_run = contenders(model)
    ms = median_ms(fns, torch.device("cpu"), budget)
    lines = [
        f"A block of width {width}, adapters of rank {rank}: {everything / 1e6:.1f} MB of weights, of them "
        f"{adapters / 1e6:.2f} MB that train (the adapters and the norms).",
        "",
        "| contender | memory made when built | update ms | time / ours |",
        "| --- | ---: | ---: | ---: |",
    ]
    lines += [f"| {name} | {made[name] / 1e6:.2f} MB | {ms[name]:.3f} | {ms[name] / ms[OURS]:.2f}x |" for name in fns]
    lines += [f"| {name} | not run: {why} | | |" for name, why in not_run.items()]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args, _, budget = parse_args(__doc__, argv, 4.0, ROOT / "docs" / "benchmarks.md")
    width, rank = (64, 4) if args.quick else (1024, 16)
    text = table(width, rank, budget)
    print(text, flush=True)
    header = cpu_header("benchmarks.lora_ema", args, __doc__)
    write_section(args.output, "lora-ema-cpu", "EMA of a LoRA-adapted block (cpu)", header, text)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
