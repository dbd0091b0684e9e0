"""ReplayBuffer: writes outside autograd and without allocation, independent samples, gymnasium spaces and dtypes,
vectorised adds, one-line errors that leave the buffer as it was, state round trip. Controls: the old write
(``copy_`` of a tensor that requires grad), a deque of tensors, stable-baselines3's ``np.array`` copy, float32 frames.
"""

from __future__ import annotations

import tracemalloc
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch
from torch import nn

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
    vectors = ReplayBuffer(8, FRAME, obs_dtype=np.uint8, num_envs=2)
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, "complex64", "no such dtype", np.uint16])
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
    """What CartPole, an Atari frame stack and a continuous-action loop pass is written without ``_checked``;
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
    monkeypatch.setattr(ReplayBuffer, "_checked", lambda *args: pytest.fail("converted"))
    for buffer, values in zip(fast, inputs, strict=True):
        buffer.add(*values)
    for a, b in zip(fast, slow, strict=True):
        assert same(snapshot(a), snapshot(b))


@pytest.mark.parametrize("device", DEVICES)
def test_vectorised_adds_write_num_envs_rows_wrap_around_and_raise_the_version_once(device: str) -> None:
    envs = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")] * 3)
    buffer = ReplayBuffer(7, envs.single_observation_space, envs.single_action_space, num_envs=3, device=device)
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
    field without ``_checked``; the bytes, position and version are those of the general path (the control: a
    capacity that is not a multiple of N, or a position made unaligned by a loaded state, takes the general path)."""
    rng = np.random.default_rng(0)
    steps = [(rng.integers(0, 256, (2, *FRAME), dtype=np.uint8), rng.integers(0, 4, 2), rng.random(2),
              rng.integers(0, 256, (2, *FRAME), dtype=np.uint8), rng.random(2) < 0.5, np.zeros(2, bool))
             for _ in range(5)]  # fmt: skip
    general = ReplayBuffer(8, FRAME, obs_dtype=np.uint8, num_envs=2)
    for step in steps:
        general.add(*step)
    rows = ReplayBuffer(8, FRAME, obs_dtype=np.uint8, num_envs=2)
    assert rows._rows is not None and ReplayBuffer(7, FRAME, num_envs=2)._rows is None
    views = zip(rows._rows.arrays, rows._fields, strict=True)
    assert all(np.shares_memory(view, field.writer) for view, field in views)
    with monkeypatch.context() as patch:
        patch.setattr(ReplayBuffer, "_checked", lambda *args: pytest.fail("converted"))
        for step in steps:
            version = rows.obs._version
            rows.add(*step)
            assert rows.obs._version == version + 1
    assert same(snapshot(rows), snapshot(general))

    unaligned = ReplayBuffer(8, FRAME, obs_dtype=np.uint8, num_envs=2)
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
        {"obs": FRAME, "obs_dtype": np.uint8, "num_envs": 3}, {"obs": np.zeros((3, *FRAME), np.float32)},
        r"^obs has dtype float32, the buffer stores uint8: a float would be truncated"),
    "vector add, one row short": (
        {"num_envs": 3}, {"reward": np.zeros(2)},
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
