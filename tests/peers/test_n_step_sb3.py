"""Our n-step windows are stable-baselines3's ``NStepReplayBuffer``'s, bit for bit, on the same stream: three envs,
random episodes (some shorter than ``n_steps``), terminations and truncations, a ring that wraps. Every transition in
both buffers is compared at several points as they fill (SB3's taken row by row, each env in turn; ours drawn by
``sample``, each found by its observation, the transition's number). Where the two define different things, the
stream keeps out of it: SB3 counts a step both terminated and truncated as a timeout (its ``TimeLimit.truncated`` is
``truncated and not terminated``, which is what it is given here)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from copy_correct import ReplayBuffer

buffers = pytest.importorskip("stable_baselines3.common.buffers", reason="stable-baselines3 not installed")
spaces = pytest.importorskip("gymnasium.spaces")

ENVS, ROWS, GAMMA = 3, 20, 0.99


def sb3_windows(sb3: object, monkeypatch: pytest.MonkeyPatch) -> dict[float, tuple]:
    """Every stored transition's window in stable-baselines3's buffer, by its observation."""
    filled = ROWS if sb3.full else sb3.pos
    windows = {}
    for env in range(ENVS):
        monkeypatch.setattr(np.random, "randint", lambda low, high, size, env=env: np.full(size, env))
        got = sb3._get_samples(np.arange(filled))
        for i in range(filled):
            windows[float(got.observations[i, 0])] = (
                got.rewards[i, 0],
                got.next_observations[i, 0],
                got.dones[i, 0],
                got.discounts[i, 0],
            )
        monkeypatch.undo()
    return windows


@pytest.mark.parametrize("n_steps", [2, 3, 5])
def test_every_window_is_stable_baselines3s_bit_for_bit(n_steps: int, monkeypatch: pytest.MonkeyPatch) -> None:
    box, actions = spaces.Box(-1e6, 1e6, (1,), np.float32), spaces.Discrete(4)
    sb3 = buffers.NStepReplayBuffer(  # its buffer_size counts transitions of all envs, as our capacity does
        ROWS * ENVS,
        box,
        actions,
        device="cpu",
        n_envs=ENVS,
        handle_timeout_termination=True,
        n_steps=n_steps,
        gamma=GAMMA,
    )
    ours = ReplayBuffer(ROWS * ENVS, box, actions, num_envs=ENVS, autoreset_mode="disabled", n_steps=n_steps,
                        gamma=GAMMA)  # fmt: skip
    rng = np.random.default_rng(n_steps)
    left = rng.integers(1, 2 * n_steps, ENVS)
    compared = 0
    for step in range(120):
        numbers = np.arange(step * ENVS, (step + 1) * ENVS, dtype=np.float32)[:, None]
        left -= 1
        ends = left == 0
        cut = rng.random(ENVS) < 0.4
        terminated, truncated = ends & ~cut, ends & cut
        rewards = rng.normal(size=ENVS).astype(np.float32)
        action = rng.integers(0, 4, ENVS)
        sb3.add(numbers, numbers + 0.5, action, rewards, ends, [{"TimeLimit.truncated": bool(t)} for t in truncated])
        ours.add(numbers, action, rewards, numbers + 0.5, terminated, truncated)
        left[ends] = rng.integers(1, 2 * n_steps, int(ends.sum()))
        if step % 13 == 12:
            theirs = sb3_windows(sb3, monkeypatch)
            batch = ours.sample(4096, generator=torch.Generator().manual_seed(step))
            seen = set()
            for row, number in enumerate(batch["obs"][:, 0].tolist()):
                reward, next_obs, done, discount = theirs[number]
                assert batch["reward"][row].item() == reward.item()  # float32 both: the same bits
                assert batch["next_obs"][row, 0].item() == next_obs.item()
                assert float(batch["terminated"][row]) == done.item()
                assert batch["discounts"][row].item() == discount.item()
                seen.add(number)
            assert len(seen) == len(theirs)  # every transition compared
            compared += len(seen)
    assert compared > 400
