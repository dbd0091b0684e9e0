"""``ReplayBuffer``'s storage (``storage``: one block, a view of it per field) and ``add``'s paths into it, one per
mode, chosen once at construction (``add_for``), with n-step links where it needs them (``linked``):

* ``one_env_on_cpu``: one transition as an environment loop has it (a numpy observation in the stored dtype, a Python
  int action, a Python float reward, Python bools), written through ``memoryview``s; any other, ``one_env``.
* ``vector_rows_on_cpu``: a vector env's step as ``envs.step`` gives it, every row a transition, at a position that
  is a multiple of ``num_envs``: one row write per field of a ``(capacity // N, N, ...)`` view; any other,
  ``vector_env``.
* ``one_env`` and ``vector_env``: anything ``add`` takes, on any device, each field through ``fields.checked``; the
  rows of ``"next_step"``'s reset steps are left out (written around, a run of envs at a time) and ``final_obs`` is
  written over the ``next_obs`` rows of the endings. Telling those rows apart reads the flags on the host (a CUDA sync).

Copy contract: every path checks every field before writing any (a refused ``add`` leaves the buffer as it was),
writes outside autograd (a tensor is read through ``detach()``; on the CPU the writes are numpy's, which torch's
probes do not see, ``tracemalloc`` does), keeps nothing of the caller's, and raises the storage's one version counter
once. New memory only where ``fields.checked`` makes it: a host copy of a tensor on another device and a float32 copy
of a bfloat16 one (numpy has none), into a CPU buffer; a 0-d host array for a number into a uint64 field elsewhere.
``linked`` writes the rows' links into arrays the buffer allocated at construction.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import groupby
from typing import Any

import numpy as np
import torch

from copy_correct.core.torch_internals import increment_versions
from copy_correct.replay.fields import TORCH_OF, Spec, checked, field_spec, unseen
from copy_correct.replay.values import F32_MAX, F32_MIN, SQUARES

__all__ = [
    "EnvRows", "Field", "add_for", "linked", "one_env", "one_env_on_cpu", "storage", "vector_env", "vector_rows_on_cpu",
]  # fmt: skip

_ALIGN = 64  # bytes from one field's start to the next one's, at least
_ndarray, _int64 = np.ndarray, np.int64  # read on every add: one lookup each, not two


@dataclass(frozen=True)
class Field(Spec):
    """One field: what a value of it must be (``Spec``: none of the dtypes taken unseen for rewards, whose values are
    always looked at), its tensor (a view of the block), what ``add`` writes through (a numpy view of the block on the
    CPU, else a tensor over the block's memory, which leaves the version counter to ``add``), its bytes per transition,
    and whether ``sample`` may gather it on the CPU with torch's ``index_select``: not a field of one number per
    transition in uint16, uint32 or uint64, for which torch's CPU ``index_select`` has no kernel before 2.14
    (``"index_select" not implemented for 'UInt16'``): numpy's ``take`` gathers it."""

    tensor: torch.Tensor
    writer: np.ndarray | torch.Tensor
    row_bytes: int
    torch_gather: bool = True


def storage(capacity: int, layout: dict[str, tuple[tuple[int, ...], np.dtype]], num_envs: int | None,
            device: torch.device) -> tuple[torch.Tensor, list[Field]]:  # fmt: skip
    """One zeroed block of bytes on ``device`` and, for each field of ``layout`` (its shape per transition and dtype),
    ``capacity`` rows of it, each field's start aligned to ``_ALIGN`` bytes."""
    on_cpu = device.type == "cpu"
    sizes = {name: capacity * int(np.prod(shape)) * dtype.itemsize for name, (shape, dtype) in layout.items()}
    nbytes = sum(-(-size // _ALIGN) * _ALIGN for size in sizes.values())
    block = np.zeros(nbytes, dtype=np.uint8) if on_cpu else None
    base = torch.from_numpy(block) if on_cpu else torch.zeros(nbytes, dtype=torch.uint8, device=device)
    fields, start = [], 0
    for name, (shape, dtype) in layout.items():
        end = start + sizes[name]
        tensor = base[start:end].view(TORCH_OF[dtype]).view(capacity, *shape)  # shares base's counter
        if on_cpu:
            writer = block[start:end].view(dtype).reshape(capacity, *shape)
        else:  # a tensor set to the same memory but not a view of base: its writes leave the counter alone
            writer = torch.empty(0, dtype=tensor.dtype, device=device)
            writer.set_(base.untyped_storage(), start // dtype.itemsize, tensor.shape)
        row_bytes = sizes[name] // capacity
        torch_gather = bool(shape) or dtype.kind != "u" or dtype.itemsize == 1  # Field: torch's CPU index_select
        spec = vars(field_spec(name, shape, tensor.dtype, num_envs))
        fields.append(Field(**spec, tensor=tensor, writer=writer, row_bytes=row_bytes, torch_gather=torch_gather))
        start += -(-sizes[name] // _ALIGN) * _ALIGN
    return base, fields


def add_for(buffer: Any) -> Callable[..., None]:
    """The path of ``buffer``'s every ``add``, from where its storage lives, ``num_envs`` and its capacity; ``linked``
    where the buffer keeps its rows' links (``_next_row``: ``n_steps`` with ``"next_step"``'s several envs)."""
    if buffer.num_envs is None:
        path = one_env_on_cpu(buffer._fields, buffer._version_of, buffer.capacity) if buffer._on_cpu else one_env
    else:
        path = vector_rows_on_cpu if buffer._rows is not None else vector_env
    return path if buffer._next_row is None else linked(path)


def linked(add: Callable[..., None]) -> Callable[..., None]:
    """``add``, keeping each env's rows linked, oldest to newest, for the n-step windows (``"next_step"`` with several
    envs: the envs whose reset steps are left out shift the others' rows, so an env's next row is not a fixed stride
    away). ``buffer._next_row[r]``: the row of the next transition of row ``r``'s env, or -1 (none yet);
    ``buffer._last_row[e]``: env ``e``'s newest row, or -1; ``buffer._linked_all``: every env has one, and none can be
    overwritten before its next (the common step then takes three writes). A refused ``add`` raises before the links
    change."""

    def add_linked(buffer: Any, *fields: Any) -> None:
        pos, skipped = buffer.pos, buffer._ended.copy() if buffer._skip else None
        add(buffer, *fields)
        following, last, envs = buffer._next_row, buffer._last_row, buffer._last_row_envs
        if skipped is None and buffer._linked_all and pos + len(envs) <= buffer.capacity:  # the common step
            rows = envs + pos
            following[pos : pos + len(envs)] = -1
            following[last] = rows
            last[:] = rows
            return
        if skipped is not None:
            envs = np.flatnonzero(~skipped)
        rows = (pos + np.arange(len(envs))) % buffer.capacity
        following[rows] = -1
        if buffer.capacity < 3 * buffer.num_envs:  # an env's newest row may be overwritten before its next is written
            last[np.isin(last, rows)] = -1
        previous = last[envs]
        linking = previous >= 0
        following[previous[linking]] = rows[linking]
        last[envs] = rows
        buffer._linked_all = buffer.capacity >= 3 * buffer.num_envs and bool((last >= 0).all())

    return add_linked


def one_env_on_cpu(fields: list[Field], versions: tuple[torch.Tensor], capacity: int) -> Callable[..., None]:
    """The path of a one-env buffer on the CPU: a transition in exactly the stored dtypes, as an environment loop has
    it, written through ``memoryview`` items and slices, which cost about half of numpy's ``array[pos] = x`` for a few
    numbers (an observation of more than one dimension, a frame, is written by numpy); any other, ``one_env``. What
    it writes through, compares with and raises the version counter of (``versions``) is bound here, once: a
    closure's cells are read faster than attributes."""
    arrays = {field.name: field.writer for field in fields}
    flat = {name: memoryview(array.reshape(-1)) for name, array in arrays.items()}
    obs_dtype, obs_shape = arrays["obs"].dtype, arrays["obs"].shape[1:]
    row = obs_shape[0] if len(obs_shape) == 1 else 0  # numbers per observation, if 1-D
    obs_rows, next_rows = (flat["obs"], flat["next_obs"]) if row else (arrays["obs"], arrays["next_obs"])
    action_dtype, action_shape, action_rows = arrays["action"].dtype, arrays["action"].shape[1:], arrays["action"]
    is_index = action_shape == () and action_dtype.kind in "iu"  # one discrete action, a Python or numpy int
    index = flat["action"] if is_index else None
    lowest, highest = (int(np.iinfo(action_dtype).min), int(np.iinfo(action_dtype).max)) if is_index else (0, 0)
    rewards, terminations, truncations = flat["reward"], flat["terminated"], flat["truncated"]

    def add(buffer: Any, obs: Any, action: Any, reward: Any, next_obs: Any, terminated: Any, truncated: Any,
            final_obs: Any) -> None:  # fmt: skip
        if (
            final_obs is None
            and type(obs) is _ndarray
            and type(next_obs) is _ndarray
            and obs.dtype is next_obs.dtype is obs_dtype
            and obs.shape == next_obs.shape == obs_shape
            and isinstance(reward, float)
            and F32_MIN <= reward <= F32_MAX
            and type(terminated) is bool
            and type(truncated) is bool
            and (
                (type(action) is int or type(action) is _int64) and lowest <= action <= highest
                if is_index
                else type(action) is _ndarray and action.dtype is action_dtype and action.shape == action_shape
            )
        ):
            pos = buffer.pos
            if row:
                start = pos * row
                obs_rows[start : start + row] = obs
                next_rows[start : start + row] = next_obs
            else:
                obs_rows[pos] = obs
                next_rows[pos] = next_obs
            if is_index:
                index[pos] = action
            else:
                action_rows[pos] = action
            rewards[pos] = reward
            terminations[pos] = terminated
            truncations[pos] = truncated
            increment_versions(versions)
            pos += 1
            buffer.pos = 0 if pos == capacity else pos
            if buffer.size < capacity:
                buffer.size += 1
            return
        one_env(buffer, obs, action, reward, next_obs, terminated, truncated, final_obs)

    return add


def vector_rows_on_cpu(buffer: Any, obs: Any, action: Any, reward: Any, next_obs: Any, terminated: Any,
                       truncated: Any, final_obs: Any) -> None:  # fmt: skip
    """A vector env's step as it comes, every row a transition, at a position that starts a row of the view."""
    if isinstance(truncated, (bool, np.bool_)):  # one flag for every env
        truncated = buffer._flag_rows[bool(truncated)]
    values = (obs, action, reward, next_obs, terminated, truncated)
    rows = buffer._rows
    if final_obs is not None or buffer._skip or buffer.pos % rows.n or not rows.fits(values):
        vector_env(buffer, obs, action, reward, next_obs, terminated, truncated, final_obs)
        return
    at = buffer.pos // rows.n
    o, a, r, n, te, tr = rows.arrays
    o[at], a[at], r[at], n[at], te[at], tr[at] = values
    increment_versions(buffer._version_of)
    buffer.pos = (buffer.pos + rows.n) % buffer.capacity
    buffer.size = min(buffer.size + rows.n, buffer.capacity)
    # next_step: the envs whose episode ended take their reset step next (count_nonzero: the cheapest look)
    if buffer._next_step and (np.count_nonzero(terminated) or np.count_nonzero(truncated)):
        np.logical_or(terminated, truncated, out=buffer._ended)
        buffer._skip = True


def one_env(buffer: Any, obs: Any, action: Any, reward: Any, next_obs: Any, terminated: Any, truncated: Any,
            final_obs: Any) -> None:  # fmt: skip
    """One transition, each field checked (and converted where it must be); ``final_obs`` over ``next_obs`` if the
    episode ended."""
    sources = _sources(buffer, (obs, action, reward, next_obs, terminated, truncated))
    ended = final_obs is not None and (_flags(sources[4]) | _flags(sources[5]))[0]
    final = checked(buffer._final, final_obs, buffer.num_envs, host=buffer._on_cpu) if ended else None
    pos = buffer.pos  # everything is checked: from here on, only writes
    for field, source in zip(buffer._fields, sources, strict=True):
        field.writer[pos] = source
    if ended:
        buffer._final.writer[pos] = final
    increment_versions(buffer._version_of)
    buffer.pos = (pos + 1) % buffer.capacity
    buffer.size = min(buffer.size + 1, buffer.capacity)


def vector_env(buffer: Any, obs: Any, action: Any, reward: Any, next_obs: Any, terminated: Any, truncated: Any,
               final_obs: Any) -> None:  # fmt: skip
    """A vector env's step, each field checked: the rows of the envs whose last row ended an episode are skipped in
    ``"next_step"`` mode, and the rows written follow one another; ``final_obs`` over the endings' ``next_obs``."""
    if isinstance(truncated, (bool, np.bool_)):  # one flag for every env
        truncated = buffer._flag_rows[bool(truncated)]
    sources = _sources(buffer, (obs, action, reward, next_obs, terminated, truncated))
    done = _flags(sources[4]) | _flags(sources[5]) if buffer._next_step or final_obs is not None else None
    skipped = buffer._ended if buffer._skip else None  # next_step: these envs' rows are their reset steps
    finals = () if final_obs is None else _finals(buffer, final_obs, done if skipped is None else done & ~skipped)
    pos, written, capacity = buffer.pos, 0, buffer.capacity  # everything is checked: from here on, only writes
    for first, stop in _runs(skipped, buffer.num_envs):
        _write_rows(buffer, sources, first, stop, (pos + written) % capacity)
        written += stop - first
    for env, value in finals:  # each over the next_obs row its env's transition was just written to
        row = env if skipped is None else env - int(skipped[:env].sum())
        buffer._final.writer[(pos + row) % capacity] = value
    increment_versions(buffer._version_of)
    buffer.pos = (pos + written) % capacity
    buffer.size = min(buffer.size + written, capacity)
    if buffer._next_step:
        ended = buffer._ended
        ended[:] = done & ~ended  # a reset step ends no episode
        buffer._skip = bool(ended.any())


def _sources(buffer: Any, values: tuple[Any, ...]) -> list[Any]:
    """Each field's value ready to be written; on the CPU, arrays of a dtype and shape that fit as they are (numpy
    casts them)."""
    num_envs = buffer.num_envs
    if buffer._on_cpu:
        return [
            v if type(v) is _ndarray and v.dtype in f.accepted and v.shape == f.add_shape else checked(f, v, num_envs)
            for f, v in zip(buffer._fields, values, strict=True)
        ]
    return [checked(f, v, num_envs, host=False) for f, v in zip(buffer._fields, values, strict=True)]


def _write_rows(buffer: Any, sources: list[Any], first: int, stop: int, pos: int) -> None:
    """The rows ``first:stop`` of every field's source (envs that follow one another) into the ring from row
    ``pos``, wrapping around its end; slices of the sources, so nothing is copied on the way."""
    split = min(stop - first, buffer.capacity - pos)
    for field, source in zip(buffer._fields, sources, strict=True):
        field.writer[pos : pos + split] = source[first : first + split]
        if first + split < stop:  # the rows wrap around the end of the ring
            field.writer[: stop - first - split] = source[first + split : stop]


def _finals(buffer: Any, final_obs: Any, ended: np.ndarray) -> list[tuple[int, Any]]:
    """``(env, observation)``, checked, for each env of ``ended`` (whose row is written and ends an episode): its row
    of ``final_obs``, one observation per env (gymnasium's object array: ``None`` where none ended)."""
    num_envs = buffer.num_envs
    rows = len(final_obs) if isinstance(final_obs, (list, tuple)) or getattr(final_obs, "ndim", 0) else None
    if rows != num_envs:
        got = type(final_obs).__name__ + ("" if rows is None else f" of {rows} rows")
        raise ValueError(f"final_obs must hold one observation per env ({num_envs}), got {got}")
    finals = []
    for env in np.flatnonzero(ended).tolist():
        if final_obs[env] is None:
            raise ValueError(f"final_obs of env {env} is None, but its episode ended: pass this step's final_obs")
        final = replace(buffer._final, name=f"final_obs of env {env}")
        finals.append((env, checked(final, final_obs[env], num_envs, host=buffer._on_cpu)))
    return finals


class EnvRows:
    """What ``vector_rows_on_cpu`` writes a step through: each field viewed as ``(capacity // N, N, ...)``, so the N
    transitions of a step are one row of each field (one numpy integer-index assignment, stable-baselines3's
    layout) whenever the write position is a multiple of N."""

    def __init__(self, fields: list[Field], num_envs: int) -> None:
        self.n = num_envs
        self.arrays = tuple(f.writer.reshape(-1, num_envs, *f.shape) for f in fields)
        obs, action, reward, _, flag, _ = fields  # next_obs is checked as obs, truncated as terminated
        self.obs_shape, self.obs_dtype, self.obs_takes = obs.add_shape, obs.writer.dtype, obs.accepted
        self.action_shape, self.action_dtype, self.action_takes = action.add_shape, action.writer.dtype, action.accepted
        self.reward_takes, self.flag_takes = unseen("reward", reward.dtype, any_range=True), flag.accepted
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
