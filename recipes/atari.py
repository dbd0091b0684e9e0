"""Atari for the ``dqn`` recipe: the environment as CleanRL's ``dqn_atari.py`` wraps it, and the Nature DQN network.

    env = make_atari_env("ALE/Breakout-v5")     # uint8 observations of 4 stacked 84x84 grey frames
    q = NatureQNetwork(env.action_space.n)      # takes those uint8 stacks, scales them by 1/255 itself

The wrappers, in CleanRL's order (the same as stable-baselines3's ``atari_wrappers``, written here so that the recipe
needs only ``ale-py``): ``gym.make(env_id, frameskip=1, repeat_action_probability=0.0)`` (``BreakoutNoFrameskip-v4``'s
emulator settings under the v5 id), up to 30 no-ops at reset, each action repeated 4 times with the last two frames'
maximum observed, a life lost ending the episode (the game goes on from there at the next reset), FIRE at reset for
games that need it, rewards clipped to their sign, frames resized to 84x84 and made grey, 4 frames stacked
(``FrameStackObservation``, padded at an episode start with copies of its first frame).

Copy contract: the frames are ``uint8`` from the emulator to the network's first layer: a stack is 28 KB, where
float32 would be 113 KB, and the replay buffer (``FrameReplayBuffer``) keeps each frame once.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import torch
from torch import nn

__all__ = ["NatureQNetwork", "game_goes_on", "is_atari", "make_atari_env", "start_a_game_at_the_next_reset"]

STACK, SIZE = 4, 84


def is_atari(env_id: str) -> bool:
    """Whether ``env_id`` names an Arcade Learning Environment game (``ALE/Pong-v5``)."""
    return env_id.startswith("ALE/")


def make_atari_env(env_id: str) -> gym.Env:
    """``env_id`` (an ``ALE/...`` id) wrapped as CleanRL's ``dqn_atari.py`` wraps it. Needs the ``atari`` extra."""
    import ale_py  # registers the ALE/ ids; the `atari` extra

    gym.register_envs(ale_py)
    env = gym.make(env_id, frameskip=1, repeat_action_probability=0.0)
    env = gym.wrappers.RecordEpisodeStatistics(env)
    env = NoopReset(env, noop_max=30)
    env = MaxAndSkip(env, skip=4)
    env = EpisodicLife(env)
    if "FIRE" in env.unwrapped.get_action_meanings():
        env = FireReset(env)
    env = gym.wrappers.TransformReward(env, lambda reward: float(np.sign(reward)))
    env = gym.wrappers.ResizeObservation(env, (SIZE, SIZE))
    env = gym.wrappers.GrayscaleObservation(env)
    return gym.wrappers.FrameStackObservation(env, STACK)


def game_goes_on(env: gym.Env) -> bool:
    """Whether the episode that just ended was a life lost and the game goes on (``EpisodicLife``): its next reset
    plays on from where the game is instead of starting it again. False for every other env."""
    lives = _episodic_life(env)
    return lives is not None and not lives.game_over


def start_a_game_at_the_next_reset(env: gym.Env) -> None:
    """Make ``env``'s next reset start its game over (an ``EpisodicLife`` env's would go on with the next life);
    nothing for every other env."""
    lives = _episodic_life(env)
    if lives is not None:
        lives.game_over = True


def _episodic_life(env: gym.Env) -> EpisodicLife | None:
    while isinstance(env, gym.Wrapper):
        if isinstance(env, EpisodicLife):
            return env
        env = env.env
    return None


class NoopReset(gym.Wrapper):
    """At reset, 1 to ``noop_max`` no-op actions (drawn from the env's generator): varied starts."""

    def __init__(self, env: gym.Env, noop_max: int) -> None:
        super().__init__(env)
        self.noop_max = noop_max

    def reset(self, **kwargs: Any) -> tuple[Any, dict]:
        obs, info = self.env.reset(**kwargs)
        for _ in range(int(self.unwrapped.np_random.integers(1, self.noop_max + 1))):
            obs, _, terminated, truncated, info = self.env.step(0)
            if terminated or truncated:
                obs, info = self.env.reset()
        return obs, info


class MaxAndSkip(gym.Wrapper):
    """Each action repeated ``skip`` times; rewards summed, the observation the maximum of the last two frames (the
    emulator draws some sprites every other frame)."""

    def __init__(self, env: gym.Env, skip: int) -> None:
        super().__init__(env)
        self.skip = skip
        self.frames = np.zeros((2, *env.observation_space.shape), dtype=env.observation_space.dtype)

    def step(self, action: int) -> tuple[Any, float, bool, bool, dict]:
        total, terminated, truncated, info = 0.0, False, False, {}
        for i in range(self.skip):
            obs, reward, terminated, truncated, info = self.env.step(action)
            if i >= self.skip - 2:
                self.frames[i - (self.skip - 2)] = obs
            total += float(reward)
            if terminated or truncated:
                break
        return self.frames.max(axis=0), total, terminated, truncated, info


class EpisodicLife(gym.Wrapper):
    """A life lost ends the episode for learning; the game itself goes on, and is reset only when it is over."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        self.lives, self.game_over = 0, True

    def step(self, action: int) -> tuple[Any, float, bool, bool, dict]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.game_over = terminated or truncated
        lives = self.unwrapped.ale.lives()
        if 0 < lives < self.lives:
            terminated = True
        self.lives = lives
        return obs, reward, terminated, truncated, info

    def reset(self, **kwargs: Any) -> tuple[Any, dict]:
        if self.game_over or kwargs.get("seed") is not None:
            obs, info = self.env.reset(**kwargs)
        else:  # a life was lost: go on from where the game is, with a no-op
            obs, _, terminated, truncated, info = self.env.step(0)
            if terminated or truncated:
                obs, info = self.env.reset(**kwargs)
        self.lives, self.game_over = self.unwrapped.ale.lives(), False
        return obs, info


class FireReset(gym.Wrapper):
    """FIRE (and a second action) at reset, for games that wait for it to start."""

    def reset(self, **kwargs: Any) -> tuple[Any, dict]:
        self.env.reset(**kwargs)
        for action in (1, 2):
            obs, _, terminated, truncated, info = self.env.step(action)
            if terminated or truncated:
                self.env.reset(**kwargs)
        return obs, info


class NatureQNetwork(nn.Module):
    """The DQN network of Mnih et al. (2015), as CleanRL's ``dqn_atari.py`` builds it: three convolutions and two
    linear layers on a stack of 4 84x84 frames, given as ``uint8`` and scaled by 1/255 here (a new float tensor)."""

    def __init__(self, actions: int, stack: int = STACK) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(stack, 32, 8, stride=4),
            nn.ReLU(),
            nn.Conv2d(32, 64, 4, stride=2),
            nn.ReLU(),
            nn.Conv2d(64, 64, 3, stride=1),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(3136, 512),
            nn.ReLU(),
            nn.Linear(512, actions),
        )

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        return self.net(frames.float() / 255.0)
