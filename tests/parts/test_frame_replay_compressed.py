"""FrameReplayBuffer(compress=...): every batch of a compressed buffer is the uncompressed buffer's, bit for bit, for
the same streams and generator, in every autoreset mode and padding, one env or three, with rings that wrap many times
and blocks taken and given back all along (small blocks; the controls: a pool that takes a block back one frame too
early hands out frames it no longer holds, and frames decompressed for a sample, kept past an add, go stale).
``nbytes`` is what the process holds: a subprocess fills a buffer and its resident set grows by ``nbytes`` (the
control: a Python object per frame, counted by its bytes, is found out: 1.09 GB resident for 26.7 MB of bytes, one
run here). State: the compressed bytes, loaded with
``weights_only=True``, resumed bit for bit; another codec's refused in one line. Refusals: an unknown codec, a codec
whose package is missing (naming the extra)."""

from __future__ import annotations

import dataclasses
import itertools
import subprocess
import sys
import threading
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch

import copy_correct.replay.frame_buffer as frame_replay
import copy_correct.replay.frame_store as frame_store
from copy_correct import FrameReplayBuffer, SampleAhead
from tests.conftest import ROOT
from tests.parts.test_frame_replay import FRAME, MODES, STACK, play, vector_envs

CODECS = ["zstd", "lz4"]
pytest.importorskip("zstandard", reason='the compress extra: pip install "copy-correct[compress]"')
pytest.importorskip("lz4", reason='the compress extra: pip install "copy-correct[compress]"')


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of a few frames, so that the streams take and give back blocks all along (``block``: the codec's
    bound, 92 bytes for these 12-byte frames)."""
    monkeypatch.setattr(frame_store, "BLOCK", 64)


def batches(mode: str, padding: str, num_envs: int, compress: str | None) -> tuple[Any, list[dict[str, torch.Tensor]]]:
    steps = 300 if num_envs > 1 else 700
    frames, _, got = play(
        mode, steps, num_envs * 24, num_envs, padding, kind=partial(FrameReplayBuffer, compress=compress)
    )
    return frames, got


@pytest.mark.parametrize("compress", CODECS)
@pytest.mark.parametrize("num_envs", [3, 1], ids=["3 envs", "1 env"])
@pytest.mark.parametrize("padding", ["reset", "zero"])
@pytest.mark.parametrize("mode", list(MODES))
def test_every_batch_is_the_uncompressed_buffers_bit_for_bit(
    mode: str, padding: str, num_envs: int, compress: str
) -> None:
    _, plain = batches(mode, padding, num_envs, None)
    frames, packed = batches(mode, padding, num_envs, compress)
    assert len(plain) == len(packed)
    assert all(torch.equal(one[k], two[k]) for one, two in zip(plain, packed, strict=True) for k in one)
    assert (frames._written > 10 * frames._length).all()  # every ring wrapped ten times
    assert len(frames._store._blocks) > 3 * num_envs  # blocks taken and given back, not one a stream


class EarlyFree(frame_store.CompressedFrames):
    """Takes a block back as soon as the frame after the one overwritten is its last: one frame too early."""

    def _commit(self, env: int, position: int, data: bytes) -> None:
        soon = position - self.length + 1
        if soon >= 0:
            block = int(self.address[env * self.length + soon % self.length]) // self.block
            if self._last_position[block] == soon and block != self._open[env] and block not in self._free:
                self._free.append(block)
        super()._commit(env, position, data)


def test_the_control_a_pool_that_takes_blocks_back_early_samples_frames_it_no_longer_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, plain = batches("same_step", "reset", 3, None)
    monkeypatch.setattr(frame_replay, "CompressedFrames", EarlyFree)
    try:
        _, packed = batches("same_step", "reset", 3, "lz4")
    except Exception:  # lz4 refuses some overwritten bytes outright
        return
    assert not all(torch.equal(one[k], two[k]) for one, two in zip(plain, packed, strict=True) for k in one)


class Unforgetting(frame_store.CompressedFrames):
    """Keeps the frames the last ``gather`` decompressed through a ``put``, which may overwrite them."""

    def put(self, env: int, position: int, frame: np.ndarray) -> None:
        rows, decoded = self._decoded_rows, self._decoded
        super().put(env, position, frame)
        self._decoded_rows, self._decoded = rows, decoded


def test_the_control_frames_decompressed_for_one_sample_and_kept_past_an_add_go_stale(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, plain = batches("same_step", "reset", 3, None)
    monkeypatch.setattr(frame_replay, "CompressedFrames", Unforgetting)
    _, packed = batches("same_step", "reset", 3, "zstd")
    assert not all(torch.equal(one[k], two[k]) for one, two in zip(plain, packed, strict=True) for k in one)


def test_past_4_gib_of_blocks_the_addresses_widen_and_the_batches_stay_the_same(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, plain = batches("next_step", "reset", 3, None)
    monkeypatch.setattr(frame_store, "ADDRESSABLE", 92 * 8)  # eight blocks of 92 bytes stand for 4 GiB
    frames, packed = batches("next_step", "reset", 3, "zstd")
    assert frames._store.address.dtype == np.int64
    assert all(torch.equal(one[k], two[k]) for one, two in zip(plain, packed, strict=True) for k in one)


RSS_SCRIPT = """
import sys
from pathlib import Path
import numpy as np
import copy_correct.replay.frame_store as frame_store
import copy_correct.replay.frame_buffer as frame_replay
from copy_correct import FrameReplayBuffer

class ObjectPerFrame(frame_store.CompressedFrames):  # the control: each frame a bytes object in a list
    frames = {}
    def put(self, env, position, frame):
        self.frames[position % self.length] = self.codec.compress(frame)
        self.newest[env] = frame.tobytes()
    @property
    def nbytes(self):
        held = sum(map(len, self.frames.values())) + len(self.newest) * self.frame_bytes
        return held + self.address.nbytes + self.size.nbytes

def resident():
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024

if sys.argv[1] == "object per frame":
    frame_replay.CompressedFrames = ObjectPerFrame
rng = np.random.default_rng(0)
pool = np.zeros((512, 84, 84), np.uint8)
for frame in pool:  # a few small sprites on black: about 100 bytes compressed
    for _ in range(3):
        y, x = rng.integers(0, 76, 2)
        frame[y : y + 8, x : x + 8] = rng.integers(0, 4, (8, 8)) * 60
stack = [pool[0]] * 4
before = resident()
buffer = FrameReplayBuffer(150_000, (4, 84, 84), compress="zstd")
for i in range(160_000):
    nxt = stack[1:] + [pool[(i * 7) % 512]]
    buffer.add(np.stack(stack), 0, 0.0, np.stack(nxt), False)
    stack = nxt
print(resident() - before, buffer.nbytes)
"""


def grown(kind: str) -> tuple[int, int]:
    done = subprocess.run(
        [sys.executable, "-c", RSS_SCRIPT, kind], cwd=ROOT, capture_output=True, text=True, timeout=600, check=True
    )
    rss, nbytes = map(int, done.stdout.split())
    return rss, nbytes


TOLERANCE = 0.1  # of nbytes; the interpreter's own allocations while it fills are a few hundred kB


def test_the_process_grows_by_nbytes_while_a_compressed_buffer_fills() -> None:
    rss, nbytes = grown("blocks")
    assert abs(rss - nbytes) <= TOLERANCE * nbytes, (rss, nbytes)
    assert nbytes < 150_000 * 200  # compressed: about 100 bytes a frame and 23 of the other fields


def test_the_control_a_python_object_per_frame_holds_more_than_its_bytes_say() -> None:
    rss, nbytes = grown("object per frame")
    assert rss - nbytes > TOLERANCE * nbytes, (rss, nbytes)


def space() -> gym.spaces.Box:
    return gym.spaces.Box(0, 255, (STACK, *FRAME), np.uint8)


@pytest.mark.parametrize("compress", CODECS)
def test_resumed_from_its_saved_compressed_bytes_it_samples_what_the_uninterrupted_buffer_samples(
    tmp_path: Path, compress: str
) -> None:
    frames, _ = batches("next_step", "reset", 3, compress)
    path = tmp_path / "replay.pt"
    state = frames.state_dict()
    assert "frames" not in state and state["frame_bytes"].dtype == torch.uint8
    rows = [row for *_, row in frames._store._live(frames._written)]  # the compressed bytes, not the frames
    assert len(rows) == 3 * 24 and len(state["frame_bytes"]) == int(frames._store.size[rows].sum())
    torch.save(state, path)
    envs = vector_envs(3, "next_step")
    resumed = FrameReplayBuffer(
        3 * 24, envs.single_observation_space, envs.single_action_space, num_envs=3, autoreset_mode="next_step",
        compress=compress,
    )  # fmt: skip
    resumed.load_state_dict(torch.load(path, weights_only=True))
    assert len(resumed) == len(frames) and resumed.stored == frames.stored
    assert resumed._store.newest == frames._store.newest
    one, two = (b.sample(256, generator=torch.Generator().manual_seed(7)) for b in (frames, resumed))
    assert all(torch.equal(one[k], two[k]) for k in one)


def test_a_state_of_another_codec_or_of_none_is_refused_naming_both() -> None:
    zstd, _ = batches("disabled", "reset", 1, "zstd")
    plain, _ = batches("disabled", "reset", 1, None)
    other = {c: FrameReplayBuffer(24, space(), compress=c) for c in ("lz4", None)}
    with pytest.raises(ValueError, match=r"^saved buffer has compress='zstd', this one 'lz4': .*$"):
        other["lz4"].load_state_dict(zstd.state_dict())
    with pytest.raises(ValueError, match=r"^saved buffer has compress='zstd', this one None: .*$"):
        other[None].load_state_dict(zstd.state_dict())
    with pytest.raises(ValueError, match=r"^saved buffer has compress=None, this one 'lz4': .*$"):
        other["lz4"].load_state_dict(plain.state_dict())


def test_a_state_saved_before_buffers_compressed_loads_as_an_uncompressed_one() -> None:
    plain, _ = batches("disabled", "reset", 1, None)
    state = plain.state_dict()
    del state["compress"]
    again = FrameReplayBuffer(24, space())
    again.load_state_dict(state)
    one, two = (b.sample(64, generator=torch.Generator().manual_seed(1)) for b in (plain, again))
    assert all(torch.equal(one[k], two[k]) for k in one)


def test_saved_bytes_that_do_not_match_their_sizes_are_refused_and_nothing_is_loaded() -> None:
    zstd, _ = batches("disabled", "reset", 1, "zstd")
    state = zstd.state_dict()
    state["frame_bytes"] = state["frame_bytes"][:-1]
    fresh = FrameReplayBuffer(24, space(), compress="zstd")
    with pytest.raises(
        ValueError, match=r"^saved frame_bytes holds \d+ bytes, its frame_size counts \d+ in its rings$"
    ):
        fresh.load_state_dict(state)
    assert fresh.stored == 0 and int(fresh._written.sum()) == 0


def test_an_unknown_codec_is_refused_naming_those_there_are() -> None:
    with pytest.raises(ValueError, match=r"^compress must be None or one of 'zstd', 'lz4', got 'gzip'$"):
        FrameReplayBuffer(24, space(), compress="gzip")


@pytest.mark.parametrize(("compress", "package"), [("zstd", "zstandard"), ("lz4", "lz4.block")])
def test_a_codec_whose_package_is_missing_is_refused_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch, compress: str, package: str
) -> None:
    monkeypatch.setitem(sys.modules, package, None)  # an import of it then raises ImportError
    with pytest.raises(
        ImportError, match=rf'^compress={compress!r} needs the .* package: pip install "copy-correct\[compress\]"$'
    ):
        FrameReplayBuffer(24, space(), compress=compress)


@pytest.mark.parametrize("compress", CODECS)
def test_float_frames_come_back_bit_for_bit(compress: str) -> None:
    """Frames are compressed as their bytes, whatever their dtype."""
    shape, rng = (STACK, 5, 6), np.random.default_rng(0)
    buffers = [FrameReplayBuffer(64, gym.spaces.Box(-1, 1, shape, np.float32), compress=c) for c in (None, compress)]
    obs = np.repeat(rng.random((1, *shape[1:]), dtype=np.float32), STACK, 0)
    for t in range(200):
        nxt = np.concatenate([obs[1:], rng.random((1, *shape[1:]), dtype=np.float32)])
        done = t % 17 == 16
        for buffer in buffers:
            buffer.add(obs, 0, 1.0, nxt, done)
        obs = np.repeat(nxt[-1:], STACK, 0) if done else nxt
    plain, packed = (b.sample(100, torch.Generator().manual_seed(0)) for b in buffers)
    assert packed["obs"].dtype == torch.float32 and all(torch.equal(plain[k], packed[k]) for k in plain)


def stacks(steps: int, seed: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``(obs, next_obs)`` of one env's episode of ``steps`` steps, frames of random bytes, padded as at a reset."""
    rng = np.random.default_rng(seed)
    obs = np.repeat(rng.integers(0, 256, (1, *FRAME), dtype=np.uint8), STACK, 0)
    for _ in range(steps):
        nxt = np.concatenate([obs[1:], rng.integers(0, 256, (1, *FRAME), dtype=np.uint8)])
        yield obs, nxt
        obs = nxt


def test_frames_wait_uncompressed_until_the_next_read_or_until_a_put_makes_64_wait() -> None:
    """Counted by ``nbytes`` while they wait (the newest once: it is also the stream's ``newest``)."""
    frames = FrameReplayBuffer(1000, space(), compress="zstd")
    store, steps = frames._store, stacks(200)
    for obs, nxt in itertools.islice(steps, 10):
        frames.add(obs, 0, 0.0, nxt, False)
    assert len(store._pending) == 11 and store._blocks == []  # the first add wrote obs's frame too
    assert store.nbytes == store.address.nbytes + store.size.nbytes + 11 * store.frame_bytes
    frames.sample(8, torch.Generator().manual_seed(0))
    assert store._pending == [] and len(store._blocks) >= 1
    assert (
        store.nbytes == len(store._blocks) * store.block + store.address.nbytes + store.size.nbytes + store.frame_bytes
    )
    for obs, nxt in itertools.islice(steps, frame_store.PENDING - 1):
        frames.add(obs, 0, 0.0, nxt, False)
    assert len(store._pending) == frame_store.PENDING - 1
    obs, nxt = next(steps)
    frames.add(obs, 0, 0.0, nxt, False)
    assert store._pending == []


class Reversed(frame_store.CompressedFrames):
    """Compresses the frames waiting newest first."""

    def flush(self) -> None:
        self._pending.reverse()
        super().flush()


@pytest.mark.parametrize("kind", ["waiting", "the control: reversed"])
def test_frames_compressed_late_lie_where_frames_compressed_at_their_put_lie(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same addresses and sizes (and so the same blocks taken) as a buffer that compresses each frame at its put
    (``PENDING = 1``), rings wrapped, a sample every 4 adds, then every 100 (past 64 waiting); the same saved bytes.
    The control compresses the frames waiting out of order."""

    def fill(pending: int, kind: type[frame_store.CompressedFrames]) -> FrameReplayBuffer:
        monkeypatch.setattr(frame_store, "PENDING", pending)
        monkeypatch.setattr(frame_replay, "CompressedFrames", kind)
        frames, generator = FrameReplayBuffer(120, space(), compress="zstd"), torch.Generator().manual_seed(0)
        for t, (obs, nxt) in enumerate(stacks(1000)):
            frames.add(obs, 0, 0.0, nxt, False)
            if (t % 4 == 3 and t < 500) or t % 100 == 99:
                frames.sample(8, generator)
        frames._store.flush()
        return frames

    eager = fill(1, frame_store.CompressedFrames)
    late = fill(64, frame_store.CompressedFrames if kind == "waiting" else Reversed)
    same = [
        np.array_equal(eager._store.address, late._store.address),
        np.array_equal(eager._store.size, late._store.size),
        len(eager._store._blocks) == len(late._store._blocks),
    ]
    assert torch.equal(eager.state_dict()["frame_bytes"], late.state_dict()["frame_bytes"])
    assert all(same) if kind == "waiting" else not all(same)


def test_with_sample_ahead_its_thread_compresses_the_frames_added_since_the_draw_before() -> None:
    frames, compressed_on = FrameReplayBuffer(1000, space(), compress="zstd"), []
    codec = frames._store.codec

    def compress(data: bytes) -> bytes:
        compressed_on.append(threading.current_thread().name)
        return codec.compress(data)

    frames._store.codec = dataclasses.replace(codec, compress=compress)
    steps = stacks(200)
    for obs, nxt in itertools.islice(steps, 10):
        frames.add(obs, 0, 0.0, nxt, False)
    with SampleAhead(frames, 8, generator=torch.Generator().manual_seed(0)) as ahead:
        ahead.sample()  # batches 0 and 1, drawn in turn on the thread: the first compresses the 11 frames
        for obs, nxt in itertools.islice(steps, 4):
            ahead.add(obs, 0, 0.0, nxt, False)
        ahead.sample()  # batch 1, and the draw of batch 2, which compresses the 4 frames
        ahead.wait()
    assert len(compressed_on) == 15 and all(name.startswith("SampleAhead") for name in compressed_on)
    obs, nxt = next(steps)
    frames.add(obs, 0, 0.0, nxt, False)
    frames.sample(8, torch.Generator().manual_seed(0))  # the control: sampled by the loop, the loop compresses
    assert compressed_on[-1] == threading.main_thread().name
