"""Write one benchmark's section into docs/benchmarks.md, leaving the other benchmarks' sections as they are."""

from __future__ import annotations

import argparse
import platform
import re
import statistics
import time
from collections.abc import Callable
from datetime import date
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from benchmarks.stream import StreamLimit

INTRO = """# Benchmarks

Each section is written by the script it names, on the machine it names. Contenders run side by side in
one process, in interleaved rounds, and the tables report medians and ratios: absolute times on shared
machines are noisy, ratios much less so. Bandwidth is compared with a plain copy of the same bytes in the same
rounds and, where a section says so, with the machine's limit measured the way STREAM does (`benchmarks.stream`,
in the same process), counting every stream a contender moves.

The peers are the libraries themselves, installed from PyPI and called the way their own docs and training
scripts call them: timm, diffusers, ema-pytorch, torch's `AveragedModel` and Lightning for the EMA update;
stable-baselines3 and TorchRL for target networks and the replay buffer. Each row names the package and version.
Install them with `pip install -e ".[bench]"`, then `pip install --no-deps timm==1.0.31` (timm requires
torchvision, which does not install beside a CPU build of torch; `benchmarks/peers.py` loads timm's EMA file,
which needs only torch). A peer that is missing gets a row saying so. Rows without a package and version are
patterns users write by hand (`load_state_dict(state_dict())`, CleanRL's line, the articles' loop), candidates
we measured for a design choice, or floors (a bare foreach call, a plain copy, an unchecked numpy ring): the least
the same work can cost.
"""


def write_section(path: Path, key: str, title: str, header: str, body: str) -> None:
    """Replace (or append) the section between ``<!-- key:start -->`` and ``<!-- key:end -->``. When ``path`` is a
    page of the manual (its folder holds ``index.md``), the section's ratio columns are charted beside its tables
    (``tools.manual.figure_bench``), so a table and its chart never disagree."""
    start, end = f"<!-- {key}:start -->", f"<!-- {key}:end -->"
    in_manual = (path.parent / "index.md").is_file()
    block = f"<!-- figure:bench-{key}:start -->\n<!-- figure:bench-{key}:end -->\n\n" if in_manual else ""
    _replace_section(path, start, end, f"{start}\n## {title}\n\n{header}\n\n{block}{body}\n{end}")
    if in_manual:
        from tools.manual.figure_bench import draw_section_chart
        from tools.manual.figure_pages import provenance

        command = re.search(r"with `([^`]+)`", header)
        made_by = provenance().sentence(command[1] if command else f"python -m benchmarks.* ({key})")
        if draw_section_chart(path.parent, path.name, key, made_by) is None:  # no ratio column: no chart
            _replace_section(path, start, end, f"{start}\n## {title}\n\n{header}\n\n{body}\n{end}")


def _replace_section(path: Path, start: str, end: str, section: str) -> None:
    text = path.read_text() if path.exists() else INTRO
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip("\n") + f"\n\n{section}\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def median_ms(fns: dict[str, Callable[[], object]], device: torch.device, budget_s: float) -> dict[str, float]:
    """Milliseconds per call, median over interleaved rounds (every contender once per round, same load)."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    calls: dict[str, int] = {}
    for name, fn in fns.items():  # warm up, and size each contender's batch of calls to ~20 ms
        fn()
        sync()
        start = time.perf_counter()
        fn()
        sync()
        calls[name] = max(1, int(0.02 / max(time.perf_counter() - start, 1e-7)))
    rounds = max(3, int(budget_s / (0.02 * len(fns))))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            sync()
            start = time.perf_counter()
            for _ in range(calls[name]):
                fn()
            sync()
            samples[name].append((time.perf_counter() - start) / calls[name] * 1e3)
    return {name: statistics.median(values) for name, values in samples.items()}


def bandwidth_table(
    caption: str,
    elements: int,
    times: dict[str, float],
    bytes_per_element: dict[str, float],
    ours: str,
    copy: str,
    not_run: dict[str, str] | None = None,
    limit: StreamLimit | None = None,
) -> str:
    """Markdown: ms, time over ``ours``, effective GB/s (``bytes_per_element`` counted STREAM's way: the bytes a
    contender names) and its share of the plain copy's (row ``copy``); a row per ``not_run`` contender says why it
    has no time.

    With ``limit`` (``benchmarks.stream.in_rounds``, timed in the same rounds), three more columns state each row
    against the machine's limit for its access pattern: the bytes it moves, write-allocate counted where ``limit``
    says the device reads a line before writing it (a row of 8 bytes an element is a copy: 4 more bytes; any other
    row updates in place and writes only lines it read), the kernel it is held to (a copy to STREAM copy, an update
    in place to STREAM2's DAXPY, ``a += q*b``), and that kernel's share, counted the same way."""
    copy_gbs = bytes_per_element[copy] * elements / (times[copy] * 1e-3) / 1e9
    columns = "| contender | ms per call | time / ours | effective GB/s | % of copy bandwidth |"
    if limit is not None:
        columns += " GB/s moved | held to | % of it |"
    lines = [caption, "", columns, "| --- " + "| ---: " * (columns.count("|") - 2) + "|"]
    for name, ms in times.items():
        gbs = bytes_per_element[name] * elements / (ms * 1e-3) / 1e9
        row = f"| {name} | {ms:.4f} | {ms / times[ours]:.2f}x | {gbs:.1f} | {100 * gbs / copy_gbs:.0f}% |"
        if limit is not None:
            is_copy = bytes_per_element[name] == 8
            unread = 4.0 if is_copy and limit.write_allocate else 0.0
            moved = (bytes_per_element[name] + unread) * elements / (ms * 1e-3) / 1e9
            kernel, held_to = ("copy", "STREAM copy") if is_copy else ("daxpy", "DAXPY")
            row += f" {moved:.1f} | {held_to} | {100 * moved / limit.moved(kernel):.0f}% |"
        lines.append(row)
    dashes = " - |" * (columns.count("|") - 3)
    lines += [f"| {name} | not run: {why} |{dashes}" for name, why in (not_run or {}).items()]
    return "\n".join(lines)


def measured_on(device: torch.device, command: str) -> str:
    where = device.type + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
    threads = f"{torch.get_num_threads()} thread{'s' if torch.get_num_threads() != 1 else ''}"
    return (
        f"Measured {date.today()} on {where}, {platform.processor() or platform.machine()}, {threads}, "
        f"torch {torch.__version__}, with `{command}`."
    )


def parse_args(
    doc: str, argv: list[str], full_budget: float, default_output: Path
) -> tuple[argparse.Namespace, torch.device, float]:
    """The options every benchmark takes: --device, --quick, --budget, --output, --threads; exits 2 on a missing
    GPU."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="small sizes and a short budget (smoke test)")
    parser.add_argument("--budget", type=float, default=None, help="seconds of timing per configuration")
    parser.add_argument("--output", type=Path, default=default_output)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, one a core)")
    args = parser.parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            parser.error("--threads must be at least 1")
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU; none is available")
    budget = args.budget if args.budget is not None else (0.5 if args.quick else full_budget)
    return args, device, budget


def cpu_header(module: str, args: argparse.Namespace, doc: str, sizes: str = "") -> str:
    """A CPU section's first paragraph: where and how it was measured (``--quick`` included), ``sizes``, then the
    third paragraph of the benchmark's docstring (what its rows are)."""
    command = command_line(module, args) + (" --quick" if args.quick else "")
    rows = doc.split("\n\n")[2].replace("\n", " ")
    return measured_on(torch.device("cpu"), command) + (f" {sizes}" if sizes else "") + " " + rows


def command_line(module: str, args: argparse.Namespace) -> str:
    """The command that reproduces a run of ``module`` (``benchmarks.ema``), with the options that change what is
    measured."""
    device = f" --device {args.device}" if torch.device(args.device).type != "cpu" else ""
    budget = f" --budget {args.budget:g}" if args.budget is not None else ""
    threads = f" --threads {args.threads}" if getattr(args, "threads", None) is not None else ""
    return f"python -m {module}{device}{budget}{threads}"
