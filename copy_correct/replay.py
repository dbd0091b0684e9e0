"""``ReplayBuffer``: preallocated transitions written outside autograd, sampled as new tensors.

    buffer = ReplayBuffer(100_000, env.observation_space, env.action_space)    # or shapes: ReplayBuffer(100_000, (4,))
    buffer.add(obs, action, reward, next_obs, terminated, truncated)             # what env.step gave, and the action
    batch = buffer.sample(64)                                                    # {"obs": tensor, "action": ..., ...}

    frames = ReplayBuffer(1_000_000, envs.single_observation_space, envs.single_action_space, num_envs=8,
                          autoreset_mode=envs.metadata["autoreset_mode"])
    frames.add(obs, actions, rewards, next_obs, terminations, truncations,
               final_obs=infos.get("final_obs"))                                # up to 8 rows; uint8 stays uint8

Vector envs, by ``autoreset_mode`` (``envs.metadata["autoreset_mode"]``, or its name; ``copy_correct._autoreset``):

* ``"next_step"`` (gymnasium 1.x's default): the step after an episode ends is the env's reset step; its row (the
  last observation to the first of the next episode, the action ignored) is no transition. The buffer remembers which
  envs' rows ended an episode at the last ``add`` and does not write their next rows: that ``add`` writes fewer rows.
  ``next_obs`` of an episode's last step is already its real last observation.
* ``"same_step"``: an env that ends resets in the same step, so its ``next_obs`` is the next episode's first
  observation. Pass the real last ones, ``final_obs=infos.get("final_obs")`` (gymnasium's object array, ``None`` for
  the envs that did not end; the key is there only at a step where one did), or ``next_obs`` with those rows replaced.
* ``"disabled"``: every row is a transition; the caller resets ended envs by hand. A single env (``num_envs=None``)
  is reset by hand: ``None`` (the default) or ``"disabled"``. With ``num_envs`` the mode must be given: a buffer
  told nothing would store a self-resetting vector env's reset steps as transitions.

In every mode ``final_obs``, where given, is taken in place of ``next_obs`` for the rows whose episode ended
(``terminated`` or ``truncated``), so each episode's real last transition is stored with its flags as given.

Copy contract:

* Storage for ``capacity`` transitions is allocated once, at construction, in the stored dtypes (uint8 frames: one
  byte per pixel): one block of ``nbytes`` bytes of which ``obs``, ``action``, ``reward``, ``next_obs``,
  ``terminated`` and ``truncated`` are views, so the six tensors share one version counter. On the CPU the block is
  numpy memory and the tensors are ``torch.from_numpy`` views of it; on CUDA it is a tensor on the device.
* ``add`` copies one transition (with ``num_envs=N``, N of them less the reset steps it skips, wrapping around the
  ring) into the next rows, one after another, so the filled rows stay contiguous: numpy arrays, tensors on any
  device, Python and numpy numbers. Every write is outside autograd: a tensor that requires grad is read through
  ``detach()``, so the buffer never holds a graph and no sample can backpropagate into the network that made an
  action. The caller's arrays are never kept: later changes to them cannot reach the buffer. ``add`` allocates no
  storage, with two exceptions, both into a CPU buffer, that make a temporary: a tensor on another device is copied
  to the host first, and a bfloat16 tensor is converted to float32 (numpy has no bfloat16). A skipped row is copied
  nowhere: the rows around it are written straight from the caller's arrays, a run of envs at a time, and
  ``final_obs`` rows over the ``next_obs`` rows just written. Telling the rows apart reads ``terminated`` and
  ``truncated`` on the host (a host sync for CUDA tensors), in ``"next_step"`` mode and when ``final_obs`` is given.
  On the CPU the writes are numpy's, which torch's probes (``CopyAudit``, ``MemoryProbe``) do not see;
  ``tracemalloc`` does. Each ``add`` raises the six tensors' version counter once, so a buffer tensor saved for
  backward and then overwritten makes ``backward()`` raise.
* An ``add`` is checked before anything is written, ``final_obs`` included: a wrong shape or dtype raises a one-line
  ``ValueError`` that names the field (and the env, for ``final_obs``), and the buffer is left as it was. So do a
  reward that is not finite (NaN, inf: refused, not counted, since every TD target it entered would be NaN) and a
  finite value beyond a floating field's range (float64 ``1e300`` into float32, which numpy would store as ``inf``
  with only a warning). Values are looked at only where they could be such: rewards, and sources wider than the
  stored dtype (float64 into float32); NaN or inf observations are stored as given. A Python float reward costs one
  comparison, a vector step's rewards one dot product (``_replay_values.finite_rewards``: 0.5-0.7 µs an ``add`` of
  8 CartPole transitions, measured against the add without it); a CUDA reward tensor is read on the host for it (a
  sync). With ``num_envs``, a single ``truncated`` flag (the default ``False``) is every env's.
* ``sample`` gathers into new memory: the batch shares nothing with the buffer, so training code can modify it
  (normalise in place, say) without corrupting the experience. Fields keep their stored dtypes. On the CPU the batch
  is numpy memory, which ``MemoryProbe`` does not count (``tracemalloc`` does). ``sample(..., device="cuda")`` from a
  buffer on the CPU gathers into pinned host memory and copies each field with ``non_blocking=True``: the host does
  not wait for the copy, and the stream orders it before the kernels that read the batch (``_host_batch``).
* ``state_dict()`` holds the filled rows of each field (sharing the buffer's memory, not copied), the write
  position, the autoreset mode and which envs' next rows are reset steps: a resumed run continues with the same
  experience, in the same ring order, and skips the same rows; it loads with ``torch.load(..., weights_only=True)``.

Where the storage lives. ``device="cuda"`` puts the storage on the GPU, so every ``add`` of host data (numpy arrays,
Python numbers: what gymnasium gives) copies each of its six fields into device memory: six host-to-device copies
from pageable memory, each of which the host waits for, after the checks of the general path (the fast paths are numpy
writes, on the CPU only). That is why an H200 measured 104.6 µs an ``add`` of a CartPole transition against
stable-baselines3's 4.7 µs, and 132 µs against 17 µs for an Atari stack (docs/gpu-results.md, "Replay buffer
(cuda)"): stable-baselines3 keeps its storage in host numpy memory whatever its ``device``, which says only where
``sample`` puts the batch. Do the same: keep the buffer on the CPU (the default) and ``sample(batch_size,
device="cuda")``, one pinned, non-blocking copy per field per batch instead of six waited-for copies per transition.
Storage on the GPU pays off only where transitions are made there (a GPU-simulated env: ``add`` then copies device to
device, with no host transfer and no wait, except for the flags read on the host in ``"next_step"`` mode or with
``final_obs``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import groupby
from typing import Any, Protocol

import numpy as np
import torch

from copy_correct import _host_batch
from copy_correct._autoreset import parse_mode
from copy_correct._checks import device as checked_device
from copy_correct._checks import integer, integral, shown
from copy_correct._replay_values import F32_MAX, F32_MIN, SQUARES, may_overflow, value_refusal
from copy_correct._torch_internals import increment_versions

__all__ = ["ReplayBuffer"]

FIELDS = ("obs", "action", "reward", "next_obs", "terminated", "truncated")

# The dtypes a buffer stores, numpy's and torch's names for each.
_TORCH_OF = {
    np.dtype(np.bool_): torch.bool,
    np.dtype(np.uint8): torch.uint8,
    np.dtype(np.int8): torch.int8,
    np.dtype(np.int16): torch.int16,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.int64): torch.int64,
    np.dtype(np.float16): torch.float16,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float64): torch.float64,
}
_NUMPY_OF = {t: n for n, t in _TORCH_OF.items()}
# What values may come in as: numpy dtypes, torch dtypes, Python number types (int counts as int64 here)
_SOURCE_DTYPES = [
    *_TORCH_OF,
    *map(np.dtype, (np.uint16, np.uint32, np.uint64)),
    *_NUMPY_OF,
    torch.bfloat16,
    bool,
    int,
    float,
]
# (source kind, field kind) stored without a check of values or widths: "b" bool, "i" integer, "f" floating
_STORED_AS_IS = frozenset({("b", "b"), ("b", "i"), ("i", "f"), ("f", "f")})
_ALIGN = 64  # bytes from one field's start to the next one's, at least
_F32_MIN, _F32_MAX = F32_MIN, F32_MAX
_TORCH_GATHER_BYTES = 512 * 1024  # a field's batch from this size on is gathered by torch (see sample)
_ndarray, _int64 = np.ndarray, np.int64  # read in add's fast path: one lookup each, not two


class Space(Protocol):
    """What the buffer reads of a gymnasium space: ``shape`` (``None`` for ``Dict`` / ``Tuple``) and ``dtype``."""

    @property
    def shape(self) -> tuple[int, ...] | None: ...

    @property
    def dtype(self) -> Any: ...


DTypeLike = torch.dtype | np.dtype | type | str


@dataclass(frozen=True)
class _Field:
    """One field: its shapes per transition and per ``add``, stored dtype, the dtypes it takes without a look at the
    values (none for rewards, whose values are always looked at: ``finite``), what ``add`` writes through (a numpy
    view of the block on the CPU, else a tensor over the block's memory), and its bytes per transition."""

    name: str
    shape: tuple[int, ...]
    add_shape: tuple[int, ...]
    dtype: torch.dtype
    accepted: frozenset[np.dtype | torch.dtype | type]
    writer: np.ndarray | torch.Tensor
    row_bytes: int
    finite: bool = False


class ReplayBuffer:
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

    Attributes:
        obs, action, reward, next_obs, terminated, truncated: the storage, ``capacity`` rows each, views of one
            block. Rewards are float32, ``terminated`` and ``truncated`` bool.
        pos: the row the next transition goes to. ``size``: how many rows hold transitions (also ``len``).
        autoreset_mode: ``"next_step"``, ``"same_step"`` or ``"disabled"`` (also when ``None`` was given).
        nbytes: the block's size in bytes: every field, each padded to a multiple of 64 bytes.
    """

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
    ) -> None:
        if num_envs is not None and integral("num_envs", num_envs, "None or an integer >= 1") < 1:
            raise ValueError(f"num_envs must be None or >= 1, got {num_envs}")
        if integral("capacity", capacity, "an integer >= 1") < max(1, num_envs or 1):
            raise ValueError(f"capacity must be >= 1 and >= num_envs, got {capacity}")
        self.autoreset_mode = parse_mode(autoreset_mode, num_envs)
        self.capacity = capacity
        self.num_envs = num_envs
        self.device = checked_device("device", device)
        self.obs_shape, obs_np = _layout("obs", obs, obs_dtype, np.float32)
        self.action_shape, action_np = _layout("action", action, action_dtype, np.int64)
        layout = {
            "obs": (self.obs_shape, obs_np),
            "action": (self.action_shape, action_np),
            "reward": ((), np.dtype(np.float32)),
            "next_obs": (self.obs_shape, obs_np),
            "terminated": ((), np.dtype(np.bool_)),
            "truncated": ((), np.dtype(np.bool_)),
        }
        sizes = {name: capacity * int(np.prod(shape)) * dtype.itemsize for name, (shape, dtype) in layout.items()}
        self.nbytes = sum(-(-size // _ALIGN) * _ALIGN for size in sizes.values())
        self._on_cpu = on_cpu = self.device.type == "cpu"
        block = np.zeros(self.nbytes, dtype=np.uint8) if on_cpu else None
        self._base = torch.from_numpy(block) if on_cpu else torch.zeros(self.nbytes, dtype=torch.uint8, device=device)
        self._fields: list[_Field] = []
        start = 0
        for name, (shape, dtype) in layout.items():
            end = start + sizes[name]
            tensor = self._base[start:end].view(_TORCH_OF[dtype]).view(capacity, *shape)  # shares _base's counter
            setattr(self, name, tensor)
            if on_cpu:
                writer = block[start:end].view(dtype).reshape(capacity, *shape)
            else:  # a tensor set to the same memory but not a view of _base: its writes leave the counter alone
                writer = torch.empty(0, dtype=tensor.dtype, device=self.device)
                writer.set_(self._base.untyped_storage(), start // dtype.itemsize, tensor.shape)
            add_shape = shape if num_envs is None else (num_envs, *shape)
            finite = name == "reward"
            accepted = frozenset() if finite else _unseen(name, tensor.dtype)
            self._fields.append(
                _Field(name, shape, add_shape, tensor.dtype, accepted, writer, sizes[name] // capacity, finite)
            )
            start += -(-sizes[name] // _ALIGN) * _ALIGN
        obs_field, next_field = self._fields[0], self._fields[3]  # final_obs: one observation, into next_obs's rows
        self._final = _Field("final_obs", self.obs_shape, self.obs_shape, obs_field.dtype, obs_field.accepted,
                             next_field.writer, obs_field.row_bytes)  # fmt: skip
        self._next_step = self.autoreset_mode == "next_step"
        self._ended = np.zeros(num_envs or 1, dtype=np.bool_)  # next_step: the env's next row is its reset step
        self._flag_rows = _flag_rows(num_envs or 1)  # truncated=False (the default) or True for every env
        self._skip = False  # some env's next row is its reset step
        self._fast = _FastPath(self._fields) if on_cpu and num_envs is None else None
        self._rows = _EnvRows(self._fields, num_envs) if on_cpu and num_envs and capacity % num_envs == 0 else None
        self._version_of = (self._base,)  # the one counter of all six tensors, raised once per add
        self.pos = 0
        self.size = 0

    def __len__(self) -> int:
        return self.size

    @property
    def full(self) -> bool:
        return self.size == self.capacity

    def add(
        self,
        obs: Any,
        action: Any,
        reward: Any,
        next_obs: Any,
        terminated: Any,
        truncated: Any = False,
        *,
        final_obs: Any = None,
    ) -> None:
        """Copy one transition (``num_envs=N``: N transitions, each field with a leading dimension N) into the next
        rows, overwriting the oldest once full. Fields: numpy arrays, tensors (detached; any device), or Python and
        numpy numbers. Checked before anything is written: a wrong shape or dtype is a ``ValueError`` naming the
        field, a float never goes into an integer field nor a bool into a floating one, and the buffer is unchanged.

        Refused too: a reward that is not finite (NaN, inf) and a finite value beyond a floating field's range
        (float64 ``1e300`` into float32, stored as ``inf`` otherwise). With ``num_envs``, a single ``truncated`` flag
        (the default ``False``) is every env's.

        In ``"next_step"`` mode the rows of the envs whose last row ended an episode are their reset steps and are
        not written; the rows written follow one another. ``final_obs`` (``infos.get("final_obs")``, ``"same_step"``
        mode): the real last observations, one per env (``None`` for an env that did not end), written in place of
        ``next_obs`` for the rows whose episode ended; ``None``: ``next_obs`` is stored as it is.
        """
        fast = self._fast
        if (  # one transition as an environment loop has it, in exactly the stored dtypes: nothing to convert
            fast is not None
            and final_obs is None
            and type(obs) is _ndarray
            and type(next_obs) is _ndarray
            and obs.dtype is next_obs.dtype is fast.obs_dtype
            and obs.shape == next_obs.shape == fast.obs_shape
            and isinstance(reward, float)
            and _F32_MIN <= reward <= _F32_MAX
            and type(terminated) is bool
            and type(truncated) is bool
            and (
                (type(action) is int or type(action) is _int64) and fast.action_min <= action <= fast.action_max
                if fast.action is not None
                else type(action) is _ndarray
                and action.dtype is fast.action_dtype
                and action.shape == fast.action_shape
            )
        ):
            pos = self.pos
            row = fast.row
            if row:
                fast.obs[pos * row : pos * row + row] = obs
                fast.next_obs[pos * row : pos * row + row] = next_obs
            else:
                fast.obs[pos] = obs
                fast.next_obs[pos] = next_obs
            if fast.action is not None:
                fast.action[pos] = action
            else:
                fast.action_array[pos] = action
            fast.reward[pos] = reward
            fast.terminated[pos] = terminated
            fast.truncated[pos] = truncated
            increment_versions(self._version_of)
            pos += 1
            self.pos = 0 if pos == self.capacity else pos
            if self.size < self.capacity:
                self.size += 1
            return
        if self.num_envs is not None and isinstance(truncated, (bool, np.bool_)):  # one flag for every env
            truncated = self._flag_rows[bool(truncated)]
        values = (obs, action, reward, next_obs, terminated, truncated)
        rows = self._rows
        if (  # a vector env's step as it comes, every row a transition
            rows is not None and final_obs is None and not self._skip and not self.pos % rows.n and rows.fits(values)
        ):
            at = self.pos // rows.n
            o, a, r, n, te, tr = rows.arrays
            o[at], a[at], r[at], n[at], te[at], tr[at] = values
            increment_versions(self._version_of)
            self.pos = (self.pos + rows.n) % self.capacity
            self.size = min(self.size + rows.n, self.capacity)
            # next_step: the envs whose episode ended take their reset step next (count_nonzero: the cheapest look)
            if self._next_step and (np.count_nonzero(terminated) or np.count_nonzero(truncated)):
                np.logical_or(terminated, truncated, out=self._ended)
                self._skip = True
            return
        fields = self._fields
        if self._on_cpu:  # arrays of a dtype and shape that fit are written as they are (numpy casts them)
            sources = [
                v if type(v) is _ndarray and v.dtype in f.accepted and v.shape == f.add_shape else self._checked(f, v)
                for f, v in zip(fields, values, strict=True)
            ]
        else:
            sources = [self._checked(f, v) for f, v in zip(fields, values, strict=True)]
        done = _flags(sources[4]) | _flags(sources[5]) if self._next_step or final_obs is not None else None
        skipped = self._ended if self._skip else None  # next_step: these envs' rows are their reset steps
        finals = () if final_obs is None else self._finals(final_obs, done if skipped is None else done & ~skipped)
        pos, written = self.pos, 0  # everything is checked: from here on, only writes
        if self.num_envs is None:
            for field, source in zip(fields, sources, strict=True):
                field.writer[pos] = source
            written = 1
        else:
            for first, stop in _runs(skipped, self.num_envs):
                self._write_rows(sources, first, stop, (pos + written) % self.capacity)
                written += stop - first
        for env, value in finals:  # each over the next_obs row its env's transition was just written to
            row = env if skipped is None else env - int(skipped[:env].sum())
            self._final.writer[(pos + row) % self.capacity] = value
        increment_versions(self._version_of)
        self.pos = (pos + written) % self.capacity
        self.size = min(self.size + written, self.capacity)
        if self._next_step:
            ended = self._ended
            ended[:] = done & ~ended  # a reset step ends no episode
            self._skip = bool(ended.any())

    def _write_rows(self, sources: list[Any], first: int, stop: int, pos: int) -> None:
        """The rows ``first:stop`` of every field's source (envs that follow one another) into the ring from row
        ``pos``, wrapping around its end; slices of the sources, so nothing is copied on the way."""
        split = min(stop - first, self.capacity - pos)
        for field, source in zip(self._fields, sources, strict=True):
            field.writer[pos : pos + split] = source[first : first + split]
            if first + split < stop:  # the rows wrap around the end of the ring
                field.writer[: stop - first - split] = source[first + split : stop]

    def _finals(self, final_obs: Any, ended: np.ndarray) -> list[tuple[int, Any]]:
        """``(env, observation)``, checked, for each env of ``ended`` (whose row is written and ends an episode):
        its row of ``final_obs``, one observation per env (gymnasium's object array: ``None`` where none ended)."""
        if self.num_envs is None:
            return [(0, self._checked(self._final, final_obs))] if ended[0] else []
        rows = len(final_obs) if isinstance(final_obs, (list, tuple)) or getattr(final_obs, "ndim", 0) else None
        if rows != self.num_envs:
            got = type(final_obs).__name__ + ("" if rows is None else f" of {rows} rows")
            raise ValueError(f"final_obs must hold one observation per env ({self.num_envs}), got {got}")
        finals = []
        for env in np.flatnonzero(ended).tolist():
            if final_obs[env] is None:
                raise ValueError(f"final_obs of env {env} is None, but its episode ended: pass this step's final_obs")
            finals.append((env, self._checked(replace(self._final, name=f"final_obs of env {env}"), final_obs[env])))
        return finals

    def _checked(self, field: _Field, value: Any) -> Any:
        """``value`` ready to be written into ``field`` (a tensor detached, and on the CPU as numpy); raises a
        ``ValueError`` naming the field if its shape or dtype does not fit, before anything is written."""
        if isinstance(value, torch.Tensor):
            value = value.detach()  # Copy decision: the buffer never holds, nor writes through, a graph
            dtype, shape = value.dtype, tuple(value.shape)
        elif isinstance(value, (np.ndarray, np.bool_, np.integer, np.floating)):
            dtype, shape = value.dtype, value.shape
        elif type(value) in (bool, int, float):
            dtype, shape = type(value), ()
        else:
            raise TypeError(f"{field.name} must be a numpy array, a tensor or a number, got {type(value).__name__}")
        if shape != field.add_shape:
            per_add = (
                "" if field.add_shape == field.shape else f" and {self.num_envs} per add: expected {field.add_shape}"
            )
            raise ValueError(f"{field.name} has shape {shape}, the buffer stores {field.shape} per transition{per_add}")
        if dtype not in field.accepted:  # a number's value may still fit; anything else is refused
            number = value if isinstance(value, (bool, int, float, np.generic)) else None
            refusal = _refusal(field.name, dtype, number, field.dtype)
            if refusal is None and (field.finite or may_overflow(dtype, field.dtype)):  # values the dtype cannot hold
                refusal = value_refusal(field.name, value, field.dtype, field.finite)
            if refusal is not None:
                raise ValueError(refusal)
        if self._on_cpu and isinstance(value, torch.Tensor):
            value = value.cpu()  # a host copy when the tensor is on another device
            return (value.float() if value.dtype == torch.bfloat16 else value).numpy()  # numpy has no bfloat16
        if not self._on_cpu and isinstance(value, (np.ndarray, np.generic)):  # torch writes tensors and Python numbers
            return torch.from_numpy(value) if isinstance(value, np.ndarray) else value.item()
        return value

    def sample(
        self, batch_size: int, generator: torch.Generator | None = None, *, device: str | torch.device | None = None
    ) -> dict[str, torch.Tensor]:
        """``batch_size`` transitions drawn uniformly with replacement, as new tensors on ``device`` (default: the
        buffer's), in the stored dtypes. The indices come from ``torch.randint`` on the CPU with ``generator``.

        On the CPU the batch is gathered the faster way for each field's size (measured by ``benchmarks/replay.py``):
        by numpy's ``take`` under 512 KiB (less overhead per call: vectors, rewards, flags); from there on, when torch
        has more than one thread, by torch's ``index_select``, which splits the copy over them, into an array from
        ``np.empty`` (numpy asks for huge pages from 4 MiB: fewer page faults). For ``device="cpu"`` the batch is that
        numpy memory, which ``MemoryProbe`` does not count (``tracemalloc`` does). For a CUDA ``device`` it is gathered
        the same way into pinned host memory and copied with ``non_blocking=True``: one copy per field that the host
        does not wait for (``copy_correct._host_batch``). A buffer on CUDA gathers there, and copies to another
        ``device`` (to the CPU: a copy the host waits for)."""
        if self.size == 0:
            raise ValueError("cannot sample from an empty ReplayBuffer")
        _check_sample(batch_size, generator)
        target = self.device if device is None else checked_device("device", device)
        index = torch.randint(self.size, (batch_size,), generator=generator, device="cpu")
        if not self._on_cpu:
            index = index.to(self.device)
            batch = {name: getattr(self, name).index_select(0, index) for name in FIELDS}
            return batch if target == self.device else _host_batch.moved(batch, target)
        rows, threads, batch = index.numpy(), torch.get_num_threads(), {}
        pinned = target.type == "cuda"
        for field in self._fields:
            shape = (batch_size, *field.shape)
            if threads > 1 and field.row_bytes * batch_size >= _TORCH_GATHER_BYTES:
                _, out = _host_batch.empty(shape, field.writer.dtype, pinned)
                batch[field.name] = torch.index_select(getattr(self, field.name), 0, index, out=out)
            elif pinned:
                array, out = _host_batch.empty(shape, field.writer.dtype, pinned)
                field.writer.take(rows, axis=0, out=array, mode="clip")  # rows are in range: clip skips a buffer
                batch[field.name] = out
            else:
                batch[field.name] = torch.from_numpy(field.writer.take(rows, axis=0))
        return batch if target.type == "cpu" else _host_batch.moved(batch, target)

    def state_dict(self) -> dict[str, Any]:
        """The filled rows of each field (sharing the buffer's memory, not copied), the write position, the autoreset
        mode and ``ended``: which envs' next rows are reset steps (``"next_step"``; one flag per env).

        Each field is a tensor over a storage of its own, made with DLPack over the same memory: ``torch.save``
        refuses tensors that view one storage in several dtypes. So only the filled rows are saved."""
        fields = {name: torch.from_dlpack(getattr(self, name)[: self.size]) for name in FIELDS}
        return {
            "pos": self.pos, "size": self.size, "autoreset_mode": self.autoreset_mode,
            "ended": torch.from_numpy(self._ended), **fields,
        }  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Copy a saved buffer into this one's storage; its size, shapes, dtypes, autoreset mode and envs must fit."""
        size, pos = int(state["size"]), int(state["pos"])
        if not 0 <= size <= self.capacity or not 0 <= pos < self.capacity:
            raise ValueError(f"saved buffer (size {size}, pos {pos}) does not fit capacity {self.capacity}")
        if state["autoreset_mode"] != self.autoreset_mode:
            raise ValueError(
                f"saved buffer has autoreset_mode={state['autoreset_mode']!r}, this one {self.autoreset_mode!r}"
            )
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
        with torch.no_grad():
            for name in FIELDS:
                getattr(self, name)[:size].copy_(state[name])
        self._ended[:] = ended.cpu().numpy()
        self._skip = bool(self._ended.any())
        self.size, self.pos = size, pos


class _FastPath:
    """What ``add`` writes one transition through on a CPU buffer when the inputs are already in the stored dtypes
    and shapes: ``memoryview`` item and slice assignment, which costs about half of numpy's ``array[pos] = x`` for a
    few numbers (observations of more than one dimension, frames, are written by numpy)."""

    def __init__(self, fields: list[_Field]) -> None:
        arrays = {field.name: field.writer for field in fields}
        flat = {name: memoryview(array.reshape(-1)) for name, array in arrays.items()}
        self.obs_dtype, self.obs_shape = arrays["obs"].dtype, arrays["obs"].shape[1:]
        self.row = self.obs_shape[0] if len(self.obs_shape) == 1 else 0  # numbers per observation, if 1-D
        self.obs = flat["obs"] if self.row else arrays["obs"]
        self.next_obs = flat["next_obs"] if self.row else arrays["next_obs"]
        self.action_dtype, self.action_shape = arrays["action"].dtype, arrays["action"].shape[1:]
        self.action_array = arrays["action"]
        is_index = self.action_shape == () and self.action_dtype.kind in "iu"
        self.action = flat["action"] if is_index else None  # one discrete action, a Python or numpy int
        info = np.iinfo(self.action_dtype) if is_index else None
        self.action_min, self.action_max = (int(info.min), int(info.max)) if info is not None else (0, 0)
        self.reward, self.terminated, self.truncated = flat["reward"], flat["terminated"], flat["truncated"]


class _EnvRows:
    """What ``add`` writes a vector env's step through on a CPU buffer whose capacity is a multiple of ``num_envs``:
    each field viewed as ``(capacity // N, N, ...)``, so the N transitions of a step are one row of each field (one
    numpy integer-index assignment, stable-baselines3's layout) whenever the write position is a multiple of N."""

    def __init__(self, fields: list[_Field], num_envs: int) -> None:
        self.n = num_envs
        self.arrays = tuple(f.writer.reshape(-1, num_envs, *f.shape) for f in fields)
        obs, action, reward, _, flag, _ = fields  # next_obs is checked as obs, truncated as terminated
        self.obs_shape, self.obs_dtype, self.obs_takes = obs.add_shape, obs.writer.dtype, obs.accepted
        self.action_shape, self.action_dtype, self.action_takes = action.add_shape, action.writer.dtype, action.accepted
        self.reward_takes, self.flag_takes = _unseen("reward", reward.dtype, any_range=True), flag.accepted
        self.step_shape = (num_envs,)

    def fits(self, values: tuple[Any, ...]) -> bool:
        """Whether every value is a numpy array of the step's shape, in a dtype its field takes as it is, and every
        reward finite within float32 (one expression: a loop over the fields costs as much as the writes)."""
        o, a, r, n, te, tr = values
        nd, step = _ndarray, self.step_shape
        return (
            type(o) is nd and type(a) is nd and type(r) is nd and type(n) is nd and type(te) is nd and type(tr) is nd
            and o.shape == self.obs_shape and n.shape == self.obs_shape and a.shape == self.action_shape
            and r.shape == step and te.shape == step and tr.shape == step
            and (o.dtype is self.obs_dtype or o.dtype in self.obs_takes)
            and (n.dtype is self.obs_dtype or n.dtype in self.obs_takes)
            and (a.dtype is self.action_dtype or a.dtype in self.action_takes)
            and r.dtype in self.reward_takes and te.dtype in self.flag_takes and tr.dtype in self.flag_takes
            and (r.dtype.kind != "f" or float(r.dot(r)) <= SQUARES)  # finite_rewards, inlined: 0.1 µs less
        )  # fmt: skip


def _unseen(name: str, stored: torch.dtype, any_range: bool = False) -> frozenset[np.dtype | torch.dtype | type]:
    """The source dtypes field ``name`` stores as ``stored`` without a look at the values: none whose values could
    change (``_refusal``) and none with finite values beyond a floating ``stored``'s range (float64 into float32: those
    are looked at). A Python int is never taken unseen: it has no range (2**64 into int64). ``any_range``: the dtypes
    ``_refusal`` allows, whatever their range (for rewards, whose values are looked at anyway)."""
    return frozenset(
        d
        for d in _SOURCE_DTYPES
        if d is not int and _refusal(name, d, None, stored) is None and (any_range or not may_overflow(d, stored))
    )


def _flag_rows(num_envs: int) -> tuple[np.ndarray, np.ndarray]:
    """A row of ``False`` and one of ``True`` for ``num_envs`` envs, read-only: a single flag given for all of them."""
    rows = np.zeros(num_envs, dtype=np.bool_), np.ones(num_envs, dtype=np.bool_)
    for row in rows:
        row.flags.writeable = False
    return rows


def _check_sample(batch_size: Any, generator: Any) -> None:
    """``sample``'s arguments: ``batch_size`` an integer >= 1 (``"64"`` and ``True`` are ``TypeError``s), ``generator``
    a ``torch.Generator`` or ``None``; a plain call costs two type checks."""
    if type(batch_size) is not int or batch_size < 1:
        integer("batch_size", batch_size, 1)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {shown(generator)}")


def _flags(value: Any) -> np.ndarray:
    """Checked ``terminated`` or ``truncated`` as a numpy bool array of one row per env, on the host."""
    if isinstance(value, torch.Tensor):
        value = value.cpu().numpy()
    return np.asarray(value, dtype=np.bool_).reshape(-1)


def _runs(skipped: np.ndarray | None, num_envs: int) -> list[tuple[int, int]]:
    """The envs whose rows are written, as runs ``(first, stop)`` of envs that follow one another."""
    if skipped is None:
        return [(0, num_envs)]
    runs, env = [], 0
    for skip, group in groupby(skipped.tolist()):
        stop = env + len(list(group))
        if not skip:
            runs.append((env, stop))
        env = stop
    return runs


def _layout(name: str, spec: Any, dtype: DTypeLike | None, default: type) -> tuple[tuple[int, ...], np.dtype]:
    """The per-transition shape and storage dtype of field ``name`` from a space or a shape, and a dtype or None."""
    if hasattr(spec, "shape") and hasattr(spec, "dtype") and not isinstance(spec, (np.ndarray, torch.Tensor)):
        if spec.shape is None:
            raise TypeError(
                f"{name}: a {type(spec).__name__} space has no single shape and dtype; flatten it first "
                "(gymnasium.wrappers.FlattenObservation for observations, gymnasium.spaces.flatten_space for actions)"
            )
        shape, space_dtype = tuple(int(d) for d in spec.shape), spec.dtype
    elif isinstance(spec, Sequence) and all(
        isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0 for d in spec
    ):
        shape, space_dtype = tuple(int(d) for d in spec), None
    else:
        raise TypeError(f"{name} must be a gymnasium space or a shape (a sequence of ints), got {spec!r}")
    chosen = dtype if dtype is not None else space_dtype if space_dtype is not None else default
    try:
        resolved = _NUMPY_OF.get(chosen) if isinstance(chosen, torch.dtype) else np.dtype(chosen)
    except TypeError:
        resolved = None
    if resolved not in _TORCH_OF:
        allowed = ", ".join(str(d) for d in _TORCH_OF)
        raise ValueError(f"{name} dtype {chosen} is not one the buffer stores ({allowed})")
    return shape, resolved


def _kind(dtype: np.dtype | torch.dtype | type) -> str:
    """``"b"`` (bool), ``"i"`` (integer), ``"f"`` (floating) or another letter for anything else."""
    if isinstance(dtype, type):  # a Python number's type
        return {bool: "b", int: "i", float: "f"}[dtype]
    if isinstance(dtype, torch.dtype):
        if dtype == torch.bool:
            return "b"
        return "f" if dtype.is_floating_point else "c" if dtype.is_complex else "i"
    return {"b": "b", "i": "i", "u": "i", "f": "f"}.get(dtype.kind, dtype.kind)


def _refusal(name: str, dtype: np.dtype | torch.dtype | type, number: Any, stored: torch.dtype) -> str | None:
    """Why field ``name`` refuses a value of ``dtype`` (``number``: the value, for numbers), one line naming both
    dtypes, or None. Refused: what storing would change: a float into an integer field, a bool into a floating one,
    anything but a bool into a bool one, an integer array whose dtype the field cannot hold, a number out of range."""
    kinds = (_kind(dtype), _kind(stored))
    if kinds in _STORED_AS_IS:
        return None
    if kinds == ("i", "i"):
        info = torch.iinfo(stored)
        if number is not None:
            fits = info.min <= int(number) <= info.max
            return None if fits else f"{name} is {int(number)}, outside the range of the buffer's {_name(stored)}"
        source = torch.iinfo(dtype) if isinstance(dtype, torch.dtype) else np.iinfo(dtype)
        if info.min <= source.min and source.max <= info.max:
            return None
        reason = "its values could wrap around (convert it first)"
    elif kinds[1] == "b":
        reason = "only bools are stored as bools"
    elif kinds[1] == "f":
        reason = "only integers and floats are stored as floats"
    else:
        reason = "a float would be truncated (convert it first, or store floats)"
    return f"{name} has dtype {_name(dtype)}, the buffer stores {_name(stored)}: {reason}"


def _name(dtype: np.dtype | torch.dtype | type) -> str:
    return dtype.__name__ if isinstance(dtype, type) else str(dtype).removeprefix("torch.")
