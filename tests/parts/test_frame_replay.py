"""FrameReplayBuffer: every frame stored once per env stream, and every sampled transition, bit for bit, the one a
buffer of whole stacks holds, for real gymnasium vector envs in each autoreset mode, with episodes shorter than the
stack and rings that wrap many times; no stack reaches across an episode start (the control: a frame buffer that
keeps no episode starts builds stacks the env never gave). Bytes per transition measured; the copy contract of
``ReplayBuffer`` (one-line refusals that write nothing, samples that share nothing, writes outside autograd, exact
resume)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.vector import AutoresetMode

import copy_correct.replay.frame_buffer as frame_replay
import copy_correct.replay.frame_writes as _replay_frames
from copy_correct import FrameReplayBuffer, ReplayBuffer

FRAME = (3, 4)  # small frames: the layout is what is proven, not the size
STACK = 4
MODES = {"next_step": AutoresetMode.NEXT_STEP, "same_step": AutoresetMode.SAME_STEP, "disabled": AutoresetMode.DISABLED}


class Frames(gym.Env):
    """Frames that say whose they are: env, episode and step in their first bytes, the rest noise. Episodes end at
    random lengths from 1 step (shorter than the stack) to 12 (or all at ``length``), terminated or truncated at
    random."""

    def __init__(self, env: int, length: int | None = None) -> None:
        self.observation_space = gym.spaces.Box(0, 255, FRAME, np.uint8)
        self.action_space = gym.spaces.Discrete(3)
        self.env, self.episode, self.t, self.length, self.fixed = env, -1, 0, 0, length

    def frame(self) -> np.ndarray:
        pixels = self.np_random.integers(0, 256, FRAME, dtype=np.uint8)
        pixels.flat[:3] = self.env, self.episode % 256, self.t
        return pixels

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self.episode, self.t = self.episode + 1, 0
        self.length = self.fixed or int(self.np_random.integers(1, 13))
        return self.frame(), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        self.t += 1
        done = self.t >= self.length
        cut = bool(self.np_random.random() < 0.5)
        return self.frame(), 0.0, done and not cut, done and cut, {}


def vector_envs(num_envs: int, mode: str, padding: str = "reset") -> gym.vector.SyncVectorEnv:
    return gym.vector.SyncVectorEnv(
        [
            lambda i=i: gym.wrappers.FrameStackObservation(Frames(i), STACK, padding_type=padding)
            for i in range(num_envs)
        ],
        autoreset_mode=MODES[mode],
    )


FEEDS = ("final_obs", "rows replaced", "truncated rows replaced", "as the env gave it")


def play(
    mode: str,
    steps: int,
    capacity: int,
    num_envs: int = 3,
    padding: str = "reset",
    naive: bool = False,
    feed: str = "final_obs",
    kind: type[FrameReplayBuffer] = FrameReplayBuffer,
) -> tuple[FrameReplayBuffer | Any, ReplayBuffer, list[dict[str, torch.Tensor]]]:
    """``steps`` vector steps of random actions into a FrameReplayBuffer and, as the env's loop must handle its
    mode, into a ReplayBuffer of whole stacks that keeps every transition; 256 transitions sampled from the former
    every 20 steps (each time from what its rings hold then). Each stored transition's reward is its number, so a
    sampled one can be found in the other buffer. ``feed``, in ``same_step`` mode: ``final_obs=infos["final_obs"]``,
    ``next_obs`` with every ended row replaced by its final observation, only the truncated ones replaced (CleanRL's
    lines for gymnasium), or ``next_obs`` as the env gave it."""
    envs = vector_envs(num_envs, mode, padding)
    frames = (NaiveFrames if naive else kind)(
        capacity, envs.single_observation_space, envs.single_action_space, num_envs=num_envs,
        autoreset_mode=envs.metadata["autoreset_mode"], padding=padding,
    )  # fmt: skip
    stacks = ReplayBuffer(steps * num_envs, envs.single_observation_space, envs.single_action_space)
    rng = np.random.default_rng(0)
    obs, _ = envs.reset(seed=0)
    ended = np.zeros(num_envs, dtype=bool)
    number, batches, generator = 0, [], torch.Generator().manual_seed(0)
    for step in range(steps):
        actions = rng.integers(0, 3, num_envs)
        next_obs, _, terminated, truncated, infos = envs.step(actions)
        rewards = np.arange(number, number + num_envs, dtype=np.float32)
        number += num_envs
        done = terminated | truncated
        real_next = next_obs.copy()
        if mode == "same_step":
            for i in np.flatnonzero(done):
                real_next[i] = infos["final_obs"][i]
        given, kwargs = next_obs, {}
        if mode == "same_step" and done.any():
            if feed == "final_obs":
                kwargs = {"final_obs": infos["final_obs"]}
            elif feed == "rows replaced":
                given = real_next
            elif feed == "truncated rows replaced":  # CleanRL: `for idx, trunc in enumerate(truncations): ...`
                given = np.where(truncated[:, None, None, None], real_next, next_obs)
        frames.add(obs, actions, rewards, given, terminated, truncated, **kwargs)
        for i in range(num_envs):
            if not (mode == "next_step" and ended[i]):  # a reset step is no transition
                stacks.add(obs[i], actions[i], rewards[i], real_next[i], terminated[i], truncated[i])
        ended = done
        if mode == "disabled" and done.any():
            reset, _ = envs.reset(options={"reset_mask": done})
            next_obs = np.where(done[:, None, None, None], reset, next_obs)
        obs = next_obs
        if step % 20 == 19:
            batches.append(frames.sample(256, generator=generator))
    return frames, stacks, batches


def same_as_stored(batch: dict[str, torch.Tensor], stacks: ReplayBuffer) -> list[int]:
    """The rows of ``batch`` that differ from the whole-stack buffer's transition of the same number."""
    row_of = {float(r): i for i, r in enumerate(stacks.reward[: stacks.size].tolist())}
    wrong = []
    for row, number in enumerate(batch["reward"].tolist()):
        i = row_of[number]
        for field in ("obs", "action", "next_obs", "terminated", "truncated"):
            if not torch.equal(batch[field][row], getattr(stacks, field)[i]):
                wrong.append(row)
                break
    return wrong


@pytest.mark.parametrize("num_envs", [3, 1], ids=["3 envs", "1 env"])  # 1 (and 2): the common step env by env
@pytest.mark.parametrize("padding", ["reset", "zero"])
@pytest.mark.parametrize("mode", list(MODES))
def test_every_sampled_transition_is_the_envs_bit_for_bit_in_every_autoreset_mode(
    mode: str, padding: str, num_envs: int
) -> None:
    steps = 400 if num_envs > 1 else 1000
    _, stacks, batches = play(mode, steps, num_envs * 24, num_envs, padding)  # 24 frames a stream
    batch = {field: torch.cat([b[field] for b in batches]) for field in batches[0]}
    assert same_as_stored(batch, stacks) == []
    assert len(set(batch["reward"].tolist())) > 0.8 * stacks.size  # 20 draws, each of its window, cover most
    # Drawn: episodes' last transitions, cut and ended, and those of episodes shorter than the stack.
    done = batch["terminated"] | batch["truncated"]
    steps = batch["next_obs"][:, -1].flatten(1)[:, 2]  # the step of the episode each next frame was made at
    assert batch["terminated"].any() and batch["truncated"].any() and (done & (steps < STACK - 1)).any()


def test_the_control_a_frame_buffer_without_episode_starts_builds_stacks_the_env_never_gave() -> None:
    frames, stacks, _ = play("same_step", steps=400, capacity=3 * 24, naive=True)
    batch = frames.sample(4096, generator=torch.Generator().manual_seed(0))
    wrong = same_as_stored(batch, stacks)
    assert len(wrong) > 100
    episodes = batch["obs"][wrong][:, :, 0, 1]  # the episode number each stacked frame was made in
    assert (episodes != episodes[:, -1:]).any(dim=1).all()  # each wrong stack mixes two episodes


@pytest.mark.parametrize("feed", ["final_obs", "rows replaced"])
def test_same_step_rows_fed_with_their_final_observations_are_the_envs(feed: str) -> None:
    """CleanRL's way (``next_obs`` with the ended rows replaced before ``add``) and ours (``final_obs``) store the same
    transitions, bit for bit."""
    _, stacks, batches = play("same_step", 300, 3 * 24, feed=feed)
    batch = {field: torch.cat([b[field] for b in batches]) for field in batches[0]}
    assert same_as_stored(batch, stacks) == [] and (batch["terminated"] | batch["truncated"]).any()


@pytest.mark.parametrize("feed", ["as the env gave it", "truncated rows replaced"])
def test_a_same_step_row_ending_on_the_next_episodes_reset_stack_is_refused_naming_final_obs(feed: str) -> None:
    """``final_obs`` forgotten (or, as CleanRL's lines for gymnasium do, only the truncated rows replaced): the first
    ended row whose ``next_obs`` is the next episode's reset stack is refused, and nothing of it is written."""
    with pytest.raises(ValueError, match=r"^next_obs of env \d ends an episode but does not continue obs") as error:
        play("same_step", 300, 3 * 24, feed=feed, kind=WrittenOnlyWhole)
    assert "final_obs=infos['final_obs']" in str(error.value) and "\n" not in str(error.value)
    refused = WrittenOnlyWhole.last
    assert refused.arrays_before == {name: a.tobytes() for name, a in refused._arrays().items()}


class WrittenOnlyWhole(FrameReplayBuffer):
    """Remembers its arrays before each ``add``: the refused one must leave them as they were."""

    last: WrittenOnlyWhole

    def add(self, *args: Any, **kwargs: Any) -> None:
        WrittenOnlyWhole.last = self
        self.arrays_before = {name: a.tobytes() for name, a in self._arrays().items()}
        super().add(*args, **kwargs)


class UncheckedEnds(FrameReplayBuffer):
    """The control: a buffer that does not look at an ended row's ``next_obs``."""

    def add(self, *args: Any, **kwargs: Any) -> None:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(_replay_frames, "check_ends", lambda *args: None)
            super().add(*args, **kwargs)


def test_the_control_without_the_check_the_ended_rows_end_on_the_next_episodes_reset_stack() -> None:
    frames, stacks, _ = play("same_step", 300, 3 * 24, feed="as the env gave it", kind=UncheckedEnds)
    batch = frames.sample(4096, generator=torch.Generator().manual_seed(0))
    wrong = same_as_stored(batch, stacks)
    done = batch["terminated"] | batch["truncated"]
    assert len(wrong) > 100 and wrong == done.nonzero().flatten().tolist()  # every ended row drawn, and only those
    episode = batch["next_obs"][wrong][:, :, 0, 1].long()  # the episode each frame of the stored next stack is from
    assert (episode[:, -1] == batch["obs"][wrong][:, -1, 0, 1].long() + 1).all()  # its newest: the next episode's
    assert (episode[:, -1:] != episode[:, :-1]).any(dim=1).all()  # a stack across two episodes, which no env gives


class NaiveFrames(FrameReplayBuffer):
    """The control: frames stored once, but stacks are the previous frames of the stream, episodes or not."""

    def _stacks(self, envs: np.ndarray, positions: np.ndarray, start: np.ndarray, pinned: bool) -> torch.Tensor:
        return torch.from_numpy(self._frames[envs[:, None], positions % self._length])


def test_a_single_env_reset_by_hand() -> None:
    env = gym.wrappers.FrameStackObservation(Frames(0), STACK)
    frames = FrameReplayBuffer(40, env.observation_space, env.action_space)
    stacks = ReplayBuffer(1000, env.observation_space, env.action_space)
    obs, _ = env.reset(seed=1)
    for number in range(300):
        next_obs, _, terminated, truncated, _ = env.step(number % 3)
        for buffer in (frames, stacks):
            buffer.add(obs, number % 3, float(number), next_obs, terminated, truncated)
        obs = env.reset()[0] if terminated or truncated else next_obs
    assert same_as_stored(frames.sample(2048, generator=torch.Generator().manual_seed(1)), stacks) == []


def test_bytes_per_transition_at_atari_size_are_one_frame_and_a_little() -> None:
    """4x84x84 uint8 stacks, episodes of 100 steps: the rings hold a frame and 15 bytes a transition, and a frame more
    per episode; a whole-stack buffer holds 56,462 (8 frames, both stacks, and its fields)."""
    space = gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)
    frames = FrameReplayBuffer(10_000, space, gym.spaces.Discrete(6))
    stack = np.zeros((4, 84, 84), dtype=np.uint8)
    for step in range(20_000):
        end = step % 100 == 99
        frames.add(stack, 1, 0.0, stack, end, False)
    per_transition = frames.nbytes / frames.stored
    assert frames.stored == 10_000 - 100  # one frame per episode is its first
    assert per_transition <= 7_200, per_transition
    whole = ReplayBuffer(10_000, space, gym.spaces.Discrete(6)).nbytes / 10_000
    assert whole >= 8 * 84 * 84 and whole / per_transition > 7.8


def test_samples_share_nothing_with_the_rings_nor_with_each_other() -> None:
    frames, *_ = play("next_step", steps=50, capacity=3 * 30)
    batch = frames.sample(64, generator=torch.Generator().manual_seed(0))
    rings = [array for array in frames._arrays().values()]
    for name, tensor in batch.items():
        array = tensor.numpy()
        assert not any(np.shares_memory(array, ring) for ring in rings), name
        assert not any(np.shares_memory(array, other.numpy()) for key, other in batch.items() if key != name), name
    before = frames.state_dict()["frames"].clone()
    batch["obs"].zero_()  # the caller's to change
    batch["next_obs"].add_(1)
    assert torch.equal(frames.state_dict()["frames"], before)


def test_a_tensor_that_requires_grad_is_stored_without_its_graph() -> None:
    space = gym.spaces.Box(-1, 1, (2, 3), np.float32)
    frames = FrameReplayBuffer(20, space, (2,), action_dtype=np.float32)
    actor = torch.nn.Linear(3, 2)
    obs = torch.zeros(2, 3)
    action = actor(torch.ones(3))  # requires grad, as an actor's output does
    frames.add(obs, action, 0.0, obs + 1, False, False)
    batch = frames.sample(4)
    assert not batch["action"].requires_grad and batch["action"].grad_fn is None
    assert torch.equal(batch["action"][0], action.detach())


REFUSALS = {
    "obs shape": (lambda row: {"obs": row["obs"][:, :, :, :3]}, r"^obs has shape \(3, 4, 3, 3\), the buffer stores"),
    "float frames": (lambda row: {"next_obs": row["next_obs"] / 2}, r"^next_obs has dtype float64, the buffer stores"),
    "float action": (lambda row: {"action": np.zeros(3, np.float32)}, r"^action has dtype float32, the buffer stores"),
    "reward shape": (lambda row: {"reward": np.zeros(2, np.float32)}, r"^reward has shape \(2,\)"),
    "broken stream": (lambda row: {"obs": row["obs"] + 1}, r"^obs of env 0 does not continue its stream"),
    "nan reward": (lambda row: {"reward": np.array([0.0, np.nan, 0.0])}, r"^reward is nan, the buffer stores finite"),
    "1e300 reward": (lambda row: {"reward": np.array([0.0, 0.0, 1e300])},
                     r"^reward holds 1e\+300, beyond the largest float32 \(3.40282e\+38\): it would be stored as inf$"),
    "truncated of 2 envs": (lambda row: {"truncated": np.zeros(2, bool)}, r"^truncated has shape \(2,\)"),
    "unpadded start": (lambda row: {"obs": row["obs"] + (np.arange(3) == 1)[:, None, None, None] * (
        np.arange(STACK) == 0)[None, :, None, None]}, r"^obs of env 1 starts an episode but its earlier frames"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_bad_row_is_a_one_line_error_naming_the_field_and_nothing_is_written(case: str) -> None:
    """Episodes of 20 steps; the bad row is the second step's, or (an unpadded start) env 1's first."""
    envs = gym.vector.SyncVectorEnv(
        [lambda i=i: gym.wrappers.FrameStackObservation(Frames(i, length=20), STACK) for i in range(3)],
        autoreset_mode=AutoresetMode.DISABLED,
    )
    frames = FrameReplayBuffer(60, envs.single_observation_space, num_envs=3, autoreset_mode="disabled")
    obs, _ = envs.reset(seed=5)
    zeros = np.zeros(3, np.int64)
    next_obs, rewards, terminated, truncated, _ = envs.step(zeros)
    if case != "unpadded start":
        frames.add(obs, zeros, rewards, next_obs, terminated, truncated)
        obs = next_obs
        next_obs, rewards, terminated, truncated, _ = envs.step(zeros)
    row = dict(obs=obs, action=zeros, reward=rewards, next_obs=next_obs, terminated=terminated, truncated=truncated)
    change, message = REFUSALS[case]
    before = {name: array.copy() for name, array in frames._arrays().items()}
    with pytest.raises(ValueError, match=message) as error:
        frames.add(**{**row, **change(row)})
    assert "\n" not in str(error.value)
    assert all(np.array_equal(before[name], array) for name, array in frames._arrays().items())
    frames.add(**row)  # the control: the row as the env gave it is taken
    assert frames.stored == (6 if case != "unpadded start" else 3)


@pytest.mark.parametrize("compress", [None, "zstd"])
def test_one_env_obs_that_continues_by_value_with_other_bytes_is_taken(compress: str | None) -> None:
    """``add`` compares an obs's newest frame with the stream's as bytes first; bytes that differ (float16 stacks for
    float32 frames, -0.0 for 0.0) are compared by value before a refusal. The control: a value that differs."""
    if compress is not None:
        pytest.importorskip("zstandard")
    frames = FrameReplayBuffer(20, gym.spaces.Box(-9, 9, (2, 3), np.float32), padding="zero", compress=compress)
    stacks = np.array([[0, 0, 0], [1, 2, 3], [4, 5, 6], [0, 0, 0]], np.float32)
    frames.add(stacks[0:2], 0, 0.0, stacks[1:3], False, False)
    frames.add(stacks[1:3].astype(np.float16), 0, 0.0, stacks[2:4], False, False)  # other bytes, the same values
    negative_zero = stacks[2:4].copy()
    negative_zero[1, 0] = -0.0
    frames.add(negative_zero, 0, 0.0, np.array([[0, 0, 0], [7, 8, 9]], np.float32), False, False)
    assert frames.stored == 3
    with pytest.raises(ValueError, match=r"^obs does not continue its stream"):
        frames.add(np.array([[0, 0, 0], [7, 8, 8]], np.float32), 0, 0.0, stacks[:2], False, False)
    assert frames.stored == 3


def test_the_buffer_knows_no_autoreset_mode_it_is_not_told() -> None:
    space = gym.spaces.Box(0, 255, (STACK, *FRAME), np.uint8)
    with pytest.raises(ValueError, match=r"autoreset_mode is needed with num_envs: pass envs.metadata"):
        FrameReplayBuffer(100, space, num_envs=2)
    with pytest.raises(ValueError, match="autoreset_mode must be one of next_step, same_step, disabled"):
        FrameReplayBuffer(100, space, num_envs=2, autoreset_mode="sometimes")
    with pytest.raises(ValueError, match="capacity must hold at least stack \\+ 2 = 6 frames per env"):
        FrameReplayBuffer(10, space, num_envs=2, autoreset_mode="next_step")
    with pytest.raises(ValueError, match="obs must be a stack of frames"):
        FrameReplayBuffer(100, (84,))
    assert FrameReplayBuffer(100, space, num_envs=2, autoreset_mode="NextStep").autoreset_mode == "next_step"


@pytest.mark.parametrize("mode", ["next_step", "same_step"])
def test_a_buffer_told_the_wrong_autoreset_mode_refuses_the_row_instead_of_storing_it(mode: str) -> None:
    """Each mode's rows fed to a buffer told the other one: the first row that would cross an episode is refused."""
    other = "same_step" if mode == "next_step" else "next_step"
    envs = vector_envs(3, mode)
    frames = FrameReplayBuffer(300, envs.single_observation_space, num_envs=3, autoreset_mode=other)
    obs, _ = envs.reset(seed=0)
    with pytest.raises(ValueError, match=r"does not continue its stream|starts an episode but|ends an episode but"):
        for _ in range(100):
            next_obs, rewards, terminated, truncated, _ = envs.step(np.zeros(3, np.int64))
            frames.add(obs, np.zeros(3, np.int64), rewards, next_obs, terminated, truncated)
            obs = next_obs


def test_resumed_from_its_state_it_samples_what_the_uninterrupted_buffer_samples(tmp_path: Path) -> None:
    frames, *_ = play("next_step", steps=120, capacity=3 * 25)
    path = tmp_path / "replay.pt"
    torch.save(frames.state_dict(), path)
    envs = vector_envs(3, "next_step")
    resumed = FrameReplayBuffer(
        3 * 25, envs.single_observation_space, envs.single_action_space, num_envs=3, autoreset_mode="next_step"
    )
    resumed.load_state_dict(torch.load(path, weights_only=True))
    assert len(resumed) == len(frames) and resumed.stored == frames.stored
    one, two = (b.sample(256, generator=torch.Generator().manual_seed(7)) for b in (frames, resumed))
    assert all(torch.equal(one[k], two[k]) for k in one)
    other = FrameReplayBuffer(3 * 25, envs.single_observation_space, num_envs=3, autoreset_mode="same_step")
    with pytest.raises(ValueError, match="saved buffer has autoreset_mode='next_step', this one 'same_step'"):
        other.load_state_dict(frames.state_dict())


def test_sampling_before_a_transition_is_stored_is_an_error() -> None:
    space = gym.spaces.Box(0, 255, (STACK, *FRAME), np.uint8)
    frames = FrameReplayBuffer(50, space)
    with pytest.raises(ValueError, match="holds no transition yet"):
        frames.sample(1)
    frames.add(np.zeros((STACK, *FRAME), np.uint8), 0, 0.0, np.zeros((STACK, *FRAME), np.uint8), False)
    assert len(frames) == 1 and frames.sample(3)["obs"].shape == (3, STACK, *FRAME)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        frames.sample(0)


def test_a_single_truncated_flag_is_every_envs() -> None:
    """``truncated``'s default (``False``) and ``True`` with ``num_envs=4``: each env's row gets it; a row of flags of
    another length is still refused (the control: only one flag broadcasts)."""
    envs = gym.vector.SyncVectorEnv(
        [lambda i=i: gym.wrappers.FrameStackObservation(Frames(i, length=20), STACK) for i in range(4)],
        autoreset_mode=AutoresetMode.DISABLED,
    )
    frames = FrameReplayBuffer(80, envs.single_observation_space, num_envs=4, autoreset_mode="disabled")
    obs, _ = envs.reset(seed=3)
    zeros = np.zeros(4, np.int64)
    for truncated in ((), (True,)):
        next_obs, rewards, terminated, _, _ = envs.step(zeros)
        frames.add(obs, zeros, rewards, next_obs, terminated, *truncated)
        obs = next_obs
    assert frames.stored == 8
    assert frames._truncated[:, :2].tolist() == [[False, True]] * 4
    with pytest.raises(ValueError, match=r"^truncated has shape \(3,\), the buffer stores \(\) per transition"):
        frames.add(obs, zeros, rewards, envs.step(zeros)[0], terminated, np.zeros(3, bool))


@pytest.mark.parametrize(("shape", "message"), [
    ((84, 84, 4), r"^obs has shape \(84, 84, 4\), a channel-last layout \(height, width, stack\), as "
                  r"stable-baselines3's VecFrameStack gives it: the buffer takes stacks first"),
    ((210, 160, 3), r"^obs has shape \(210, 160, 3\), a channel-last layout"),
    ((84, 84), r"^obs has shape \(84, 84\), not a stack of frames \(stack, \*frame\) of at most 32: an unstacked"),
    ((84,), r"^obs must be a stack of frames, shape \(stack, \*frame\), got \(84,\)"),
])  # fmt: skip
def test_a_channel_last_or_unstacked_space_is_refused_at_construction_naming_the_layout(
    shape: tuple[int, ...], message: str
) -> None:
    with pytest.raises(ValueError, match=message) as error:
        FrameReplayBuffer(1000, gym.spaces.Box(0, 255, shape, np.uint8))
    assert "\n" not in str(error.value)
    assert FrameReplayBuffer(1000, gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)).stack == 4  # stacks first: taken


def test_the_control_taken_as_84_frames_a_channel_last_stack_is_refused_only_at_the_first_add(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(frame_replay, "MAX_STACK", 1000)  # no limit on the frames of a stack: the layout goes unseen
    frames = FrameReplayBuffer(1000, gym.spaces.Box(0, 255, (84, 84, 4), np.uint8))
    assert (frames.stack, frames.frame_shape) == (84, (84, 4))
    stack = np.random.default_rng(0).integers(0, 256, (84, 84, 4), dtype=np.uint8)  # 4 frames, channel-last
    with pytest.raises(ValueError, match="starts an episode but its earlier frames are not the reset padding"):
        frames.add(stack, 0, 0.0, stack, False)


def test_sample_on_the_cpu_is_the_default_batch_and_a_bad_device_is_refused() -> None:
    frames, *_ = play("next_step", steps=60, capacity=3 * 30)
    default = frames.sample(32, generator=torch.Generator().manual_seed(4))
    on_cpu = frames.sample(32, generator=torch.Generator().manual_seed(4), device=torch.device("cpu"))
    assert all(on_cpu[k].device.type == "cpu" and torch.equal(on_cpu[k], default[k]) for k in default)
    with pytest.raises(ValueError, match=r"^device must be a torch\.device or a device string"):
        frames.sample(4, device="gpu0")
