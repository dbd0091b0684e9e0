"""What the checkpoint digests cost, measured in one process, interleaved, medians of ``--repeat`` rounds:

* writing them: ``atomic_save`` (``torch.save`` into a file beside the target, the CRC-32 of its bytes read back and
  sealed into the archive's comment, ``fsync``, rename) against the same save with no digest at all (its seal a no-op,
  ``torch.save``'s per-record CRC-32 off), and against the same save with ``torch.save``'s own per-record CRC-32
  (computed in line) instead of the seal;
* checking them: ``verify_file`` against the load it guards, ``torch.load(weights_only=True)`` (a resume's read) and
  ``torch.load(weights_only=True, mmap=True)`` (the post-hoc command's); ``verify_file`` with zlib's CRC-32, what it
  costs without the ``fast-digest`` extra; and ``load_checked`` (the check, then the load) against the plain load;
* the candidate hashes, each over the same 64 MiB in memory beside a plain copy of those bytes: zlib's CRC-32, ISA-L's
  (``isal``), and, where installed, CRC-32C (``crc32c``, ``google-crc32c``) and xxHash's XXH3 (``xxhash``).

    python -m benchmarks.checkpoint_digest outputs/ema/RUN/checkpoints/last.ckpt ... [--synthetic-mb 256]

Each FILE is loaded (``weights_only=True``) and re-saved into a temporary folder beside it (the same filesystem).
``--synthetic-mb`` adds a state dict of float32 tensors of that size. Prints two Markdown tables.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import copy_correct.files.atomic_save as _atomic_save
import copy_correct.files.digest as _file_digest
from copy_correct.files.atomic_save import atomic_save
from copy_correct.files.checked_load import load_checked
from copy_correct.files.digest import verify_file


def unsealed_save(obj: Any, path: Path, torch_crc32: bool) -> None:
    """``atomic_save`` without its digest, every other step the same (the temporary file, ``fsync``, rename, the
    directory's ``fsync``): its seal a no-op, ``torch.save``'s per-record CRC-32 on or off."""
    seal, crc = _atomic_save.seal, _atomic_save.torch_crc32
    _atomic_save.seal = lambda file: None
    _atomic_save.torch_crc32 = lambda enabled: _file_digest.torch_crc32(torch_crc32)
    try:
        atomic_save(obj, path)
    finally:
        _atomic_save.seal, _atomic_save.torch_crc32 = seal, crc


def _seconds(action: Callable[[], Any]) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def measure(name: str, state: Any, folder: Path, repeat: int) -> str:
    """One table row: sizes, save times with and without the digests, check and load times."""
    target = folder / f"{name}.ckpt"
    keys = ("none", "torch", "ours", "verify", "zlib", "load", "checked", "mmap")
    times: dict[str, list[float]] = {k: [] for k in keys}
    saves: list[tuple[str, Callable[[], Any]]] = [
        ("none", lambda: unsealed_save(state, folder / "none.ckpt", torch_crc32=False)),
        ("torch", lambda: unsealed_save(state, folder / "torch.ckpt", torch_crc32=True)),
        ("ours", lambda: atomic_save(state, target)),
    ]
    for round_ in range(repeat):
        for key, save in saves[round_ % 3 :] + saves[: round_ % 3]:  # each first in turn
            times[key].append(_seconds(save))
        times["verify"].append(_seconds(lambda: verify_file(target)))
        times["zlib"].append(_seconds(lambda: _with_zlib(lambda: verify_file(target))))
        times["load"].append(_seconds(lambda: torch.load(target, map_location="cpu", weights_only=True)))
        times["checked"].append(_seconds(lambda: load_checked(target)))
        times["mmap"].append(_seconds(lambda: torch.load(target, map_location="cpu", weights_only=True, mmap=True)))
    m = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    size = target.stat().st_size / 1e6
    return (
        f"| {name} | {size:.2f} | {m['none']:.2f} | {m['ours']:.2f} | {(m['ours'] / m['none'] - 1) * 100:+.1f}% "
        f"| {(m['torch'] / m['none'] - 1) * 100:+.1f}% | {m['verify']:.2f} | {m['load']:.2f} "
        f"| {m['verify'] / m['load'] * 100:.1f}% | {m['zlib'] / m['load'] * 100:.0f}% "
        f"| {(m['checked'] / m['load'] - 1) * 100:+.1f}% | {m['mmap']:.2f} |"
    )


def _with_zlib(action: Callable[[], Any]) -> Any:
    """``action`` with ``_file_digest``'s CRC-32 zlib's: the digests without the fast-digest extra."""
    fast, _file_digest.crc32 = _file_digest.crc32, zlib.crc32
    try:
        return action()
    finally:
        _file_digest.crc32 = fast


def candidates() -> dict[str, Callable[[memoryview], object]]:
    """The hashes measured for the digest, by name: the two CRC-32s always, the others where installed."""
    found: dict[str, Callable[[memoryview], object]] = {"zlib CRC-32": zlib.crc32}
    for name, module, function in [
        ("ISA-L CRC-32 (isal)", "isal.isal_zlib", "crc32"),
        ("CRC-32C (crc32c)", "crc32c", "crc32c"),
        ("CRC-32C (google-crc32c)", "google_crc32c", "value"),
        ("XXH3 64-bit (xxhash)", "xxhash", "xxh3_64_intdigest"),
    ]:
        try:
            found[name] = getattr(importlib.import_module(module), function)
        except ImportError:
            continue
    return found


def hash_table(repeat: int) -> str:
    """GB/s of each candidate over the same 64 MiB, beside a plain copy of them (medians of interleaved rounds)."""
    data = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8)
    view, copy = memoryview(data.numpy()), torch.empty_like(data)
    rows: dict[str, Callable[[], object]] = {k: (lambda f=f: f(view)) for k, f in candidates().items()}
    rows["plain copy of the same bytes"] = lambda: copy.copy_(data)
    times: dict[str, list[float]] = {k: [] for k in rows}
    for _ in range(repeat):
        for key, action in rows.items():
            times[key].append(_seconds(action))
    lines = ["| hash | GB/s | time / ISA-L's |", "|---|---:|---:|"]
    fast = statistics.median(times.get("ISA-L CRC-32 (isal)", times["zlib CRC-32"]))
    for key, values in times.items():
        median = statistics.median(values)
        lines.append(f"| {key} | {data.numel() / median / 1e9:.1f} | {median / fast:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", type=Path, help="checkpoint or snapshot files to re-save and load")
    parser.add_argument("--repeat", type=int, default=21, help="rounds; the medians are reported")
    parser.add_argument("--synthetic-mb", type=float, default=0, help="also a float32 state dict of this size")
    args = parser.parse_args(argv)
    rows = [
        "| file | MB | save, no digest (ms) | atomic_save (ms) | its digest's cost | torch's per-record CRC's cost "
        "| verify (ms) | load (ms) | verify / load | with zlib's CRC-32 | load_checked over the load "
        "| mmap load (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    cases: list[tuple[str, Any, Path]] = [
        (f"{p.parent.parent.name}/{p.name}", torch.load(p, map_location="cpu", weights_only=True), p.parent)
        for p in args.files
    ]
    if args.synthetic_mb:
        tensors = int(args.synthetic_mb * 1e6 / 4 / 2**20) or 1
        state = {"state_dict": {f"w{i}": torch.randn(2**20) for i in range(tensors)}}
        cases.append((f"synthetic {args.synthetic_mb:g} MB", state, Path(tempfile.gettempdir())))
    for name, state, near in cases:
        with tempfile.TemporaryDirectory(dir=near) as folder:
            rows.append(measure(name.replace("/", "-"), state, Path(folder), args.repeat))
    print("\n".join(rows), end="\n\n")
    print(hash_table(args.repeat))


if __name__ == "__main__":
    main()
