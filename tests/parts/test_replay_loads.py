"""A replay state loads only into a buffer it fits as saved: never a ring whose size counts rows no transition wrote,
and never memory shared with the buffer it came from (issue 43's first point)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import copy_correct.replay.buffer as replay
from copy_correct import FrameReplayBuffer, ReplayBuffer


def filled(capacity: int, transitions: int, num_envs: int | None = None) -> ReplayBuffer:
    """A buffer of 1-float observations 1.0, 2.0, ... (one per env and step): no written row holds 0.0."""
    kwargs = {} if num_envs is None else {"num_envs": num_envs, "autoreset_mode": "same_step"}
    buffer = ReplayBuffer(capacity, (1,), **kwargs)
    rows = 1 if num_envs is None else num_envs
    for step in range(transitions):
        obs = np.arange(step * rows + 1, (step + 1) * rows + 1, dtype=np.float32).reshape(-1, 1)
        obs = obs[0] if num_envs is None else obs
        flags = False if num_envs is None else np.zeros(num_envs, bool)
        reward = 0.0 if num_envs is None else np.zeros(num_envs, np.float32)
        action = 0 if num_envs is None else np.zeros(num_envs, np.int64)
        buffer.add(obs, action, reward, obs, flags, flags)
    return buffer


def unwritten_rows(buffer: ReplayBuffer) -> set[int]:
    return {int(i) for i in np.flatnonzero(buffer.obs[: buffer.size, 0] == 0.0)}


def test_a_state_of_a_smaller_ring_is_refused_naming_both_capacities() -> None:
    """The issue's case: 7 transitions through ReplayBuffer(5, (1,)), loaded into ReplayBuffer(10, (1,))."""
    state = filled(5, 7).state_dict()
    larger = ReplayBuffer(10, (1,))
    with pytest.raises(ValueError, match=r"^saved buffer has capacity=5, this one 10$"):
        larger.load_state_dict(state)
    assert (len(larger), larger.pos) == (0, 0)


def test_control_without_the_refusal_the_larger_ring_samples_rows_never_written(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    state = {k: v for k, v in filled(5, 7).state_dict().items() if k not in ("capacity", "num_envs")}
    monkeypatch.setattr(ReplayBuffer, "load_state_dict", _unchecked_load)
    larger = ReplayBuffer(10, (1,))
    larger.load_state_dict(state)
    for value in (8.0, 9.0, 10.0):  # three more adds, as the issue says
        obs = np.array([value], np.float32)
        larger.add(obs, 0, 0.0, obs, False, False)
    assert (len(larger), larger.pos) == (8, 5) and unwritten_rows(larger) == {5, 6, 7}


def _unchecked_load(self: ReplayBuffer, state: dict) -> None:
    """The load before the refusal: rows and counters copied in, whatever capacity they wrapped around."""
    size, pos = int(state["size"]), int(state["pos"])
    for name in replay.FIELDS:
        getattr(self, name)[:size].copy_(state[name])
    self.size, self.pos = size, pos


def test_a_state_saved_without_its_capacity_loads_only_if_it_never_wrapped() -> None:
    unwrapped = {k: v for k, v in filled(8, 3).state_dict().items() if k not in ("capacity", "num_envs")}
    larger = ReplayBuffer(10, (1,))
    larger.load_state_dict(unwrapped)  # rows 0-2 written, the next at 3: in order in any ring that holds them
    obs = np.array([4.0], np.float32)
    larger.add(obs, 0, 0.0, obs, False, False)
    assert larger.obs[:4, 0].tolist() == [1.0, 2.0, 3.0, 4.0] and unwritten_rows(larger) == set()
    wrapped = {k: v for k, v in filled(5, 7).state_dict().items() if k not in ("capacity", "num_envs")}
    with pytest.raises(
        ValueError, match=r"^saved buffer wrapped around a capacity of 5 rows \(pos 2\), this one has 10"
    ):
        ReplayBuffer(10, (1,)).load_state_dict(wrapped)
    same = ReplayBuffer(5, (1,))
    same.load_state_dict(wrapped)
    assert (len(same), same.pos) == (5, 2)


def test_a_state_of_other_envs_is_refused_naming_both() -> None:
    state = filled(8, 2, num_envs=2).state_dict()
    other = ReplayBuffer(8, (1,), num_envs=4, autoreset_mode="same_step")
    with pytest.raises(ValueError, match=r"^saved buffer has num_envs=2, this one 4$"):
        other.load_state_dict(state)


def test_a_state_round_trips_and_shares_nothing_with_the_buffer_it_came_from() -> None:
    source = filled(5, 7)
    loaded = ReplayBuffer(5, (1,))
    loaded.load_state_dict(source.state_dict())
    before = {name: getattr(loaded, name).clone() for name in replay.FIELDS}
    for value in (20.0, 21.0, 22.0):  # the source goes on after the load
        obs = np.array([value], np.float32)
        source.add(obs, 1, 1.0, obs, True, False)
    assert all(torch.equal(getattr(loaded, name), before[name]) for name in replay.FIELDS)
    assert (len(loaded), loaded.pos) == (5, 2)


def test_control_the_state_itself_shares_the_source_rows() -> None:
    """What the load must not keep: ``state_dict()`` hands out the filled rows without a copy (documented), so a
    buffer that kept the state's tensors would change with the source."""
    source = filled(5, 3)
    state = source.state_dict()
    obs = np.array([30.0], np.float32)
    source.add(obs, 0, 0.0, obs, False, False)
    source.add(obs, 0, 0.0, obs, False, False)
    source.add(obs, 0, 0.0, obs, False, False)  # wraps: row 0 is overwritten
    assert state["obs"][0, 0].item() == 30.0


def test_a_frame_buffer_of_another_capacity_or_envs_is_refused_and_a_loaded_one_shares_nothing() -> None:
    def frames(capacity: int, num_envs: int | None = None) -> FrameReplayBuffer:
        kwargs = {} if num_envs is None else {"num_envs": num_envs, "autoreset_mode": "same_step"}
        return FrameReplayBuffer(capacity, (2, 3, 3), **kwargs)

    source = frames(12)
    stack = np.zeros((2, 3, 3), np.uint8)
    for step in range(1, 9):
        next_stack = np.concatenate([stack[1:], np.full((1, 3, 3), step, np.uint8)])
        source.add(stack, 0, 0.0, next_stack, False, False)
        stack = next_stack
    refused = r"^saved frames is \(1, 13, 3, 3\) torch.uint8, this buffer's is \(1, 25, 3, 3\)"
    with pytest.raises(ValueError, match=refused):
        frames(24).load_state_dict(source.state_dict())
    with pytest.raises(ValueError, match=r"^saved \w+ is \(2, .*\) torch\.\w+, this buffer's is \(4, .*\)"):
        frames(24, num_envs=4).load_state_dict(frames(24, num_envs=2).state_dict())
    loaded = frames(12)
    loaded.load_state_dict(source.state_dict())
    generator = torch.Generator().manual_seed(0)
    before = loaded.sample(6, generator=generator)
    source.add(stack, 0, 0.0, np.full((2, 3, 3), 99, np.uint8), False, False)
    again = loaded.sample(6, generator=torch.Generator().manual_seed(0))
    assert all(torch.equal(before[k], again[k]) for k in before) and len(loaded) == 8
