"""Benchmark host-to-device batch loading: a synchronous copy, Lightning's way and the DevicePrefetcher, side by side.

    python -m benchmarks.loading                  # CPU: the prefetcher's overhead; writes docs/benchmarks.md
    python -m benchmarks.loading --device cuda    # GPU: samples/s, copy bandwidth, overlap
    python -m benchmarks.loading --quick --output /tmp/b.md

On a GPU, every contender gets the same ``uint8`` image batches already in host memory (so loader workers
do not blur the copy) and the same compute per batch: the conversion to normalised float32 plus a spin
(``torch.cuda._sleep``) calibrated to last as long as one batch's copy, the case where overlap matters most.
  * pageable, synchronous: ``batch.to(device)`` from pageable memory, then compute;
  * pinned, ``non_blocking``, on the compute stream (Lightning's default): the copy waits for the previous
    step's compute and the step waits for the copy;
  * ``DevicePrefetcher``: the next batch's copy (and conversion) on a side stream while this one computes.
The table gives samples per second, each copy path's bandwidth against the device's pinned host-to-device
bandwidth measured here, and the overlap fraction: the share of the copy time hidden behind compute.

On a CPU there is nothing to copy: the table says so, and reports what the prefetcher costs over iterating the
bare loader (a ``DataLoader`` collating ``uint8`` images, and a list of ready batches, the worst case).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.report import command_line, measured_on, median_ms, parse_args, write_section
from copy_correct import DeviceDataLoader, DevicePrefetcher
from recipes.data.pinned_digits import normalize

ROOT = Path(__file__).resolve().parents[1]


def image_batches(count: int, batch: int, side: int, pinned: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(count):
        images = torch.randint(0, 256, (batch, 3, side, side), dtype=torch.uint8, generator=generator)
        labels = torch.randint(0, 10, (batch,), generator=generator)
        batches.append((images.pin_memory(), labels.pin_memory()) if pinned else (images, labels))
    return batches


def cpu_overhead(quick: bool, budget: float) -> str:
    """Per-epoch time of the bare loaders and the same loaders through the prefetcher, on the CPU."""
    count, batch, side = (8, 32, 32) if quick else (32, 256, 64)
    images = torch.randint(0, 256, (count * batch, 1, side, side), dtype=torch.uint8)
    data = TensorDataset(images, torch.randint(0, 10, (count * batch,)))
    loader = DataLoader(data, batch_size=batch)
    device_loader = DeviceDataLoader(data, batch_size=batch, device="cpu")
    ready = image_batches(count, batch, side, pinned=False)
    prefetched = DevicePrefetcher(ready, "cpu")
    fns: dict[str, Callable[[], object]] = {
        "DataLoader": lambda: sum(1 for _ in loader),
        "DeviceDataLoader (cpu)": lambda: sum(1 for _ in device_loader),
        "list of ready batches": lambda: sum(1 for _ in ready),
        "DevicePrefetcher over the list (cpu)": lambda: sum(1 for _ in prefetched),
    }
    times = median_ms(fns, torch.device("cpu"), budget)
    per_batch_us = {name: ms * 1e3 / count for name, ms in times.items()}
    rows = [
        f"{count} batches of {batch} uint8 images, 1x{side}x{side}. The GPU figures (overlap, bandwidth, samples/s) "
        "need a GPU: run `python -m benchmarks.loading --device cuda` there. On a CPU the prefetcher makes no copy "
        "and pins nothing; this is what it costs.",
        "",
        "| loader | µs per batch | time / bare loader |",
        "| --- | ---: | ---: |",
    ]
    for name, bare in (("DeviceDataLoader (cpu)", "DataLoader"), ("DevicePrefetcher over the list (cpu)", None)):
        base = bare or "list of ready batches"
        rows.append(f"| {base} | {per_batch_us[base]:.2f} | 1.00x |")
        rows.append(f"| {name} | {per_batch_us[name]:.2f} | {times[name] / times[base]:.3f}x |")
    return "\n".join(rows)


def gpu_table(device: torch.device, quick: bool, budget: float) -> str:
    count, batch, side = (6, 32, 64) if quick else (16, 128, 224)
    pinned = image_batches(count, batch, side, pinned=True)
    pageable = image_batches(count, batch, side, pinned=False)
    batch_bytes = sum(t.numel() * t.element_size() for t in pinned[0])

    def copy_once() -> None:
        for tensor in pinned[0]:
            tensor.to(device, non_blocking=True)

    peak = torch.empty(batch_bytes * 8, dtype=torch.uint8).pin_memory()
    peak_target = torch.empty_like(peak, device=device)
    standalone = median_ms(
        {"copy": copy_once, "peak": lambda: peak_target.copy_(peak, non_blocking=True)}, device, budget / 4
    )
    copy_ms = standalone["copy"]
    peak_gbs = peak.numel() / (standalone["peak"] * 1e-3) / 1e9
    per_million = median_ms({"sleep": lambda: torch.cuda._sleep(1_000_000)}, device, budget / 4)["sleep"]
    cycles = int(copy_ms / per_million * 1e6)

    def spin() -> None:
        torch.cuda._sleep(cycles)

    def synchronous() -> None:
        for images, labels in pageable:
            normalize((images.to(device), labels.to(device)))
            spin()

    def lightning_default() -> None:
        for images, labels in pinned:
            normalize((images.to(device, non_blocking=True), labels.to(device, non_blocking=True)))
            spin()

    prefetcher = DevicePrefetcher(pinned, device, transform=normalize)

    def prefetched() -> None:
        for _ in prefetcher:
            spin()

    fns = {
        "pageable, synchronous copy": synchronous,
        "pinned, non_blocking, compute stream (Lightning)": lightning_default,
        "DevicePrefetcher (side stream)": prefetched,
    }
    times = median_ms(fns, device, budget)
    compute_ms = median_ms({"spin": spin}, device, budget / 4)["spin"]
    serial = times["pinned, non_blocking, compute stream (Lightning)"]
    copy_gbs = batch_bytes / (copy_ms * 1e-3) / 1e9
    rows = [
        f"{count} batches of {batch} uint8 images 3x{side}x{side} ({batch_bytes / 2**20:.1f} MiB per batch); compute "
        f"per batch {compute_ms:.3f} ms, one batch's pinned copy {copy_ms:.3f} ms ({copy_gbs:.1f} GB/s, "
        f"{100 * copy_gbs / peak_gbs:.0f}% of the {peak_gbs:.1f} GB/s pinned host-to-device peak measured with one "
        f"{peak.numel() >> 20} MiB copy).",
        "",
        "| path | ms per epoch | samples/s | time / prefetcher | copy time hidden (vs Lightning's) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    ours = times["DevicePrefetcher (side stream)"]
    for name, ms in times.items():
        hidden = min(1.0, max(0.0, (serial - ms) / (count * min(copy_ms, compute_ms))))
        rows.append(f"| {name} | {ms:.3f} | {count * batch / (ms * 1e-3):,.0f} | {ms / ours:.2f}x | {hidden:.0%} |")
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    args, device, budget = parse_args(__doc__, argv, 10.0, ROOT / "docs" / "benchmarks.md")
    table = gpu_table(device, args.quick, budget) if device.type == "cuda" else cpu_overhead(args.quick, budget)
    print(table)
    command = command_line("benchmarks.loading", args)
    title = f"Batch loading ({device.type})"
    write_section(args.output, f"loading-{device.type}", title, measured_on(device, command), table)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
