"""The environment the ``dqn`` recipe plays: ``make_env`` makes it from a gymnasium id, or refuses it in one line naming
``model.env_id`` (``env.id``) and what the recipe takes; ``is_frame_stack`` tells stacked frames (Atari's) apart.

Copy contract: none; nothing here holds a tensor. Environments are made once per run (training and evaluation each
their own); their observations are copied into the replay buffer by ``recipes/dqn.py``.
"""

from __future__ import annotations

import importlib.util

import gymnasium as gym
import numpy as np

from recipes.atari import is_atari, make_atari_env

__all__ = ["LISTING", "SUGGESTED_ENVS", "is_frame_stack", "make_env"]

# Environments with Discrete actions and Box observations that gymnasium registers, named in refusals.
SUGGESTED_ENVS = "CartPole-v1, Acrobot-v1, MountainCar-v0 or LunarLander-v3 (needs gymnasium[box2d])"
LISTING = "python -c 'import gymnasium; gymnasium.pprint_registry()' lists every id"


def is_frame_stack(space: gym.Space) -> bool:
    """Whether observations are stacks of uint8 frames (``(stack, height, width)``), as Atari's are."""
    return isinstance(space, gym.spaces.Box) and space.dtype == np.uint8 and len(space.shape) == 3


def make_env(env_id: str) -> gym.Env:
    """``gym.make(env_id)`` for DQN (an ``ALE/`` game wrapped as CleanRL wraps it, ``recipes/atari.py``): a
    ``ValueError`` of one line naming ``model.env_id`` (the config's ``env.id``) when gymnasium cannot make it, its
    action space is not ``Discrete`` from 0 (a DQN picks the action of the largest Q-value, by index) or its
    observation space is not a ``Box``."""
    where = f"model.env_id={env_id} (env.id)"
    if is_atari(env_id) and importlib.util.find_spec("ale_py") is None:
        raise ValueError(f"{where} needs ale-py, which plays the Atari games: pip install -e '.[atari]'")
    try:
        env = make_atari_env(env_id) if is_atari(env_id) else gym.make(env_id)
    except (gym.error.Error, ModuleNotFoundError) as err:
        said = " ".join(str(err).split())
        raise ValueError(f"{where} cannot be made: {said.rstrip('.')}; try {SUGGESTED_ENVS} ({LISTING})") from err
    actions, observations = env.action_space, env.observation_space
    if not isinstance(actions, gym.spaces.Discrete):
        kind = "a continuous" if isinstance(actions, gym.spaces.Box) else "a non-Discrete"
        problem = f"has {kind} action space ({actions}); recipe dqn needs a Discrete one"
        problem += " (a DQN picks the action of the largest Q-value)"
    elif actions.start != 0:
        problem = f"numbers its actions from {actions.start} ({actions}); recipe dqn takes the Q-network's index"
        problem += " as the action, so they must start at 0"
    elif not isinstance(observations, gym.spaces.Box):
        problem = f"has {observations} observations; recipe dqn needs a Box (an array the Q-network flattens)"
    else:
        return env
    env.close()
    raise ValueError(" ".join(f"{where} {problem}: try {SUGGESTED_ENVS}".split()))
