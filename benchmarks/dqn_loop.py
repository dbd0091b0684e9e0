"""CleanRL's ``dqn_atari.py`` loop on real Pong frames with each replay buffer in turn: stable-baselines3's, as the
script builds it, against ``FrameReplayBuffer`` alone and sampled ahead (``SampleAhead``); steps a second, and the
``add`` and ``sample(32)`` calls, each against stable-baselines3's.

    pip install -e ".[atari,bench]"                 # ale-py (the games, offline) and stable-baselines3
    python -m benchmarks.dqn_loop                   # about 10 minutes on 2 cores
    python -m benchmarks.dqn_loop --quick --output /tmp/b.md   # smoke run: a few steps, small buffers

The loop is ``dqn_atari.py``'s, step for step: the Nature network's forward on the current stack (the greedy action
of epsilon 0.01), one ``add``, and every 4 steps ``sample(32)``, the target ``r + 0.99 max Q_target(s')`` under
``no_grad`` (zero at a termination), the squared error, backward and an Adam step (learning rate 1e-4); the target
copied every 1,000 steps. The env is not stepped: ``ALE/Pong-v5``, wrapped as the script wraps it, is played once by a
random policy (``benchmarks.frame_replay.record``) and every loop feeds its steps in turn, the recorded action taken
in place of the greedy one, so every buffer holds the same transitions. A live env would add the same time to every
contender's step (1-2 ms here) and so pull every ratio towards 1: the recording shows the buffers' difference
undiluted. Each contender has its own networks and optimizer, made from one seed; every buffer is full.

Contenders run side by side in one process: each round runs a stretch of steps of every contender in turn (the order
rotated each round; the first round is a warm-up), and a contender's ratio is stable-baselines3's time per step over
its own in the same round, the median over rounds (above 1: faster than stable-baselines3). ``add`` and ``sample``
in the loop are the time the loop waits in those calls (with ``SampleAhead``, ``add`` includes waiting for a draw in
flight); apart, each call is timed alone (``benchmarks.report.median_ms``, interleaved), ``SampleAhead.sample()``
back to back, so with nothing to overlap, and ``add`` once more right after the network's forward of one stack (the
loop's order), which leaves the caches cold, with a sample every 4 adds as in the loop. A compressed buffer compresses
the frames added since the last sample at the next one (or every 64 adds): in the loop, that is the sample's time (on
``SampleAhead``'s thread, where there is one); alone, back-to-back adds pay it every 64th.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.frame_replay import Recording, record, space
from benchmarks.peers import Missing, label, load
from benchmarks.report import command_line, measured_on, median_ms, parse_args, write_section
from copy_correct import FrameReplayBuffer, SampleAhead, hard_update, make_target

ROOT = Path(__file__).resolve().parents[1]
GAME, BATCH, EVERY, GAMMA, LR, TARGET_EVERY, ACTIONS = "ALE/Pong-v5", 32, 4, 0.99, 1e-4, 1000, 6
SB3 = "sb3"


@dataclass
class Batch:
    obs: torch.Tensor
    action: torch.Tensor
    reward: torch.Tensor
    next_obs: torch.Tensor
    terminated: torch.Tensor
    indices: torch.Tensor | None = None  # a prioritized buffer's rows drawn, and their importance weights
    weights: torch.Tensor | None = None


@dataclass
class Feed:
    """A buffer as its users call it: ``add(i)`` adds the recording's step ``i``, ``sample()`` gives 32."""

    add: Callable[[int], object]
    sample: Callable[[], Batch]
    close: Callable[[], object] = lambda: None
    update: Callable[[torch.Tensor, torch.Tensor], object] = lambda indices, priorities: None


def sb3(rec: Recording, capacity: int, device: torch.device) -> Feed | Missing:
    """stable-baselines3's ``ReplayBuffer`` as ``dqn_atari.py`` builds and calls it (one env)."""
    buffers = load("stable_baselines3.common.buffers", "stable-baselines3")
    if isinstance(buffers, Missing):
        return buffers
    import gymnasium as gym

    buffer = buffers.ReplayBuffer(capacity, space(rec), gym.spaces.Discrete(ACTIONS), device, n_envs=1,
                                  optimize_memory_usage=False, handle_timeout_termination=False)  # fmt: skip
    steps = [
        (rec.obs[i][None], rec.next_obs[i][None], np.array([rec.action[i]]), np.array([rec.reward[i]]),
         np.array([rec.terminated[i]]), [{}])
        for i in range(len(rec))
    ]  # fmt: skip

    def sample() -> Batch:
        data = buffer.sample(BATCH)
        return Batch(data.observations, data.actions.flatten(), data.rewards.flatten(), data.next_observations,
                     data.dones.flatten())  # fmt: skip

    return Feed(lambda i: buffer.add(*steps[i]), sample)


def ours(rec: Recording, capacity: int, device: torch.device, ahead: bool, **options: Any) -> Feed | Missing:
    """``FrameReplayBuffer(**options)``, sampled directly or through ``SampleAhead``."""
    try:
        buffer = FrameReplayBuffer(capacity, space(rec), (), **options)
    except TypeError as error:  # an option this FrameReplayBuffer does not take
        return Missing(f"FrameReplayBuffer does not take it here ({error})")
    steps = list(zip(rec.obs, rec.action, rec.reward, rec.next_obs, rec.terminated, rec.truncated, strict=True))
    generator = torch.Generator().manual_seed(0)
    if ahead:
        wrapper = SampleAhead(buffer, BATCH, generator=generator, device=device)
        add, draw, close, update = wrapper.add, wrapper.sample, wrapper.close, wrapper.update_priorities
    else:
        add, draw, close = buffer.add, partial(buffer.sample, BATCH, generator, device=device), lambda: None
        update = buffer.update_priorities

    def sample() -> Batch:
        data = draw()
        return Batch(data["obs"], data["action"], data["reward"], data["next_obs"], data["terminated"],
                     data.get("indices"), data.get("weights"))  # fmt: skip

    return Feed(lambda i: add(*steps[i]), sample, close, update)


OURS = "copy_correct.FrameReplayBuffer"
CONTENDERS: dict[str, tuple[str, Callable[..., Feed | Missing]]] = {  # a compressed buffer: one line each
    SB3: (label("stable-baselines3", "ReplayBuffer"), sb3),
    "frames": (OURS, partial(ours, ahead=False)),
    "frames-ahead": (f"{OURS} + SampleAhead", partial(ours, ahead=True)),
    "zstd": (f'{OURS}(compress="zstd")', partial(ours, ahead=False, compress="zstd")),
    "zstd-ahead": (f'{OURS}(compress="zstd") + SampleAhead', partial(ours, ahead=True, compress="zstd")),
    "zstd-prioritized-ahead": (
        f'{OURS}(compress="zstd", prioritized=True) + SampleAhead',
        partial(ours, ahead=True, compress="zstd", prioritized=True),
    ),
}


@dataclass
class Loop:
    """One contender's loop: its buffer, networks and optimizer, where it is in the recording, and the time it
    waited in ``add`` and ``sample``."""

    feed: Feed
    q: torch.nn.Module
    target: torch.nn.Module
    optimizer: torch.optim.Optimizer
    stacks: list[torch.Tensor]
    device: torch.device
    steps: int = 0
    add_s: list[float] = field(default_factory=list)
    sample_s: list[float] = field(default_factory=list)

    def act(self, i: int) -> None:
        """The greedy action on the recording's stack ``i`` (computed, not taken: the recording's action is)."""
        with torch.no_grad():
            self.q(self.stacks[i].to(self.device).unsqueeze(0)).argmax(dim=1)

    def step(self) -> None:
        """One step of ``dqn_atari.py``: act, add; every 4 steps, learn."""
        i = self.steps % len(self.stacks)
        self.act(i)
        start = time.perf_counter()
        self.feed.add(i)
        self.add_s.append(time.perf_counter() - start)
        self.steps += 1
        if self.steps % EVERY == 0:
            self.learn()
        if self.steps % TARGET_EVERY == 0:
            hard_update(self.target, self.q)

    def learn(self) -> None:
        start = time.perf_counter()
        data = self.feed.sample()
        self.sample_s.append(time.perf_counter() - start)
        with torch.no_grad():
            target_max = self.target(data.next_obs).max(dim=1).values
            td_target = data.reward + GAMMA * target_max * (1 - data.terminated.float())
        old_val = self.q(data.obs).gather(1, data.action.long().unsqueeze(1)).squeeze(1)
        if data.weights is None:
            loss = F.mse_loss(td_target, old_val)
        else:  # prioritized: the squared errors weighted, and the drawn rows' priorities their |TD error|
            loss = (data.weights * (td_target - old_val) ** 2).mean()
            self.feed.update(data.indices, (td_target - old_val).detach().abs() + 1e-6)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()


def loops(rec: Recording, capacity: int, device: torch.device) -> tuple[dict[str, Loop], dict[str, str]]:
    """Every contender's loop, its buffer filled past its capacity (not timed); the contenders not run, and why."""
    from recipes.atari import NatureQNetwork

    made, not_run = {}, {}
    stacks = [torch.from_numpy(obs) for obs in rec.obs]
    for key, (name, make) in CONTENDERS.items():
        feed = make(rec, capacity, device)
        if isinstance(feed, Missing):
            not_run[name] = feed
            continue
        torch.manual_seed(0)
        q = NatureQNetwork(ACTIONS).to(device)
        loop = Loop(feed, q, make_target(q), torch.optim.Adam(q.parameters(), lr=LR), stacks, device)
        for i in range(capacity + capacity // 10):
            feed.add(i % len(rec))
        loop.steps = capacity + capacity // 10
        made[key] = loop
    return made, not_run


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_rounds(made: dict[str, Loop], stretch: int, budget: float, least: int, device: torch.device) -> dict[str, list]:
    """Seconds per step of every contender in each round after the warm-up: ``stretch`` steps each, in turn, the order
    rotated each round, until ``budget`` seconds have passed and at least ``least`` rounds are timed."""
    times: dict[str, list[float]] = {key: [] for key in made}
    order, rounds, started = list(made), -1, time.perf_counter()
    while rounds < least or time.perf_counter() - started < budget:
        for key in order:
            sync(device)
            start = time.perf_counter()
            for _ in range(stretch):
                made[key].step()
            sync(device)
            times[key].append((time.perf_counter() - start) / stretch)
        if rounds == -1:  # the warm-up: forgotten
            for key, loop in made.items():
                loop.add_s.clear()
                loop.sample_s.clear()
                times[key].clear()
        order = order[1:] + order[:1]
        rounds += 1
    return times


def ratio(reference: list[float], own: list[float]) -> float:
    """The median over rounds of ``reference``'s time over ``own``'s in the same round."""
    return statistics.median(r / o for r, o in zip(reference, own, strict=True))


def loop_table(made: dict[str, Loop], times: dict[str, list], stretch: int, not_run: dict[str, str]) -> str:
    """The loop's table, each contender's steps a second against stable-baselines3's (``-`` without it)."""
    ratios = {key: ratio(times[SB3], times[key]) for key in made} if SB3 in made else {}
    lines = [
        f"**The loop**: {len(next(iter(times.values())))} rounds timed, each of {stretch} steps a contender",
        "",
        "| buffer | steps/s | loop: stable-baselines3 / ours | add in the loop µs | sample(32) in the loop µs | "
        "share of a step in sample |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for key, loop in made.items():
        step_s = statistics.median(times[key])
        versus = f"{ratios[key]:.3f}x" if ratios else "-"
        add_us, sample_us = statistics.median(loop.add_s) * 1e6, statistics.median(loop.sample_s) * 1e6
        share = sum(loop.sample_s) / (sum(times[key]) * stretch)
        lines.append(f"| {CONTENDERS[key][0]} | {1 / step_s:.1f} | {versus} | {add_us:.1f} | {sample_us:.1f} | "
                     f"{100 * share:.2f}% |")  # fmt: skip
    lines += [f"| {name} | not run: {why} | - | - | - | - |" for name, why in not_run.items()]
    return "\n".join(lines)


def adds_after_a_forward(made: dict[str, Loop], rounds: int) -> dict[str, float]:
    """Milliseconds of an ``add`` right after the network's forward of one stack (the loop's order, the forward not
    timed), the median over ``rounds``, every contender in turn in each round, with a ``sample(32)`` (not timed) every
    4 rounds as in the loop: a compressed buffer's frames are compressed by the next sample (its time is in the loop's
    table), where without samples every 64th add would compress 64. ``add`` alone (``calls_table``) is timed in runs of
    about 20 ms of adds and no sample: its time per add counts those compressions."""
    times: dict[str, list[float]] = {key: [] for key in made}
    for round_ in range(rounds):
        for key, loop in made.items():
            i = loop.steps % len(loop.stacks)
            loop.act(i)
            sync(loop.device)
            start = time.perf_counter()
            loop.feed.add(i)
            times[key].append((time.perf_counter() - start) * 1e3)
            loop.steps += 1
            if round_ % EVERY == EVERY - 1:
                loop.feed.sample()
    return {key: statistics.median(values) for key, values in times.items()}


def calls_table(made: dict[str, Loop], budget: float, rounds: int, device: torch.device) -> str:
    """The table of ``add`` and ``sample(32)`` timed alone, every contender interleaved in one round, and ``add``
    right after a forward, each against stable-baselines3's (``-`` without it)."""

    def adder(loop: Loop) -> Callable[[], None]:
        def add() -> None:
            loop.feed.add(loop.steps % len(loop.stacks))
            loop.steps += 1

        return add

    adds = median_ms({key: adder(loop) for key, loop in made.items()}, device, budget)
    samples = median_ms({key: loop.feed.sample for key, loop in made.items()}, device, budget)
    cold = adds_after_a_forward(made, rounds)
    lines = [
        "**The calls alone**: each buffer full, every contender's call in turn in each round; an `add` also right "
        f"after the network's forward of one stack, as in the loop ({rounds} rounds)",
        "",
        "| buffer | add µs | add: stable-baselines3 / ours | add after a forward µs | "
        "add after a forward: stable-baselines3 / ours | sample(32) µs | sample: stable-baselines3 / ours |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    columns = (adds, cold, samples)
    ratios = {key: tuple(c[SB3] / c[key] for c in columns) for key in made} if SB3 in made else {}
    for key in made:
        versus = [f"{r:.2f}x" for r in ratios[key]] if ratios else ["-"] * len(columns)
        cells = [f"{c[key] * 1e3:.1f} | {v}" for c, v in zip(columns, versus, strict=True)]
        lines.append(f"| {CONTENDERS[key][0]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args, device, budget = parse_args(__doc__, argv, 300.0, ROOT / "docs" / "benchmarks.md")
    if args.threads is None:
        torch.set_num_threads(2)
    steps, capacity, stretch, least = (300, 1_000, 8, 1) if args.quick else (3_000, 20_000, 100, 5)
    rec = record(GAME, steps, seed=0)
    if isinstance(rec, Missing):
        print(f"python -m benchmarks.dqn_loop: cannot play {GAME}: {rec}", file=sys.stderr)
        return 2
    made, not_run = loops(rec, capacity, device)
    try:
        times = run_rounds(made, stretch, budget, least, device)
        loop_text = loop_table(made, times, stretch, not_run)
        calls_text = calls_table(made, min(budget, 5.0), 20 if args.quick else 300, device)
    finally:
        for loop in made.values():
            loop.feed.close()
    print(loop_text, calls_text, sep="\n\n", end="\n\n", flush=True)
    command = command_line("benchmarks.dqn_loop", args) + (" --quick" if args.quick else "")
    header = (
        measured_on(device, command)
        + f" Buffers of {capacity:,} transitions. "
        + " ".join(__doc__.split("\n\n")[2:4]).replace("\n", " ")
    )
    write_section(args.output, f"dqn-loop-{device.type}", f"The DQN loop, CleanRL's cadence ({device.type})", header,
                  f"{loop_text}\n\n{calls_text}")  # fmt: skip
    docs = args.output.parent
    if (docs / "index.md").is_file():  # the manual's page: the DQN page's chart of the tables too
        from tools.manual.figure_bench import dqn_loop_figure
        from tools.manual.figure_pages import provenance

        dqn_loop_figure(docs, provenance(device).sentence(command))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
