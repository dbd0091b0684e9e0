"""Benchmark prioritized replay: ``ReplayBuffer(..., prioritized=True)`` against the same buffer drawing uniformly and
against TorchRL's ``PrioritizedReplayBuffer`` (a C++ segment tree over a ``LazyTensorStorage``), in one process; write
the table to docs/benchmarks.md.

    python -m benchmarks.prioritized                          # CPU, a million transitions of 4 float32
    python -m benchmarks.prioritized --quick --output /tmp/b.md   # smoke run: small buffers, short budget

TorchRL 0.14.1's segment trees are in its compiled extension, which loads with the torch it was built for (2.14.1
here; under 2.13.0 it fails with an undefined symbol): its rows come from an environment with that torch
(``pip install torch==2.14.1 torchrl==0.14.1`` and this checkout on the path), else they say why they are missing.
Each buffer holds the same transitions (alpha 0.6, beta 0.4); rows: ``sample(32)``, ``sample(32)`` then
``update_priorities`` of the 32 rows drawn with ``|reward| + 1e-6`` (a DQN step's priority upkeep), and ``sample(32)``
once every row's priority is set to ``|N(0, 1)| + 1e-6`` (a trained DQN's spread of TD errors, where rejection
sampling tries several rows for each it keeps; the rows before leave most at the first priority). Timings are medians
over interleaved rounds; a ratio is the other's time over ours (prioritized): above 1, ours is faster.

Memory (with the atari and compress extras): a ``FrameReplayBuffer(compress="zstd", prioritized=True)`` built for a
million transitions of Pong and fed them (``benchmarks.frame_replay.filled_million``: the rings wrap), beside the same
buffer without priorities; its storage (``nbytes``: frames, rings and priorities) and the growth of the resident set.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from benchmarks import frame_replay
from benchmarks.peers import Missing, label, load
from benchmarks.report import cpu_header, median_ms, parse_args, write_section
from copy_correct import ReplayBuffer

ROOT = Path(__file__).resolve().parents[1]
ALPHA, BETA, BATCH, CHUNK = 0.6, 0.4, 32, 1000
OURS, UNIFORM, TORCHRL = "ours", "ours, uniform", "TorchRL"


def chunks(capacity: int) -> list[tuple[np.ndarray, ...]]:
    """The stream, ``CHUNK`` transitions at a time: obs, action, reward, next_obs, terminated, truncated."""
    rng = np.random.default_rng(0)
    made = []
    for _ in range(capacity // CHUNK):
        obs = rng.normal(size=(CHUNK, 4)).astype(np.float32)
        ends = rng.random(CHUNK) < 0.01
        made.append(
            (obs, rng.integers(0, 2, CHUNK), rng.normal(size=CHUNK).astype(np.float32), obs, ends, ends & False)
        )
    return made


def ours(capacity: int, prioritized: bool) -> dict[str, Callable[[], Any]]:
    options = {"prioritized": True, "alpha": ALPHA} if prioritized else {}
    buffer = ReplayBuffer(capacity, (4,), num_envs=CHUNK, autoreset_mode="same_step", **options)
    for step in tqdm(chunks(capacity), desc="filling ours", leave=False, file=sys.stderr):
        buffer.add(*step)
    generator = torch.Generator().manual_seed(0)
    draw = partial(buffer.sample, BATCH, generator, **({"beta": BETA} if prioritized else {}))

    def draw_and_update() -> None:
        batch = draw()
        buffer.update_priorities(batch["indices"], batch["reward"].abs() + 1e-6)

    def spread() -> float:
        """Spread the priorities; the share of uniform candidates rejection sampling keeps then."""
        if not prioritized:
            return 1.0
        buffer.update_priorities(np.arange(capacity), spread_priorities(capacity))
        tree = buffer._priorities
        assert tree is not None
        tree._flush()
        return float(tree._run_sums[-1] / (tree._high * tree._max))

    return {"sample": draw, "update": draw_and_update if prioritized else draw, "spread": spread}


def spread_priorities(capacity: int) -> np.ndarray:
    """Every row's priority as a trained DQN's might be: ``|TD error| + 1e-6``, the errors normal (a fixed seed)."""
    return np.abs(np.random.default_rng(1).normal(size=capacity)) + 1e-6


def torchrl(capacity: int) -> dict[str, Callable[[], Any]] | Missing:
    data, dicts = load("torchrl.data", "torchrl"), load("tensordict", "tensordict")
    if isinstance(data, Missing) or isinstance(dicts, Missing):
        return data if isinstance(data, Missing) else dicts
    try:
        buffer = data.PrioritizedReplayBuffer(
            alpha=ALPHA, beta=BETA, storage=data.LazyTensorStorage(capacity), batch_size=BATCH
        )
    except RuntimeError as error:  # its segment trees are compiled for another torch (see the module docstring)
        why = str(error).splitlines()[0].rstrip(".")
        return Missing(f"torchrl's segment tree does not load with torch {torch.__version__}: {why}")
    names = ("obs", "action", "reward", "next_obs", "terminated", "truncated")
    for step in tqdm(chunks(capacity), desc="filling TorchRL", leave=False, file=sys.stderr):
        fields = {name: torch.from_numpy(np.ascontiguousarray(value)) for name, value in zip(names, step, strict=True)}
        buffer.extend(dicts.TensorDict(fields, batch_size=[CHUNK]))

    def draw_and_update() -> None:
        batch, info = buffer.sample(return_info=True)
        buffer.update_priority(info["index"], batch["reward"].abs() + 1e-6)

    def spread() -> float:
        buffer.update_priority(torch.arange(capacity), torch.from_numpy(spread_priorities(capacity)).float())
        return 1.0

    return {"sample": partial(buffer.sample, return_info=True), "update": draw_and_update, "spread": spread}


def table(capacity: int, budget: float) -> tuple[str, dict[str, str]]:
    made: dict[str, dict[str, Callable[[], Any]]] = {OURS: ours(capacity, True), UNIFORM: ours(capacity, False)}
    theirs = torchrl(capacity)
    not_run = {}
    if isinstance(theirs, Missing):
        not_run[TORCHRL] = theirs
    else:
        made[TORCHRL] = theirs
    names = {OURS: "copy_correct.ReplayBuffer(prioritized=True)", UNIFORM: "copy_correct.ReplayBuffer (uniform)",
             TORCHRL: label("torchrl", "PrioritizedReplayBuffer")}  # fmt: skip
    present = list(made)
    lines = [
        "| operation | " + " | ".join(f"{names[n]} µs" + ("" if n == OURS else f" | {n} / ours") for n in present)
        + " |",
        "| --- |" + " ---: |" * (2 * len(present) - 1),
    ]  # fmt: skip
    ops = {
        f"sample {BATCH}": "sample",
        f"sample {BATCH} + update_priorities {BATCH}": "update",
        f"sample {BATCH}, every priority set to a spread of TD errors": "sample",
    }
    ratios, kept = [], 1.0
    for op, key in tqdm(ops.items(), desc="timing", leave=False, file=sys.stderr):
        if "spread" in op:
            kept = min(made[name]["spread"]() for name in present)
        fns = {name: made[name][key] for name in present}
        us = {name: ms * 1e3 for name, ms in median_ms(fns, torch.device("cpu"), budget).items()}
        cells = [f"{us[n]:.1f}" + ("" if n == OURS else f" | {us[n] / us[OURS]:.2f}x") for n in present]
        lines.append(f"| {op} | " + " | ".join(cells) + " |")
        if key == "sample":
            ratios.append(f"{us[OURS] / us[UNIFORM]:.2f}x")
    ratio = (
        f"A prioritized sample({BATCH}): {ratios[0]} the uniform one (goal: at most 2x); with the priorities spread as "
        f"TD errors (|N(0, 1)| + 1e-6 over every row: p^{ALPHA} averages {kept:.2f} of its largest, so about "
        f"{1 / kept:.1f} rows are tried for each drawn by rejection), {ratios[1]}."
    )
    return "\n".join(lines) + "\n\n" + ratio, {names[n]: why for n, why in not_run.items()}


def memory_table(transitions: int, budget: float) -> str:
    """A million Pong transitions compressed, with and without priorities (module docstring), and their ``sample(32)``
    timed in interleaved rounds; or why not."""
    rec = frame_replay.record("ALE/Pong-v5", 6_000 if transitions >= 100_000 else 400, 0)
    zstd = load("zstandard", "zstandard")
    if isinstance(rec, Missing) or isinstance(zstd, Missing):
        return f"Not run: the memory of a million Pong transitions: {rec if isinstance(rec, Missing) else zstd}."
    lines = [
        f"**{transitions:,} Pong transitions, compressed (zstd)**: bytes per transition and storage (``nbytes``), "
        f"resident memory (measured), and a ``sample({BATCH})``; the goal (issue 54): a million with priorities "
        "under 250 MB",
        "",
        "| buffer | bytes per transition | storage | of it, priorities | resident memory (measured) | "
        f"sample {BATCH} µs |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    rows, draws = {}, {}
    for prioritized in (False, True):
        buffer, _, grown, _ = frame_replay.filled_million([rec], transitions, "zstd", prioritized=prioritized)
        tree = 0 if buffer._priorities is None else buffer._priorities.nbytes
        name = f'FrameReplayBuffer(compress="zstd"{", prioritized=True" if prioritized else ""})'
        rows[name] = (
            f"| {name} | {buffer.nbytes / buffer.stored:,.0f} | {buffer.nbytes / 1e6:,.0f} MB | {tree / 1e6:,.1f} MB | "
            f"{grown / 1e6:,.0f} MB |"
        )
        options = {"beta": BETA} if prioritized else {}
        draws[name] = partial(buffer.sample, BATCH, torch.Generator().manual_seed(0), **options)
    us = {name: ms * 1e3 for name, ms in median_ms(draws, torch.device("cpu"), budget).items()}
    lines += [f"{row} {us[name]:.1f} |" for name, row in rows.items()]
    uniform, prioritized = us.values()
    return "\n".join(lines) + f"\n\nA prioritized sample of frames: {prioritized / uniform:.2f}x the uniform one."


def main(argv: list[str]) -> int:
    args, _, budget = parse_args(__doc__, argv, 4.0, ROOT / "docs" / "benchmarks.md")
    capacity = 4 * CHUNK if args.quick else 1_000_000
    text, not_run = table(capacity, budget)
    text += "".join(f"\n\nNot run: {name}: {why}." for name, why in not_run.items())
    text += "\n\n" + memory_table(20_000 if args.quick else 1_000_000, budget)
    print(text, flush=True)
    header = cpu_header("benchmarks.prioritized", args, __doc__, f"Obs 4 float32, capacity {capacity:,}.")
    write_section(args.output, "prioritized-cpu", "Prioritized replay (cpu)", header, text)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
