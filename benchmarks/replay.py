"""Benchmark ``ReplayBuffer.add`` and ``.sample`` against stable-baselines3's and TorchRL's replay buffers, as
installed and called the way their users call them, in one process; write the tables to docs/benchmarks.md.

    pip install -e ".[bench]"                               # the peers (see benchmarks/peers.py)
    python -m benchmarks.replay                          # CPU; CartPole-sized vectors and 4x84x84 uint8 frames
    python -m benchmarks.replay --budget 10              # seconds of timing per row (default 4)
    python -m benchmarks.replay --quick --output /tmp/b.md   # smoke run: small buffers, short budget

Contenders, each filled to capacity first (so every page of its memory is committed and samples draw from all of it),
each fed what its users have in hand:

* ``copy_correct.ReplayBuffer`` (ours): numpy observations, a Python int action, a Python float reward and Python
  bools for one transition; for a vector env's step, the arrays ``envs.step`` returns.
* stable-baselines3's ``ReplayBuffer(capacity, observation_space, action_space, n_envs=N,
  handle_timeout_termination=False)``, as CleanRL's ``dqn.py`` and ``dqn_atari.py`` build it:
  ``add(obs, next_obs, actions, rewards, terminations, infos)`` with the vector env's arrays (one env: arrays of 1),
  ``sample(batch_size)`` (tensors copied from numpy).
* TorchRL's ``ReplayBuffer(storage=LazyTensorStorage(capacity))``: ``add`` of one transition and ``extend`` of a
  vector env's step, each a ``TensorDict`` built beforehand (TorchRL's environments hand one over, so building it is
  not timed); ``sample(batch_size)``.
* the floor, not a library: a numpy ring buffer written ``array[pos] = x`` per field, sampled with
  ``np.random.randint``, fancy indexing and ``torch.from_numpy``. It checks no shape or dtype and raises no version
  counter; ours does both on every add, which is what our add rows pay over it.

Rows: one ``add``; one ``add`` of a vector env's step (``num_envs=8``); CleanRL's cadence of adds and samples
(``dqn.py``: a sample of 128 every 10 steps; ``dqn_atari.py``: 32 every 4); ``sample`` of 32 and 256. Timings are
medians over interleaved rounds (every contender once per round, same machine load); a ratio is a peer's time over
ours, so above 1 means ours is faster. Bytes per transition are each contender's storage over its capacity.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, NoReturn

import gymnasium as gym
import numpy as np
import torch
from tqdm import tqdm

from benchmarks.peers import Missing, label, load
from benchmarks.report import measured_on, median_ms, write_section
from copy_correct import ReplayBuffer

ROOT = Path(__file__).resolve().parents[1]

OURS, SB3, TORCHRL, FLOOR = "ours", "stable-baselines3", "torchrl", "floor"
FIELDS = ("obs", "action", "reward", "next_obs", "terminated", "truncated")
ENVS = 8  # environments of the vectorised add
ACTIONS = 4
EXPLAINED = (
    "Each library is called as its users call it: stable-baselines3's buffer as CleanRL's DQN scripts build it, "
    "TorchRL's with `LazyTensorStorage`, given the `TensorDict` its environments hand over. A ratio is the peer's time "
    "over ours: above 1, ours is faster. The floor is a numpy ring buffer that checks nothing (no shape, no dtype, "
    "no version counter); ours checks every add, which is what our add rows pay over it. The cadence rows are "
    "CleanRL's loops: `dqn.py` samples 128 transitions every 10 steps, `dqn_atari.py` 32 every 4. Frame samples move "
    "megabytes per call and vary more from run to run than the other rows (page faults of new memory)."
)


class Step:
    """One environment step's data, for ``envs`` environments (``envs=0``: one env, unbatched), as numpy arrays."""

    def __init__(self, observations: list[np.ndarray], envs: int, offset: int = 0) -> None:
        n = max(envs, 1)
        self.obs = np.stack([observations[(offset + i) % len(observations)] for i in range(n)])
        self.next_obs = np.stack([observations[(offset + i + 1) % len(observations)] for i in range(n)])
        self.action = (np.arange(n) + offset) % ACTIONS
        self.reward = np.ones(n)  # float64, as gymnasium returns rewards
        self.terminated = (np.arange(n) + offset) % 50 == 49
        self.truncated = np.zeros(n, dtype=bool)
        # one env as a plain loop has it from env.step: an array, and Python numbers for the rest
        self.one = (self.obs[0], int(self.action[0]), float(self.reward[0]), self.next_obs[0],
                    bool(self.terminated[0]), False)  # fmt: skip


class NumpyRing:
    """The floor: preallocated numpy arrays written ``array[pos] = x``; ``envs=(N,)`` gives each row N envs."""

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

    def sample(self, batch_size: int, device: torch.device | None = None) -> dict[str, torch.Tensor]:
        index = np.random.randint(0, self.capacity if self.full else self.pos, size=batch_size)
        return {name: torch.from_numpy(getattr(self, name)[index]).to(device) for name in FIELDS}

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, name).nbytes for name in FIELDS)


class Contender:
    """One buffer with one environment, another with ``ENVS``, and the calls its users make on them."""

    add: Callable[[Step], object]
    add_vec: Callable[[Step], object]
    sample: Callable[[int], object]
    nbytes: Callable[[], int]  # the storage's bytes, asked once the buffer is full


def ours(capacity: int, space: gym.spaces.Box, device: torch.device) -> Contender:
    one = ReplayBuffer(capacity, space, gym.spaces.Discrete(ACTIONS), device=device)
    vec = ReplayBuffer(
        capacity, space, gym.spaces.Discrete(ACTIONS), num_envs=ENVS, autoreset_mode="disabled", device=device
    )
    c = Contender()
    c.add = lambda s: one.add(*s.one)
    c.add_vec = lambda s: vec.add(s.obs, s.action, s.reward, s.next_obs, s.terminated, s.truncated)
    c.sample, c.nbytes = one.sample, lambda: one.nbytes
    return c


def floor(capacity: int, space: gym.spaces.Box, device: torch.device) -> Contender:
    one = NumpyRing(capacity, space.shape, space.dtype.type)
    vec = NumpyRing(capacity // ENVS, space.shape, space.dtype.type, envs=(ENVS,))
    c = Contender()
    c.add = lambda s: one.add(*s.one)
    c.add_vec = lambda s: vec.add(s.obs, s.action, s.reward, s.next_obs, s.terminated, s.truncated)
    c.sample = one.sample if device.type == "cpu" else partial(one.sample, device=device)
    c.nbytes = lambda: one.nbytes
    return c


def sb3(capacity: int, space: gym.spaces.Box, device: torch.device) -> Contender | Missing:
    buffers = load("stable_baselines3.common.buffers", "stable-baselines3")
    if isinstance(buffers, Missing):
        return buffers

    def make(n_envs: int) -> Any:
        return buffers.ReplayBuffer(capacity // n_envs, space, gym.spaces.Discrete(ACTIONS), device=device,
                                    n_envs=n_envs, handle_timeout_termination=False)  # fmt: skip

    one, vec, infos = make(1), make(ENVS), [{}] * ENVS
    c = Contender()
    c.add = lambda s: one.add(s.obs, s.next_obs, s.action, s.reward, s.terminated, infos[:1])
    c.add_vec = lambda s: vec.add(s.obs, s.next_obs, s.action, s.reward, s.terminated, infos)
    c.sample = one.sample
    c.nbytes = lambda: sum(a.nbytes for a in (one.observations, one.next_observations, one.actions, one.rewards,
                                              one.dones))  # fmt: skip
    return c


def torchrl(capacity: int, space: gym.spaces.Box, device: torch.device) -> Contender | Missing:
    data = load("torchrl.data", "torchrl")
    if isinstance(data, Missing):
        return data
    from tensordict import TensorDict

    logging.getLogger("torchrl").setLevel(logging.WARNING)  # not a line per storage it initialises
    one = data.ReplayBuffer(storage=data.LazyTensorStorage(capacity, device=device))
    vec = data.ReplayBuffer(storage=data.LazyTensorStorage(capacity, device=device))
    tensordicts: dict[int, Any] = {}

    def tensordict(s: Step) -> Any:  # what a TorchRL env hands over; built once per step, outside the timing
        if id(s) not in tensordicts:
            fields = {
                "observation": torch.from_numpy(s.obs),
                "action": torch.from_numpy(s.action),
                "next": {
                    "observation": torch.from_numpy(s.next_obs),
                    "reward": torch.from_numpy(s.reward.astype(np.float32)),
                    "terminated": torch.from_numpy(s.terminated),
                    "truncated": torch.from_numpy(s.truncated),
                },
            }
            batched = TensorDict(fields, batch_size=[len(s.obs)])
            tensordicts[id(s)] = (batched, batched[0])
        return tensordicts[id(s)]

    c = Contender()
    c.add = lambda s: one.add(tensordict(s)[1])
    c.add_vec = lambda s: vec.extend(tensordict(s)[0])
    c.sample = one.sample
    c.nbytes = lambda: sum(t.nbytes for t in one.storage._storage.values(True, True))  # allocated at the first add
    return c


def table(
    title: str, space: gym.spaces.Box, capacity: int, cadence: tuple[int, int], budget: float, device: torch.device
) -> tuple[str, dict[str, str]]:
    """Time each operation of every contender on buffers filled to ``capacity``; the table and the peers not run."""
    makers = {OURS: ours, SB3: sb3, TORCHRL: torchrl, FLOOR: floor}
    contenders: dict[str, Contender] = {}
    not_run: dict[str, str] = {}
    for name, make in makers.items():
        made = make(capacity, space, device)
        if isinstance(made, Missing):
            not_run[name] = made
        else:
            contenders[name] = made
    rng = np.random.default_rng(0)
    high = 256 if space.dtype == np.uint8 else 100
    observations = [rng.integers(0, high, space.shape).astype(space.dtype) for _ in range(ENVS + 1)]
    singles = [Step(observations, 0, offset) for offset in range(ENVS)]
    vectors = [Step(observations, ENVS, offset) for offset in range(ENVS)]
    for name, c in contenders.items():
        for i in tqdm(range(capacity), desc=f"filling {name} ({title})", leave=False, file=sys.stderr):
            c.add(singles[i % ENVS])
        for i in range(capacity // ENVS):
            c.add_vec(vectors[i % ENVS])
    single, vector = singles[0], vectors[0]
    every, batch_size = cadence

    def loop(c: Contender) -> None:
        for _ in range(every):
            c.add(single)
        c.sample(batch_size)

    ops: dict[str, Callable[[Contender], object]] = {
        "add one transition": lambda c: c.add(single),
        f"add {ENVS} transitions (num_envs={ENVS})": lambda c: c.add_vec(vector),
        f"{every} adds + sample {batch_size} (CleanRL's cadence)": loop,
        "sample 32": lambda c: c.sample(32),
        "sample 256": lambda c: c.sample(256),
    }
    names = {
        OURS: "copy_correct.ReplayBuffer",
        SB3: label("stable-baselines3", "ReplayBuffer"),
        TORCHRL: label("torchrl", "ReplayBuffer(LazyTensorStorage)"),
        FLOOR: "floor: unchecked numpy ring",
    }
    peers = [name for name in (SB3, TORCHRL) if name in contenders]
    sizes = ", ".join(f"{n} {contenders[n].nbytes() / capacity:,.1f}" for n in contenders)
    lines = [
        f"**{title}**: obs {'x'.join(map(str, space.shape))} {space.dtype}, discrete actions, capacity "
        f"{capacity:,}; bytes per transition: {sizes}",
        "",
        "| operation | " + " | ".join(f"{names[n]} µs" + (f" | {n} / ours" if n in peers else "") for n in contenders)
        + " |",
        "| --- |" + " ---: |" * (len(contenders) + len(peers)),
    ]  # fmt: skip
    for op, call in tqdm(ops.items(), desc=f"timing ({title})", leave=False, file=sys.stderr):
        fns = {name: partial(call, c) for name, c in contenders.items()}
        us = {name: ms * 1e3 for name, ms in median_ms(fns, device, budget).items()}
        cells = [f"{us[n]:.2f}" + (f" | {us[n] / us[OURS]:.2f}x" if n in peers else "") for n in contenders]
        lines.append(f"| {op} | " + " | ".join(cells) + " |")
    return "\n".join(lines), {names[n]: why for n, why in not_run.items()}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}\n")  # one line, no usage block


def positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def main(argv: list[str]) -> int:
    parser = _Parser(prog="python -m benchmarks.replay", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small buffers and a short budget (smoke test)")
    parser.add_argument("--budget", type=positive, default=None, help="seconds of timing per row (default 4)")
    parser.add_argument("--device", type=torch.device, default=torch.device("cpu"), help="where the buffers live")
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "benchmarks.md")
    args = parser.parse_args(argv)
    device = args.device
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU; none is available")
    budget = args.budget if args.budget is not None else (0.3 if args.quick else 4.0)
    vectors, frames = (1_000, 200) if args.quick else (100_000, 10_000)
    vector_space = gym.spaces.Box(-100.0, 100.0, (4,), np.float32)  # CleanRL's dqn.py on CartPole
    frame_space = gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)  # CleanRL's dqn_atari.py
    results = [
        table("CartPole-sized vectors", vector_space, vectors, (10, 128), budget, device),
        table("Atari-sized frames", frame_space, frames, (4, 32), budget, device),
    ]
    tables = [text for text, _ in results]
    not_run = {name: why for _, missing in results for name, why in missing.items()}
    tables += [f"Not run: {name}: {why}." for name, why in not_run.items()]
    for text in tables:
        print(text, end="\n\n", flush=True)
    options = (" --quick" if args.quick else "") + (f" --budget {args.budget:g}" if args.budget is not None else "")
    options += f" --device {device.type}" if device.type != "cpu" else ""
    command = f"python -m benchmarks.replay{options}"
    header = measured_on(device, command) + " " + EXPLAINED
    key, title = f"replay-{device.type}", f"Replay buffer ({device.type})"
    write_section(args.output, key, title, header, "\n\n".join(tables))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
