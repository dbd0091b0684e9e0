"""Benchmark ``ReplayBuffer.add`` and ``.sample`` against a numpy ring buffer, in one process; write the tables to
docs/benchmarks.md.

    python scripts/bench_replay.py                          # CPU; CartPole-sized vectors and 4x84x84 uint8 frames
    python scripts/bench_replay.py --budget 10              # seconds of timing per row (default 4)
    python scripts/bench_replay.py --quick --output /tmp/b.md   # smoke run: small buffers, short budget

Contenders, each filled to capacity first (so every page of its memory is committed and samples draw from all of it):

* ``components.ReplayBuffer`` (ours), fed what an environment loop has: numpy observations, a Python int action,
  a Python float reward and Python bools.
* a numpy ring buffer written the way CleanRL / stable-baselines3 loops write one: preallocated numpy arrays,
  ``array[pos] = x`` per field; ``sample`` draws ``np.random.randint`` indices, gathers with fancy indexing and wraps
  each field with ``torch.from_numpy`` (no copy). It checks nothing and never raises a version counter.
* for ``sample`` only, a candidate: our storage gathered with ``torch.index_select`` for every field (one index
  for all) into torch memory, where ours uses it only for a field whose batch is 512 KiB or more, into numpy memory,
  and numpy's ``take`` for the rest.

Rows: one ``add``; one ``add`` of a vector env's step (``num_envs=8``; the peer keeps stable-baselines3's layout,
a row of 8); CleanRL's cadence of adds and samples (``dqn.py``: a sample of 128 every 10 steps; ``dqn_atari.py``:
32 every 4); ``sample`` of 32 and 256.

Timings are medians over interleaved rounds (every contender once per round, same machine load); the ratio is the
peer's time over ours, so above 1 means ours is faster. Bytes per transition are each contender's storage over its
capacity.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from components import ReplayBuffer  # noqa: E402
from scripts.bench_report import measured_on, median_ms, write_section  # noqa: E402

OURS, PEER, CANDIDATE = "components.ReplayBuffer", "numpy ring buffer", "candidate: index_select gather"
FIELDS = ("obs", "action", "reward", "next_obs", "terminated", "truncated")
ENVS = 8  # environments of the vectorised add
EXPLAINED = (
    "The peer is a numpy ring buffer written the way CleanRL and stable-baselines3 loops write one "
    "(`array[pos] = x`; `np.random.randint`, fancy indexing and `torch.from_numpy` to sample). It checks no shape "
    "or dtype and raises no version counter; ours does both on every add, which is what its add rows pay for. "
    "peer / ours above 1: ours is faster. The cadence rows are CleanRL's loops: `dqn.py` samples 128 transitions "
    "every 10 steps, `dqn_atari.py` 32 every 4. The candidate gathers every field with `index_select` into torch "
    "memory; ours uses it for large fields only (frames), into numpy memory, and numpy's `take` for the rest. Frame "
    "samples move megabytes per call and vary more from run to run than the other rows (page faults of new memory)."
)


class NumpyRing:
    """The peer: preallocated numpy arrays written ``array[pos] = x``, as CleanRL's and stable-baselines3's loops
    keep one; ``envs=(N,)`` gives each row N environments' transitions, stable-baselines3's layout."""

    def __init__(self, capacity: int, obs_shape: tuple[int, ...], obs_dtype: type, envs: tuple[int, ...] = ()) -> None:
        self.obs = np.zeros((capacity, *envs, *obs_shape), dtype=obs_dtype)
        self.next_obs = np.zeros((capacity, *envs, *obs_shape), dtype=obs_dtype)
        self.action = np.zeros((capacity, *envs), dtype=np.int64)
        self.reward = np.zeros((capacity, *envs), dtype=np.float32)
        self.terminated = np.zeros((capacity, *envs), dtype=np.bool_)
        self.truncated = np.zeros((capacity, *envs), dtype=np.bool_)
        self.capacity, self.pos, self.full = capacity, 0, False

    def add(self, obs: Any, action: Any, reward: Any, next_obs: Any, terminated: Any, truncated: Any) -> None:
        self.obs[self.pos] = obs
        self.action[self.pos] = action
        self.reward[self.pos] = reward
        self.next_obs[self.pos] = next_obs
        self.terminated[self.pos] = terminated
        self.truncated[self.pos] = truncated
        self.pos += 1
        if self.pos == self.capacity:
            self.full, self.pos = True, 0

    def sample(self, batch_size: int) -> dict[str, torch.Tensor]:
        index = np.random.randint(0, self.capacity if self.full else self.pos, size=batch_size)
        return {name: torch.from_numpy(getattr(self, name)[index]) for name in FIELDS}

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, name).nbytes for name in FIELDS)


def index_select_sample(buffer: ReplayBuffer, batch_size: int) -> dict[str, torch.Tensor]:
    """The candidate: the same batch gathered by torch from the buffer's tensors, one index for all fields."""
    index = torch.randint(len(buffer), (batch_size,))
    return {name: getattr(buffer, name).index_select(0, index) for name in FIELDS}


def table(
    title: str, obs_shape: tuple[int, ...], obs_dtype: type, capacity: int, cadence: tuple[int, int], budget: float
) -> str:
    """Time each operation of ours and the peer's (and the candidate's) on buffers filled to ``capacity``."""
    ours = ReplayBuffer(capacity, obs_shape, obs_dtype=obs_dtype)
    peer = NumpyRing(capacity, obs_shape, obs_dtype)
    ours_vec = ReplayBuffer(capacity, obs_shape, obs_dtype=obs_dtype, num_envs=ENVS)
    peer_vec = NumpyRing(capacity // ENVS, obs_shape, obs_dtype, envs=(ENVS,))
    rng = np.random.default_rng(0)
    high = 256 if obs_dtype == np.uint8 else 100
    observations = [rng.integers(0, high, obs_shape).astype(obs_dtype) for _ in range(ENVS)]
    for i in tqdm(range(capacity), desc=f"filling the buffers ({title})", leave=False, file=sys.stderr):
        for buffer in (ours, peer):
            buffer.add(observations[i % ENVS], i % 4, float(i), observations[(i + 1) % ENVS], i % 50 == 49, False)
    obs, next_obs = observations[0], observations[1]
    # a vector env's step: N observations, int64 actions, float64 rewards (as gymnasium returns them), bools
    batch = (np.stack(observations), np.arange(ENVS) % 4, np.ones(ENVS), np.stack(observations[1:] + observations[:1]),
             np.zeros(ENVS, dtype=bool), np.zeros(ENVS, dtype=bool))  # fmt: skip
    for _ in range(capacity // ENVS):
        ours_vec.add(*batch)
        peer_vec.add(*batch)
    ops: dict[str, dict[str, Callable[[], object]]] = {
        "add one transition": {
            OURS: lambda: ours.add(obs, 1, 1.0, next_obs, False, False),
            PEER: lambda: peer.add(obs, 1, 1.0, next_obs, False, False),
        },
        f"add {ENVS} transitions (num_envs={ENVS})": {
            OURS: lambda: ours_vec.add(*batch),
            PEER: lambda: peer_vec.add(*batch),
        },
    }
    every, batch_size = cadence

    def loop(buffer: ReplayBuffer | NumpyRing, sample: Callable[[int], object]) -> None:
        for _ in range(every):
            buffer.add(obs, 1, 1.0, next_obs, False, False)
        sample(batch_size)

    ops[f"{every} adds + sample {batch_size} (CleanRL's cadence)"] = {
        OURS: lambda: loop(ours, ours.sample),
        PEER: lambda: loop(peer, peer.sample),
    }
    for size in (32, 256):
        ops[f"sample {size}"] = {
            OURS: lambda size=size: ours.sample(size),
            PEER: lambda size=size: peer.sample(size),
            CANDIDATE: lambda size=size: index_select_sample(ours, size),
        }
    per_row = {name: buffer.nbytes / capacity for name, buffer in (("ours", ours), ("peer", peer))}
    float32 = ReplayBuffer(capacity, obs_shape).nbytes / capacity  # float32 observations: the old buffer's only way
    old = (
        ""
        if np.dtype(obs_dtype) == np.float32
        else f" (float32 observations, the old buffer's only way: {float32:,.1f})"
    )
    lines = [
        f"**{title}**: obs {'x'.join(map(str, obs_shape))} {np.dtype(obs_dtype)}, discrete actions, capacity "
        f"{capacity:,}; bytes per transition: ours {per_row['ours']:,.1f}, peer {per_row['peer']:,.1f}{old}",
        "",
        f"| operation | {OURS} µs | {PEER} µs | peer / ours | {CANDIDATE} µs |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for op, fns in tqdm(ops.items(), desc=f"timing ({title})", leave=False, file=sys.stderr):
        us = {name: ms * 1e3 for name, ms in median_ms(fns, torch.device("cpu"), budget).items()}
        candidate = f"{us[CANDIDATE]:.2f}" if CANDIDATE in us else "-"
        lines.append(f"| {op} | {us[OURS]:.2f} | {us[PEER]:.2f} | {us[PEER] / us[OURS]:.2f}x | {candidate} |")
    return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}\n")  # one line, no usage block


def positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def main(argv: list[str]) -> int:
    parser = _Parser(prog="bench_replay.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small buffers and a short budget (smoke test)")
    parser.add_argument("--budget", type=positive, default=None, help="seconds of timing per row (default 4)")
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "benchmarks.md")
    args = parser.parse_args(argv)
    budget = args.budget if args.budget is not None else (0.3 if args.quick else 4.0)
    vectors, frames = (1_000, 200) if args.quick else (100_000, 10_000)
    tables = [
        table("CartPole-sized vectors", (4,), np.float32, vectors, (10, 128), budget),  # CleanRL's dqn.py
        table("Atari-sized frames", (4, 84, 84), np.uint8, frames, (4, 32), budget),  # CleanRL's dqn_atari.py
    ]
    for text in tables:
        print(text, end="\n\n", flush=True)
    options = (" --quick" if args.quick else "") + (f" --budget {args.budget:g}" if args.budget is not None else "")
    command = f"python scripts/bench_replay.py{options}"
    header = measured_on(torch.device("cpu"), command) + " " + EXPLAINED
    write_section(args.output, "replay-cpu", "Replay buffer (cpu)", header, "\n\n".join(tables))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
