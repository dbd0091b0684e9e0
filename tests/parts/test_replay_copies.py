"""A replay buffer is neither pickled nor copied: ``pickle``, ``copy.copy`` and ``copy.deepcopy`` of a ``ReplayBuffer``
or a ``FrameReplayBuffer`` (frames as they are, zstd- or lz4-compressed) raise one ``TypeError`` line naming the class
and ``state_dict()``; a new buffer's ``load_state_dict(buffer.state_dict())`` is the copy, which samples what the
original samples and shares no memory with it. The controls, the refusal taken away: a deep copy of a one-env
``ReplayBuffer`` adds into the original's rows, one of a vector env's buffer or of an uncompressed ``FrameReplayBuffer``
(pickled too) adds where its own samples do not read, a shallow copy is the original's rings, and a compressed one fails
on its flush lock and its codec (zstandard's own ``TypeError``: nothing names ``state_dict``)."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from copy_correct import FrameReplayBuffer, ReplayBuffer
from copy_correct.replay.base import ReplayBase

Buffer = ReplayBuffer | FrameReplayBuffer
ENVS = 2


def compressed(codec: str) -> Callable[[], FrameReplayBuffer]:
    def make() -> FrameReplayBuffer:
        pytest.importorskip({"zstd": "zstandard", "lz4": "lz4"}[codec], reason="the compress extra")
        return FrameReplayBuffer(40, (4, 6, 6), compress=codec)

    return make


MAKERS: dict[str, Callable[[], Buffer]] = {
    "ReplayBuffer": lambda: ReplayBuffer(40, (4, 6, 6), obs_dtype=np.uint8),
    "ReplayBuffer-2-envs": lambda: ReplayBuffer(
        40, (4, 6, 6), obs_dtype=np.uint8, num_envs=ENVS, autoreset_mode="same_step"
    ),
    "FrameReplayBuffer": lambda: FrameReplayBuffer(40, (4, 6, 6)),
    "FrameReplayBuffer-zstd": compressed("zstd"),
    "FrameReplayBuffer-lz4": compressed("lz4"),
}
EVERY_BUFFER = pytest.mark.parametrize("kind", MAKERS)
COPIES = {"pickle": lambda b: pickle.loads(pickle.dumps(b)), "copy": copy.copy, "deepcopy": copy.deepcopy}


def steps(buffer: Buffer, seed: int = 0) -> Iterator[tuple[Any, ...]]:
    """Transitions of stacks of 4 frames continuing their stream (one per env of ``buffer``), no episode ending."""
    envs = buffer.num_envs or 1
    rng = np.random.default_rng(seed)
    stack = np.repeat(rng.integers(0, 256, (envs, 1, 6, 6), dtype=np.uint8), 4, axis=1)
    while True:
        following = np.concatenate([stack[:, 1:], rng.integers(0, 256, (envs, 1, 6, 6), dtype=np.uint8)], axis=1)
        if buffer.num_envs is None:
            yield stack[0], int(rng.integers(3)), float(rng.normal()), following[0], False, False
        else:
            no = np.zeros(envs, dtype=np.bool_)
            yield stack, rng.integers(3, size=envs), rng.normal(size=envs), following, no, no
        stack = following


def fed(buffer: Buffer, transitions: Iterator[tuple[Any, ...]], count: int) -> Buffer:
    for _ in range(count):
        buffer.add(*next(transitions))
    return buffer


def same_batches(one: Buffer, two: Buffer) -> bool:
    a, b = (buffer.sample(64, torch.Generator().manual_seed(5)) for buffer in (one, two))
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def memory(buffer: Buffer) -> list[np.ndarray]:
    """Every array, tensor and compressed block the buffer holds, as numpy arrays over the same memory."""
    store = getattr(buffer, "_store", None)
    held = list(vars(buffer).values()) + ([] if store is None else [*vars(store).values(), *store._blocks])
    found = [np.asarray(value) for value in held if isinstance(value, (np.ndarray, memoryview))]
    return found + [value.numpy() for value in held if isinstance(value, torch.Tensor) and value.device.type == "cpu"]


def shared(one: Any, two: Buffer) -> bool:
    ones = memory(one) if isinstance(one, (ReplayBuffer, FrameReplayBuffer)) else [t.numpy() for t in one]
    return any(np.shares_memory(a, b) for a in ones for b in memory(two))


@EVERY_BUFFER
@pytest.mark.parametrize("how", COPIES)
def test_pickle_and_copies_are_refused_in_one_line_naming_the_class_and_state_dict(kind: str, how: str) -> None:
    buffer = fed(MAKERS[kind](), steps(MAKERS[kind]()), 10)
    name = type(buffer).__name__
    message = (
        rf"^a {name} cannot be pickled or copied \(pickle, copy\.copy, copy\.deepcopy\): save its state_dict\(\) and "
        rf"load_state_dict\(\) it into a new {name}$"
    )
    with pytest.raises(TypeError, match=message):
        COPIES[how](buffer)


@EVERY_BUFFER
def test_its_state_loaded_into_a_new_buffer_is_the_copy_sampling_the_same_and_sharing_nothing(kind: str) -> None:
    """The control: the state itself shares the original's memory (not copied, as its docstring says), and the check
    of shared memory sees it."""
    transitions = steps(MAKERS[kind]())
    original = fed(MAKERS[kind](), transitions, 30)
    state = original.state_dict()
    duplicate = MAKERS[kind]()
    duplicate.load_state_dict(state)
    assert not shared(duplicate, original)
    assert shared([v for v in state.values() if isinstance(v, torch.Tensor)], original)
    assert same_batches(original, duplicate)
    for transition in (next(transitions) for _ in range(25)):
        original.add(*transition)
        duplicate.add(*transition)
    assert same_batches(original, duplicate)


def test_the_control_a_deep_copy_of_a_one_env_replay_buffer_adds_into_the_originals_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(ReplayBase, "__reduce_ex__")
    original = MAKERS["ReplayBuffer"]()
    duplicate = copy.deepcopy(original)
    obs, *rest = next(steps(original))
    duplicate.add(obs, *rest)
    assert original.pos == 0 and np.array_equal(original.obs[0].numpy(), obs)


@pytest.mark.parametrize("kind", ["ReplayBuffer-2-envs", "FrameReplayBuffer"])
@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_the_control_a_deep_copy_adds_where_its_own_samples_do_not_read(
    kind: str, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copy and the original, fed the same transitions, sample the same before the copy's first add, and apart
    after it."""
    monkeypatch.delattr(ReplayBase, "__reduce_ex__")
    transitions = steps(MAKERS[kind]())
    original = fed(MAKERS[kind](), transitions, 10)
    duplicate = COPIES[how](original)
    assert same_batches(original, duplicate)
    for transition in (next(transitions) for _ in range(25)):
        original.add(*transition)
        duplicate.add(*transition)
    assert not same_batches(original, duplicate)


@pytest.mark.parametrize("kind", ["ReplayBuffer", "FrameReplayBuffer"])
def test_the_control_a_shallow_copy_holds_the_originals_rings(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(ReplayBase, "__reduce_ex__")
    original = MAKERS[kind]()
    assert shared(copy.copy(original), original)


@pytest.mark.parametrize("codec", ["zstd", "lz4"])
def test_the_control_a_compressed_buffer_fails_on_its_flush_lock_and_its_codec(
    codec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(ReplayBase, "__reduce_ex__")
    buffer = compressed(codec)()
    with pytest.raises(TypeError, match=r"^cannot pickle '_thread\.lock' object$"):
        copy.deepcopy(buffer)
    if codec == "zstd":
        with pytest.raises(TypeError, match=r"^cannot pickle 'zstandard\.\w+\.ZstdCompressor' object$"):
            pickle.dumps(buffer)
    else:
        with pytest.raises((AttributeError, pickle.PicklingError), match=r"local object 'codec\.<locals>\.<lambda>'"):
            pickle.dumps(buffer)
