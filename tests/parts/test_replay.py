"""ReplayBuffer: writes outside autograd and without allocation, independent samples, gymnasium spaces and dtypes,
vectorised adds, one-line errors that leave the buffer as it was, state round trip; a gymnasium vector env in each
autoreset mode stores every real transition and no reset step, also across a saved state. Controls: the old write
(``copy_`` of a tensor that requires grad), a deque of tensors, stable-baselines3's ``np.array`` copy, float32 frames,
a buffer that writes every row of a vector step (or is told another mode), a loop without the final observations.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.vector import AutoresetMode
from torch import nn

import copy_correct.replay.writes as _replay_writes
from copy_correct import ReplayBuffer
from copy_correct.probes import CopyAudit, MemoryProbe, shares_storage, storage_key
from tests.conftest import CUDA, DEVICES

FIELDS = ("obs", "action", "reward", "next_obs", "terminated", "truncated")
FRAME = (4, 84, 84)


def transition(i: int) -> tuple:
    """What a CartPole loop passes: float32 arrays, a Python int, a Python float, Python bools."""
    obs = np.full(4, i, dtype=np.float32)
    return obs, i % 2, float(i), obs + 1, i % 5 == 4, False


def snapshot(buffer: ReplayBuffer) -> dict[str, Any]:
    return {
        **{name: getattr(buffer, name).clone() for name in FIELDS},
        "pos": buffer.pos, "size": buffer.size, "version": buffer.obs._version,
    }  # fmt: skip


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


class Actor(nn.Module):
    """A DDPG actor: its action requires grad, and its graph saves the observation and the tanh output."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.net(obs))


@pytest.mark.parametrize("device", DEVICES)
def test_add_writes_in_place_without_allocating(device: str) -> None:
    buffer = ReplayBuffer(8, (4,), device=device)
    storage = {name: storage_key(getattr(buffer, name)) for name in FIELDS}
    buffer.add(*transition(0))
    with CopyAudit() as audit, MemoryProbe(device) as memory:
        for i in range(1, 6):
            buffer.add(*transition(i))
    assert audit.bytes_allocated == 0 and memory.peak_bytes == 0, audit.summary()
    # What the probes can see: on CUDA the writes are torch's copy_ and fill_; on the CPU they are numpy's, which
    # no torch probe sees (test_numpy_writes_allocate_nothing_tracemalloc_sees... measures those).
    assert (audit.count(kind="write") > 0) == (device != "cpu"), audit.summary()
    assert storage == {name: storage_key(getattr(buffer, name)) for name in FIELDS}
    obs = transition(3)[0]
    obs[:] = -1  # the caller reuses its array: the buffer kept a copy, not the array
    assert buffer.obs[3].tolist() == [3.0] * 4


def test_the_control_list_of_tensors_allocates_per_transition() -> None:
    kept: list[torch.Tensor] = []
    with MemoryProbe("cpu") as memory:
        for i in range(5):
            kept.append(torch.tensor(transition(i)[0]).clone())  # the usual deque-of-tensors buffer
    assert memory.net_bytes == 5 * 16


def test_numpy_writes_allocate_nothing_tracemalloc_sees_and_sb3s_copy_does() -> None:
    """On the CPU the probes are blind to numpy, so this measures with ``tracemalloc``, which numpy reports its array
    memory to. The control is stable-baselines3's ``ReplayBuffer.add``: ``self.observations[pos] = np.array(obs)``."""
    frame = np.full(FRAME, 7, dtype=np.uint8)
    buffer = ReplayBuffer(8, FRAME, obs_dtype=np.uint8)
    vectors = ReplayBuffer(8, FRAME, obs_dtype=np.uint8, num_envs=2, autoreset_mode="disabled")
    frames, as_tensor, action = np.stack([frame, frame]), torch.from_numpy(frame), torch.tensor(1)
    actions, rewards, flags = np.array([1, 2]), np.array([1.0, 0.5]), np.zeros(2, dtype=bool)
    sb3 = np.zeros((8, *FRAME), dtype=np.uint8)
    tracemalloc.start()
    try:
        for _ in range(6):  # the environment loop's own types, tensors (converted), a vector env's batch
            buffer.add(frame, 1, 1.0, frame, False, False)
            buffer.add(as_tensor, action, 1.0, as_tensor, False, False)
            vectors.add(frames, actions, rewards, frames, flags, flags)
        ours = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        for i in range(6):
            sb3[i] = np.array(frame)
        control = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert ours < frame.nbytes // 4, ours  # small Python objects (about 2 KB), never a frame (28 KB)
    assert control >= frame.nbytes, control


@pytest.mark.parametrize("device", DEVICES)
def test_samples_are_independent_of_the_buffer(device: str) -> None:
    buffer = ReplayBuffer(16, (4,), device=device)
    for i in range(10):
        buffer.add(*transition(i))
    batch = buffer.sample(32, generator=torch.Generator().manual_seed(0))
    assert set(batch) == set(FIELDS)
    assert batch["obs"].shape == (32, 4) and batch["action"].dtype == torch.int64
    assert all(batch[name].device.type == torch.device(device).type for name in batch)
    assert all(not shares_storage(batch[name], getattr(buffer, name)) for name in batch)
    before = buffer.obs.clone()
    batch["obs"].mul_(0)  # training normalises in place...
    assert torch.equal(buffer.obs, before)  # ...and the experience is untouched
    assert torch.equal(batch["next_obs"][:, 0], batch["reward"] + 1)  # rows stay consistent


@pytest.mark.parametrize("threads", [1, 2])
def test_each_field_is_gathered_with_the_same_index_into_numpy_memory(
    threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A frame batch of 32 is 903 KB: with more than one torch thread ``index_select`` copies it, otherwise numpy's
    ``take`` does, as it does the small fields. Either way the rows are the ones the generator drew, for every field,
    in numpy memory: MemoryProbe sees only the index, ``tracemalloc`` sees the batch."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    buffer = ReplayBuffer(64, FRAME, obs_dtype=np.uint8)
    rng = np.random.default_rng(0)
    for i in range(64):
        obs, next_obs = rng.integers(0, 256, (2, *FRAME), dtype=np.uint8)
        buffer.add(obs, i % 6, float(i), next_obs, i % 7 == 0, i % 5 == 0)
    with CopyAudit() as audit, MemoryProbe("cpu") as memory:
        buffer.sample(32, generator=torch.Generator().manual_seed(3))
    tracemalloc.start()
    try:
        batch = buffer.sample(32, generator=torch.Generator().manual_seed(3))
        numpy_bytes = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    index = torch.randint(64, (32,), generator=torch.Generator().manual_seed(3))
    for name in FIELDS:
        assert torch.equal(batch[name], getattr(buffer, name)[index]), name
        assert not shares_storage(batch[name], getattr(buffer, name)), name
    assert memory.peak_bytes == 32 * 8, memory.report()  # the index (32 int64), nothing of the batch
    assert numpy_bytes >= 2 * 32 * int(np.prod(FRAME)), numpy_bytes
    assert audit.count("index_select") == (2 if threads > 1 else 0), audit.summary()  # obs and next_obs


@pytest.mark.parametrize("device", DEVICES)
def test_an_action_that_requires_grad_is_stored_without_its_graph(device: str) -> None:
    """The issue's repro: a DDPG actor's output. Control: the old write, ``slot.copy_(action)``, stores the graph
    (``CopySlices``) and a loss on the stored actions trains the actor."""
    actor = Actor().to(device)
    buffer = ReplayBuffer(10, (4,), (1,), action_dtype=torch.float32, device=device)
    obs = torch.randn(4, device=device)
    action = actor(obs)
    assert action.requires_grad
    buffer.add(obs, action, 0.0, obs, False)
    assert buffer.action.grad_fn is None and not buffer.action.requires_grad
    assert torch.equal(buffer.action[0], action.detach())
    batch = buffer.sample(4)
    assert not batch["action"].requires_grad
    critic = nn.Linear(5, 1).to(device)
    critic(torch.cat([batch["obs"], batch["action"]], dim=1)).sum().backward()
    assert actor.net.weight.grad is None  # no gradient reaches the actor through the buffer

    old = torch.zeros(10, 1, device=device)  # the control: the old ReplayBuffer's write
    old[0].copy_(action)
    assert type(old.grad_fn).__name__ == "CopySlices"
    old.sum().backward()
    assert actor.net.weight.grad is not None


@pytest.mark.parametrize("device", DEVICES)
def test_5000_adds_of_an_action_that_requires_grad_keep_nothing_alive(device: str) -> None:
    actor = Actor().to(device)
    buffer = ReplayBuffer(5000, (4,), (1,), action_dtype=torch.float32, device=device)
    old = torch.zeros(5000, 1, device=device)  # the control's storage: the old buffer's action tensor

    def ours_step() -> None:
        obs = torch.randn(4, device=device)
        buffer.add(obs, actor(obs), 1.0, obs, False)

    def old_step(i: int) -> None:
        obs = torch.randn(4, device=device)
        old[i].copy_(actor(obs))  # each step's graph hangs off the storage, chained through CopySlices

    ours_step()  # the first call may set up what the loop's calls reuse
    with MemoryProbe(device) as ours:
        for _ in range(5000):
            ours_step()
    with MemoryProbe(device) as control:
        for i in range(5000):
            old_step(i)
    assert ours.net_bytes == 0, ours.report()
    assert control.net_bytes >= 5000 * 4 * 4, control.report()  # at least each step's observation is kept


def test_built_from_gymnasium_spaces_in_their_dtypes() -> None:
    cartpole = gym.make("CartPole-v1")
    buffer = ReplayBuffer(100, cartpole.observation_space, cartpole.action_space)
    assert (buffer.obs.dtype, buffer.obs.shape, buffer.action.dtype, buffer.action.shape) == (
        torch.float32, (100, 4), torch.int64, (100,)
    )  # fmt: skip
    obs, _ = cartpole.reset(seed=0)
    for _ in range(5):  # the environment's own values, as a loop passes them
        action = int(cartpole.action_space.sample())
        next_obs, reward, terminated, truncated, _ = cartpole.step(action)
        buffer.add(obs, action, reward, next_obs, terminated, truncated)
        obs = next_obs
    assert torch.equal(buffer.next_obs[4], torch.from_numpy(obs))

    frames = gym.spaces.Box(0, 255, FRAME, np.uint8)
    steering = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    atari = ReplayBuffer(8, frames, gym.spaces.Discrete(6))
    car = ReplayBuffer(8, gym.spaces.Box(-np.inf, np.inf, (3,), np.float64), steering)
    assert (atari.obs.dtype, atari.obs.shape, atari.action.dtype) == (torch.uint8, (8, *FRAME), torch.int64)
    assert (car.obs.dtype, car.action.dtype, car.action.shape) == (torch.float64, torch.float32, (8, 2))
    frame = frames.sample()
    atari.add(frame, 5, 1.0, frame, False)
    car.add(np.ones(3), steering.sample(), -0.5, np.ones(3), True)
    assert atari.sample(3)["obs"].dtype == torch.uint8  # frames come out as they are stored
    assert np.array_equal(atari.obs[0].numpy(), frame) and car.action[0].dtype == torch.float32


@pytest.mark.parametrize("space", [
    gym.spaces.Dict({"image": gym.spaces.Box(0, 255, (8, 8), np.uint8), "speed": gym.spaces.Discrete(3)}),
    gym.spaces.Tuple((gym.spaces.Discrete(2), gym.spaces.Discrete(3))),
], ids=["Dict", "Tuple"])  # fmt: skip
def test_a_dict_or_tuple_space_is_refused_with_the_way_to_flatten_it(space: gym.Space) -> None:
    refusal = (
        rf"^obs: a {type(space).__name__} space has no single shape and dtype; flatten it first .*FlattenObservation"
    )
    with pytest.raises(TypeError, match=refusal):
        ReplayBuffer(8, space)
    flat = ReplayBuffer(8, gym.spaces.flatten_space(space))  # the space FlattenObservation gives: one Box
    assert flat.obs.shape == (8, gym.spaces.flatdim(space))


@pytest.mark.parametrize("dtype", [np.uint8, np.dtype("uint8"), torch.uint8, "uint8"], ids=str)
def test_dtypes_may_be_numpy_torch_or_strings(dtype: Any) -> None:
    buffer = ReplayBuffer(4, FRAME, obs_dtype=dtype, action_dtype=dtype)
    assert buffer.obs.dtype == buffer.action.dtype == torch.uint8


@pytest.mark.parametrize("dtype", [torch.bfloat16, "complex64", "no such dtype", np.datetime64])
def test_a_dtype_the_buffer_cannot_store_is_a_clear_error(dtype: Any) -> None:
    with pytest.raises(ValueError, match=r"obs dtype .* is not one the buffer stores \(bool, uint8, .*float64\)"):
        ReplayBuffer(4, (4,), obs_dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_uint8_frames_take_one_byte_per_pixel_and_the_float32_control_four(device: str) -> None:
    frames = ReplayBuffer(100, gym.spaces.Box(0, 255, FRAME, np.uint8), device=device)
    control = ReplayBuffer(100, FRAME, obs_dtype=torch.float32, device=device)  # what the old buffer forced
    pixels = 100 * int(np.prod(FRAME))
    assert frames.obs.nbytes == frames.next_obs.nbytes == pixels
    assert control.obs.nbytes == 4 * pixels
    for buffer in (frames, control):  # the block: every field, padded to a multiple of 64 bytes
        assert buffer.nbytes == sum(-(-getattr(buffer, name).nbytes // 64) * 64 for name in FIELDS)
    assert control.nbytes > 3.99 * frames.nbytes
    assert frames.obs.untyped_storage().nbytes() == frames.nbytes  # one block holds every field
    frame = np.arange(np.prod(FRAME), dtype=np.int64).reshape(FRAME).astype(np.uint8)  # every value 0..255
    frames.add(frame, 0, 0.0, frame, False)
    assert np.array_equal(frames.obs[0].cpu().numpy(), frame)  # stored exactly


@pytest.mark.parametrize("device", DEVICES)
def test_tensors_of_any_dtype_that_fits_are_written_as_the_stored_dtype(device: str) -> None:
    buffer = ReplayBuffer(4, (4,), (2,), action_dtype=torch.float32, device=device)
    obs = torch.arange(4, dtype=torch.float64, device=device)  # float64 into float32
    action = torch.tensor([0.5, -0.25], dtype=torch.bfloat16, device=device)  # bfloat16: no numpy twin
    buffer.add(obs, action, np.float64(2.0), obs.to(torch.int32), np.bool_(True), torch.tensor(False))
    assert buffer.obs[0].tolist() == [0.0, 1.0, 2.0, 3.0] and buffer.next_obs[0].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert buffer.action[0].tolist() == [0.5, -0.25] and buffer.reward[0].item() == 2.0
    assert buffer.terminated[0].item() and not buffer.truncated[0].item()


@CUDA
@pytest.mark.gpu
def test_a_cuda_tensor_into_a_cpu_buffer_is_copied_to_the_host() -> None:
    buffer = ReplayBuffer(4, (4,))
    obs = torch.ones(4, device="cuda")
    buffer.add(obs, torch.tensor(1, device="cuda"), 1.0, obs, False)
    assert buffer.obs.device.type == "cpu" and buffer.obs[0].tolist() == [1.0] * 4


def test_the_environment_loops_types_take_the_path_that_converts_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """What CartPole, an Atari frame stack and a continuous-action loop pass is written without ``checked``;
    the bytes stored are the same as through it (np.float64 rewards, numpy ints and bools take that path)."""

    def buffers() -> list[ReplayBuffer]:
        return [
            ReplayBuffer(4, (4,)),
            ReplayBuffer(4, FRAME, obs_dtype="uint8"),
            ReplayBuffer(4, (3,), (2,), action_dtype="float32"),
        ]

    fast, slow = buffers(), buffers()
    rng = np.random.default_rng(0)
    vector, frame, steering = (rng.random(4, dtype=np.float32), rng.integers(0, 256, FRAME, dtype=np.uint8),
                               rng.random(3, dtype=np.float32))  # fmt: skip
    inputs = [
        (vector, 1, 0.5, vector + 1, True, False),
        (frame, 3, -1.0, frame // 2, False, True),
        (steering, rng.random(2, dtype=np.float32), 2.5, steering + 1, False, False),
    ]
    for buffer, (obs, action, reward, next_obs, terminated, truncated) in zip(slow, inputs, strict=True):
        numpy_action = np.int64(action) if isinstance(action, int) else action
        buffer.add(obs, numpy_action, np.float64(reward), next_obs, np.bool_(terminated), np.bool_(truncated))
    monkeypatch.setattr(_replay_writes, "checked", lambda *args: pytest.fail("converted"))
    for buffer, values in zip(fast, inputs, strict=True):
        buffer.add(*values)
    for a, b in zip(fast, slow, strict=True):
        assert same(snapshot(a), snapshot(b))


@pytest.mark.parametrize("device", DEVICES)
def test_vectorised_adds_write_num_envs_rows_wrap_around_and_raise_the_version_once(device: str) -> None:
    envs = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")] * 3)
    buffer = ReplayBuffer(
        7, envs.single_observation_space, envs.single_action_space, num_envs=3, autoreset_mode="disabled", device=device
    )
    obs, _ = envs.reset(seed=0)
    written = []
    for _ in range(3):  # 9 rows into 7: the third add wraps around
        actions = envs.action_space.sample()
        next_obs, rewards, terminations, truncations, _ = envs.step(actions)  # rewards: float64 arrays
        version = buffer.obs._version
        buffer.add(obs, actions, rewards, next_obs, terminations, truncations)
        assert all(getattr(buffer, name)._version == version + 1 for name in FIELDS)
        written.append((obs, actions))
        obs = next_obs
    assert (len(buffer), buffer.pos, buffer.full) == (7, 2, True)
    assert torch.equal(buffer.obs[6].cpu(), torch.from_numpy(written[2][0][0]))  # rows 6, 0, 1 hold the last add
    assert torch.equal(buffer.obs[:2].cpu(), torch.from_numpy(written[2][0][1:]))
    assert torch.equal(buffer.action[2:6].cpu(), torch.from_numpy(np.concatenate([written[0][1][2:], written[1][1]])))
    assert buffer.sample(16)["obs"].shape == (16, 4)


def test_a_vector_step_is_one_row_per_field_when_capacity_is_a_multiple_of_num_envs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A vector env's step as it comes (numpy arrays, float64 rewards) goes into a ``(capacity // N, N)`` view of each
    field without ``checked``; the bytes, position and version are those of the general path (the control: a
    capacity that is not a multiple of N, or a position made unaligned by a loaded state, takes the general path)."""
    rng = np.random.default_rng(0)
    steps = [(rng.integers(0, 256, (2, *FRAME), dtype=np.uint8), rng.integers(0, 4, 2), rng.random(2),
              rng.integers(0, 256, (2, *FRAME), dtype=np.uint8), rng.random(2) < 0.5, np.zeros(2, bool))
             for _ in range(5)]  # fmt: skip
    general = ReplayBuffer(8, FRAME, obs_dtype=np.uint8, num_envs=2, autoreset_mode="disabled")
    for step in steps:
        general.add(*step)
    rows = ReplayBuffer(8, FRAME, obs_dtype=np.uint8, num_envs=2, autoreset_mode="disabled")
    assert rows._rows is not None and ReplayBuffer(7, FRAME, num_envs=2, autoreset_mode="disabled")._rows is None
    views = zip(rows._rows.arrays, rows._fields, strict=True)
    assert all(np.shares_memory(view, field.writer) for view, field in views)
    with monkeypatch.context() as patch:
        patch.setattr(_replay_writes, "checked", lambda *args: pytest.fail("converted"))
        for step in steps:
            version = rows.obs._version
            rows.add(*step)
            assert rows.obs._version == version + 1
    assert same(snapshot(rows), snapshot(general))

    unaligned = ReplayBuffer(8, FRAME, obs_dtype=np.uint8, num_envs=2, autoreset_mode="disabled")
    unaligned.load_state_dict({**general.state_dict(), "pos": 3})
    general.load_state_dict({**general.state_dict(), "pos": 3})
    unaligned.add(*steps[0])  # position 3: rows 3 and 4, across two rows of the view, so the general path
    general.add(*steps[0])
    contents = [{k: v for k, v in snapshot(b).items() if k != "version"} for b in (unaligned, general)]
    assert same(*contents) and unaligned.pos == 5


def test_wraps_around_overwriting_the_oldest() -> None:
    buffer = ReplayBuffer(4, (4,))
    for i in range(6):
        buffer.add(*transition(i))
    assert len(buffer) == 4 and buffer.full and buffer.pos == 2
    assert buffer.reward.tolist() == [4.0, 5.0, 2.0, 3.0]
    assert buffer.terminated.tolist() == [True, False, False, False]


def test_state_round_trip_keeps_experience_and_ring_order(tmp_path: Path) -> None:
    buffer = ReplayBuffer(4, gym.spaces.Box(0, 255, (2, 3), np.uint8))
    for i in range(6):
        frame = np.full((2, 3), 40 * i, dtype=np.uint8)
        buffer.add(frame, i % 2, float(i), frame + 1, i % 5 == 4, False)
    state = buffer.state_dict()
    assert all(shares_storage(state[name], getattr(buffer, name)) for name in FIELDS)  # views, not copies
    torch.save(state, tmp_path / "replay.pt")
    restored = ReplayBuffer(4, gym.spaces.Box(0, 255, (2, 3), np.uint8))
    restored.load_state_dict(torch.load(tmp_path / "replay.pt", weights_only=True))
    assert same(snapshot(restored) | {"version": 0}, snapshot(buffer) | {"version": 0})
    buffer.add(frame, 1, 6.0, frame, False)
    restored.add(frame, 1, 6.0, frame, False)
    assert torch.equal(restored.reward, buffer.reward) and restored.pos == buffer.pos == 3
    with pytest.raises(ValueError, match="does not fit capacity 2"):
        ReplayBuffer(2, (2, 3), obs_dtype=np.uint8).load_state_dict(buffer.state_dict())
    with pytest.raises(ValueError, match=r"saved obs is \(4, 2, 3\) torch.uint8, expected \(4, 2, 3\) torch.float32"):
        ReplayBuffer(4, (2, 3)).load_state_dict(buffer.state_dict())


FRAMES = np.zeros(FRAME, dtype=np.uint8)
BAD_ADDS = {  # case -> (the buffer's arguments, the bad field, the error it raises)
    "reward of shape (1,)": (
        {}, {"reward": np.ones(1, np.float32)}, r"^reward has shape \(1,\), the buffer stores \(\) per transition$"),
    "obs of another shape": ({}, {"obs": np.zeros(3, np.float32)}, r"^obs has shape \(3,\), the buffer stores \(4,\)"),
    "next_obs as a list": ({}, {"next_obs": [0.0] * 4}, r"^next_obs must be a numpy array, a tensor or a number"),
    "a float action": ({}, {"action": 0.5}, r"^action has dtype float, the buffer stores int64: a float would be"),
    "a float array action": (
        {}, {"action": np.array(1.0)}, r"^action has dtype float64, the buffer stores int64: a float would"),
    "a bool reward": ({}, {"reward": True}, r"^reward has dtype bool, the buffer stores float32"),
    "an int terminated": ({}, {"terminated": 1}, r"^terminated has dtype int, the buffer stores bool"),
    "float frames into uint8": (
        {"obs": FRAME, "obs_dtype": np.uint8}, {"obs": FRAMES.astype(np.float32)},
        r"^obs has dtype float32, the buffer stores uint8: a float would be truncated"),
    "int64 frames into uint8": (
        {"obs": FRAME, "obs_dtype": np.uint8}, {"next_obs": FRAMES.astype(np.int64)},
        r"^next_obs has dtype int64, the buffer stores uint8: its values could wrap"),
    "a torch float tensor into uint8": (
        {"obs": FRAME, "obs_dtype": np.uint8}, {"obs": torch.zeros(FRAME)},
        r"^obs has dtype float32, the buffer stores uint8"),
    "action 300 into uint8": ({"action_dtype": "uint8"}, {"action": 300}, r"^action is 300, outside the range of"),
    "action 2**64 into int64": ({}, {"action": 2**64},
                                r"^action is 18446744073709551616, outside the range of the buffer's int64$"),
    "vector add, float frames into uint8": (
        {"obs": FRAME, "obs_dtype": np.uint8, "num_envs": 3, "autoreset_mode": "disabled"},
        {"obs": np.zeros((3, *FRAME), np.float32)},
        r"^obs has dtype float32, the buffer stores uint8: a float would be truncated"),
    "a NaN reward": ({}, {"reward": float("nan")}, r"^reward is nan, the buffer stores finite rewards only$"),
    "an inf numpy reward": ({}, {"reward": np.float32("inf")}, r"^reward is inf, the buffer stores finite rewards"),
    "a float64 1e300 reward": (
        {}, {"reward": 1e300}, r"^reward holds 1e\+300, beyond the largest float32 \(3.40282e\+38\): it would be"),
    "float64 1e300 obs into float32": (
        {}, {"obs": np.full(4, 1e300)}, r"^obs holds 1e\+300, beyond the largest float32 \(3.40282e\+38\): it would"),
    "a float64 tensor 1e300 into float32": (
        {}, {"next_obs": torch.full((4,), -1e300, dtype=torch.float64)},
        r"^next_obs holds -1e\+300, beyond the largest"),
    "int32 70000 into float16 frames": (
        {"obs_dtype": np.float16}, {"obs": np.full(4, 70_000, np.int32)},
        r"^obs holds 70000, beyond the largest float16"),
    "vector add, a NaN among float64 rewards": (
        {"num_envs": 3, "autoreset_mode": "disabled"}, {"reward": np.array([0.0, np.nan, 1.0])}, r"^reward is nan"),
    "vector add, a float32 inf reward": (
        {"num_envs": 3, "autoreset_mode": "disabled"}, {"reward": np.array([0, 0, np.inf], np.float32)},
        r"^reward is inf"),
    "vector add, 1e300 among float64 rewards": (
        {"num_envs": 3, "autoreset_mode": "disabled"}, {"reward": np.array([1e300, 0.0, 0.0])},
        r"^reward holds 1e\+300, beyond the largest float32"),
    "vector add, truncated of 2 envs": (
        {"num_envs": 3, "autoreset_mode": "disabled"}, {"truncated": np.zeros(2, bool)},
        r"^truncated has shape \(2,\), the buffer stores \(\) per transition and 3 per add"),
    "vector add, one row short": (
        {"num_envs": 3, "autoreset_mode": "disabled"}, {"reward": np.zeros(2)},
        r"^reward has shape \(2,\), the buffer stores \(\) per transition and 3 per add: expected \(3,\)$"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_ADDS)
@pytest.mark.parametrize("full", [False, True], ids=["filling", "full"])
def test_a_bad_field_is_a_one_line_error_naming_it_and_nothing_is_written(case: str, full: bool) -> None:
    kwargs, bad, message = BAD_ADDS[case]
    kwargs = {"obs": (4,), **kwargs}
    buffer = ReplayBuffer(3, **kwargs)
    n = kwargs.get("num_envs")
    obs = np.zeros((*([n] if n else []), *buffer.obs_shape), dtype=buffer.obs.numpy().dtype)
    good = {
        "obs": obs + 1, "action": np.ones(n, np.int64) if n else 1, "reward": np.ones(n) if n else 1.0,
        "next_obs": obs + 2, "terminated": np.ones(n, bool) if n else True,
        "truncated": np.zeros(n, bool) if n else False,
    }  # fmt: skip
    for _ in range(3 if full else 1):  # full: the next row is the oldest transition, which must survive
        buffer.add(**good)
    before = snapshot(buffer)
    with pytest.raises((ValueError, TypeError), match=message) as error:
        buffer.add(**{**good, **bad})
    assert "\n" not in str(error.value)
    assert same(snapshot(buffer), before)  # nothing half-written, the position and the version unchanged


@pytest.mark.parametrize(("args", "kwargs", "message"), [
    ((0, (4,)), {}, "capacity must be >= 1"),
    ((2, (4,)), {"num_envs": 3}, "capacity must be >= 1 and >= num_envs, got 2"),
    ((4, (4,)), {"num_envs": 0}, "num_envs must be None or >= 1, got 0"),
    ((4, "4"), {}, "obs must be a gymnasium space or a shape"),
    ((4, (4,), (-1,)), {}, "action must be a gymnasium space or a shape"),
])  # fmt: skip
def test_bad_construction_is_a_clear_error(args: tuple, kwargs: dict, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        ReplayBuffer(*args, **kwargs)


def test_sampling_an_empty_buffer_or_no_rows_is_an_error() -> None:
    buffer = ReplayBuffer(4, (4,))
    with pytest.raises(ValueError, match="empty"):
        buffer.sample(4)
    buffer.add(*transition(0))
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        buffer.sample(0)


# -- vector envs in every autoreset mode ---------------------------------------------------------------------------

MODES = {"next_step": AutoresetMode.NEXT_STEP, "same_step": AutoresetMode.SAME_STEP, "disabled": AutoresetMode.DISABLED}
LENGTHS = (2, 3, 5)  # each env's episode length: episodes end at different steps (envs 0 and 2 at once, at times)


class Steps(gym.Env):
    """An env whose observation says where it is, ``(env, episode, step)``, with episodes of ``LENGTHS[env]`` steps,
    terminated in even envs and truncated in odd ones. The reward is the step reached; the action is ignored."""

    def __init__(self, env: int) -> None:
        self.observation_space = gym.spaces.Box(0, 1000, (3,), np.float32)
        self.action_space = gym.spaces.Discrete(1000)
        self.env, self.episode, self.t = env, -1, 0

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self.episode, self.t = self.episode + 1, 0
        return np.array([self.env, self.episode, 0], np.float32), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        self.t += 1
        end = self.t == LENGTHS[self.env]
        odd = self.env % 2 == 1
        return np.array([self.env, self.episode, self.t], np.float32), float(self.t), end and not odd, end and odd, {}


def vector_steps(mode: str) -> gym.vector.SyncVectorEnv:
    return gym.vector.SyncVectorEnv([lambda env=env: Steps(env) for env in range(3)], autoreset_mode=MODES[mode])


def steps(envs: gym.vector.SyncVectorEnv, count: int, feed: str = "final_obs") -> Iterator[tuple[tuple, dict]]:
    """``count`` steps of ``envs``: each one's ``add`` arguments as the mode's loop passes them (``feed``: the
    manual's loop, ``final_obs=infos.get("final_obs")``; ``"as is"``: ``next_obs`` as the env gave it; ``"cleanrl"``:
    CleanRL's ``dqn.py``, truncated rows of ``next_obs`` replaced by their final observation). The action of env
    ``e`` at step ``s`` is ``100 e + s``. In the disabled mode the loop resets the ended envs by hand."""
    obs, _ = envs.reset(seed=0)
    for step in range(count):
        actions = 100 * np.arange(3) + step
        next_obs, rewards, terminations, truncations, infos = envs.step(actions)
        real_next_obs, kwargs = next_obs, {}
        if feed == "final_obs":
            kwargs = {"final_obs": infos.get("final_obs")}
        elif feed == "cleanrl":
            real_next_obs = next_obs.copy()
            for idx, trunc in enumerate(truncations):
                if trunc:
                    real_next_obs[idx] = infos["final_obs"][idx]
        yield (obs, actions, rewards, real_next_obs, terminations, truncations), kwargs
        if envs.metadata["autoreset_mode"] == AutoresetMode.DISABLED and (done := terminations | truncations).any():
            reset, _ = envs.reset(options={"reset_mask": done})
            next_obs = np.where(done[:, None], reset, next_obs)
        obs = next_obs


def expected(mode: str, count: int) -> list[tuple]:
    """The transitions the envs make in ``count`` steps, in the order a buffer keeps them (step by step, env by env),
    as ``stored`` lists them; in next_step mode each episode's end costs its env a step, the reset step."""
    rows = []
    for step in range(count):
        for env, length in enumerate(LENGTHS):
            episode, t = divmod(step, length + (mode == "next_step"))
            if t < length:
                end = t + 1 == length
                rows.append((env, episode, t, 100 * env + step, t + 1.0, env, episode, t + 1,
                             end and env % 2 == 0, end and env % 2 == 1))  # fmt: skip
    return rows


def stored(buffer: ReplayBuffer) -> list[tuple]:
    """The buffer's rows from the oldest to the newest: obs, action, reward, next_obs, terminated, truncated."""
    order = [*range(buffer.pos, buffer.size), *range(buffer.pos)] if buffer.full else range(buffer.size)
    fields = {name: getattr(buffer, name).cpu() for name in FIELDS}
    return [
        (*map(int, fields["obs"][i].tolist()), int(fields["action"][i]), float(fields["reward"][i]),
         *map(int, fields["next_obs"][i].tolist()), bool(fields["terminated"][i]), bool(fields["truncated"][i]))
        for i in order
    ]  # fmt: skip


def crossing(rows: list[tuple]) -> list[tuple]:
    """The rows that are no step of an env: their next observation is not the next step of the same episode."""
    return [row for row in rows if (row[5], row[6], row[7]) != (row[0], row[1], row[2] + 1)]


@pytest.mark.parametrize("capacity", [39, 40], ids=["capacity-a-multiple-of-3", "capacity-not"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", list(MODES))
def test_a_vector_env_in_each_autoreset_mode_stores_every_real_transition_and_nothing_else(
    mode: str, device: str, capacity: int
) -> None:
    """Three envs whose episodes of 2, 3 and 5 steps end at different steps, 30 steps, in a ring of 39 or 40 rows
    (it wraps): the rows, oldest to newest, are exactly the envs' transitions, in step and env order, with no reset
    step and with each episode's real last transition, terminated or truncated as the env said (a capacity that is
    a multiple of 3 takes a reset-free step as one row per field). The controls are the next test."""
    envs = vector_steps(mode)
    buffer = ReplayBuffer(
        capacity, envs.single_observation_space, envs.single_action_space, num_envs=3,
        autoreset_mode=envs.metadata["autoreset_mode"], device=device,
    )  # fmt: skip
    for args, kwargs in steps(envs, 30):
        buffer.add(*args, **kwargs)
    rows, want = stored(buffer), expected(mode, 30)
    assert len(want) > capacity and buffer.full
    assert rows == want[-capacity:]
    assert crossing(rows) == []
    ends = [row for row in rows if row[8] or row[9]]  # each ending: the step that reaches the episode's length
    assert {row[0] for row in ends if row[8]} == {0, 2} and {row[0] for row in ends if row[9]} == {1}
    assert all(row[7] == LENGTHS[row[0]] for row in ends)


CONTROLS = {  # case -> (the env's mode, the buffer's mode, the loop's feed)
    "next_step, the buffer told disabled": ("next_step", "disabled", "final_obs"),
    "same_step, next_obs as it is": ("same_step", "same_step", "as is"),
    "same_step, CleanRL's truncated rows only": ("same_step", "same_step", "cleanrl"),
    "disabled, the buffer told next_step": ("disabled", "next_step", "final_obs"),
}


@pytest.mark.parametrize("case", list(CONTROLS))
def test_the_controls_store_reset_steps_or_lose_transitions(case: str) -> None:
    """What the loop stores when the buffer does not know the env's mode, or the loop does not pass the real last
    observations: a buffer that writes every row stores each reset step (the last observation to the next episode's
    first, its action ignored); without ``final_obs`` each ending goes in with the next episode's first observation
    (CleanRL's lines fix the truncated ones only); a buffer told next_step drops each new episode's first step."""
    mode, told, feed = CONTROLS[case]
    envs = vector_steps(mode)
    buffer = ReplayBuffer(200, envs.single_observation_space, envs.single_action_space, num_envs=3,
                          autoreset_mode=told)  # fmt: skip
    for args, kwargs in steps(envs, 30, feed):
        buffer.add(*args, **kwargs)
    rows, want = stored(buffer), expected(mode, 30)
    bad, lost = crossing(rows), [row for row in want if row not in rows]
    if mode == "next_step":  # every reset step: (env, episode, last step) -> (env, next episode, 0)
        assert len(rows) == 90 and len(bad) == 90 - len(want) > 20 and lost == []
        assert all((row[5], row[6], row[7]) == (row[0], row[1] + 1, 0) and row[2] == LENGTHS[row[0]] for row in bad)
    elif mode == "same_step":  # each ending, or each terminated one, with the next episode's first observation
        endings = [row for row in want if row[8] or (row[9] and feed == "as is")]
        assert len(bad) == len(lost) == len(endings) > 10 and lost == endings
        assert all((row[5], row[6], row[7]) == (row[0], row[1] + 1, 0) for row in bad)
    else:  # each episode's first step after the first episode: missing, nothing stored in its place
        assert bad == [] and len(lost) > 10 and all(row[2] == 0 and row[1] > 0 for row in lost)
        assert len(rows) == len(want) - len(lost)


def test_a_state_saved_between_an_ending_and_its_reset_step_resumes_skipping_it(tmp_path: Path) -> None:
    """next_step: saved right after the step where envs 0 and 2 both end, before their reset steps; resumed, the
    buffer skips those reset steps and ends with the rows of the uninterrupted one. Control: the same state without
    the envs that ended (``ended`` all false, all a state holds that knows no autoreset) stores both reset steps."""
    envs = vector_steps("next_step")
    space, actions = envs.single_observation_space, envs.single_action_space

    def new() -> ReplayBuffer:
        return ReplayBuffer(60, space, actions, num_envs=3, autoreset_mode="next_step")

    buffer, resumed, control = new(), new(), new()
    run = steps(envs, 16)
    for _ in range(5):  # steps 0-4: env 0 ends at steps 1 and 4, env 2 at step 4
        args, kwargs = next(run)
        buffer.add(*args, **kwargs)
    state = buffer.state_dict()
    assert state["ended"].tolist() == [True, False, True] and state["autoreset_mode"] == "next_step"
    torch.save(state, tmp_path / "replay.pt")
    resumed.load_state_dict(torch.load(tmp_path / "replay.pt", weights_only=True))
    control.load_state_dict({**state, "ended": torch.zeros(3, dtype=torch.bool)})
    for args, kwargs in run:
        for each in (buffer, resumed, control):
            each.add(*args, **kwargs)
    assert stored(resumed) == stored(buffer) == expected("next_step", 16)
    assert [row[:3] for row in crossing(stored(control))] == [(0, 1, 2), (2, 0, 5)]  # the two reset steps
    with pytest.raises(ValueError, match=r"^saved buffer has autoreset_mode='next_step', this one 'disabled'$"):
        ReplayBuffer(60, space, actions, num_envs=3, autoreset_mode="disabled").load_state_dict(state)


def test_skipped_rows_and_final_observations_are_written_without_allocating() -> None:
    """4 envs of 4x84x84 uint8 frames: a next_step add that skips envs 0 and 2 writes envs 1 and 3 from the caller's
    array, and a same_step add writes ``final_obs`` over the rows just written: no frame is allocated on the way
    (``tracemalloc``), each add raises the version once. Control: picking the kept rows first, ``obs[keep]``."""
    frames = np.stack([np.full(FRAME, env, np.uint8) for env in range(4)])
    actions, rewards, no = np.arange(4), np.ones(4), np.zeros(4, bool)
    ends = np.array([True, False, True, False])
    finals = np.array([frames[0] + 10, None, frames[2] + 10, None], dtype=object)
    next_step = ReplayBuffer(16, FRAME, obs_dtype=np.uint8, num_envs=4, autoreset_mode="next_step")
    same_step = ReplayBuffer(16, FRAME, obs_dtype=np.uint8, num_envs=4, autoreset_mode="same_step")
    next_step.add(frames, actions, rewards, frames, ends, no)
    tracemalloc.start()
    try:
        version = next_step.obs._version
        next_step.add(frames, actions, rewards, frames, no, no)  # envs 0 and 2 take their reset steps
        same_step.add(frames, actions, rewards, frames, ends, no, final_obs=finals)
        ours = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        keep = ~ends
        control = np.zeros((16, *FRAME), np.uint8)
        control[4:6] = frames[keep]
        naive = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert ours < frames[0].nbytes // 4, ours
    assert naive >= 2 * frames[0].nbytes, naive
    assert next_step.obs._version == version + 1 and (len(next_step), next_step.pos) == (6, 6)
    assert next_step.obs[4:6, 0, 0, 0].tolist() == [1, 3]  # envs 1 and 3, one after the other
    assert same_step.next_obs[:, 0, 0, 0].tolist()[:4] == [10, 1, 12, 3] and same_step.obs[2, 0, 0, 0] == 2


ONE_PER_ENV = r"final_obs must hold one observation per env \(3\)"
FINALS = {  # case -> (final_obs for envs 0 and 2 ending, of 3, the error)
    "None for an env that ended": (np.array([np.zeros(4), None, None], dtype=object),
                                   r"^final_obs of env 2 is None, but its episode ended: pass this step's final_obs$"),
    "a row of another shape": (np.array([np.zeros(3), None, np.zeros(4)], dtype=object),
                               r"^final_obs of env 0 has shape \(3,\), the buffer stores \(4,\) per transition$"),
    "a row as a list": (np.array([[0.0] * 4, None, np.zeros(4)], dtype=object),
                        r"^final_obs of env 0 must be a numpy array, a tensor or a number, got list$"),
    "two rows for three envs": (np.zeros((2, 4)), rf"^{ONE_PER_ENV}, got ndarray of 2 rows$"),
    "one observation, not one per env": (np.zeros(4), rf"^{ONE_PER_ENV}, got ndarray of 4 rows$"),
    "a number": (0.0, rf"^{ONE_PER_ENV}, got float$"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(FINALS))
def test_a_bad_final_obs_is_a_one_line_error_naming_the_env_and_nothing_is_written(case: str) -> None:
    buffer = ReplayBuffer(4, (4,), num_envs=3, autoreset_mode="next_step")
    obs, flags = np.zeros((3, 4), np.float32), np.zeros(3, bool)
    buffer.add(obs, np.zeros(3, np.int64), np.ones(3), obs, flags, flags)
    before, ended = snapshot(buffer), buffer._ended.copy()
    final_obs, message = FINALS[case]
    ends = np.array([True, False, True])
    with pytest.raises((ValueError, TypeError), match=message) as error:
        buffer.add(obs, np.zeros(3, np.int64), np.ones(3), obs, ends, flags, final_obs=final_obs)
    assert "\n" not in str(error.value)
    assert same(snapshot(buffer), before) and np.array_equal(buffer._ended, ended)
    good = np.array([np.ones(4), None, np.full(4, 2.0)], dtype=object)  # the control: the env's kind is taken
    buffer.add(obs, np.zeros(3, np.int64), np.ones(3), obs, ends, flags, final_obs=good)
    assert buffer.next_obs[[3, 0, 1], 0].tolist() == [1.0, 0.0, 2.0] and buffer._ended.tolist() == [True, False, True]


def test_autoreset_modes_by_any_name_and_a_single_env_reset_by_hand() -> None:
    """The mode as gymnasium's enum or its name in any spelling; a single env is reset by hand; ``final_obs`` with a
    single env is its one last observation, written for an ending only."""
    assert ReplayBuffer(4, (4,), num_envs=2, autoreset_mode="NextStep").autoreset_mode == "next_step"
    assert ReplayBuffer(4, (4,), num_envs=2, autoreset_mode=AutoresetMode.SAME_STEP).autoreset_mode == "same_step"
    assert ReplayBuffer(4, (4,)).autoreset_mode == "disabled"
    with pytest.raises(ValueError, match=r"^autoreset_mode is needed with num_envs: pass envs.metadata"):
        ReplayBuffer(4, (4,), num_envs=2)  # a vector env told nothing would have its reset steps stored
    with pytest.raises(ValueError, match=r"^autoreset_mode must be one of next_step, same_step, disabled"):
        ReplayBuffer(4, (4,), num_envs=2, autoreset_mode="sometimes")
    with pytest.raises(ValueError, match=r"^a single env \(num_envs=None\) is reset by hand: autoreset_mode must be"):
        ReplayBuffer(4, (4,), autoreset_mode="next_step")
    one = ReplayBuffer(4, (4,))
    one.add(*transition(0), final_obs=np.full(4, 9, np.float32))  # not an ending: next_obs is kept
    one.add(*transition(4), final_obs=np.full(4, 9, np.float32))  # an ending (i % 5 == 4)
    assert one.next_obs[:2, 0].tolist() == [1.0, 9.0] and one.terminated[:2].tolist() == [False, True]


def test_values_the_stored_dtype_holds_are_stored_as_given_and_only_rewards_must_be_finite() -> None:
    """float64 observations within float32's range are stored (rounded as numpy rounds them), and NaN or inf
    observations as they are (they were not finite before: nothing overflowed); a reward must be finite."""
    buffer = ReplayBuffer(4, (4,))
    obs = np.array([1.5, -3.4e38, np.nan, np.inf])
    buffer.add(obs, 1, 2.0, torch.tensor([0.1, 2, 3, 4], dtype=torch.float64), False)
    assert buffer.obs[0, :2].tolist() == [1.5, np.float32(-3.4e38)] and buffer.obs[0, 2].isnan()
    assert buffer.obs[0, 3] == float("inf") and buffer.next_obs[0, 0] == np.float32(0.1)
    vector = ReplayBuffer(6, (4,), num_envs=3, autoreset_mode="disabled")
    vector.add(np.zeros((3, 4), np.float32), np.zeros(3, np.int64), np.array([1.0, -2.0, 3.4e38]),
               np.ones((3, 4), np.float32), np.zeros(3, bool))  # fmt: skip
    assert vector.reward[:3].tolist() == [1.0, -2.0, np.float32(3.4e38)]


def test_the_control_numpys_own_cast_stores_1e300_as_inf_with_only_a_warning() -> None:
    """What a write without the check does (stable-baselines3's ``self.rewards[self.pos] = np.array(reward)``): the
    overflow becomes inf, and NaN goes in without a word."""
    rewards = np.zeros(2, np.float32)
    with pytest.warns(RuntimeWarning, match="overflow"):
        rewards[0] = np.float64(1e300)
    rewards[1] = np.nan
    assert np.isinf(rewards[0]) and np.isnan(rewards[1])


def test_a_single_truncated_flag_is_every_envs() -> None:
    buffer = ReplayBuffer(6, (4,), num_envs=3, autoreset_mode="disabled")
    obs, actions, rewards, flags = np.zeros((3, 4), np.float32), np.zeros(3, np.int64), np.ones(3), np.zeros(3, bool)
    buffer.add(obs, actions, rewards, obs, flags)  # truncated's default, False, is each env's
    buffer.add(obs, actions, rewards, obs, flags, True)
    buffer.add(obs, actions, rewards, obs, flags, np.bool_(False))
    assert buffer.truncated.tolist() == [False, False, False, True, True, True] and buffer.pos == 3
    assert buffer.terminated.tolist() == [False] * 6


def test_sample_on_the_cpu_is_the_default_batch_and_a_bad_device_is_refused() -> None:
    buffer = ReplayBuffer(100, (4,))
    for i in range(50):
        buffer.add(*transition(i))
    default = buffer.sample(16, generator=torch.Generator().manual_seed(2))
    on_cpu = buffer.sample(16, generator=torch.Generator().manual_seed(2), device="cpu")
    assert all(on_cpu[k].device.type == "cpu" and torch.equal(on_cpu[k], default[k]) for k in default)
    with pytest.raises(ValueError, match=r"^device must be a torch\.device or a device string"):
        buffer.sample(4, device="gpu0")
