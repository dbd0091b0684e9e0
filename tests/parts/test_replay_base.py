"""``ReplayBase._draw`` is the one method that chooses a batch's rows, for both buffers: a subclass that overrides it
alone, as prioritized sampling will, gets batches of exactly the transitions at the rows it returns, in its order and
repeats, with their n-step windows and discounts. Each transition is numbered by its values (``obs`` and ``reward``
of a ``ReplayBuffer`` row, the frames and ``reward`` of a ``FrameReplayBuffer`` one). The control: the buffers' own
draw, with the same generator, gives other rows, so a ``sample`` that drew elsewhere would fail the test."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from copy_correct import FrameReplayBuffer, ReplayBuffer

ROWS = np.array([5, 5, 0, 17, 3, 30])  # repeats, out of order, the first row and one near the newest
GAMMA = 0.5


class ChosenRows(ReplayBuffer):
    def _draw(self, batch_size: int, generator: torch.Generator | None, span: int) -> np.ndarray:
        return ROWS[:batch_size].copy()


class ChosenFrameRows(FrameReplayBuffer):
    def _draw(self, batch_size: int, generator: torch.Generator | None, span: int) -> np.ndarray:
        return ROWS[:batch_size].copy()


def filled(kind: type, n_steps: int) -> ReplayBuffer | FrameReplayBuffer:
    """40 transitions of one episode, transition ``t`` numbered ``t``: its reward, and its ``obs`` (``ReplayBuffer``)
    or the newest frame of its ``obs`` stack (``FrameReplayBuffer``), whose next frame is ``t + 1``."""
    gamma = GAMMA if n_steps > 1 else None
    if issubclass(kind, FrameReplayBuffer):
        buffer = kind(64, (4, 2, 2), n_steps=n_steps, gamma=gamma)
        frames = [np.full((2, 2), max(t, 0), np.uint8) for t in range(-3, 42)]  # padded before the first: reset
        for t in range(40):
            obs, next_obs = np.stack(frames[t : t + 4]), np.stack(frames[t + 1 : t + 5])
            buffer.add(obs, t % 3, float(t), next_obs, False, False)
        return buffer
    buffer = kind(64, (3,), n_steps=n_steps, gamma=gamma)
    for t in range(40):
        buffer.add(np.full(3, t, np.float32), t % 3, float(t), np.full(3, t + 1, np.float32), False, False)
    return buffer


def numbers(batch: dict[str, torch.Tensor]) -> tuple[list[int], list[int]]:
    """The number of each drawn transition and of its window's last ``next_obs``."""
    obs, next_obs = batch["obs"], batch["next_obs"]
    if obs.dim() == 4:  # stacks of frames: the newest frame's number
        return obs[:, -1, 0, 0].tolist(), next_obs[:, -1, 0, 0].tolist()
    return obs[:, 0].long().tolist(), next_obs[:, 0].long().tolist()


@pytest.mark.parametrize("n_steps", [1, 3])
@pytest.mark.parametrize("kind", [ChosenRows, ChosenFrameRows], ids=["ReplayBuffer", "FrameReplayBuffer"])
def test_the_batch_holds_the_transitions_at_the_rows_draw_returns(kind: type, n_steps: int) -> None:
    buffer = filled(kind, n_steps)
    batch = buffer.sample(len(ROWS), generator=torch.Generator().manual_seed(0))
    drawn, ends = numbers(batch)
    assert drawn == ROWS.tolist() and batch["action"].tolist() == (ROWS % 3).tolist()
    assert ends == (ROWS + n_steps).tolist()  # the window's last transition's next_obs
    if n_steps == 1:
        assert batch["reward"].tolist() == ROWS.astype(float).tolist() and "discounts" not in batch
    else:
        expected = sum(GAMMA**k * (ROWS + k) for k in range(n_steps))
        assert np.allclose(batch["reward"].numpy(), expected) and batch["discounts"].tolist() == [GAMMA**n_steps] * 6


@pytest.mark.parametrize("kind", [ReplayBuffer, FrameReplayBuffer])
def test_the_control_the_buffers_own_draw_gives_other_rows(kind: type) -> None:
    drawn, _ = numbers(filled(kind, 1).sample(len(ROWS), generator=torch.Generator().manual_seed(0)))
    assert drawn != ROWS.tolist()
