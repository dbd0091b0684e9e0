"""Benchmark n-step returns: ``ReplayBuffer(..., n_steps=3, gamma=0.99)`` against stable-baselines3's
``NStepReplayBuffer`` (the same windows, bit for bit: tests/peers/test_n_step_sb3.py), and against the one-step
buffers, in one process; write the table to docs/benchmarks.md.

    pip install -e ".[bench]"                            # stable-baselines3 (see benchmarks/peers.py)
    python -m benchmarks.n_step                          # CPU, CartPole-sized vectors
    python -m benchmarks.n_step --quick --output /tmp/b.md   # smoke run: small buffers, short budget

Each buffer is filled to capacity with the same stream of episodes (10 to 200 steps, a third of them truncated), one
env or eight (ours with ``autoreset_mode="next_step"``, whose left-out reset steps make it link each env's rows; the
stream has no reset steps for stable-baselines3, whose vector envs reset in the same step). Rows: ``sample`` of 32,
128 and 256 from one env's buffer, ``sample`` of 128 and one ``add`` of a step of eight envs in which no episode
ends (the common step; ours pays the links' upkeep there). Timings are medians over
interleaved rounds; a ratio is the other's time over ours with ``n_steps=3``: above 1, ours is faster.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from tqdm import tqdm

from benchmarks.peers import Missing, label, load
from benchmarks.report import cpu_header, median_ms, parse_args, write_section
from copy_correct import ReplayBuffer

ROOT = Path(__file__).resolve().parents[1]
N_STEPS, GAMMA, ENVS, ACTIONS = 3, 0.99, 8, 2
OURS, OURS_1, SB3, SB3_1 = "ours", "ours, n_steps=1", "stable-baselines3", "stable-baselines3, one step"
SPACE = gym.spaces.Box(-100.0, 100.0, (4,), np.float32)  # CleanRL's dqn.py on CartPole


def stream(steps: int, envs: int, seed: int = 0) -> list[tuple[np.ndarray, ...]]:
    """``steps`` vector steps of random episodes: obs, action, reward, next_obs, terminated, truncated."""
    rng = np.random.default_rng(seed)
    left = rng.integers(10, 201, envs)
    steps_made = []
    for _ in range(steps):
        left -= 1
        ends = left == 0
        cut = rng.random(envs) < 1 / 3
        obs, next_obs = rng.normal(size=(2, envs, 4)).astype(np.float32)
        action, reward = rng.integers(0, ACTIONS, envs), np.ones(envs, dtype=np.float32)
        steps_made.append((obs, action, reward, next_obs, ends & ~cut, ends & cut))
        left[ends] = rng.integers(10, 201, int(ends.sum()))
    return steps_made


def ours(capacity: int, envs: int, n_steps: int) -> tuple[Callable[..., Any], Callable[[int], Any]]:
    mode = {} if envs == 1 else {"num_envs": envs, "autoreset_mode": "next_step"}
    buffer = ReplayBuffer(capacity, SPACE, gym.spaces.Discrete(ACTIONS), n_steps=n_steps, gamma=GAMMA, **mode)
    if envs > 1:
        return buffer.add, buffer.sample

    def add(o: Any, a: Any, r: Any, n: Any, te: Any, tr: Any) -> None:  # what a loop has from env.step
        buffer.add(o[0], int(a[0]), float(r[0]), n[0], bool(te[0]), bool(tr[0]))

    return add, buffer.sample


def sb3(capacity: int, envs: int, n_steps: int) -> tuple[Callable[..., Any], Callable[[int], Any]] | Missing:
    buffers = load("stable_baselines3.common.buffers", "stable-baselines3")
    if isinstance(buffers, Missing):
        return buffers
    kind, extra = (buffers.NStepReplayBuffer, {"n_steps": n_steps, "gamma": GAMMA}) if n_steps > 1 else (
        buffers.ReplayBuffer, {}
    )  # fmt: skip
    buffer = kind(capacity, SPACE, gym.spaces.Discrete(ACTIONS), device="cpu", n_envs=envs,
                  handle_timeout_termination=True, **extra)  # fmt: skip

    def add(o: Any, a: Any, r: Any, n: Any, te: Any, tr: Any) -> None:
        timeouts = [{"TimeLimit.truncated": bool(t and not e)} for t, e in zip(tr, te, strict=True)]
        buffer.add(o, n, a, r, te | tr, timeouts)

    return add, buffer.sample


def table(capacity: int, budget: float) -> tuple[str, dict[str, str]]:
    makers = {
        OURS: partial(ours, n_steps=N_STEPS), SB3: partial(sb3, n_steps=N_STEPS),
        OURS_1: partial(ours, n_steps=1), SB3_1: partial(sb3, n_steps=1),
    }  # fmt: skip
    made: dict[int, dict[str, tuple]] = {1: {}, ENVS: {}}
    not_run: dict[str, str] = {}
    for envs in made:
        steps = stream(capacity // envs + 50, envs)
        for name, make in makers.items():
            got = make(capacity, envs)
            if isinstance(got, Missing):
                not_run[name] = got
                continue
            add = got[0]
            for step in tqdm(steps, desc=f"filling {name} ({envs} env)", leave=False, file=sys.stderr):
                add(*step)
            made[envs][name] = got
    obs, action, reward, next_obs, _, _ = stream(1, ENVS, seed=1)[0]
    going = np.zeros(ENVS, dtype=np.bool_)
    one_step = (obs, action, reward, next_obs, going, going)  # every env going on: the common step
    ops: dict[str, tuple[int, Callable[[tuple], object]]] = {
        "sample 32, one env": (1, lambda c: c[1](32)),
        "sample 128, one env (CleanRL's dqn.py)": (1, lambda c: c[1](128)),
        "sample 256, one env": (1, lambda c: c[1](256)),
        f"sample 128, {ENVS} envs": (ENVS, lambda c: c[1](128)),
        f"add a step of {ENVS} envs": (ENVS, lambda c: c[0](*one_step)),
    }
    names = {OURS: f"copy_correct.ReplayBuffer(n_steps={N_STEPS})", SB3: label("stable-baselines3",
             f"NStepReplayBuffer(n_steps={N_STEPS})"), OURS_1: "copy_correct.ReplayBuffer(n_steps=1)",
             SB3_1: label("stable-baselines3", "ReplayBuffer")}  # fmt: skip
    present = [n for n in makers if n in made[1]]
    lines = [
        "| operation | " + " | ".join(f"{names[n]} µs" + ("" if n == OURS else f" | {n} / ours") for n in present)
        + " |",
        "| --- |" + " ---: |" * (2 * len(present) - 1),
    ]  # fmt: skip
    for op, (envs, call) in tqdm(ops.items(), desc="timing", leave=False, file=sys.stderr):
        fns = {name: partial(call, made[envs][name]) for name in present}
        us = {name: ms * 1e3 for name, ms in median_ms(fns, torch.device("cpu"), budget).items()}
        cells = [f"{us[n]:.2f}" + ("" if n == OURS else f" | {us[n] / us[OURS]:.2f}x") for n in present]
        lines.append(f"| {op} | " + " | ".join(cells) + " |")
    return "\n".join(lines), {names[n]: why for n, why in not_run.items()}


def main(argv: list[str]) -> int:
    args, _, budget = parse_args(__doc__, argv, 4.0, ROOT / "docs" / "benchmarks.md")
    capacity = 2_000 if args.quick else 100_000
    text, not_run = table(capacity, budget)
    text += "".join(f"\n\nNot run: {name}: {why}." for name, why in not_run.items())
    print(text, flush=True)
    header = cpu_header("benchmarks.n_step", args, __doc__, f"Obs 4 float32, capacity {capacity:,}, gamma {GAMMA}.")
    write_section(args.output, "n-step-cpu", f"N-step returns, n_steps={N_STEPS} (cpu)", header, text)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
