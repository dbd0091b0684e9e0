"""Benchmark ``FrameReplayBuffer`` on real Atari frames, as it is and compressed (``compress="zstd"``, ``"lz4"``),
against the buffers that store whole stacks: ours (``ReplayBuffer``), stable-baselines3's ``ReplayBuffer`` (default,
and ``optimize_memory_usage=True``) and TorchRL's; the codecs on single frames (the choice of codec), bytes and
resident memory per transition, a million transitions built and filled, and the time of CleanRL's calls.

    pip install -e ".[atari,compress,bench]"              # ale-py (the games, offline), the codecs and the peers
    python -m benchmarks.frame_replay                     # four games' frames; 1M-transition buffers filled
    python -m benchmarks.frame_replay --quick --output /tmp/b.md   # smoke run: few frames, small buffers

The frames: ``ALE/Pong-v5``, ``ALE/Breakout-v5``, ``ALE/Seaquest-v5`` and ``ALE/SpaceInvaders-v5`` played by a
random policy, wrapped as CleanRL's ``dqn_atari.py``
wraps them (``recipes/atari.py``: no-op starts, 4 frames skipped with a max of the last 2, a lost life ends the
episode, FIRE at reset, clipped rewards, 84x84 grey, 4 frames stacked), recorded once. Every buffer is then filled
with the same transitions, in the order the game gave them, one ``add`` per step as CleanRL's loop calls it
(stable-baselines3's with arrays of one env and ``handle_timeout_termination=False``, as ``dqn_atari.py`` builds it;
TorchRL's with the ``TensorDict`` its environments hand over, built before the timing).

Bytes per transition are each buffer's storage over the transitions it holds when full (ours: a frame a transition,
a frame more per episode, and 23 bytes of action, reward, flags and episode start; compressed: every block of
compressed frames taken, in use or not, and 6 bytes a slot saying where a frame's bytes are). Resident memory is the
growth of this process's resident set (``VmRSS``) from building a buffer to having filled it, the heap's free pages
handed back first (``malloc_trim``): what the operating system had to find. Times are medians over interleaved
rounds, each peer's in a pair with ours (our column: the median over the pairs); a ratio is a peer's time over ours in
its pair, above 1: ours is faster (ours compressed are rows of their own, each in a pair with ours uncompressed).

The vector rows (``vector_table``): one game's frames cut into 1, 4 and 8 env streams, each from an episode's start and
all cut to one length with the last step truncated (so the steps fed in a cycle continue every stream), added as a
vector env's steps: ours with ``num_envs`` and ``autoreset_mode="disabled"``, stable-baselines3's with ``n_envs``, each
full, timed interleaved in one run.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import itertools
import logging
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
from tqdm import tqdm

from benchmarks.peers import Missing, label, load
from benchmarks.report import measured_on, median_ms, write_section
from copy_correct import FrameReplayBuffer, ReplayBuffer

ROOT = Path(__file__).resolve().parents[1]
GAMES = ("ALE/Pong-v5", "ALE/Breakout-v5", "ALE/Seaquest-v5", "ALE/SpaceInvaders-v5")
OURS, WHOLE, SB3, SB3_OPT, TORCHRL = "ours", "whole", "sb3", "sb3-opt", "torchrl"
ZSTD, LZ4 = "zstd", "lz4"  # ours, compressed with each codec
CODEC_PACKAGES = {ZSTD: ("zstandard", "zstandard"), LZ4: ("lz4.block", "lz4")}  # module, distribution
GOALS = {"Pong": 100, "Breakout": 100, "Seaquest": 100, "SpaceInvaders": 50}  # issue 43: stable-baselines3's / ours
GB = 1e9


@dataclass
class Recording:
    """A game's transitions in the order it gave them, ending with an episode's end (so a buffer fed them in a
    cycle sees each episode whole): stacked observations, actions, rewards and flags, and each step's data as each
    library's users hand it over."""

    game: str
    obs: list[np.ndarray] = field(default_factory=list)
    next_obs: list[np.ndarray] = field(default_factory=list)
    action: list[int] = field(default_factory=list)
    reward: list[float] = field(default_factory=list)
    terminated: list[bool] = field(default_factory=list)
    truncated: list[bool] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.obs)

    @property
    def episodes(self) -> int:
        return int(np.sum(np.logical_or(self.terminated, self.truncated)))


def record(game: str, steps: int, seed: int) -> Recording | Missing:
    """``steps`` or more steps of ``game`` by a uniformly random policy, up to the end of an episode."""
    ale = load("ale_py", "ale-py")
    if isinstance(ale, Missing):
        return Missing(f"{ale} (the atari extra: pip install -e '.[atari]')")
    from recipes.atari import make_atari_env

    env = make_atari_env(game)
    rng = np.random.default_rng(seed)
    rec = Recording(game)
    obs, _ = env.reset(seed=seed)
    with tqdm(total=steps, desc=f"playing {game}", leave=False, file=sys.stderr) as bar:
        while len(rec) < steps or not (rec.terminated[-1] or rec.truncated[-1]):
            action = int(rng.integers(env.action_space.n))
            next_obs, reward, terminated, truncated, _ = env.step(action)
            for name, value in zip(
                ("obs", "next_obs", "action", "reward", "terminated", "truncated"),
                (obs, next_obs, action, float(reward), bool(terminated), bool(truncated)),
                strict=True,
            ):
                getattr(rec, name).append(value)
            obs = env.reset()[0] if terminated or truncated else next_obs
            bar.update(1)
    env.close()
    return rec


class Contender:
    """A buffer fed a recording's steps in a cycle, as its users call it, and how much memory it holds."""

    def __init__(self, add: Callable[[int], object], sample: Callable[[int], object], stored: Callable[[], int],
                 nbytes: Callable[[], int]) -> None:  # fmt: skip
        self.add_step, self.sample, self.stored, self.nbytes = add, sample, stored, nbytes
        self.cursor = 0
        self.rss_growth = 0

    def add(self, steps: int) -> None:
        self.add_step(self.cursor % steps)
        self.cursor += 1


def space(rec: Recording) -> Any:
    import gymnasium as gym

    return gym.spaces.Box(0, 255, rec.obs[0].shape, np.uint8)


def ours(rec: Recording, capacity: int, compress: str | None = None) -> Contender | Missing:
    if compress is not None:
        module, distribution = CODEC_PACKAGES[compress]
        loaded = load(module, distribution)
        if isinstance(loaded, Missing):
            return Missing(f"{loaded} (the compress extra)")
    buffer = FrameReplayBuffer(capacity, space(rec), (), compress=compress)
    steps = list(zip(rec.obs, rec.action, rec.reward, rec.next_obs, rec.terminated, rec.truncated, strict=True))
    return Contender(lambda i: buffer.add(*steps[i]), buffer.sample, lambda: buffer.stored, lambda: buffer.nbytes)


def whole(rec: Recording, capacity: int) -> Contender:
    buffer = ReplayBuffer(capacity, space(rec), ())
    steps = list(zip(rec.obs, rec.action, rec.reward, rec.next_obs, rec.terminated, rec.truncated, strict=True))
    return Contender(lambda i: buffer.add(*steps[i]), buffer.sample, lambda: buffer.size, lambda: buffer.nbytes)


def sb3(rec: Recording, capacity: int, optimize: bool) -> Contender | Missing:
    buffers = load("stable_baselines3.common.buffers", "stable-baselines3")
    if isinstance(buffers, Missing):
        return buffers
    import gymnasium as gym

    buffer = buffers.ReplayBuffer(capacity, space(rec), gym.spaces.Discrete(18), device="cpu", n_envs=1,
                                  optimize_memory_usage=optimize, handle_timeout_termination=False)  # fmt: skip
    steps = [
        (rec.obs[i][None], rec.next_obs[i][None], np.array([rec.action[i]]), np.array([rec.reward[i]]),
         np.array([rec.terminated[i]]), [{}])
        for i in range(len(rec))
    ]  # fmt: skip
    arrays = ("observations", "actions", "rewards", "dones", "timeouts") + (() if optimize else ("next_observations",))
    return Contender(
        lambda i: buffer.add(*steps[i]),
        buffer.sample,
        lambda: buffer.buffer_size if buffer.full else buffer.pos,
        lambda: sum(getattr(buffer, name).nbytes for name in arrays),
    )


def torchrl(rec: Recording, capacity: int) -> Contender | Missing:
    data = load("torchrl.data", "torchrl")
    if isinstance(data, Missing):
        return data
    from tensordict import TensorDict

    logging.getLogger("torchrl").setLevel(logging.WARNING)
    buffer = data.ReplayBuffer(storage=data.LazyTensorStorage(capacity))
    steps = [
        TensorDict({
            "observation": torch.from_numpy(rec.obs[i]), "action": torch.tensor(rec.action[i]),
            "next": {"observation": torch.from_numpy(rec.next_obs[i]), "reward": torch.tensor(rec.reward[i]),
                     "terminated": torch.tensor(rec.terminated[i]), "truncated": torch.tensor(rec.truncated[i])},
        })
        for i in range(len(rec))
    ]  # fmt: skip
    return Contender(
        lambda i: buffer.add(steps[i]),
        buffer.sample,
        lambda: len(buffer),
        lambda: sum(t.nbytes for t in buffer.storage._storage.values(True, True)),
    )


def settle() -> None:
    """Collect garbage and hand the heap's free pages back to the operating system (glibc's ``malloc_trim``), so that
    a buffer's resident growth is not hidden by pages an earlier one freed (compressed frames take 64 KiB blocks from
    the heap, where the frames a codec table compressed had been)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: the growth may then be under the storage
        ctypes.CDLL(None).malloc_trim(0)


def resident() -> int:
    """This process's resident memory in bytes (``VmRSS``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def machine_memory() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return 0


def filled(make: Callable[[], Contender | Missing], rec: Recording, transitions: int, name: str) -> Contender | Missing:
    """A contender built and fed ``transitions`` steps; its resident-memory growth recorded."""
    settle()
    before = resident()
    made = make()
    if isinstance(made, Missing):
        return made
    for _ in tqdm(range(transitions), desc=f"filling {name}", leave=False, file=sys.stderr):
        made.add(len(rec))
    made.rss_growth = resident() - before
    return made


NAMES = {
    OURS: "copy_correct.FrameReplayBuffer",
    ZSTD: 'copy_correct.FrameReplayBuffer(compress="zstd")',
    LZ4: 'copy_correct.FrameReplayBuffer(compress="lz4")',
    WHOLE: "copy_correct.ReplayBuffer (whole stacks)",
    SB3: "stable-baselines3 ReplayBuffer",
    SB3_OPT: "stable-baselines3 ReplayBuffer(optimize_memory_usage=True)",
    TORCHRL: "torchrl ReplayBuffer(LazyTensorStorage)",
}


SHORT = {
    ZSTD: "zstd",
    LZ4: "lz4",
    WHOLE: "whole stacks",
    SB3: "stable-baselines3",
    SB3_OPT: "its optimize_memory_usage",
    TORCHRL: "torchrl",
}


def names() -> dict[str, str]:
    return {
        OURS: NAMES[OURS], ZSTD: NAMES[ZSTD], LZ4: NAMES[LZ4], WHOLE: NAMES[WHOLE],
        SB3: label("stable-baselines3", "ReplayBuffer"),
        SB3_OPT: label("stable-baselines3", "ReplayBuffer(optimize_memory_usage=True)"),
        TORCHRL: label("torchrl", "ReplayBuffer(LazyTensorStorage)"),
    }  # fmt: skip


def makers(rec: Recording, capacity: int) -> dict[str, Callable[[], Contender | Missing]]:
    return {
        OURS: partial(ours, rec, capacity), ZSTD: partial(ours, rec, capacity, ZSTD),
        LZ4: partial(ours, rec, capacity, LZ4), WHOLE: partial(whole, rec, capacity),
        SB3: partial(sb3, rec, capacity, False), SB3_OPT: partial(sb3, rec, capacity, True),
        TORCHRL: partial(torchrl, rec, capacity),
    }  # fmt: skip


def memory_table(recordings: list[Recording], capacity: int) -> tuple[str, dict[str, float], dict[str, str]]:
    """Bytes and resident memory per transition of every contender, full, for each game (a column group each); the
    bytes per transition of the last game, and the peers not run."""
    measured: dict[str, dict[str, tuple[int, float, float]]] = {}  # {game: {contender: (held, bytes, resident)}}
    not_run: dict[str, str] = {}
    shown = names()
    for rec in recordings:
        measured[rec.game] = {}
        for name, make in makers(rec, capacity).items():
            made = filled(make, rec, capacity + capacity // 10, f"{name} ({rec.game})")
            if isinstance(made, Missing):
                not_run[shown[name]] = made
                continue
            held = made.stored()
            measured[rec.game][name] = (held, made.nbytes() / held, made.rss_growth / held)
            del made
            gc.collect()
    games = {rec.game: rec.game.removeprefix("ALE/").removesuffix("-v5") for rec in recordings}
    held = ", ".join(
        f"{short} {measured[game][OURS][0]:,} (episodes of {len(rec) / max(rec.episodes, 1):,.0f} steps)"
        for rec, (game, short) in zip(recordings, games.items(), strict=True)
    )
    lines = [
        f"**Memory per transition**: each buffer built for {capacity:,} transitions and fed {capacity // 10:,} more, "
        f"one game's frames at a time; ours holds {held}, a frame going to each episode's start",
        "",
        "| buffer | " + " | ".join(f"{s}: bytes per transition | {s}: resident per transition | {s}: size / ours"
                                    for s in games.values()) + " |",
        "| --- |" + " ---: | ---: | ---: |" * len(games),
    ]  # fmt: skip
    for name in measured[recordings[0].game]:
        cells = []
        for game in games:
            _, nbytes, rss = measured[game][name]
            cells.append(f"{nbytes:,.0f} | {rss:,.0f} | {nbytes / measured[game][OURS][1]:.2f}x")
        lines.append(f"| {shown[name]} | " + " | ".join(cells) + " |")
    per_transition = {name: values[1] for name, values in measured[recordings[-1].game].items()}
    return "\n".join(lines) + goals_table(measured, games), per_transition, not_run


def goals_table(measured: dict[str, dict[str, tuple[int, float, float]]], games: dict[str, str]) -> str:
    """How many times fewer bytes per transition than stable-baselines3's default buffer each of ours holds, beside
    issue 43's goal for the game (where stable-baselines3 ran)."""
    if any(SB3 not in measured[game] for game in games):
        return ""
    ours_rows = [name for name in (OURS, ZSTD, LZ4) if all(name in measured[game] for game in games)]
    lines = [
        "",
        "",
        "**Against stable-baselines3**: its bytes per transition over ours, from the table above; the goal (issue 43): "
        + ", ".join(f"{short} {GOALS.get(short, 100)}x" for short in games.values()),
        "",
        "| buffer | " + " | ".join(f"{short}: stable-baselines3 / this" for short in games.values()) + " | goals met |",
        "| --- |" + " ---: |" * len(games) + " --- |",
    ]
    for name in ours_rows:
        ratios = {short: measured[game][SB3][1] / measured[game][name][1] for game, short in games.items()}
        met = [short for short, ratio in ratios.items() if ratio >= GOALS.get(short, 100)]
        lines.append(
            f"| {names()[name]} | " + " | ".join(f"{ratio:.1f}x" for ratio in ratios.values())
            + f" | {len(met)} of {len(ratios)}" + (f" ({', '.join(met)})" if met and len(met) < len(ratios) else "")
            + " |"
        )  # fmt: skip
    return "\n".join(lines)


def million(recordings: list[Recording], transitions: int, per_transition: dict[str, float]) -> str:
    """Ours built with room for ``transitions`` and their episodes' first frames (2% more frames), fed every
    recording in turn until its rings have wrapped (5% more), its resident memory and time; the others' needs at
    their measured bytes per transition, beside this machine's memory."""
    buffer, seconds, grown, fed = filled_million(recordings, transitions, None)
    sample_ms = median_ms({"sample 32": partial(buffer.sample, 32)}, torch.device("cpu"), 1.0)["sample 32"]
    memory = machine_memory()
    played = " and ".join(f"{rec.game.removeprefix('ALE/').removesuffix('-v5')}'s" for rec in recordings)
    lines = [
        f"**{transitions:,} transitions**, {played} in turn, on this machine ({memory / GB:.1f} GB of "
        f"memory): ours built for {buffer.capacity:,} frames, fed {fed:,} transitions (the rings wrap) in "
        f"{seconds:.0f} s ({seconds / fed * 1e6:.1f} µs an add), holding {buffer.stored:,}, then sampled "
        f"({sample_ms * 1e3:.0f} µs for 32)",
        "",
        "| buffer | bytes per transition | storage for these transitions | resident memory | fits this machine |",
        "| --- | ---: | ---: | ---: | --- |",
        f"| {names()[OURS]} | {buffer.nbytes / buffer.stored:,.0f} | {buffer.nbytes / GB:.2f} GB | {grown / GB:.2f} "
        "GB (measured) | yes: built and filled |",
    ]
    for name in (WHOLE, SB3, SB3_OPT, TORCHRL):
        if name in per_transition:
            need = per_transition[name] * transitions
            verdict = "no" if need > memory else "yes"
            lines.append(
                f"| {names()[name]} | {per_transition[name]:,.0f} | {need / GB:.1f} GB | not built | {verdict}: "
                f"{need / memory:.1f}x this machine's memory |"
            )
    return "\n".join(lines)


def filled_million(
    recordings: list[Recording], transitions: int, compress: str | None, **options: Any
) -> tuple[FrameReplayBuffer, float, int, int]:
    """Ours built with room for ``transitions`` and their episodes' first frames (2% more frames), ``options`` passed
    on (``prioritized=True``), and fed every recording in turn until its rings have wrapped (5% more): the buffer, the
    seconds it took, the growth of the resident set and the transitions fed."""
    steps = [(rec, i) for rec in recordings for i in range(len(rec))]
    settle()
    before = resident()
    start = time.perf_counter()
    buffer = FrameReplayBuffer(transitions + transitions // 50, space(recordings[0]), (), compress=compress, **options)
    fed = transitions + transitions // 20
    for n in tqdm(range(fed), desc=f"filling {transitions:,} ({compress})", leave=False, file=sys.stderr):
        rec, i = steps[n % len(steps)]
        buffer.add(rec.obs[i], rec.action[i], rec.reward[i], rec.next_obs[i], rec.terminated[i], rec.truncated[i])
    return buffer, time.perf_counter() - start, resident() - before, fed


def million_compressed(rec: Recording, transitions: int) -> tuple[str, dict[str, str]]:
    """Ours compressed, with each codec, built for ``transitions`` of one game and filled (``filled_million``): its
    storage, resident memory, and the time of an add and of a sample of 32; issue 43's goal: a million Pong
    transitions under 300 MB."""
    lines = [
        f"**{transitions:,} transitions compressed**, {rec.game}'s, each buffer built for {transitions * 51 // 50:,} "
        f"frames and fed {transitions * 21 // 20:,} transitions (the rings wrap), one codec at a time; the goal: a "
        "million Pong transitions under 300 MB",
        "",
        "| buffer | bytes per transition | storage | resident memory (measured) | add µs (filling) | sample 32 µs |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    not_run: dict[str, str] = {}
    for name in (ZSTD, LZ4):
        module, distribution = CODEC_PACKAGES[name]
        loaded = load(module, distribution)
        if isinstance(loaded, Missing):
            not_run[names()[name]] = loaded
            continue
        buffer, seconds, grown, fed = filled_million([rec], transitions, name)
        sample_ms = median_ms({"sample 32": partial(buffer.sample, 32)}, torch.device("cpu"), 1.0)["sample 32"]
        lines.append(
            f"| {names()[name]} | {buffer.nbytes / buffer.stored:,.0f} | {buffer.nbytes / 1e6:,.0f} MB | "
            f"{grown / 1e6:,.0f} MB | {seconds / fed * 1e6:.1f} | {sample_ms * 1e3:.0f} |"
        )
        del buffer
        gc.collect()
    return "\n".join(lines), not_run


def codec_candidates(frame_bytes: int) -> dict[str, tuple[Callable[[Any], bytes], Callable[[Any], bytes]] | Missing]:
    """The codecs measured for ``compress=``, each frame compressed alone: (compress, decompress) or why not here."""
    from copy_correct.replay.frame_codec import codec

    found: dict[str, tuple[Callable[[Any], bytes], Callable[[Any], bytes]] | Missing] = {}
    zstd, lz4 = load("zstandard", "zstandard"), load("lz4.block", "lz4")
    for name, module in (("zstd", zstd), ("lz4", lz4)):
        if isinstance(module, Missing):
            found[f"{name} (ours)"] = module
        else:
            chosen = codec(name, frame_bytes)
            found[f"{name} (ours: level 1)" if name == "zstd" else "lz4 (ours)"] = (chosen.compress, chosen.decompress)
    if not isinstance(zstd, Missing):
        unframed = zstd.FORMAT_ZSTD1_MAGICLESS
        for level in (3, 6):
            params = zstd.ZstdCompressionParameters.from_level(
                level, source_size=frame_bytes, format=unframed, write_content_size=False, write_checksum=False,
                write_dict_id=False,
            )  # fmt: skip
            found[f"zstd level {level}"] = (
                zstd.ZstdCompressor(compression_params=params).compress,
                partial(zstd.ZstdDecompressor(format=unframed).decompress, max_output_size=frame_bytes),
            )
    if not isinstance(lz4, Missing):
        found["lz4 HC level 9"] = (
            partial(lz4.compress, mode="high_compression", compression=9, store_size=False),
            partial(lz4.decompress, uncompressed_size=frame_bytes),
        )
    blosc2 = load("blosc2", "blosc2")
    for name, clevel in (("ZSTD", 1), ("LZ4", 5)):
        label_ = f"blosc2 {name.lower()} level {clevel}, shuffle"
        if isinstance(blosc2, Missing):
            found[label_] = blosc2
            continue
        found[label_] = (
            partial(blosc2.compress2, codec=getattr(blosc2.Codec, name), clevel=clevel, typesize=1),
            blosc2.decompress2,
        )
    return found


def cycling(fn: Callable[[Any], object], items: list[Any]) -> Callable[[], object]:
    """A call of ``fn`` on the next of ``items``, in a cycle."""
    each = itertools.cycle(items)
    return lambda: fn(next(each))


def codec_table(recordings: list[Recording], budget: float) -> tuple[str, dict[str, str]]:
    """Each candidate codec on each game's frames (the newest of each ``next_obs``), every frame compressed alone:
    mean bytes, and the time to compress and to decompress one, candidates interleaved."""
    frames = {rec.game: [np.ascontiguousarray(obs[-1]) for obs in rec.next_obs] for rec in recordings}
    candidates = codec_candidates(recordings[0].next_obs[0][-1].nbytes)
    present = {name: calls for name, calls in candidates.items() if not isinstance(calls, Missing)}
    games = {rec.game: rec.game.removeprefix("ALE/").removesuffix("-v5") for rec in recordings}
    cells: dict[str, list[str]] = {name: [] for name in present}
    for some in frames.values():
        packed = {name: [compress(f) for f in some] for name, (compress, _) in present.items()}
        fns = {}
        for name, (compress, decompress) in present.items():
            fns[f"{name} c"], fns[f"{name} d"] = cycling(compress, some), cycling(decompress, packed[name])
        ms = median_ms(fns, torch.device("cpu"), budget)
        for name in present:
            mean = statistics.mean(len(p) for p in packed[name])
            cells[name].append(f"{mean:,.0f} | {ms[name + ' c'] * 1e3:.1f} | {ms[name + ' d'] * 1e3:.1f}")
    lines = [
        "**Codecs on single frames**: each game's frames (the newest of each stacked observation, 84x84 uint8, "
        "7,056 bytes), each compressed alone (a sample decompresses any frame without its neighbours); bytes are "
        "means, times medians of interleaved rounds",
        "",
        "| codec | " + " | ".join(f"{s}: bytes | {s}: compress µs | {s}: decompress µs" for s in games.values()) + " |",
        "| --- |" + " ---: | ---: | ---: |" * len(games),
        *(f"| {name} | " + " | ".join(row) + " |" for name, row in cells.items()),
    ]  # fmt: skip
    return "\n".join(lines), {name: why for name, why in candidates.items() if isinstance(why, Missing)}


def timing_table(rec: Recording, capacity: int, budget: float) -> tuple[str, dict[str, str]]:
    """CleanRL's calls on every contender, each full with ``rec``'s transitions."""
    contenders: dict[str, Contender] = {}
    not_run: dict[str, str] = {}
    shown = names()
    for name, make in makers(rec, capacity).items():
        made = filled(make, rec, capacity, f"{name} (timing)")
        if isinstance(made, Missing):
            not_run[shown[name]] = made
        else:
            contenders[name] = made
    steps = len(rec)

    def cadence(c: Contender) -> None:  # dqn_atari.py: a sample of 32 every 4 steps
        for _ in range(4):
            c.add(steps)
        c.sample(32)

    ops: dict[str, Callable[[Contender], object]] = {
        "add one transition": lambda c: c.add(steps),
        "4 adds + sample 32 (CleanRL's dqn_atari.py)": cadence,
        "sample 32": lambda c: c.sample(32),
    }
    peers = [n for n in contenders if n != OURS]
    lines = [
        f"**CleanRL's calls**: {rec.game}'s frames, every buffer full ({capacity:,} transitions)",
        "",
        "| operation | " + " | ".join(f"{shown[n]} µs" + (f" | {SHORT[n]} / ours" if n in peers else "")
                                     for n in contenders) + " |",
        "| --- |" + " ---: |" * (len(contenders) + len(peers)),
    ]  # fmt: skip
    for op, call in tqdm(ops.items(), desc="timing", leave=False, file=sys.stderr):
        # Each peer against ours alone, interleaved: a third buffer's traffic (TorchRL's sample moves four times the
        # bytes) would otherwise fall between the pair's calls. Ours: the median of its times over the pairs.
        pairs = {
            peer: median_ms({n: partial(call, contenders[n]) for n in (OURS, peer)}, torch.device("cpu"), budget)
            for peer in peers
        }
        us = {peer: pair[peer] * 1e3 for peer, pair in pairs.items()}
        us[OURS] = statistics.median(pair[OURS] * 1e3 for pair in pairs.values()) if pairs else float("nan")
        cells = [f"{us[n]:.1f}" + (f" | {pairs[n][n] / pairs[n][OURS]:.2f}x" if n in peers else "") for n in contenders]
        lines.append(f"| {op} | " + " | ".join(cells) + " |")
    return "\n".join(lines), not_run


ENVS = (1, 4, 8)


def streams(rec: Recording, num_envs: int) -> list[tuple[Any, ...]]:
    """``rec`` cut into ``num_envs`` env streams, each from an episode's start, as a vector env's steps ``(obs,
    actions, rewards, next_obs, terminated, truncated)``: obs of shape ``(num_envs, stack, 84, 84)``, rewards in
    float64 (as gymnasium's vector envs give them).
    Every stream is cut to the shortest one's length and its last step truncated, so the steps fed in a cycle
    continue each stream (as ``autoreset_mode="disabled"``: an env whose episode ended starts its next one)."""
    starts = [0] + [i + 1 for i in range(len(rec) - 1) if rec.terminated[i] or rec.truncated[i]]
    share = len(rec) // num_envs
    firsts = [min(starts, key=lambda s, k=k: abs(s - k * share)) for k in range(num_envs)]
    length = min(b - a for a, b in zip(firsts, [*firsts[1:], len(rec)], strict=True))
    index = np.array(firsts)[:, None] + np.arange(length)  # (env, step) into the recording
    obs = [np.stack([rec.obs[i] for i in index[:, t]]) for t in range(length)]
    nxt = [np.stack([rec.next_obs[i] for i in index[:, t]]) for t in range(length)]
    steps = []
    for t in range(length):
        at = index[:, t]
        truncated = np.array([rec.truncated[i] or t == length - 1 for i in at])
        steps.append((np.array([rec.action[i] for i in at]), np.array([rec.reward[i] for i in at]),
                      np.array([rec.terminated[i] for i in at]) & ~truncated, truncated))  # fmt: skip
    return [(obs[t], *steps[t][:2], nxt[t], *steps[t][2:]) for t in range(length)]


def vector_adds(rec: Recording, num_envs: int, capacity: int, budget: float, sb3_buffer: Any) -> dict[str, float]:
    """Milliseconds per ``add`` of one step of ``num_envs`` envs, ours and stable-baselines3's, interleaved, each
    buffer filled first (its ring wrapped)."""
    import gymnasium as gym

    steps = streams(rec, num_envs)
    ours = FrameReplayBuffer(capacity, space(rec), (), num_envs=num_envs, autoreset_mode="disabled")
    sb3 = sb3_buffer(capacity // num_envs, space(rec), gym.spaces.Discrete(18), device="cpu", n_envs=num_envs,
                     handle_timeout_termination=False)  # fmt: skip
    infos = [{} for _ in range(num_envs)]
    cursor = {OURS: 0, SB3: 0}

    def add_ours() -> None:
        ours.add(*steps[cursor[OURS] % len(steps)])
        cursor[OURS] += 1

    def add_sb3() -> None:
        o, a, r, nxt, te, tr = steps[cursor[SB3] % len(steps)]
        sb3.add(o, nxt, a, r, te | tr, infos)
        cursor[SB3] += 1

    for _ in tqdm(range(capacity // num_envs + len(steps)), desc=f"filling {num_envs} envs", leave=False,
                  file=sys.stderr):  # fmt: skip
        add_ours()
        add_sb3()
    return median_ms({OURS: add_ours, SB3: add_sb3}, torch.device("cpu"), budget)


def vector_table(rec: Recording, capacity: int, budget: float) -> tuple[str, dict[str, str]]:
    """``add`` of one step of 1, 4 and 8 envs, ours against stable-baselines3's (``n_envs``), each full."""
    buffers = load("stable_baselines3.common.buffers", "stable-baselines3")
    if isinstance(buffers, Missing):
        return "", {label("stable-baselines3", "ReplayBuffer"): buffers}
    lines = [
        f"**add, one step of a vector env**: {rec.game}'s frames cut into 1, 4 or 8 env streams (each from an "
        f"episode's start), rewards in float64 as gymnasium's vector envs give them; every buffer full "
        f'({capacity:,} transitions); ours with ``num_envs`` and ``autoreset_mode="disabled"``, checking every '
        "row (shapes, dtypes, finite rewards, each stream continued, each ended episode's last stack continued)",
        "",
        f"| envs | {NAMES[OURS]} µs | {label('stable-baselines3', 'ReplayBuffer')} µs | stable-baselines3 / ours | "
        "ours per transition µs |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for num_envs in ENVS:
        ms = vector_adds(rec, num_envs, capacity, budget, buffers.ReplayBuffer)
        lines.append(
            f"| {num_envs} | {ms[OURS] * 1e3:.1f} | {ms[SB3] * 1e3:.1f} | {ms[SB3] / ms[OURS]:.2f}x | "
            f"{ms[OURS] * 1e3 / num_envs:.1f} |"
        )
        gc.collect()
    return "\n".join(lines), {}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}\n")  # one line, no usage block


def main(argv: list[str]) -> int:
    parser = _Parser(prog="python -m benchmarks.frame_replay", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few frames and small buffers (smoke test)")
    parser.add_argument("--budget", type=float, default=None, help="seconds of timing per row (default 4)")
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "benchmarks.md")
    args = parser.parse_args(argv)
    if args.budget is not None and not args.budget > 0:
        parser.error(f"--budget must be > 0, got {args.budget:g}")
    budget = args.budget if args.budget is not None else (0.3 if args.quick else 4.0)
    steps, capacity, many = (400, 1_000, 5_000) if args.quick else (6_000, 50_000, 1_000_000)
    recordings = [record(game, steps, seed) for seed, game in enumerate(GAMES)]
    missing = [r for r in recordings if isinstance(r, Missing)]
    if missing:
        print(f"{parser.prog}: cannot play the games: {missing[0]}", file=sys.stderr)
        return 2
    played: list[Recording] = [r for r in recordings if isinstance(r, Recording)]
    codecs, codecs_missing = codec_table(played, budget / 4)
    pong = next(rec for rec in played if rec.game == "ALE/Pong-v5")
    breakout = next(rec for rec in played if rec.game == "ALE/Breakout-v5")  # the timed game: many short episodes
    compressed, compressed_missing = million_compressed(pong, many)  # first: a heap that earlier tables left
    memory, per_transition, not_run = memory_table(played, capacity)
    timing, more = timing_table(breakout, capacity, budget)
    vector, vector_missing = vector_table(breakout, capacity, budget)
    tables = [codecs, memory, million(played, many, per_transition), compressed, timing, *([vector] if vector else [])]
    missing_rows = {**codecs_missing, **not_run, **compressed_missing, **more, **vector_missing}
    tables += [f"Not run: {name}: {why}." for name, why in missing_rows.items()]
    for text in tables:
        print(text, end="\n\n", flush=True)
    options = (" --quick" if args.quick else "") + (f" --budget {args.budget:g}" if args.budget is not None else "")
    header = (
        measured_on(torch.device("cpu"), f"python -m benchmarks.frame_replay{options}")
        + " "
        + " ".join(__doc__.split("\n\n")[2:4]).replace("\n", " ")
    )
    write_section(args.output, "frame-replay-cpu", "Frame-stacked replay on Atari frames (cpu)", header,
                  "\n\n".join(tables))  # fmt: skip
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
