"""Measure a device's memory bandwidth the way STREAM does (McCalpin's copy, scale, add and triad, and STREAM2's
DAXPY), with torch, and write the table to docs/benchmarks.md; the EMA and target benchmarks state their rows
against the same limit, timed in their own rounds (``in_rounds``).

    python -m benchmarks.stream                  # CPU: float32 arrays of 4x the caches' total each
    python -m benchmarks.stream --device cuda    # the same on a GPU (4x its L2)
    python -m benchmarks.stream --quick --output /tmp/b.md   # smoke run: small arrays, in cache

STREAM's rules, kept: three arrays, each at least 4 times the sum of the caches (read from /sys on a CPU, from the
device's properties on a GPU), so no kernel runs from cache; each kernel timed alone, and its best time after the
first run reported (STREAM prints the best rate of NTIMES); here the median over the same interleaved rounds is
reported beside it, since the benchmarks' tables report medians. The kernels are torch calls on float32 arrays:
copy ``c.copy_(a)``, scale ``torch.mul(c, q, out=b)``, add ``torch.add(a, b, out=c)``, triad ``torch.add(b, c,
alpha=q, out=a)``, and DAXPY ``a.add_(b, alpha=q)`` from McCalpin's STREAM2 (``a(i) = a(i) + q*b(i)``): the one
kernel of the family that updates an array in place, as an EMA update and ``soft_update`` do.

Counting. STREAM counts the arrays a kernel names, 4 bytes per float32 element each: copy and scale 2, add and triad
3. A CPU cache that allocates on a write (x86 without non-temporal stores; torch's kernels use plain stores) first
reads each line it is to write: one more stream per array written that the kernel did not read, so copy and scale
move 3 streams, add and triad 4. Both are given on a CPU; a GPU's L2 does not fetch a line that is written whole, so
there the two counts agree. An update in place (``lerp_``: EMA's and ``soft_update``'s kernel) writes lines it has
just read: 3 streams either way, as DAXPY. A copy of a model's state (``hard_update``) is a copy: 2 streams, 3
moved.

Which limit. Kernels that move the same bytes do not reach the same rate: on this project's CPU machine an update
in place (DAXPY) moved 1.2x the bytes per second that triad or copy moved, write-allocate counted (2026-12-02), so
triad is no ceiling for an update in place, and STREAM's own rule is to compare a kernel with its like. A row is
held to the kernel with its access pattern: a copy to STREAM copy, an update in place to DAXPY.

Beyond STREAM, the same arrays also run the calls our updates make: ``lerp_`` in place, and ``_foreach_copy_`` and
``_foreach_lerp_`` over 132 pieces (as many tensors as the large conv net's state); and a second table times a copy
of the large conv net's 24M elements several ways, which is what the target benchmark's reference copy was.
"""

from __future__ import annotations

import functools
import glob
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.report import command_line, measured_on, parse_args, write_section

ROOT = Path(__file__).resolve().parents[1]

SCALAR = 3.0  # STREAM's q
WEIGHT = 0.005  # a lerp weight (soft_update's tau)
PIECES = 132  # tensors in the large conv net's state
REFILL_EVERY = 8  # triad grows the arrays 15x a round (as STREAM's do): refill before float32 overflows
# kernel: (STREAM's streams, streams moved with write-allocate, the call)
KERNELS = {
    "copy": (2, 3, "c.copy_(a)"),
    "scale": (2, 3, "torch.mul(c, q, out=b)"),
    "add": (3, 4, "torch.add(a, b, out=c)"),
    "triad": (3, 4, "torch.add(b, c, alpha=q, out=a)"),
    "daxpy": (3, 3, "a.add_(b, alpha=q)"),  # STREAM2's; in place: no line written that was not read
}
LIMITS = ("copy", "triad", "daxpy")  # the kernels a benchmark's rows are stated against
EXTRA = {  # our updates' calls on the same arrays: not STREAM's, counted the same way
    "lerp_ in place (EMA's kernel)": (3, 3, "b.lerp_(a, w)"),
    f"_foreach_copy_ over {PIECES} pieces": (2, 3, "_foreach_copy_(c pieces, a pieces)"),
    f"_foreach_lerp_ over {PIECES} pieces": (3, 3, "_foreach_lerp_(b pieces, a pieces, w)"),
}


def cache_bytes(device: torch.device) -> tuple[int, str]:
    """The caches' total and how it was found: every distinct data or unified cache of every CPU (``/sys``), or the
    GPU's L2."""
    if device.type == "cuda":
        size = torch.cuda.get_device_properties(device).L2_cache_size
        return size, f"L2 {size / 2**20:.0f} MiB"
    seen: dict[tuple[str, str, str], int] = {}
    for index in glob.glob("/sys/devices/system/cpu/cpu[0-9]*/cache/index[0-9]*"):
        try:
            kind = Path(index, "type").read_text().strip()
            level = Path(index, "level").read_text().strip()
            shared = Path(index, "shared_cpu_list").read_text().strip()
            size = Path(index, "size").read_text().strip()
        except OSError:
            continue
        if kind == "Instruction" or not size:
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(size[-1], 1)
        seen[(level, kind, shared)] = int(size.rstrip("KMG")) * scale
    if not seen:
        return 64 * 2**20, "caches unknown (no /sys): 64 MiB assumed"
    levels: dict[str, list[int]] = {}
    for (level, _, _), size in seen.items():
        levels.setdefault(level, []).append(size)
    parts = ", ".join(f"L{level} {len(sizes)} x {sizes[0] / 2**20:g} MiB" for level, sizes in sorted(levels.items()))
    return sum(seen.values()), parts


def array_elements(device: torch.device, quick: bool = False) -> tuple[int, str]:
    """float32 elements per array: 4x the caches' total (STREAM's rule), rounded up to a MiB of elements; ``quick``:
    1 Mi elements (in cache: a smoke test, not a limit)."""
    total, how = cache_bytes(device)
    if quick:
        return 2**20, f"{how}; quick run: 4 MiB arrays, in cache"
    elements = math.ceil(4 * total / 4 / 2**20) * 2**20
    return elements, f"{how} ({total / 2**20:.1f} MiB in all); arrays of 4x that: {4 * elements / 2**20:.0f} MiB each"


class Arrays:
    """STREAM's three arrays (a = 1, b = 2, c = 0 at first, as STREAM sets them) and their 132-piece views."""

    def __init__(self, elements: int, device: torch.device) -> None:
        self.elements = elements
        self.a, self.b, self.c = (torch.empty(elements, device=device) for _ in range(3))
        self.pieces = {name: list(t.chunk(PIECES)) for name, t in zip("abc", (self.a, self.b, self.c), strict=True)}
        self.calls = 0
        self.refill()

    def refill(self) -> None:
        self.a.fill_(1.0), self.b.fill_(2.0), self.c.fill_(0.0)

    def limits(self) -> dict[str, Callable[[], object]]:
        """Copy, triad and DAXPY for ``in_rounds``, on arrays whose values stay bounded however often they run
        (``c = b``, ``a = b + q*c``, ``a += q*b``; triad resets ``a``), so no refill is timed with them: a
        benchmark's rounds time a batch of calls whole, and a refill in the batch would be three more streams."""
        a, b, c, q = self.a, self.b, self.c, SCALAR
        return {
            STREAM_COPY: lambda: c.copy_(b),
            STREAM_TRIAD: lambda: torch.add(b, c, alpha=q, out=a),
            STREAM2_DAXPY: lambda: a.add_(b, alpha=q),
        }

    def kernels(self, extra: bool = True) -> dict[str, Callable[[], object]]:
        a, b, c, q = self.a, self.b, self.c, SCALAR

        def triad() -> None:
            torch.add(b, c, alpha=q, out=a)
            self.calls += 1
            if self.calls % REFILL_EVERY == 0:  # a refill is three more streams; rare enough to leave in the time
                self.refill()

        fns: dict[str, Callable[[], object]] = {
            "copy": lambda: c.copy_(a),
            "scale": lambda: torch.mul(c, q, out=b),
            "add": lambda: torch.add(a, b, out=c),
            "triad": triad,
            "daxpy": lambda: a.add_(b, alpha=q),
        }
        if extra:
            fns |= dict(zip(EXTRA, [
                lambda: b.lerp_(a, WEIGHT),
                lambda: torch._foreach_copy_(self.pieces["c"], self.pieces["a"]),
                lambda: torch._foreach_lerp_(self.pieces["b"], self.pieces["a"], WEIGHT),
            ], strict=True))  # fmt: skip
        return fns


def best_ms(fns: dict[str, Callable[[], object]], device: torch.device, budget_s: float) -> dict[str, list[float]]:
    """STREAM's timing: every kernel once per round, each timed alone; all rounds' times after the first, in ms
    (at least 3 each, then rounds until ``budget_s`` is spent)."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    samples: dict[str, list[float]] = {name: [] for name in fns}
    deadline = time.perf_counter() + budget_s
    rounds = 0
    while rounds < 4 or (time.perf_counter() < deadline and rounds < 1000):
        for name, fn in fns.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            if rounds:  # STREAM drops the first
                samples[name].append((time.perf_counter() - start) * 1e3)
        rounds += 1
    return samples


@dataclass(frozen=True)
class StreamLimit:
    """STREAM copy and triad and STREAM2 DAXPY on ``device``, in GB/s counted STREAM's way (2, 3 and 3 streams of
    4 bytes per element): ``median`` over interleaved rounds (what the benchmarks' medians compare with) and ``best``
    as STREAM reports them (``None`` when timed in a benchmark's rounds, which keep medians only).
    ``write_allocate``: a written line is read first (a CPU), so a kernel that writes lines it did not read moves
    one more stream than STREAM counts."""

    device: str
    array_mib: float
    copy_median: float
    triad_median: float
    daxpy_median: float
    write_allocate: bool
    copy_best: float | None = None
    triad_best: float | None = None
    daxpy_best: float | None = None

    def moved(self, kernel: str) -> float:
        """Median GB/s of bytes actually moved by ``kernel`` (``copy``, ``triad`` or ``daxpy``), write-allocate
        counted."""
        streams, moved, _ = KERNELS[kernel]
        gbs: float = getattr(self, f"{kernel}_median")
        return gbs * (moved / streams if self.write_allocate else 1.0)

    def sentence(self) -> str:
        """The limit in words, for a table's caption."""
        bests = [getattr(self, f"{kernel}_best") for kernel in LIMITS]
        best = f" (best {', '.join(f'{b:.1f}' for b in bests)})" if all(bests) else ""
        moved = (
            f"; bytes moved, write-allocate counted: {', '.join(f'{self.moved(k):.1f}' for k in LIMITS)}"
            if self.write_allocate
            else ""
        )
        return (
            f"STREAM ({self.array_mib:.0f} MiB arrays) in the same rounds: copy {self.copy_median:.1f} GB/s, triad "
            f"{self.triad_median:.1f}, STREAM2 DAXPY (in place) {self.daxpy_median:.1f}, medians counted STREAM's "
            f"way{best}{moved}"
        )


STREAM_COPY, STREAM_TRIAD, STREAM2_DAXPY = "STREAM copy", "STREAM triad", "STREAM2 DAXPY"
FILLED, NEVER_WRITTEN = "flat copy_, a written source", "flat copy_, a source never written (torch.empty)"


def in_rounds(
    device: torch.device, quick: bool = False
) -> tuple[dict[str, Callable[[], object]], Callable[..., StreamLimit]]:
    """STREAM copy and triad and STREAM2 DAXPY as three more contenders for ``benchmarks.report.median_ms``, so that
    the limit is timed in the same interleaved rounds, under the same load, as the rows stated against it; and the
    function that takes their medians out of the times it returns (``limit(times)``) and makes the limit."""
    elements, _ = array_elements(device, quick)
    arrays = _arrays(str(device), elements)

    def limit(times: dict[str, float]) -> StreamLimit:
        per_ms = 4 * elements / 1e6  # GB/s of one stream at 1 ms
        return StreamLimit(
            device=device.type,
            array_mib=4 * elements / 2**20,
            copy_median=2 * per_ms / times.pop(STREAM_COPY),
            triad_median=3 * per_ms / times.pop(STREAM_TRIAD),
            daxpy_median=3 * per_ms / times.pop(STREAM2_DAXPY),
            write_allocate=device.type == "cpu",
        )

    return arrays.limits(), limit


def limit_from(arrays: Arrays, device: torch.device, samples: dict[str, list[float]]) -> StreamLimit:
    def gbs(kernel: str, ms: float) -> float:
        return KERNELS[kernel][0] * 4 * arrays.elements / (ms * 1e-3) / 1e9

    return StreamLimit(
        device=device.type,
        array_mib=4 * arrays.elements / 2**20,
        **{f"{kernel}_best": gbs(kernel, min(samples[kernel])) for kernel in LIMITS},
        **{f"{kernel}_median": gbs(kernel, statistics.median(samples[kernel])) for kernel in LIMITS},
        write_allocate=device.type == "cpu",
    )


@functools.cache
def _arrays(device: str, elements: int) -> Arrays:
    return Arrays(elements, torch.device(device))


def stream_table(arrays: Arrays, samples: dict[str, list[float]], write_allocate: bool) -> str:
    lines = [
        f"**STREAM**: float32 arrays of {arrays.elements / 2**20:g} Mi elements ({4 * arrays.elements / 2**20:.0f} "
        "MiB) each; GB/s from the best time after the first, as STREAM reports it, and from the median",
        "",
        "| kernel | torch call | streams (STREAM) | streams moved (write-allocate) | best ms | best GB/s (STREAM) "
        "| median GB/s (STREAM) | best GB/s moved | % of copy moved | % of DAXPY moved |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    table = KERNELS | EXTRA

    def moved_per_ms(name: str) -> float:  # streams moved per ms, at the best time
        streams, moved, _ = table[name]
        return (moved if write_allocate else streams) / min(samples[name])

    for name, times in samples.items():
        streams, moved, call = table[name]
        moved = moved if write_allocate else streams
        best, median = min(times), statistics.median(times)
        per = 4 * arrays.elements / 1e6  # MB per stream; / ms = GB/s
        shares = " | ".join(f"{100 * moved_per_ms(name) / moved_per_ms(of):.0f}%" for of in ("copy", "daxpy"))
        lines.append(
            f"| {name} | `{call}` | {streams} | {moved} | {best:.3f} | {streams * per / best:.1f} "
            f"| {streams * per / median:.1f} | {moved * per / best:.1f} | {shares} |"
        )
    return "\n".join(lines)


def copy_table(arrays: Arrays, device: torch.device, budget_s: float, quick: bool) -> tuple[str, dict[str, float]]:
    """A copy of the large conv net's state (24M elements, 132 tensors) several ways, in interleaved rounds: what the
    target benchmark's reference copy and ``hard_update`` reach against STREAM copy."""
    if quick:
        shapes = [(32, 3, 3, 3), (32,), (32,), (32,), (32,), (64, 32, 3, 3), (64,), (64,), (64,), (64,)]
    else:
        from benchmarks.ema import large_model

        shapes = [tuple(t.shape) for t in large_model().state_dict().values() if t.is_floating_point()]
    online = [torch.randn(shape, device=device) for shape in shapes]
    target = [torch.randn(shape, device=device) for shape in shapes]
    elements = sum(t.numel() for t in online)
    never_written, flat_target = torch.empty(elements, device=device), torch.empty(elements, device=device)
    flat_source = torch.randn(elements, device=device)
    small = {f"flat copy_ of {mib} MiB, in {where}": (torch.randn(mib * 2**18, device=device),
                                                      torch.empty(mib * 2**18, device=device))
             for mib, where in ([(1, "L2"), (8, "L3")] if not quick else [(1, "cache")])}  # fmt: skip
    foreach = f"_foreach_copy_ over the {len(shapes)} float tensors (hard_update's call)"
    fns: dict[str, Callable[[], object]] = {
        foreach: lambda: torch._foreach_copy_(target, online),
        FILLED: lambda: flat_target.copy_(flat_source),
        NEVER_WRITTEN: lambda: flat_target.copy_(never_written),
    }
    fns |= {name: partial_copy(pair) for name, pair in small.items()}
    fns[STREAM_COPY] = arrays.kernels(extra=False)["copy"]
    counts = {name: elements for name in fns} | {name: pair[0].numel() for name, pair in small.items()}
    counts[STREAM_COPY] = arrays.elements
    samples = best_ms(fns, device, budget_s)
    rates = {name: 8 * counts[name] / (min(times) * 1e-3) / 1e9 for name, times in samples.items()}
    lines = [
        f"**A copy of the large conv net's state**: {elements / 1e6:.2f}M float32 elements "
        f"({8 * elements / 1e6:.0f} MB counted STREAM's way), every way and STREAM copy in the same rounds",
        "",
        "| copy | elements | best ms | best GB/s (STREAM) | median GB/s (STREAM) | % of STREAM copy (best) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, times in samples.items():
        median = 8 * counts[name] / (statistics.median(times) * 1e-3) / 1e9
        share = 100 * rates[name] / rates[STREAM_COPY]
        lines.append(
            f"| {name} | {counts[name]:,} | {min(times):.4f} | {rates[name]:.1f} | {median:.1f} | {share:.0f}% |"
        )
    rates["foreach"] = rates[foreach]
    return "\n".join(lines), rates


def notes(stream: dict[str, list[float]], arrays: Arrays, rates: dict[str, float], write_allocate: bool) -> str:
    """What the tables say about the benchmarks' bandwidth columns, in this run's figures."""
    per = 4 * arrays.elements / 1e6
    lerp = 3 * per / min(stream["lerp_ in place (EMA's kernel)"])
    copy, triad, daxpy = (KERNELS[k][1 if write_allocate else 0] * per / min(stream[k]) for k in LIMITS)
    counting = (
        "*Counting.* STREAM's count leaves out the write-allocate read: a copy names 8 bytes an element and moves "
        "12, an update in place names 12 and moves 12. At the same traffic a copy's effective GB/s is 2/3 of an "
        "update's, so an EMA update above 100% of a copy's effective rate is that count, not a copy outrun. "
        if write_allocate
        else ""
    )
    which = (
        f"*Which limit.* Counted in bytes moved, the kernels still differ: DAXPY in place moved {daxpy:.1f} GB/s, "
        f"triad {triad:.1f} and copy {copy:.1f} ({daxpy / triad:.2f}x and {daxpy / copy:.2f}x), and `lerp_` in place "
        f"{lerp:.1f}, {100 * lerp / daxpy:.0f}% of DAXPY. Why the memory system serves an update in place faster "
        "than a kernel that writes another array is not measured here; what it means is measured: triad is no "
        "ceiling for an update in place. The EMA and target tables hold each row to the kernel with its access "
        "pattern, timed in their own rounds: a copy to STREAM copy, an update in place to DAXPY. "
    )
    zero = rates[NEVER_WRITTEN] / rates[FILLED]
    in_cache = ", ".join(
        f"{name.split('of ')[1].replace(',', '')}: {rates[name]:.1f}" for name in rates if ", in " in name
    )
    return (
        f"{counting}{which}*The reference copy.* A source from `torch.empty` that nothing wrote is pages the "
        f"kernel has not given memory yet: read, every one is the same zero page, which stays in cache, so the "
        f"copy moves only the target's lines; here {rates[NEVER_WRITTEN]:.1f} GB/s against {rates[FILLED]:.1f} "
        f"from a written source ({zero:.2f}x). The plain copy in the EMA and target tables of 2026-12-01 was that "
        f"copy, a floor set too fast (`hard_update` read 56% of it); the target benchmark's now reads a written "
        f"source. *Many tensors.* On a CPU a foreach call is one `copy_` per tensor, each its own parallel region "
        f"over torch's threads: here {rates['foreach']:.1f} GB/s, {100 * rates['foreach'] / rates[FILLED]:.0f}% of"
        f" the same bytes copied flat from a written source; when other processes share the cores, each region "
        f"waits for a thread that is not running, so per-tensor calls lose more of their time than one flat copy "
        f"does. *Cache.* A copy that fits in cache moves no memory: its rate is the cache's and a call's fixed "
        f"cost, not this limit (GB/s, STREAM's count: {in_cache}; STREAM copy {rates[STREAM_COPY]:.1f}); the small"
        f" models' rows are such copies."
    )


def partial_copy(pair: tuple[torch.Tensor, torch.Tensor]) -> Callable[[], object]:
    source, target = pair
    return lambda: target.copy_(source)


def main(argv: list[str]) -> int:
    args, device, budget = parse_args(__doc__, argv, 10.0, ROOT / "docs" / "benchmarks.md")
    elements, sizing = array_elements(device, args.quick)
    arrays = Arrays(elements, device)
    samples = best_ms(arrays.kernels(), device, budget)
    limit = limit_from(arrays, device, samples)
    copies, rates = copy_table(arrays, device, budget / 2, args.quick)
    tables = [stream_table(arrays, samples, limit.write_allocate), copies]
    for table in tables:
        print(table, end="\n\n", flush=True)
    header = f"{measured_on(device, command_line('benchmarks.stream', args))} Caches: {sizing}. " + (
        "Write-allocate counted: a store to a line not in cache reads it first on this CPU, so copy and scale "
        "move 3 streams, add and triad 4; an update in place (`lerp_`) writes lines it has just read: 3."
        if limit.write_allocate
        else "Counted STREAM's way: a GPU's L2 does not read a line that is written whole."
    )
    write_section(args.output, f"stream-{device.type}", f"STREAM: the memory-bandwidth limit ({device.type})",
                  header, "\n\n".join([*tables, notes(samples, arrays, rates, limit.write_allocate)]))  # fmt: skip
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
