"""``SampleAhead``: the batches of a loop that samples ahead are, bit for bit, those of synchronous ``buffer.sample``
calls at the stated points of a twin buffer fed the same transitions, whatever the thread's timing (draws slowed at
random); the controls, a wrapper whose ``add`` does not wait for the draw in flight and one that draws each batch at
the call that returns it, give other batches. A draw's error reaches the caller; only the thread uses the generator;
no thread outlives ``close()`` or the wrapper; a batch shares nothing with the buffer. Resumed from a checkpoint of its
state (the batch in flight, the generator's) and its buffer's, a run draws the uninterrupted one's batches, bit for bit,
plain, whole-stack or compressed (the control: a state without the batch in flight gives others); the saved batch and a
load share nothing with where they came from (the control: no copies). Pickle and copies are refused in one line (the
controls: the thread's parts do not pickle, a shallow copy shares the thread)."""

from __future__ import annotations

import copy
import gc
import io
import pickle
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

import copy_correct.replay.sample_ahead as sample_ahead
from copy_correct import FrameReplayBuffer, ReplayBuffer, SampleAhead
from copy_correct.replay.base import ReplayBase
from tests.conftest import CUDA

BATCH, EVERY, STEPS, FIRST = 16, 4, 160, 20  # a sample every 4 adds from add 20 on, as dqn_atari.py's cadence
Buffer = ReplayBuffer | FrameReplayBuffer


def transitions(steps: int) -> Iterator[tuple[Any, ...]]:
    """Stacks of 4 small frames continuing their stream, an episode every 13 steps (one truncated in 3)."""
    rng = np.random.default_rng(0)
    stack = np.repeat(rng.integers(0, 256, (1, 6, 6), dtype=np.uint8), 4, axis=0)
    for step in range(steps):
        next_stack = np.concatenate([stack[1:], rng.integers(0, 256, (1, 6, 6), dtype=np.uint8)])
        end = step % 13 == 12
        yield stack, step % 3, float(rng.normal()), next_stack, end and step % 3 != 0, end and step % 3 == 0
        stack = np.repeat(rng.integers(0, 256, (1, 6, 6), dtype=np.uint8), 4, axis=0) if end else next_stack


def frames() -> FrameReplayBuffer:
    return FrameReplayBuffer(400, (4, 6, 6))


def stacks() -> ReplayBuffer:
    return ReplayBuffer(400, (4, 6, 6), obs_dtype=np.uint8)


BUFFERS = pytest.mark.parametrize("make", [frames, stacks], ids=["FrameReplayBuffer", "ReplayBuffer"])


class Slowed:
    """Mixed into a buffer: each draw starts after a pause of 0-3 ms (seeded), so the loop's next ``add`` comes while
    a draw is in flight, at another point of it each time."""

    def sample(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        time.sleep(float(self.pauses.uniform(0, 0.003)))
        return super().sample(*args, **kwargs)  # type: ignore[misc]


def slowed(make: Callable[[], Buffer]) -> Buffer:
    buffer = make()
    buffer.__class__ = type(f"Slowed{type(buffer).__name__}", (Slowed, type(buffer)), {})
    buffer.pauses = np.random.default_rng(1)  # type: ignore[attr-defined]
    return buffer


def loop(ahead: Any) -> list[dict[str, torch.Tensor]]:
    """dqn_atari.py's cadence through ``ahead``: an add each step, a sample every ``EVERY`` steps from ``FIRST``."""
    batches = []
    for step, transition in enumerate(transitions(STEPS)):
        ahead.add(*transition)
        if step >= FIRST and step % EVERY == 0:
            batches.append(ahead.sample())
    return batches


def synchronous(make: Callable[[], Buffer]) -> list[dict[str, torch.Tensor]]:
    """The stated points, on a twin: at call k, batch k (drawn at call k - 1; the first call draws batches 0 and 1)."""
    buffer, generator, pending, batches = make(), torch.Generator().manual_seed(7), None, []
    for step, transition in enumerate(transitions(STEPS)):
        buffer.add(*transition)
        if step >= FIRST and step % EVERY == 0:
            batches.append(pending if pending is not None else buffer.sample(BATCH, generator))
            pending = buffer.sample(BATCH, generator)
    return batches


def same(got: list[dict[str, torch.Tensor]], expected: list[dict[str, torch.Tensor]]) -> bool:
    return len(got) == len(expected) and all(
        sorted(a) == sorted(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
        for a, b in zip(got, expected, strict=True)
    )


class Racing(SampleAhead):
    """The control: ``add`` writes while a draw may be in flight."""

    def add(self, *args: Any, **kwargs: Any) -> None:
        self.buffer.add(*args, **kwargs)


class Fresh(SampleAhead):
    """The control: each batch drawn at the call that returns it, from the buffer as it is then (synchronously)."""

    def sample(self) -> Any:
        return self.buffer.sample(self.batch_size, self.generator)


def ahead(make: Callable[[], Buffer], kind: type[SampleAhead] = SampleAhead) -> SampleAhead:
    return kind(slowed(make), BATCH, generator=torch.Generator().manual_seed(7))


@BUFFERS
def test_the_batches_are_the_synchronous_draws_at_the_stated_points_whatever_the_timing(make: Any) -> None:
    expected = synchronous(make)
    for _ in range(2):  # the pauses, and so where each add finds its draw, differ between runs
        with ahead(make) as sampled:
            assert same(loop(sampled), expected)


@BUFFERS
def test_the_control_an_add_during_a_draw_changes_the_batches(make: Any) -> None:
    with ahead(make, Racing) as racing:
        assert not same(loop(racing), synchronous(make))


@BUFFERS
def test_the_control_a_batch_drawn_at_the_call_that_returns_it_is_another(make: Any) -> None:
    with ahead(make, Fresh) as fresh:
        assert not same(loop(fresh), synchronous(make))


def test_the_generator_is_used_by_the_background_thread_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every draw from the generator (``torch.randint`` inside ``sample``) happens on the thread, from the first
    call on; the control, the synchronous wrapper, draws on the caller's."""
    users: list[str] = []
    randint = torch.randint

    def recording(*args: Any, generator: torch.Generator | None = None, **kwargs: Any) -> torch.Tensor:
        users.append(threading.current_thread().name)
        return randint(*args, generator=generator, **kwargs)

    monkeypatch.setattr(torch, "randint", recording)
    with ahead(frames) as sampled:
        loop(sampled)
    assert users and all(name.startswith("SampleAhead") for name in users), set(users)
    users.clear()
    with ahead(frames, Fresh) as fresh:
        loop(fresh)
    assert users and set(users) == {threading.current_thread().name}


class Failing(FrameReplayBuffer):
    """Its third draw raises."""

    draws = 0

    def sample(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        self.draws += 1
        if self.draws == 3:
            raise ArithmeticError("third draw")
        return super().sample(*args, **kwargs)


def test_a_draws_error_is_raised_by_the_call_for_its_batch_and_the_next_call_draws_anew() -> None:
    buffer, twin = Failing(400, (4, 6, 6)), frames()
    generator = torch.Generator().manual_seed(3)
    with SampleAhead(buffer, BATCH, generator=torch.Generator().manual_seed(3)) as sampled:
        with pytest.raises(ValueError, match="holds no transition"):  # the first call draws now: the buffer is empty
            sampled.sample()
        for transition in transitions(30):
            sampled.add(*transition)
            twin.add(*transition)
        first = sampled.sample()  # draws 2 (returned) and 3 (which fails)
        assert same([first], [twin.sample(BATCH, generator)])
        with pytest.raises(ArithmeticError, match="third draw") as raised:
            sampled.sample()
        assert raised.traceback[-1].name == "sample"  # raised in the thread's frame, handed over as it was
        again = sampled.sample()  # drawn anew, now, as the first call
        assert same([again], [twin.sample(BATCH, generator)])


def sample_ahead_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("SampleAhead")]


def ended(threads: list[threading.Thread]) -> bool:
    for thread in threads:
        thread.join(timeout=10)
    return not any(thread.is_alive() for thread in threads)


def test_close_ends_the_thread_and_a_closed_wrapper_refuses() -> None:
    sampled = ahead(frames)
    loop(sampled)
    threads = sample_ahead_threads()
    assert threads
    sampled.close()
    assert not any(t.is_alive() for t in threads)
    sampled.close()  # again: nothing
    with pytest.raises(RuntimeError, match="closed"):
        sampled.sample()
    with pytest.raises(RuntimeError, match="closed"):
        sampled.add(*next(transitions(1)))


class Naive:
    """The control: a thread of its own that holds the wrapper (a bound method), so nothing ever collects it."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        threading.Thread(target=self.serve, name="SampleAhead-naive", daemon=True).start()

    def serve(self) -> None:
        self.stop.wait()


def test_an_unclosed_wrapper_garbage_collected_ends_its_thread_and_the_control_keeps_its_own() -> None:
    before = set(sample_ahead_threads())
    sampled = ahead(frames)
    loop(sampled)  # a draw is in flight
    threads = [t for t in sample_ahead_threads() if t not in before]
    assert threads
    del sampled
    gc.collect()
    assert ended(threads)
    naive = Naive()
    left = [t for t in sample_ahead_threads() if t not in before]
    stop = naive.stop
    del naive
    gc.collect()
    assert left and all(t.is_alive() for t in left)
    stop.set()
    assert ended(left)


def test_a_batch_shares_nothing_with_the_buffer_and_the_wrapper_keeps_none_it_handed_over() -> None:
    buffer = slowed(stacks)
    with SampleAhead(buffer, BATCH, generator=torch.Generator().manual_seed(7)) as sampled:
        for transition in transitions(40):
            sampled.add(*transition)
        batch = sampled.sample()
        sampled.wait()
        low, high = buffer._base.data_ptr(), buffer._base.data_ptr() + buffer.nbytes
        for name, tensor in batch.items():
            start = tensor.untyped_storage().data_ptr()
            assert start + tensor.untyped_storage().nbytes() <= low or start >= high, name
        # control: a view of the storage is inside it
        assert low <= buffer.obs[:BATCH].untyped_storage().data_ptr() < high
        stored = buffer.obs.clone()
        batch["obs"].zero_()
        assert torch.equal(buffer.obs, stored)
        handed = weakref.ref(batch["obs"])
        del batch
        gc.collect()
        assert handed() is None
        assert sampled._pending is not None  # the control: the batch in flight, which the wrapper holds, is alive
        in_flight = weakref.ref(sampled._pending.result()["obs"])
        gc.collect()
        assert in_flight() is not None


def test_arguments_are_checked_in_one_line() -> None:
    with pytest.raises(TypeError, match=r"generator must be a torch\.Generator of its own .* got NoneType"):
        SampleAhead(frames(), BATCH, generator=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        SampleAhead(frames(), 0, generator=torch.Generator())
    with pytest.raises(ValueError, match="device must be"):
        SampleAhead(frames(), BATCH, generator=torch.Generator(), device="nowhere")


def test_the_device_is_passed_to_every_draw() -> None:
    devices = []

    class Recording(FrameReplayBuffer):
        def sample(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
            devices.append(kwargs.get("device"))
            return super().sample(*args, **kwargs)

    buffer = Recording(400, (4, 6, 6))
    with SampleAhead(buffer, BATCH, generator=torch.Generator(), device="cpu") as sampled:
        for transition in transitions(30):
            sampled.add(*transition)
        sampled.sample()
    assert devices == [torch.device("cpu")] * 2


@pytest.mark.gpu
@CUDA
def test_cuda_batches_are_the_synchronous_draws_and_the_loops_stream_sees_them_whole() -> None:
    """With ``device="cuda"`` the thread's copies go on the default stream, the loop's: work the loop queues after
    ``sample()`` reads the whole batch without a synchronisation of its own (here: a reduction compared on the host)."""
    with SampleAhead(slowed(frames), BATCH, generator=torch.Generator().manual_seed(7), device="cuda") as sampled:
        batches = loop(sampled)
        sums = [int(b["obs"].sum(dtype=torch.int64)) for b in batches]  # queued on the loop's stream
    assert all(b[k].device.type == "cuda" for b in batches for k in b)
    expected = synchronous(frames)
    assert same([{k: v.cpu() for k, v in b.items()} for b in batches], expected)
    assert sums == [int(b["obs"].sum(dtype=torch.int64)) for b in expected]


def compressed() -> FrameReplayBuffer:
    pytest.importorskip("zstandard", reason='the compress extra: pip install "copy-correct[compress]"')
    return FrameReplayBuffer(400, (4, 6, 6), compress="zstd")


def saved(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` through ``torch.save`` and ``torch.load(weights_only=True)``, as a checkpoint takes it."""
    file = io.BytesIO()
    torch.save(state, file)
    file.seek(0)
    return torch.load(file, weights_only=True)


def interrupted(make: Callable[[], Buffer], save_at: int, device: str | None) -> tuple[dict[str, Any], list[Any]]:
    """Run A: the loop's cadence; after step ``save_at``'s add (and sample) the checkpoint, SampleAhead's state then
    the buffer's; the batches A samples after it."""
    buffer = slowed(make)
    checkpoint, after = None, []
    with SampleAhead(buffer, BATCH, generator=torch.Generator().manual_seed(7), device=device) as sampled:
        for step, transition in enumerate(transitions(STEPS)):
            sampled.add(*transition)
            if step >= FIRST and step % EVERY == 0:
                batch = sampled.sample()
                if checkpoint is not None:
                    after.append(batch)
            if step == save_at:
                checkpoint = saved({"ahead": sampled.state_dict(), "buffer": buffer.state_dict()})
    assert checkpoint is not None
    return checkpoint, after


def resumed(make: Callable[[], Buffer], checkpoint: dict[str, Any], save_at: int, device: str | None) -> list[Any]:
    """Run B: a fresh buffer and SampleAhead loaded from ``checkpoint``, then the steps after ``save_at``."""
    buffer, batches = slowed(make), []
    buffer.load_state_dict(checkpoint["buffer"])
    with SampleAhead(buffer, BATCH, generator=torch.Generator(), device=device) as sampled:
        sampled.load_state_dict(checkpoint["ahead"])
        for step, transition in enumerate(transitions(STEPS)):
            if step <= save_at:
                continue
            sampled.add(*transition)  # the first: an add between the save and the resume's first sample
            if step >= FIRST and step % EVERY == 0:
                batches.append(sampled.sample())
    return batches


RESUMED = pytest.mark.parametrize("make", [frames, stacks, compressed], ids=["frames", "stacks", "zstd"])
SAVE_AT = [10, 100, 102]  # before the first sample; right after a sample; after two adds since it


@RESUMED
@pytest.mark.parametrize("device", [None, "cpu"])
@pytest.mark.parametrize("save_at", SAVE_AT)
def test_a_resumed_run_draws_the_batches_of_the_uninterrupted_one_and_the_control_without_the_batch_in_flight_does_not(
    make: Any, device: str | None, save_at: int
) -> None:
    checkpoint, expected = interrupted(make, save_at, device)
    assert (checkpoint["ahead"]["batch"] is None) == (save_at < FIRST)
    assert len(expected) > 10 and same(resumed(make, checkpoint, save_at, device), expected)
    if save_at >= FIRST:  # the control: the buffer and the generator saved, not the batch in flight (as before)
        checkpoint["ahead"]["batch"] = None
        assert not same(resumed(make, checkpoint, save_at, device), expected)


def test_the_saved_batch_is_a_copy_of_the_batch_in_flight_and_a_load_shares_nothing_with_its_state(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The loop may change the handed-over batch in place after a save, and a state may be changed after a load: neither
    reaches the other. The control: states that hold the batches themselves (no copy) see those changes."""
    for copied in (True, False):
        if not copied:
            monkeypatch.setattr(sample_ahead, "map_tensors", lambda fn, batch: batch)
        with ahead(frames) as sampled, SampleAhead(frames(), BATCH, generator=torch.Generator()) as other:
            for transition in transitions(40):
                sampled.add(*transition)
            sampled.sample()
            state = sampled.state_dict()
            kept = state["batch"]["obs"].clone()
            sampled.sample()["obs"].zero_()  # the batch in flight at the save, handed over and changed
            assert torch.equal(state["batch"]["obs"], kept) == copied
            state["batch"]["obs"].copy_(kept)
            sampled.wait()
            other.buffer.load_state_dict(sampled.buffer.state_dict())
            other.load_state_dict(state)
            state["batch"]["obs"].zero_()
            assert torch.equal(other.sample()["obs"], kept) == copied


def test_a_state_of_another_batch_size_or_not_a_state_is_refused_in_one_line_and_nothing_changes() -> None:
    with ahead(frames) as sampled, SampleAhead(frames(), 2 * BATCH, generator=torch.Generator()) as other:
        for transition in transitions(40):
            sampled.add(*transition)
        sampled.sample()
        state = sampled.state_dict()
        before = other.generator.get_state()
        with pytest.raises(
            ValueError, match=rf"^saved SampleAhead drew batches of {BATCH}, this one draws {2 * BATCH}$"
        ):
            other.load_state_dict(state)
        with pytest.raises(ValueError, match=r"^not a SampleAhead state: it lacks generator, batch \(state_dict\(\)"):
            other.load_state_dict({"batch_size": 2 * BATCH})
        assert torch.equal(other.generator.get_state(), before) and other._pending is None


def test_a_failed_draw_in_flight_is_raised_by_state_dict_and_again_by_the_sample_it_was_for() -> None:
    buffer = Failing(400, (4, 6, 6))
    with SampleAhead(buffer, BATCH, generator=torch.Generator().manual_seed(3)) as sampled:
        for transition in transitions(30):
            sampled.add(*transition)
        sampled.sample()
        sampled.sample()  # the draw in flight, the third, fails
        with pytest.raises(ArithmeticError, match="third draw"):
            sampled.state_dict()
        with pytest.raises(ArithmeticError, match="third draw"):
            sampled.sample()
        assert sampled.state_dict()["batch"] is None  # the next call draws anew, as the first: so does a resume


@pytest.mark.parametrize("duplicate", [pickle.dumps, copy.deepcopy], ids=["pickle", "deepcopy"])
def test_pickle_and_deepcopy_are_refused_in_one_line_naming_state_dict_and_the_control_fails_on_the_thread(
    duplicate: Callable[[Any], Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    with SampleAhead(frames(), BATCH, generator=torch.Generator()) as sampled:
        with pytest.raises(TypeError, match=r"^a SampleAhead cannot be pickled or copied \(.*state_dict\(\)[^\n]*$"):
            duplicate(sampled)
        monkeypatch.delattr(SampleAhead, "__reduce_ex__")  # the control: without the refusals, the thread's parts
        monkeypatch.delattr(ReplayBase, "__reduce_ex__")  # (the buffer's comes first)
        with pytest.raises(TypeError, match=r"^cannot pickle '(_queue\.SimpleQueue|_thread\.\w+)' object$"):
            duplicate(sampled)


def test_a_shallow_copy_is_refused_too_and_the_control_shares_the_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """A shallow copy would draw on the same thread, its ``add`` waiting only for its own draws."""
    with ahead(frames) as sampled:
        with pytest.raises(TypeError, match=r"^a SampleAhead cannot be pickled or copied "):
            copy.copy(sampled)
        monkeypatch.delattr(SampleAhead, "__reduce_ex__")
        assert copy.copy(sampled)._pool is sampled._pool


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("save_at", SAVE_AT[1:])
def test_a_resumed_cuda_run_draws_the_batches_of_the_uninterrupted_one(save_at: int) -> None:
    checkpoint, expected = interrupted(frames, save_at, "cuda")
    assert all(t.device.type == "cuda" for t in checkpoint["ahead"]["batch"].values())
    got = resumed(frames, checkpoint, save_at, "cuda")
    assert all(b[k].device.type == "cuda" for b in got for k in b)
    on_host = [[{k: v.cpu() for k, v in b.items()} for b in run] for run in (got, expected)]
    assert same(*on_host)
