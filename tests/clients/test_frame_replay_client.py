"""``FrameReplayBuffer`` in a loop written as CleanRL's ``dqn_atari.py`` writes it for gymnasium (its names, its order
of steps, its ``real_next_obs`` lines), on a vector env that resets in the step that ends an episode (``SAME_STEP``, the
autoreset CleanRL's lines are written for), with our buffer dropped in (marked ``# ours``): every transition it samples
is one the env gave, bit for bit, and the Q-network trains on them.

CleanRL's lines replace only the truncated rows of ``next_obs`` (a terminated row's next state is masked out of the TD
target), so its terminated rows carry the next episode's reset stack; ours takes ``final_obs=infos.get("final_obs")``
too, which puts every ended row's real last stack in. The control: the same loop without it is refused at its first
terminated row, in one line naming ``final_obs``, where a buffer that did not look would store a stack reaching into
the next episode.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gymnasium.vector import AutoresetMode
from torch import nn, optim

from copy_correct import FrameReplayBuffer, ReplayBuffer


class Pixels(gym.Env):
    """A small pixel game: 12x12 grey frames of noise whose first pixels say the episode and step; episodes of 3-30
    steps, ended (terminated) at random, cut (truncated) at 30."""

    def __init__(self) -> None:
        self.observation_space = gym.spaces.Box(0, 255, (12, 12), np.uint8)
        self.action_space = gym.spaces.Discrete(3)
        self.episode, self.t = -1, 0

    def frame(self) -> np.ndarray:
        pixels = self.np_random.integers(0, 256, (12, 12), dtype=np.uint8)
        pixels.flat[:2] = self.episode % 256, self.t
        return pixels

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self.episode, self.t = self.episode + 1, 0
        return self.frame(), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        self.t += 1
        terminated = self.t >= 3 and self.np_random.random() < 0.08
        return self.frame(), float(action == 1), terminated, self.t >= 30 and not terminated, {}


@dataclass
class Args:  # CleanRL's, scaled down
    seed: int = 1
    num_envs: int = 4
    buffer_size: int = 2_000
    learning_rate: float = 1e-4
    gamma: float = 0.99
    batch_size: int = 32
    learning_starts: int = 100
    train_frequency: int = 4
    total_timesteps: int = 400


def make_env(seed: int) -> Callable[[], gym.Env]:
    def thunk() -> gym.Env:
        env = gym.wrappers.RecordEpisodeStatistics(Pixels())
        env = gym.wrappers.FrameStackObservation(env, 4)
        env.action_space.seed(seed)
        return env

    return thunk


class QNetwork(nn.Module):
    def __init__(self, env: gym.vector.VectorEnv) -> None:
        super().__init__()
        self.network = nn.Sequential(
            nn.Conv2d(4, 8, 3, stride=2), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 5 * 5, 32), nn.ReLU(),
            nn.Linear(32, env.single_action_space.n),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.network(x / 255.0)


def run(args: Args, final_obs: bool = True) -> tuple[FrameReplayBuffer, ReplayBuffer, list[float], list[dict]]:
    """CleanRL's loop; beside it (not CleanRL's), a buffer of whole stacks fed the real transitions, each numbered by
    its reward slot, and every batch sampled."""
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    envs = gym.vector.SyncVectorEnv(
        [make_env(args.seed + i) for i in range(args.num_envs)], autoreset_mode=AutoresetMode.SAME_STEP
    )
    q_network = QNetwork(envs)
    optimizer = optim.Adam(q_network.parameters(), lr=args.learning_rate)
    rb = FrameReplayBuffer(  # ours
        args.buffer_size, envs.single_observation_space, envs.single_action_space, num_envs=args.num_envs,
        autoreset_mode=envs.metadata["autoreset_mode"],
    )  # fmt: skip
    truth = ReplayBuffer(args.total_timesteps * args.num_envs, envs.single_observation_space, (), obs_dtype=np.uint8)
    losses, batches, number = [], [], 0
    obs, _ = envs.reset(seed=args.seed)
    for global_step in range(args.total_timesteps):
        actions = np.array([envs.single_action_space.sample() for _ in range(envs.num_envs)])
        next_obs, rewards, terminations, truncations, infos = envs.step(actions)
        rewards = np.arange(number, number + args.num_envs, dtype=np.float64)  # not CleanRL's: a number per row
        number += args.num_envs

        # TRY NOT TO MODIFY: save data to reply buffer; handle `final_observation`
        real_next_obs = next_obs.copy()
        for idx, trunc in enumerate(truncations):
            if trunc:
                real_next_obs[idx] = infos["final_obs"][idx]
        extra = {"final_obs": infos.get("final_obs")} if final_obs else {}
        rb.add(obs, actions, rewards, real_next_obs, terminations, truncations, **extra)  # ours: and final_obs
        for i in range(args.num_envs):  # not CleanRL's: the real transitions
            done = terminations[i] or truncations[i]
            real = infos["final_obs"][i] if done else next_obs[i]
            truth.add(obs[i], int(actions[i]), float(rewards[i]), real, bool(terminations[i]), bool(truncations[i]))

        # TRY NOT TO MODIFY: CRUCIAL step easy to overlook
        obs = next_obs

        if global_step > args.learning_starts and global_step % args.train_frequency == 0:
            data = rb.sample(args.batch_size)
            batches.append(data)
            with torch.no_grad():
                target_max, _ = q_network(data["next_obs"]).max(dim=1)
                td_target = data["reward"] + args.gamma * target_max * (1 - data["terminated"].float())
            old_val = q_network(data["obs"]).gather(1, data["action"].unsqueeze(1)).squeeze()
            loss = F.mse_loss(td_target, old_val)
            losses.append(loss.item())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    envs.close()
    return rb, truth, losses, batches


def test_cleanrl_dqn_atari_loop_samples_only_transitions_the_env_gave() -> None:
    _, truth, losses, batches = run(Args())
    row_of = {float(r): i for i, r in enumerate(truth.reward[: truth.size].tolist())}
    batch = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
    rows = [row_of[r] for r in batch["reward"].tolist()]
    for field in ("obs", "action", "next_obs", "terminated", "truncated"):
        assert torch.equal(batch[field], getattr(truth, field)[rows]), field
    assert batch["terminated"].any() and batch["truncated"].any()  # episodes' ends were drawn, both kinds
    assert len(losses) == 74 and np.isfinite(losses).all()  # steps 104, 108, ..., 396


def test_the_control_cleanrls_lines_alone_leave_the_terminated_rows_on_the_reset_stack_and_are_refused() -> None:
    with pytest.raises(ValueError, match=r"^next_obs of env \d ends an episode but does not continue obs") as error:
        run(Args(), final_obs=False)
    assert "final_obs=infos['final_obs']" in str(error.value) and "\n" not in str(error.value)
