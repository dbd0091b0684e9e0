"""ReplayBuffer: in-place ring writes, independent samples, wrap-around, clear errors, state round trip."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from components import CopyAudit, MemoryProbe, ReplayBuffer, shares_storage, storage_key
from tests.conftest import DEVICES


def transition(i: int) -> tuple:
    obs = np.full(4, i, dtype=np.float32)
    return obs, i % 2, float(i), obs + 1, i % 5 == 4, False


@pytest.mark.parametrize("device", DEVICES)
def test_add_writes_in_place_without_allocating(device: str) -> None:
    buffer = ReplayBuffer(8, (4,), device=device)
    storage = {name: storage_key(getattr(buffer, name)) for name in ("obs", "action", "reward")}
    buffer.add(*transition(0))
    with CopyAudit() as audit, MemoryProbe(device) as memory:
        for i in range(1, 6):
            buffer.add(*transition(i))
    assert audit.bytes_allocated == 0 and memory.peak_bytes == 0, audit.summary()
    assert storage == {name: storage_key(getattr(buffer, name)) for name in ("obs", "action", "reward")}
    obs = transition(3)[0]
    obs[:] = -1  # the caller reuses its array: the buffer kept a copy, not the array
    assert buffer.obs[3].tolist() == [3.0] * 4


def test_the_control_list_of_tensors_allocates_per_transition() -> None:
    kept: list[torch.Tensor] = []
    with MemoryProbe("cpu") as memory:
        for i in range(5):
            kept.append(torch.tensor(transition(i)[0]).clone())  # the usual deque-of-tensors buffer
    assert memory.net_bytes == 5 * 16


@pytest.mark.parametrize("device", DEVICES)
def test_samples_are_independent_of_the_buffer(device: str) -> None:
    buffer = ReplayBuffer(16, (4,), device=device)
    for i in range(10):
        buffer.add(*transition(i))
    batch = buffer.sample(32, generator=torch.Generator().manual_seed(0))
    assert set(batch) == {"obs", "action", "reward", "next_obs", "terminated", "truncated"}
    assert batch["obs"].shape == (32, 4) and batch["action"].dtype == torch.int64
    assert all(not shares_storage(batch[name], getattr(buffer, name)) for name in batch)
    before = buffer.obs.clone()
    batch["obs"].mul_(0)  # training normalises in place...
    assert torch.equal(buffer.obs, before)  # ...and the experience is untouched
    assert torch.equal(batch["next_obs"][:, 0], batch["reward"] + 1)  # rows stay consistent


def test_wraps_around_overwriting_the_oldest() -> None:
    buffer = ReplayBuffer(4, (4,))
    for i in range(6):
        buffer.add(*transition(i))
    assert len(buffer) == 4 and buffer.full and buffer.pos == 2
    assert buffer.reward.tolist() == [4.0, 5.0, 2.0, 3.0]
    assert buffer.terminated.tolist() == [True, False, False, False]


def test_state_round_trip_keeps_experience_and_ring_order(tmp_path) -> None:
    buffer = ReplayBuffer(4, (4,))
    for i in range(6):
        buffer.add(*transition(i))
    torch.save(buffer.state_dict(), tmp_path / "replay.pt")
    restored = ReplayBuffer(4, (4,))
    restored.load_state_dict(torch.load(tmp_path / "replay.pt", weights_only=True))
    for name in ("obs", "action", "reward", "next_obs", "terminated", "truncated"):
        assert torch.equal(getattr(restored, name), getattr(buffer, name)), name
    buffer.add(*transition(6))
    restored.add(*transition(6))
    assert torch.equal(restored.reward, buffer.reward) and restored.pos == buffer.pos == 3
    with pytest.raises(ValueError, match="does not fit capacity 2"):
        ReplayBuffer(2, (4,)).load_state_dict(buffer.state_dict())


def test_bad_inputs_are_clear_errors() -> None:
    buffer = ReplayBuffer(4, (4,))
    obs = np.zeros(4, dtype=np.float32)
    with pytest.raises(ValueError, match=r"obs has shape \(3,\), the buffer stores \(4,\)"):
        buffer.add(np.zeros(3, dtype=np.float32), 0, 0.0, obs, False)
    with pytest.raises(ValueError, match="action must be an integer"):
        buffer.add(obs, 0.5, 0.0, obs, False)
    with pytest.raises(TypeError, match="obs must be a numpy array or tensor"):
        buffer.add([0.0] * 4, 0, 0.0, obs, False)
    with pytest.raises(ValueError, match="empty"):
        buffer.sample(4)
    with pytest.raises(ValueError, match="capacity"):
        ReplayBuffer(0, (4,))
    with pytest.raises(ValueError, match="obs_dtype"):
        ReplayBuffer(4, (4,), obs_dtype=torch.int64)
    assert len(buffer) == 0  # nothing half-written
