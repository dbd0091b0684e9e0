"""``ReplayBuffer``: transitions copied into storage allocated once, sampled as new tensors.

    buffer = ReplayBuffer(100_000, env.observation_space, env.action_space)    # or shapes: ReplayBuffer(100_000, (4,))
    buffer.add(obs, action, reward, next_obs, terminated, truncated)             # what env.step gave, and the action
    batch = buffer.sample(64, device="cuda")                                     # {"obs": tensor, "action": ..., ...}

A vector env's step is one ``add`` (``num_envs=N``, ``autoreset_mode=envs.metadata["autoreset_mode"]``): the
``"next_step"`` reset steps are not written, ``final_obs=infos.get("final_obs")`` is written as the endings'
``next_obs`` (``autoreset``; the modes, CleanRL's loop, measurements: docs/recipes/dqn.md, section 3).

Copy contract:

* New storage, once, at construction: one block of ``nbytes`` in the stored dtypes (uint8 frames stay uint8), numpy
  memory on the CPU (the default; keep it there and ``sample(..., device="cuda")``: on CUDA every ``add`` of host data
  waits for six copies), of which ``obs``, ``action``, ``reward``, ``next_obs``, ``terminated`` and ``truncated`` are
  views. ``add`` copies into the next rows, allocating nothing but the two temporaries ``writes`` names;
  ``sample`` gathers into new memory (pinned for a CUDA batch, copied without a wait: ``host_batch``).
* Shared: nothing with the caller (``add`` keeps none of its arrays; a batch shares nothing with the storage, so
  training code may change it in place). ``state_dict()`` shares the filled rows (not copied) and resumes the same
  ring order and the same skipped rows; it loads with ``torch.load(..., weights_only=True)``. Loaded into a new
  buffer it is the copy: ``pickle`` and ``copy`` refuse in one line (a deep copy's ``add`` wrote the original's rows).
* What autograd sees: no write (a tensor that requires grad is read through ``detach()``), so the buffer never holds
  a graph and no sample backpropagates into the network that acted; each ``add`` raises the six views' one version
  counter once, so a stored tensor saved for backward and then overwritten makes ``backward()`` raise. A refused
  ``add`` (shape, dtype, a reward not finite, a value beyond its float field: one line naming the field,
  ``fields``) writes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from copy_correct.core.checks import device as checked_device
from copy_correct.replay import host_batch, n_step
from copy_correct.replay.autoreset import parse_mode
from copy_correct.replay.base import ReplayBase
from copy_correct.replay.fields import DTypeLike, Space, check_settings, layout
from copy_correct.replay.host_batch import held, taken
from copy_correct.replay.priorities import Priorities
from copy_correct.replay.writes import EnvRows, add_for, storage

__all__ = ["ReplayBuffer"]

FIELDS = ("obs", "action", "reward", "next_obs", "terminated", "truncated")
_OF_THE_LAST = frozenset({"next_obs", "terminated", "truncated"})  # an n-step window's last transition's fields
_TORCH_GATHER_BYTES = 512 * 1024  # a field's batch from this size on is gathered by torch (see _fields_at)


class ReplayBuffer(ReplayBase):
    """Ring buffer of (obs, action, reward, next_obs, terminated, truncated), ``capacity`` rows of each.

    Args:
        capacity: transitions kept; the oldest are overwritten once full.
        obs: the observation space (``env.observation_space``; ``envs.single_observation_space`` for a vector
            env) or the shape of one observation.
        action: the action space or the shape of one action (``()``, the default: one discrete action index).
        obs_dtype: storage dtype of observations (torch or numpy dtype, ``np.uint8``, ``"uint8"``); default: the
            space's dtype, else float32.
        action_dtype: storage dtype of actions; default: the space's dtype (``Discrete``: int64), else int64.
        num_envs: ``None``: ``add`` takes one transition. ``N``: every field of ``add`` has a leading dimension
            ``N`` (a vector env's step) and ``N`` rows are written, less the reset steps skipped. With a capacity
            that is a multiple of ``N``, a step of numpy arrays as ``envs.step`` returns them is one row write per
            field (stable-baselines3's layout), the fastest way in.
        autoreset_mode: how the vector env resets (module docstring): ``envs.metadata["autoreset_mode"]``, or
            ``"next_step"``, ``"same_step"``, ``"disabled"``; ``None``: every row is stored.
        device: where the storage lives, and so where samples are gathered: the CPU (the default) unless transitions
            are made on the GPU (module docstring: on CUDA each ``add`` of host data waits for six copies).
            ``sample(..., device=)`` says where a batch goes.
        n_steps: transitions summed into each sampled one (stable-baselines3's name; ``copy_correct.replay.n_step``):
            ``sample``'s ``reward`` is the discounted sum of up to ``n_steps`` rewards of the drawn transition's env,
            ``next_obs``, ``terminated`` and ``truncated`` the window's last transition's. 1 (the default): the
            stored transitions as they are. More needs the storage on the CPU and ``gamma``.
        gamma: the agent's discount; given, a batch holds ``discounts``, ``gamma**m`` for the ``m`` transitions
            summed (the bootstrap factor; ``gamma`` with ``n_steps=1``).
        prioritized: ``True``: rows drawn by priority (``sample``'s ``beta``, ``update_priorities``;
            ``copy_correct.replay.priorities``), about 17 bytes a row more; ``False`` (the default): uniformly.
        alpha: how much the priorities count, ``P(i) ~ p_i^alpha`` (0: uniform); baselines' default, 0.6.

    Attributes:
        obs, action, reward, next_obs, terminated, truncated: the storage, ``capacity`` rows each, views of one
            block. Rewards are float32, ``terminated`` and ``truncated`` bool.
        pos: the row the next transition goes to. ``size``: how many rows hold transitions (also ``len``).
        autoreset_mode: ``"next_step"``, ``"same_step"`` or ``"disabled"`` (also when ``None`` was given).
        nbytes: the block's size in bytes: every field, each padded to a multiple of 64 bytes.
    """

    _EMPTY = "an empty ReplayBuffer"
    _every_row_drawable = True  # rows 0 .. size - 1 hold transitions

    def __init__(
        self,
        capacity: int,
        obs: Space | Sequence[int],
        action: Space | Sequence[int] = (),
        *,
        obs_dtype: DTypeLike | None = None,
        action_dtype: DTypeLike | None = None,
        num_envs: int | None = None,
        autoreset_mode: Any = None,
        device: str | torch.device = "cpu",
        n_steps: int = 1,
        gamma: float | None = None,
        prioritized: bool = False,
        alpha: float = 0.6,
    ) -> None:
        super().__init__(capacity, num_envs, n_steps, gamma, prioritized, alpha)
        if capacity < max(1, num_envs or 1):
            raise ValueError(f"capacity must be >= 1 and >= num_envs, got {capacity}")
        self.autoreset_mode = parse_mode(autoreset_mode, num_envs)
        self.capacity = capacity
        self.device = checked_device("device", device)
        self.obs_shape, obs_np = layout("obs", obs, obs_dtype, np.float32)
        self.action_shape, action_np = layout("action", action, action_dtype, np.int64)
        fields = {
            "obs": (self.obs_shape, obs_np),
            "action": (self.action_shape, action_np),
            "reward": ((), np.dtype(np.float32)),
            "next_obs": (self.obs_shape, obs_np),
            "terminated": ((), np.dtype(np.bool_)),
            "truncated": ((), np.dtype(np.bool_)),
        }
        self._on_cpu = on_cpu = self.device.type == "cpu"
        if n_steps > 1 and not on_cpu:
            raise ValueError(
                f"n_steps={n_steps} needs the buffer's storage on the CPU (device='cpu', the default), got "
                f"device={str(self.device)!r}: keep it there and sample(..., device=...) the batch onto the GPU"
            )
        self._base, self._fields = storage(capacity, fields, num_envs, self.device)
        self.nbytes = self._base.numel()
        for field in self._fields:
            setattr(self, field.name, field.tensor)
        # final_obs: one observation (whatever num_envs), written into next_obs's rows
        self._final = replace(self._fields[3], name="final_obs", add_shape=self.obs_shape)
        self._next_step = self.autoreset_mode == "next_step"
        self._skip = False  # some env's next row is its reset step
        self._rows = EnvRows(self._fields, num_envs) if on_cpu and num_envs and capacity % num_envs == 0 else None
        self._version_of = (self._base,)  # the one counter of all six tensors, raised once per add
        # n-step windows follow an env's rows: a fixed stride apart, unless next_step's skipped rows shift them
        self._next_row = self._last_row = None
        self._strides = np.arange(n_steps, dtype=np.int64) * (num_envs or 1)
        if n_steps > 1 and num_envs is not None and num_envs > 1 and self._next_step:
            self._next_row = np.full(capacity, -1, dtype=np.int64)
            self._last_row = np.full(num_envs, -1, dtype=np.int64)
            self._last_row_envs = np.arange(num_envs)
            self._linked_all = False
            self.nbytes += self._next_row.nbytes + self._last_row.nbytes
        self._add = add_for(self)  # every add's path (writes), chosen once, linked for n_steps where it must be
        self.pos = 0
        self.size = 0
        self._prioritize(capacity)
        if self._priorities is not None:
            self.nbytes += self._priorities.nbytes

    def _with_priorities(self, add: Callable[..., None], priorities: Priorities) -> Callable[..., None]:
        """``add``, then the rows it wrote given the largest priority so far: the next (one env), or the next of
        each env whose row is not a reset step left out."""
        capacity, envs = self.capacity, self.num_envs

        def add_one(buffer: Any, *fields: Any) -> None:
            pos = buffer.pos
            add(buffer, *fields)
            priorities.set_new(pos)

        def add_rows(buffer: Any, *fields: Any) -> None:
            pos, written = buffer.pos, envs - int(buffer._ended.sum()) if buffer._skip else envs
            add(buffer, *fields)
            priorities.set_new((pos + np.arange(written)) % capacity)

        return add_one if envs is None else add_rows

    def _row_written(self, rows: np.ndarray) -> np.ndarray:
        return rows < self.size

    def __len__(self) -> int:
        return self.size

    @property
    def full(self) -> bool:
        return self.size == self.capacity

    def _span(self) -> int:
        return self.size

    def _fields_at(self, rows: np.ndarray, window: n_step.Window | None, pinned: bool) -> dict[str, torch.Tensor]:
        """Each field's ``rows`` (``next_obs``, ``terminated`` and ``truncated``: the window's last rows, and its
        returns as ``reward``) gathered into new memory, the faster way for the field's size (measured by
        ``benchmarks/replay.py``): by numpy's ``take`` under 512 KiB (less overhead per call: vectors, rewards, flags);
        from there on, when torch has more than one thread, by torch's ``index_select``, which splits the copy over
        them, into an array from ``np.empty`` (numpy asks for huge pages from 4 MiB: fewer page faults). ``pinned``:
        into page-locked memory. A buffer on CUDA gathers there (``n_steps`` is 1: checked at construction)."""
        if not self._on_cpu:
            index = torch.from_numpy(rows).to(self.device)
            return {field.name: field.tensor.index_select(0, index) for field in self._fields}
        batch_size, threads, batch = len(rows), torch.get_num_threads(), {}
        last = rows if window is None else window.last
        indexes: dict[bool, torch.Tensor] = {}  # the rows (or the windows' last rows) as a tensor, made once
        for field in self._fields:
            at = last if field.name in _OF_THE_LAST else rows
            if threads > 1 and field.row_bytes * batch_size >= _TORCH_GATHER_BYTES and field.torch_gather:
                index = indexes.get(at is rows)
                if index is None:
                    index = indexes[at is rows] = torch.from_numpy(at)
                _, out = host_batch.empty((batch_size, *field.shape), field.writer.dtype, pinned)
                batch[field.name] = torch.index_select(field.tensor, 0, index, out=out)
            else:
                batch[field.name] = taken(field.writer, at, pinned)
        if window is not None:
            batch["reward"] = held(window.returns, pinned)
        return batch

    def _window(self, rows: np.ndarray) -> n_step.Window:
        """The n-step windows of the transitions at ``rows`` (``copy_correct.replay.n_step``). An env's next row is
        ``num_envs`` rows on (an ``add`` writes every env's row, in order), written if the ring's newest rows are
        that far on; where ``"next_step"`` leaves reset steps out, the link kept for it."""
        _, _, reward, _, terminated, truncated = (field.writer for field in self._fields)
        if self._next_row is None:
            ahead = self._strides
            window = (rows[:, None] + ahead) % self.capacity
            written = ahead <= ((self.pos - 1 - rows) % self.capacity)[:, None]
        else:
            window = np.empty((len(rows), self.n_steps), dtype=np.int64)
            written = np.ones((len(rows), self.n_steps), dtype=np.bool_)
            window[:, 0] = rows
            for k in range(1, self.n_steps):
                after = self._next_row[window[:, k - 1]]
                written[:, k] = after >= 0
                window[:, k] = np.where(written[:, k], after, window[:, k - 1])
        return n_step.windows(window, written, reward, terminated, truncated, self.gamma)

    def state_dict(self) -> dict[str, Any]:
        """The filled rows of each field (sharing the buffer's memory, not copied), the write position, the autoreset
        mode and ``ended``: which envs' next rows are reset steps (``"next_step"``; one flag per env).

        Each field is a tensor over a storage of its own, made with DLPack over the same memory: ``torch.save``
        refuses tensors that view one storage in several dtypes. So only the filled rows are saved. With ``n_steps``
        and ``"next_step"``'s several envs, the rows' links too (``next_row``, ``last_row``: ``writes.linked``)."""
        fields = {name: torch.from_dlpack(getattr(self, name)[: self.size]) for name in FIELDS}
        if self._next_row is not None:
            fields |= {
                "next_row": torch.from_numpy(self._next_row[: self.size]),
                "last_row": torch.from_numpy(self._last_row),
            }
        return {
            "capacity": self.capacity, "num_envs": self.num_envs, "pos": self.pos, "size": self.size,
            "autoreset_mode": self.autoreset_mode, "ended": torch.from_numpy(self._ended), **fields,
        } | self._priority_state()  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Copy a saved buffer into this one's storage (copies: nothing shared with the state); its capacity,
        ``num_envs``, shapes, dtypes and autoreset mode must be this one's, or it is refused in one line naming both:
        a ring of another capacity would count rows no transition wrote. A state saved before it held the capacity
        loads only when it never wrapped (its next row follows its last) or filled this capacity. A buffer that links
        its rows for ``n_steps`` (``state_dict``) needs a state that holds the links: one saved without them
        (``n_steps=1``) is refused, as its windows could not be found."""
        size, pos = int(state["size"]), int(state["pos"])
        if not 0 <= size <= self.capacity or not 0 <= pos < self.capacity:
            raise ValueError(f"saved buffer (size {size}, pos {pos}) does not fit capacity {self.capacity}")
        if "capacity" in state:
            check_settings(state, self, ("capacity", "num_envs"))
        elif pos != size and size != self.capacity:
            raise ValueError(
                f"saved buffer wrapped around a capacity of {size} rows (pos {pos}), this one has {self.capacity}: "
                "build the buffer with the saved capacity"
            )
        check_settings(state, self, ("autoreset_mode",))
        ended = state["ended"]
        if tuple(ended.shape) != self._ended.shape or ended.dtype != torch.bool:
            raise ValueError(f"saved ended is {tuple(ended.shape)} {ended.dtype}, expected {self._ended.shape} bool")
        for name in FIELDS:
            saved, into = state[name], getattr(self, name)
            expected = (size, *into.shape[1:])
            if tuple(saved.shape) != expected or saved.dtype != into.dtype:
                raise ValueError(
                    f"saved {name} is {tuple(saved.shape)} {saved.dtype}, expected {expected} {into.dtype}"
                )
        links = self._checked_links(state, size)
        self._check_priority_state(state)
        with torch.no_grad():
            for name in FIELDS:
                getattr(self, name)[:size].copy_(state[name])
        if links is not None:
            self._next_row[:] = -1
            self._next_row[:size], self._last_row[:] = links
            self._linked_all = self.capacity >= 3 * self.num_envs and bool((self._last_row >= 0).all())
        self._ended[:] = ended.cpu().numpy()
        self._skip = bool(self._ended.any())
        self.size, self.pos = size, pos
        self._load_priorities(state)

    def _checked_links(self, state: Mapping[str, Any], size: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The saved links of the rows (``writes.linked``) as numpy arrays, checked, if this buffer keeps them."""
        if self._next_row is None:
            return None
        if "next_row" not in state:
            raise ValueError(
                f"saved buffer has no n-step links (saved with n_steps=1?), this one has n_steps={self.n_steps} with "
                f"{self.num_envs} envs in next_step mode: load it into a buffer with n_steps=1"
            )
        links = state["next_row"].numpy(), state["last_row"].numpy()
        for name, saved, expected in zip(("next_row", "last_row"), links, ((size,), self._last_row.shape), strict=True):
            if saved.shape != expected or saved.dtype != np.int64 or ((saved < -1) | (saved >= size)).any():
                raise ValueError(f"saved {name} is {saved.shape} {saved.dtype}, expected {expected} int64 rows")
        return links
