"""N-step returns from ``FrameReplayBuffer``: every sampled window is the oracle's, found in the logged episodes of
real gymnasium vector envs in each autoreset mode (episodes shorter than the stack and than ``n_steps``, rings that
wrap), its ``next_obs`` the stack the env gave after the window's last step; ``n_steps=1`` samples what the buffer
did. Each window is found through a twin buffer of ``n_steps=1`` sampled with the same generator (the same draws),
whose rewards are the transitions' numbers. The control: windows that do not stop at a stream's newest transition.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import copy_correct.replay.n_step as _n_step
from copy_correct import FrameReplayBuffer
from tests.parts.test_frame_replay import MODES, vector_envs

GAMMA = 0.9


class PastTheNewest(FrameReplayBuffer):
    """The control: a stream's next slot taken as a transition whether one was stored there or not."""

    def _window(self, rows: np.ndarray) -> _n_step.Window:
        valid = self._valid_flat.copy()
        self._valid_flat[:] = True
        try:
            return super()._window(rows)
        finally:
            self._valid_flat[:] = valid


def play(mode: str, n_steps: int, num_envs: int = 3, capacity: int = 72, kind: type = FrameReplayBuffer,
         compress: str | None = None) -> list[int]:  # fmt: skip
    """400 vector steps into a buffer of ``n_steps`` and its twin of 1; every 20 steps 256 windows are sampled and
    held against the oracle of the streams as they are then. Returns the numbers of the wrong windows."""
    envs = vector_envs(num_envs, mode)
    built = [
        kind_(capacity, envs.single_observation_space, envs.single_action_space, num_envs=num_envs,
              autoreset_mode=envs.metadata["autoreset_mode"], n_steps=n, gamma=GAMMA, compress=compress)
        for kind_, n in ((kind, n_steps), (FrameReplayBuffer, 1))
    ]  # fmt: skip
    rng = np.random.default_rng(0)
    streams: list[list[tuple[float, bool, bool, np.ndarray]]] = [[] for _ in range(num_envs)]
    where: dict[int, tuple[int, int]] = {}
    obs, _ = envs.reset(seed=0)
    resetting, wrong = np.zeros(num_envs, dtype=bool), []
    for step in range(400):
        actions = rng.integers(0, 3, num_envs)
        next_obs, _, terminated, truncated, infos = envs.step(actions)
        done = terminated | truncated
        rewards = rng.normal(size=num_envs).astype(np.float32)
        numbers = np.arange(step * num_envs, (step + 1) * num_envs, dtype=np.float32)
        kwargs = {"final_obs": infos["final_obs"]} if mode == "same_step" and done.any() else {}
        for buffer, given in zip(built, (rewards, numbers), strict=True):
            buffer.add(obs, actions, given, next_obs, terminated, truncated, **kwargs)
        for env in np.flatnonzero(~resetting).tolist():
            real = infos["final_obs"][env] if mode == "same_step" and done[env] else next_obs[env]
            where[step * num_envs + env] = (env, len(streams[env]))
            streams[env].append((float(rewards[env]), bool(terminated[env]), bool(truncated[env]), real))
        resetting = done if mode == "next_step" else np.zeros(num_envs, dtype=bool)
        if mode == "disabled" and done.any():
            reset, _ = envs.reset(options={"reset_mask": done})
            next_obs = np.where(done[:, None, None, None], reset, next_obs)
        obs = next_obs
        if step % 20 == 19:
            batch, numbered = (b.sample(256, generator=torch.Generator().manual_seed(step)) for b in built)
            assert torch.equal(batch["obs"], numbered["obs"]) and torch.equal(batch["action"], numbered["action"])
            for row, number in enumerate(numbered["reward"].long().tolist()):
                env, i = where[number]
                total, m = 0.0, 0
                while True:
                    reward, te, tr, real = streams[env][i + m]
                    total, m = total + GAMMA**m * reward, m + 1
                    if m == n_steps or te or tr or i + m == len(streams[env]):
                        break
                same = (
                    np.isclose(float(batch["reward"][row]), total, rtol=1e-6, atol=1e-6)
                    and np.array_equal(batch["next_obs"][row].numpy(), real)
                    and (bool(batch["terminated"][row]), bool(batch["truncated"][row])) == (te, tr)
                    and np.isclose(float(batch["discounts"][row]), GAMMA**m, rtol=1e-6)
                )
                if not same:
                    wrong.append(number)
    return wrong


@pytest.mark.parametrize("n_steps", [3, 6])  # 6: longer than the stack of 4
@pytest.mark.parametrize("mode", list(MODES))
def test_every_sampled_window_is_the_oracles(mode: str, n_steps: int) -> None:
    assert play(mode, n_steps) == []


@pytest.mark.parametrize("mode", ["next_step", "same_step"])
def test_compressed_frames_give_the_same_windows(mode: str) -> None:
    pytest.importorskip("zstandard", reason='the compress extra: pip install "copy-correct[compress]"')
    assert play(mode, 3, compress="zstd") == []


def test_one_env_and_a_ring_of_few_frames() -> None:
    assert play("disabled", 3, num_envs=1, capacity=10) == []


def test_the_control_windows_past_the_newest_transition_are_caught() -> None:
    assert len(play("same_step", 3, kind=PastTheNewest)) > 50


def test_n_steps_1_samples_what_the_buffer_did_and_gamma_adds_its_discounts() -> None:
    envs = vector_envs(2, "same_step")
    made = [
        FrameReplayBuffer(40, envs.single_observation_space, num_envs=2, autoreset_mode="same_step", **kwargs)
        for kwargs in ({}, {"n_steps": 1, "gamma": GAMMA})
    ]
    obs, _ = envs.reset(seed=1)
    for _ in range(60):
        next_obs, rewards, terminated, truncated, infos = envs.step(np.zeros(2, dtype=np.int64))
        kwargs = {"final_obs": infos["final_obs"]} if (terminated | truncated).any() else {}
        for buffer in made:
            buffer.add(obs, np.zeros(2, dtype=np.int64), rewards, next_obs, terminated, truncated, **kwargs)
        obs = next_obs
    as_was, batch = (b.sample(64, generator=torch.Generator().manual_seed(2)) for b in made)
    assert list(batch) == [*as_was, "discounts"]
    assert all(torch.equal(batch[name], as_was[name]) for name in as_was)
    assert torch.equal(batch["discounts"], torch.full((64,), np.float32(GAMMA)))
