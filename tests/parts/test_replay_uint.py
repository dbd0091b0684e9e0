"""uint16, uint32 and uint64 observations and actions (issue 43), stored as stable-baselines3 stores them: in their
dtype, a batch in that dtype too (``torch.uint16``...). Proven on every path ``ReplayBuffer`` has (the CPU's fast and
checked ``add``s, tensor inputs, a vector step, both CPU gathers, the staging of a CUDA batch, ``state_dict`` through
``torch.save``, the torch writes of a buffer off the CPU) and for ``FrameReplayBuffer``'s frames, on torch 2.10 as on
the newest (``tools/versions/run.sh``). What a uint field cannot hold is refused in one line, and nothing is written.

Controls: the values used are ones the signed dtype of the same width would change; torch's own gather of a one-number
uint field and torch's own write of a uint64 number beyond int64, each raising on a torch without the kernel or the
conversion (2.10-2.13; where a torch has them, the control is the same values); numpy's cast, which would store a
refused value wrapped; a CPU batch, which asks for no staging.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import pairwise
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch

import copy_correct.replay.buffer as replay
import copy_correct.replay.writes as _replay_writes
from copy_correct import FrameReplayBuffer, ReplayBuffer
from copy_correct.probes import CopyAudit
from copy_correct.replay.fields import TORCH_OF
from tests.conftest import CUDA, DEVICES
from tests.parts.test_replay_sample_device import Staging

UINTS = [pytest.param(np.dtype(d), id=np.dtype(d).name) for d in (np.uint16, np.uint32, np.uint64)]
FIELDS = ("obs", "action", "reward", "next_obs", "terminated", "truncated")


def highest(dtype: np.dtype) -> int:
    return int(np.iinfo(dtype).max)


def rows(dtype: np.dtype) -> np.ndarray:
    """Observations of 3 numbers: the largest, one past the signed dtype's largest (``2**15`` for uint16), 0..."""
    top, half = highest(dtype), highest(dtype) // 2 + 1
    return np.array([[top, top - 1, 0], [half, 1, top], [7, 200, 255], [top, 0, half]], dtype=dtype)


def actions(dtype: np.dtype) -> list[int]:
    return [highest(dtype), highest(dtype) // 2 + 1, 5, highest(dtype) - 1]


def uint_buffer(dtype: np.dtype, device: str = "cpu", **kwargs: Any) -> ReplayBuffer:
    """A buffer of uint observations (3 numbers) and one uint action per transition, from gymnasium spaces."""
    top = highest(dtype)
    return ReplayBuffer(8, gym.spaces.Box(0, top, (3,), dtype), gym.spaces.Box(0, top, (), dtype), device=device,
                        **kwargs)  # fmt: skip


def filled(dtype: np.dtype, device: str = "cpu") -> ReplayBuffer:
    """``rows`` and ``actions`` written four ways: as an env loop has them (numpy in the stored dtype, a Python int:
    the CPU's fast path), as tensors of the stored dtype with a numpy scalar action, as narrower numpy values (uint8),
    and with a 0-d tensor action."""
    buffer, obs, acts = uint_buffer(dtype, device), rows(dtype), actions(dtype)
    on = torch.device(device)
    buffer.add(obs[0], acts[0], 1.0, obs[0], False)
    buffer.add(torch.from_numpy(obs[1]).to(on), dtype.type(acts[1]), 1.0, torch.from_numpy(obs[1]).to(on), False)
    buffer.add(obs[2].astype(np.uint8), np.uint8(acts[2]), 1.0, obs[2].astype(np.uint8), True)
    action = torch.from_numpy(np.array(acts[3], dtype)).to(on)
    buffer.add(obs[3], action, 1.0, obs[3], False, True)
    return buffer


def force_torch_gather(monkeypatch: pytest.MonkeyPatch) -> None:
    """``sample`` gathers every field it may with torch's ``index_select``, as it does big fields with 2+ threads."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(replay, "_TORCH_GATHER_BYTES", 1)


def drawn(buffer: ReplayBuffer, batch_size: int, seed: int) -> np.ndarray:
    """The rows ``sample`` draws with a generator seeded ``seed``."""
    return torch.randint(len(buffer), (batch_size,), generator=torch.Generator().manual_seed(seed)).numpy()


def lacks(op: Any) -> BaseException | None:
    """What ``op`` raises on this torch (a kernel or a conversion it lacks), or ``None`` where it works."""
    try:
        op()
    except (RuntimeError, NotImplementedError, ValueError) as error:
        return error
    return None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", UINTS)
def test_uint_values_beyond_the_signed_range_are_stored_and_sampled_exactly(
    dtype: np.dtype, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    buffer = filled(dtype, device)
    stored = TORCH_OF[dtype]
    assert buffer.obs.dtype == buffer.next_obs.dtype == buffer.action.dtype == stored
    assert np.array_equal(buffer.obs[:4].cpu().numpy(), rows(dtype))
    assert buffer.action[:4].tolist() == actions(dtype)
    index = drawn(buffer, 64, seed=5)
    by_numpy = buffer.sample(64, generator=torch.Generator().manual_seed(5))
    force_torch_gather(monkeypatch)
    by_torch = buffer.sample(64, generator=torch.Generator().manual_seed(5))
    for batch in (by_numpy, by_torch):
        assert batch["obs"].dtype == batch["action"].dtype == stored  # as stable-baselines3's th.tensor gives them
        assert np.array_equal(batch["obs"].cpu().numpy(), rows(dtype)[index])
        assert np.array_equal(batch["next_obs"].cpu().numpy(), rows(dtype)[index])
        assert batch["action"].tolist() == np.array(actions(dtype), dtype)[index].tolist()
    # The control: these values are not what the signed dtype of the same width (int16 for uint16) would hold.
    assert (rows(dtype).astype(np.dtype(f"int{dtype.itemsize * 8}")) < 0).any()


@pytest.mark.parametrize("dtype", UINTS)
def test_a_vector_step_of_uint_observations_is_one_row_write_and_samples_exactly(dtype: np.dtype) -> None:
    buffer = uint_buffer(dtype, num_envs=2, autoreset_mode="same_step")
    obs, acts = rows(dtype), np.array(actions(dtype), dtype)
    flags = np.zeros(2, np.bool_)
    buffer.add(obs[:2], acts[:2], np.zeros(2, np.float32), obs[2:], flags, flags)
    buffer.add(obs[2:], acts[2:], np.ones(2, np.float32), obs[:2], flags, flags)
    assert np.array_equal(buffer.obs[:4].numpy(), obs)
    assert np.array_equal(buffer.next_obs[:4].numpy(), obs[[2, 3, 0, 1]])
    batch = buffer.sample(16, generator=torch.Generator().manual_seed(1))
    assert np.array_equal(batch["obs"].numpy(), obs[drawn(buffer, 16, seed=1)])


@pytest.mark.parametrize("dtype", UINTS)
def test_a_one_number_uint_field_is_gathered_by_numpy_where_torch_would_gather_its_size(
    dtype: np.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's CPU ``index_select`` has no kernel for a one-dimensional uint16/32/64 tensor before 2.14, so ``sample``
    leaves such a field (one action per transition) to numpy's ``take``; every other field, and every field of the
    other dtypes, goes as before. Control: that field handed to torch raises on a torch without the kernel."""
    buffer = filled(dtype)
    assert [f.torch_gather for f in buffer._fields] == [True, False, True, True, True, True]
    assert all(f.torch_gather for f in ReplayBuffer(8, (), (), obs_dtype=np.uint8, action_dtype=np.int64)._fields)
    force_torch_gather(monkeypatch)
    with CopyAudit() as audit:
        batch = buffer.sample(32, generator=torch.Generator().manual_seed(2))
    assert audit.count("index_select") == 5, audit.summary()  # every field but the action
    expected = np.array(actions(dtype), dtype)[drawn(buffer, 32, seed=2)]
    assert batch["action"].tolist() == expected.tolist()
    buffer._fields = [replace(f, torch_gather=True) for f in buffer._fields]  # the control: torch gathers it too
    missing = lacks(lambda: torch.index_select(buffer.action, 0, torch.zeros(1, dtype=torch.int64)))
    if missing is not None:
        with pytest.raises(type(missing), match=r"not implemented for 'UInt(16|32|64)'"):
            buffer.sample(32, generator=torch.Generator().manual_seed(2))
    else:  # a torch with the kernel (2.14 on): the same batch either way
        assert buffer.sample(32, generator=torch.Generator().manual_seed(2))["action"].tolist() == expected.tolist()


@pytest.mark.parametrize(("dtype", "field", "value", "refusal"), [
    (np.uint16, "obs", np.array([1, 2, 3], np.uint32), "obs has dtype uint32, the buffer stores uint16: its values "
                                                       r"could wrap around \(convert it first\)"),
    (np.uint16, "obs", np.array([1, 2, 3], np.int64), "obs has dtype int64, the buffer stores uint16: its values"),
    (np.uint16, "obs", np.array([1, 2, 3], np.int8), "obs has dtype int8, the buffer stores uint16: its values"),
    (np.uint16, "obs", torch.tensor([1, 2, 3], dtype=torch.int32), "obs has dtype int32, the buffer stores uint16"),
    (np.uint16, "obs", np.ones(3, np.float32), "obs has dtype float32, the buffer stores uint16: a float would be "
                                               "truncated"),
    (np.uint16, "action", np.uint32(70000), "action is 70000, outside the range of the buffer's uint16"),
    (np.uint16, "action", 65536, "action is 65536, outside the range of the buffer's uint16"),
    (np.uint16, "action", -1, "action is -1, outside the range of the buffer's uint16"),
    (np.uint16, "action", np.int64(-1), "action is -1, outside the range of the buffer's uint16"),
    (np.uint32, "obs", np.array([1, 2, 3], np.uint64), "obs has dtype uint64, the buffer stores uint32: its values"),
    (np.uint32, "action", 2**32, "action is 4294967296, outside the range of the buffer's uint32"),
    (np.uint64, "obs", np.array([1, 2, 3], np.int64), "obs has dtype int64, the buffer stores uint64: its values"),
    (np.uint64, "action", 2**64, "action is 18446744073709551616, outside the range of the buffer's uint64"),
    (np.uint64, "action", np.int8(-3), "action is -3, outside the range of the buffer's uint64"),
])  # fmt: skip
def test_what_a_uint_field_cannot_hold_is_refused_in_one_line_and_nothing_is_written(
    dtype: Any, field: str, value: Any, refusal: str
) -> None:
    buffer = filled(np.dtype(dtype))
    before = {name: getattr(buffer, name).clone() for name in FIELDS}, buffer.pos, buffer.size
    given = {"obs": rows(np.dtype(dtype))[0], "action": 1, "reward": 1.0, "next_obs": rows(np.dtype(dtype))[0],
             "terminated": False, field: value}  # fmt: skip
    with pytest.raises(ValueError, match=f"^{refusal}[^\n]*$"):
        buffer.add(**given)
    assert all(torch.equal(getattr(buffer, name), before[0][name]) for name in FIELDS)
    assert (buffer.pos, buffer.size) == before[1:]


def test_control_what_fits_is_stored_and_what_a_cast_would_have_stored() -> None:
    """The refusals are of values, not of every source: each of these fits a uint16 field and is stored as it is.
    What the refused ones would become, cast as numpy casts: wrapped, 70000 as 4464 and -1 as 65535."""
    buffer = uint_buffer(np.dtype(np.uint16))
    obs = np.array([0, 255, 1], np.uint8)
    for action in (np.uint32(65535), 65535, np.int64(3), True, torch.tensor(9, dtype=torch.uint8)):
        buffer.add(obs, action, 1.0, np.array([True, False, True]), False)
    assert buffer.action[:5].tolist() == [65535, 65535, 3, 1, 9]
    assert buffer.obs[0].tolist() == [0, 255, 1] and buffer.next_obs[0].tolist() == [1, 0, 1]
    assert np.array([70000], np.uint32).astype(np.uint16)[0] == 4464
    assert np.array([-1], np.int64).astype(np.uint16)[0] == 65535


@pytest.mark.parametrize("dtype", UINTS)
def test_a_uint_state_round_trips_through_torch_save_and_shares_nothing(dtype: np.dtype, tmp_path: Any) -> None:
    source = filled(dtype)
    torch.save(source.state_dict(), tmp_path / "buffer.pt")
    loaded = uint_buffer(dtype)
    loaded.load_state_dict(torch.load(tmp_path / "buffer.pt", weights_only=True))
    assert all(torch.equal(getattr(loaded, name), getattr(source, name)) for name in FIELDS)
    state = source.state_dict()
    again = uint_buffer(dtype)
    again.load_state_dict(state)
    for _ in range(8):  # the source goes on and overwrites every row
        source.add(np.zeros(3, dtype), 0, 0.0, np.zeros(3, dtype), False)
    assert np.array_equal(again.obs[:4].numpy(), rows(dtype)) and again.action[:4].tolist() == actions(dtype)
    assert not state["obs"].numpy().any()  # the control: the state itself shares the source's rows


def test_a_device_buffers_torch_writes_take_uint64_numbers_beyond_int64() -> None:
    """A buffer off the CPU writes through torch, which before 2.14 takes no Python int beyond int64's range
    (``Overflow when unpacking long``): a uint64 field's number is handed over as a 0-d tensor. Run here through the
    same path on CPU tensors (a buffer on CUDA: the first test, on a GPU). Control: torch's write of the number."""
    buffer = uint_buffer(np.dtype(np.uint64))
    buffer._on_cpu, buffer._add = False, _replay_writes.one_env  # the writes of a buffer off the CPU
    buffer._fields = [replace(f, writer=f.tensor) for f in buffer._fields]
    top, obs = 2**64 - 1, rows(np.dtype(np.uint64))
    buffer.add(obs[0], top, 1.0, obs[0], False)
    buffer.add(torch.from_numpy(obs[1]), np.uint64(top - 1), 1.0, obs[1], False)
    assert buffer.action[:2].tolist() == [top, top - 1] and np.array_equal(buffer.obs[:2].numpy(), obs[:2])
    plain = torch.zeros(1, dtype=torch.uint64)
    missing = lacks(lambda: plain.__setitem__(0, top))
    assert (missing is None and plain.tolist() == [top]) or "Overflow when unpacking long" in str(missing)


def episode_stacks(frames: list[np.ndarray], first: int, last: int) -> list[np.ndarray]:
    """The stacks of 4 ``FrameStackObservation`` gives from frame ``first`` to ``last``, padded with the first."""
    return [np.stack([frames[max(first, t - 3 + i)] for i in range(4)]) for t in range(first, last + 1)]


def uint_frames(dtype: np.dtype) -> list[np.ndarray]:
    return [np.full((2, 2), highest(dtype) - t, dtype) for t in range(12)]


def frame_buffer(dtype: np.dtype) -> tuple[FrameReplayBuffer, set[tuple[bytes, bytes]]]:
    """A ``FrameReplayBuffer`` of two episodes of uint frames beyond the signed range (frames 0-6: 6 transitions, the
    last one terminated; 7-11: 4), and the pairs of stacks the env gave."""
    buffer = FrameReplayBuffer(32, gym.spaces.Box(0, highest(dtype), (4, 2, 2), dtype))
    frames, pairs = uint_frames(dtype), set()
    for first, last in ((0, 6), (7, 11)):
        stacks = episode_stacks(frames, first, last)
        for step, (obs, next_obs) in enumerate(pairwise(stacks)):
            buffer.add(obs, step, 1.0, next_obs, step == len(stacks) - 2, False)
            pairs.add((obs.tobytes(), next_obs.tobytes()))
    return buffer, pairs


def frames_only(dtype: np.dtype) -> FrameReplayBuffer:
    return frame_buffer(dtype)[0]


MAKERS = [pytest.param(filled, id="ReplayBuffer"), pytest.param(frames_only, id="FrameReplayBuffer")]


@pytest.mark.parametrize("make", MAKERS)
@pytest.mark.parametrize("dtype", UINTS)
def test_a_cuda_batch_of_uint_fields_is_staged_with_the_cpu_batchs_values(
    dtype: np.dtype, make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host side of ``sample(..., device="cuda")`` on any machine (``test_replay_sample_device``): every field,
    gathered by numpy or by torch, lands in the staging ``_host_batch`` hands out, with the CPU batch's values."""
    buffer = make(dtype)
    force_torch_gather(monkeypatch)
    on_cpu = buffer.sample(16, generator=torch.Generator().manual_seed(4))
    staging = Staging(monkeypatch)
    buffer.sample(16, generator=torch.Generator().manual_seed(4), device="cuda")
    assert staging.pinned == [True] * 6 and sorted(staging.moved) == sorted(FIELDS)
    staged = {t.untyped_storage().data_ptr() for t in staging.staged}
    for name in FIELDS:
        assert staging.moved[name].untyped_storage().data_ptr() in staged, name
        assert torch.equal(staging.moved[name], on_cpu[name]), name
    staging.pinned.clear()
    buffer.sample(16)  # the control: a CPU batch asks for no staging
    assert not any(staging.pinned)


@CUDA
@pytest.mark.gpu
@pytest.mark.parametrize("make", MAKERS)
@pytest.mark.parametrize("dtype", UINTS)
def test_a_uint_batch_reaches_the_gpu_with_its_values(dtype: np.dtype, make: Any) -> None:
    buffer = make(dtype)
    batch = buffer.sample(16, generator=torch.Generator().manual_seed(6), device="cuda")
    on_cpu = buffer.sample(16, generator=torch.Generator().manual_seed(6))
    for name in FIELDS:
        assert batch[name].device.type == "cuda" and batch[name].dtype == on_cpu[name].dtype, name
        assert torch.equal(batch[name].cpu(), on_cpu[name]), name


@pytest.mark.parametrize("dtype", UINTS)
def test_frame_replay_buffer_stores_uint_frames_and_rebuilds_their_stacks_exactly(dtype: np.dtype) -> None:
    """Frames beyond the signed range, two episodes; every drawn pair of stacks is one the env gave, in the frames'
    dtype, also after a state round trip. Control: a uint8 frame buffer refuses these frames in one line."""
    buffer, pairs = frame_buffer(dtype)
    batch = buffer.sample(64, generator=torch.Generator().manual_seed(0))
    assert batch["obs"].dtype == batch["next_obs"].dtype == TORCH_OF[dtype]
    got = {(o.tobytes(), n.tobytes()) for o, n in zip(batch["obs"].numpy(), batch["next_obs"].numpy(), strict=True)}
    assert got <= pairs and len(got) > 5
    loaded = FrameReplayBuffer(32, gym.spaces.Box(0, highest(dtype), (4, 2, 2), dtype))
    loaded.load_state_dict(buffer.state_dict())
    again = loaded.sample(64, generator=torch.Generator().manual_seed(0))
    assert all(torch.equal(again[name], batch[name]) for name in FIELDS)
    obs, next_obs = episode_stacks(uint_frames(dtype), 0, 1)
    with pytest.raises(ValueError, match=rf"^obs has dtype {dtype.name}, the buffer stores uint8: its values could"):
        FrameReplayBuffer(32, (4, 2, 2)).add(obs, 0, 1.0, next_obs, False)
