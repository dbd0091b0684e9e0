"""``recipes/atari.py``: the games as CleanRL wraps them (stacks of 4 84x84 uint8 frames; a lost life ends the
episode and the game goes on at the next reset, unless a new game is asked for; deterministic given the env's
generator) and the Nature network, which takes uint8 stacks and scales them itself."""

from __future__ import annotations

import importlib.util

import gymnasium as gym
import numpy as np
import pytest
import torch

from recipes.atari import NatureQNetwork, game_goes_on, is_atari, make_atari_env, start_a_game_at_the_next_reset

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ale_py") is None, reason="the atari extra (ale-py)")


def lose_a_life(env: gym.Env, rng: np.random.Generator) -> int:
    """Random actions until an episode ends; the lives left."""
    while True:
        _, _, terminated, truncated, _ = env.step(int(rng.integers(env.action_space.n)))
        if terminated or truncated:
            return env.unwrapped.ale.lives()


def test_a_lost_life_ends_the_episode_and_the_game_goes_on_at_the_next_reset() -> None:
    env = make_atari_env("ALE/Breakout-v5")
    obs, _ = env.reset(seed=0)
    assert obs.shape == (4, 84, 84) and obs.dtype == np.uint8 and is_atari("ALE/Breakout-v5")
    assert (obs == obs[-1]).all()  # a first observation: padded with copies of its frame
    lives = lose_a_life(env, np.random.default_rng(0))
    assert 0 < lives < 5 and game_goes_on(env)
    env.reset()
    assert env.unwrapped.ale.lives() == lives  # the same game, one life less
    start_a_game_at_the_next_reset(env)  # the control: asked for, the reset starts a new game
    env.reset()
    assert env.unwrapped.ale.lives() == 5


def test_the_same_generator_state_plays_the_same_game() -> None:
    frames = []
    for _ in range(2):
        env = make_atari_env("ALE/Pong-v5")
        env.reset(seed=3)
        frames.append([env.step(step % 6)[0] for step in range(60)])
    assert all(np.array_equal(a, b) for a, b in zip(*frames, strict=True))


def test_the_nature_network_scales_uint8_stacks_itself() -> None:
    torch.manual_seed(0)
    q = NatureQNetwork(6)
    frames = torch.randint(0, 256, (2, 4, 84, 84), dtype=torch.uint8)
    assert q(frames).shape == (2, 6)
    assert torch.equal(q(frames), q.net(frames.float() / 255.0))
    assert frames.dtype == torch.uint8  # the input is read, not converted in place
