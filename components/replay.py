"""``ReplayBuffer``: preallocated transitions written in place, sampled as independent tensors.

Copy contract:

* Storage for ``capacity`` transitions is allocated once, at construction. ``add`` writes one transition
  into the next ring slot with ``copy_`` / ``fill_`` into views of that storage: no allocation per
  transition, and the caller's arrays are never kept (a later change to them cannot reach the buffer).
* ``sample`` gathers with advanced indexing, which makes new storage: the batch shares nothing with the
  buffer, so training code can modify it (normalise in place, say) without corrupting the experience.
* ``state_dict()`` holds the filled part as tensors plus the write position: a resumed run continues with
  the same experience, in the same ring order; it loads with ``torch.load(..., weights_only=True)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["ReplayBuffer"]

_FIELDS = ("obs", "action", "reward", "next_obs", "terminated", "truncated")


class ReplayBuffer:
    """Ring buffer of (obs, action, reward, next_obs, terminated, truncated).

    Args:
        capacity: transitions kept; the oldest is overwritten once full.
        obs_shape: shape of one observation.
        action_shape: shape of one action (``()`` for a discrete action index).
        obs_dtype: storage dtype of observations (floating).
        action_dtype: storage dtype of actions (``torch.int64`` for discrete, floating for continuous).
        device: where the storage lives (and so where samples are gathered).
    """

    def __init__(
        self,
        capacity: int,
        obs_shape: Sequence[int],
        *,
        action_shape: Sequence[int] = (),
        obs_dtype: torch.dtype = torch.float32,
        action_dtype: torch.dtype = torch.int64,
        device: str | torch.device = "cpu",
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if not obs_dtype.is_floating_point:
            raise ValueError(f"obs_dtype must be floating, got {obs_dtype}")
        self.capacity = capacity
        self.obs_shape = tuple(obs_shape)
        self.action_shape = tuple(action_shape)
        self.device = torch.device(device)
        kw = {"device": self.device}
        self.obs = torch.zeros((capacity, *self.obs_shape), dtype=obs_dtype, **kw)
        self.next_obs = torch.zeros((capacity, *self.obs_shape), dtype=obs_dtype, **kw)
        self.action = torch.zeros((capacity, *self.action_shape), dtype=action_dtype, **kw)
        self.reward = torch.zeros(capacity, dtype=torch.float32, **kw)
        self.terminated = torch.zeros(capacity, dtype=torch.bool, **kw)
        self.truncated = torch.zeros(capacity, dtype=torch.bool, **kw)
        self.pos = 0
        self.size = 0

    def __len__(self) -> int:
        return self.size

    @property
    def full(self) -> bool:
        return self.size == self.capacity

    def add(
        self, obs: Any, action: Any, reward: float, next_obs: Any, terminated: bool, truncated: bool = False
    ) -> None:
        """Write one transition into the next slot, in place (arrays, tensors or Python numbers)."""
        slot = self.pos
        self._write(self.obs[slot], obs, "obs")
        self._write(self.next_obs[slot], next_obs, "next_obs")
        self._write(self.action[slot], action, "action")
        self.reward[slot] = float(reward)
        self.terminated[slot] = bool(terminated)
        self.truncated[slot] = bool(truncated)
        self.pos = (slot + 1) % self.capacity
        self.size = min(self.size + 1, self.capacity)

    def _write(self, into: torch.Tensor, value: Any, name: str) -> None:
        if isinstance(value, (bool, int, float, np.generic)):
            if into.dim() != 0:
                raise ValueError(f"{name} must have shape {tuple(into.shape)}, got the scalar {value!r}")
            if isinstance(value, (float, np.floating)) and not into.is_floating_point():
                raise ValueError(f"{name} must be an integer for a {into.dtype} buffer, got {value!r}")
            into.fill_(value)
            return
        source = torch.from_numpy(value) if isinstance(value, np.ndarray) else value
        if not isinstance(source, torch.Tensor):
            raise TypeError(f"{name} must be a numpy array or tensor, got {type(value).__name__}")
        if tuple(source.shape) != tuple(into.shape):
            raise ValueError(f"{name} has shape {tuple(source.shape)}, the buffer stores {tuple(into.shape)}")
        if source.is_floating_point() and not into.is_floating_point():
            raise ValueError(f"{name} has dtype {source.dtype}, the buffer stores {into.dtype}")
        if source.dtype == torch.bool and into.is_floating_point():
            raise ValueError(f"{name} has dtype {source.dtype}, the buffer stores {into.dtype}")
        into.copy_(source)

    def sample(self, batch_size: int, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        """``batch_size`` transitions drawn uniformly with replacement, as new tensors on the buffer's device."""
        if self.size == 0:
            raise ValueError("cannot sample from an empty ReplayBuffer")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        index = torch.randint(self.size, (batch_size,), generator=generator, device="cpu").to(self.device)
        return {name: getattr(self, name)[index] for name in _FIELDS}

    def state_dict(self) -> dict[str, Any]:
        """The filled part of the storage (aliased) and the write position."""
        return {"pos": self.pos, "size": self.size, **{name: getattr(self, name)[: self.size] for name in _FIELDS}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Copy a saved buffer into this one's storage; capacity and shapes must be compatible."""
        size, pos = int(state["size"]), int(state["pos"])
        if not 0 <= size <= self.capacity or not 0 <= pos < self.capacity:
            raise ValueError(f"saved buffer (size {size}, pos {pos}) does not fit capacity {self.capacity}")
        for name in _FIELDS:
            saved = state[name]
            into = getattr(self, name)
            if tuple(saved.shape) != (size, *into.shape[1:]):
                raise ValueError(f"saved {name} has shape {tuple(saved.shape)}, expected {(size, *into.shape[1:])}")
            into[:size].copy_(saved)
        self.size, self.pos = size, pos
