"""Benchmark the gan recipe's training step against the "generator twice" step, in one process.

    python -m benchmarks.gan                  # CPU; writes its section of docs/benchmarks.md
    python -m benchmarks.gan --device cuda    # the same on a GPU
    python -m benchmarks.gan --quick --output /tmp/b.md

Ours (the recipe): ``fake = G(z)`` once; the discriminator step on ``fake.detach()`` (one D forward over
real and fake together); the generator step reuses ``fake`` through a frozen D. The peer (Lightning's GAN
example): the generator step computes ``D(G(z))``, then the discriminator step runs ``G(z).detach()``
again, a second generator forward. Both use the same networks, optimisers and batches; the table gives
milliseconds per step (median of interleaved rounds), the ratio, and each step's peak memory above its
start (``MemoryProbe``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.report import command_line, measured_on, median_ms, parse_args, write_section
from copy_correct import frozen
from copy_correct.probes import MemoryProbe
from copy_correct.probes._storage_events import human_bytes
from recipes.gan import _bce, discriminator_loss
from recipes.networks import MLPDiscriminator, MLPGenerator

ROOT = Path(__file__).resolve().parents[1]

LATENT = 32
DIGITS = (1, 8, 8)  # the recipe's default data


def steps(batch: int, hidden: int, device: torch.device) -> dict[str, Callable[[], object]]:
    torch.manual_seed(0)
    g, d = MLPGenerator(LATENT, hidden, DIGITS).to(device), MLPDiscriminator(DIGITS, hidden, 0.3).to(device)
    opt_g = torch.optim.Adam(g.parameters(), lr=2e-4, betas=(0.5, 0.999), fused=True)
    opt_d = torch.optim.Adam(d.parameters(), lr=2e-4, betas=(0.5, 0.999), fused=True)
    real = torch.rand(batch, *DIGITS, device=device) * 2 - 1

    def ours() -> None:
        fake = g(torch.randn(batch, LATENT, device=device))
        discriminator_loss(d, real, fake.detach()).backward()
        opt_d.step()
        opt_d.zero_grad(set_to_none=True)
        with frozen(d):
            _bce(d(fake), 1.0).backward()
        opt_g.step()
        opt_g.zero_grad(set_to_none=True)

    def generator_twice() -> None:
        z = torch.randn(batch, LATENT, device=device)
        g_loss = _bce(d(g(z)), 1.0)  # generator step: D's parameters receive gradients too
        opt_g.zero_grad(set_to_none=True)
        g_loss.backward()
        opt_g.step()
        d_loss = _bce(d(real), 1.0) + _bce(d(g(z).detach()), 0.0)  # a second generator forward
        opt_d.zero_grad(set_to_none=True)
        d_loss.backward()
        opt_d.step()

    return {"ours: G once, detach, frozen D": ours, "generator twice (Lightning example)": generator_twice}


def peak_bytes(step: Callable[[], object], device: torch.device) -> int:
    step()  # optimiser state exists before measuring
    with MemoryProbe(device) as probe:
        step()
    return probe.peak_bytes


def main(argv: list[str]) -> int:
    args, device, budget = parse_args(__doc__, argv, 10.0, ROOT / "docs" / "benchmarks.md")
    configs = [(64, 256)] if args.quick else [(64, 256), (512, 1024)]
    lines = [
        "| batch, hidden | step | ms per step | time / ours | peak memory in the step |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for batch, hidden in configs:
        fns = steps(batch, hidden, device)
        times = median_ms(fns, device, budget)
        ours = times["ours: G once, detach, frozen D"]
        for name, fn in fns.items():
            peak = human_bytes(peak_bytes(fn, device))
            lines.append(f"| {batch}, {hidden} | {name} | {times[name]:.3f} | {times[name] / ours:.2f}x | {peak} |")
    table = "\n".join(lines)
    print(table)
    command = command_line("benchmarks.gan", args)
    write_section(
        args.output, f"gan-{device.type}", f"GAN training step ({device.type})", measured_on(device, command), table
    )
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
