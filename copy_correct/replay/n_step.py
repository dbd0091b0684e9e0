"""N-step returns, computed when a batch is sampled from the one-step rows a buffer stores (nothing more is stored).

A drawn transition's window is it and the next ones of its env's stream, up to ``n_steps`` in all. It ends early at
the first that terminated or was truncated (included) and at the stream's newest transition, whose successor is not
written yet (stable-baselines3's ``NStepReplayBuffer`` cuts there too). With ``m`` the transitions in it: ``reward``
is ``sum(gamma**k * r_k for k < m)``, ``next_obs``, ``terminated`` and ``truncated`` are the last one's (a
truncation's real last observation is what bootstraps), and ``discounts`` is ``gamma**m``, the bootstrap factor of
``reward + discounts * (1 - terminated) * max_a Q(next_obs, a)``. The arithmetic is stable-baselines3's, in float32:
``(rewards * gamma**arange(n) * mask).sum(axis=1)`` by numpy and ``gamma ** m``, so the two agree bit for bit.

A buffer hands over, for each drawn transition, the rows of the ``n_steps`` transitions of its env's stream from it
on (``rows``, one line each) and whether each is written yet (``written``; where it is not, any row in range):
``ReplayBuffer`` a fixed stride on, or the links ``writes.linked`` keeps where ``"next_step"`` leaves rows out. A
window never crosses an episode's end (it stops at the flag), so a reset step left out of the rows needs no look.

Copy contract: reads the buffer's reward and flag rows (numpy memory on the host), writes none of them; the returns
and discounts are new arrays, which the sample hands over as new tensors. Nothing here is seen by autograd.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from copy_correct.core.checks import integral

__all__ = ["Window", "settings", "windows"]


def settings(n_steps: Any, gamma: Any) -> tuple[int, float | None]:
    """``n_steps`` an integer >= 1 and ``gamma`` a discount in [0, 1], or ``None`` (no ``discounts`` in a batch);
    ``n_steps > 1`` needs ``gamma``: the agent's own discount, never a default that could differ from it."""
    if integral("n_steps", n_steps, "an integer >= 1") < 1:
        raise ValueError(f"n_steps must be >= 1, got {n_steps}")
    if gamma is None:
        if n_steps > 1:
            raise ValueError(f"n_steps={n_steps} needs gamma, the agent's discount (stable-baselines3's name)")
        return n_steps, None
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float, np.floating, np.integer)):
        raise TypeError(f"gamma must be a number in [0, 1] or None, got {type(gamma).__name__}")
    if not 0.0 <= float(gamma) <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    return n_steps, float(gamma)


@dataclass(frozen=True)
class Window:
    """Each drawn transition's window: the row of its last transition, its ``m`` transitions, the discounted rewards
    and ``gamma**m``."""

    last: np.ndarray
    steps: np.ndarray
    returns: np.ndarray
    discounts: np.ndarray


def windows(rows: np.ndarray, written: np.ndarray, reward: np.ndarray, terminated: np.ndarray,
            truncated: np.ndarray, gamma: float) -> Window:  # fmt: skip
    """The windows of the transitions whose streams' rows are ``rows`` (batch, n_steps), from the flat per-row arrays
    ``reward``, ``terminated`` and ``truncated`` (module docstring): a step is taken if it and every step before it
    is written, and no step before it ended its episode. Some fifteen numpy calls, whatever ``n_steps``."""
    ends = terminated[rows] | truncated[rows]
    after_an_end = np.zeros_like(ends)
    np.logical_or.accumulate(ends[:, :-1], axis=1, out=after_an_end[:, 1:])
    mask = np.logical_and.accumulate(written, axis=1) & ~after_an_end
    steps = mask.sum(axis=1)
    powers = gamma ** np.arange(rows.shape[1], dtype=np.float32)
    returns = (reward[rows] * powers * mask).sum(axis=1)  # a step not taken is masked out, as stable-baselines3's are
    last = rows[np.arange(len(rows)), steps - 1]
    return Window(last, steps, returns, gamma ** steps.astype(np.float32))
