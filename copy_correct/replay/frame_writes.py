"""``FrameReplayBuffer.add``'s paths, one per mode, chosen once at construction: ``one_env`` (one env reset by hand:
the numbers a loop has from ``env.step`` written as they are, on plain indices) and ``vector_env`` (every env's row;
a single env's too when ``final_obs`` is given). A step in which every env goes on with its episode is checked and
written for all envs at once (``_common_step``); one in which some env starts an episode or takes its reset step
looks at the envs of each case apart (``_boundary_step``).

Every row is checked before anything is written, each refusal one line naming the field (and env): its shape and dtype
(``checked``, with ``fields``'s refusals and ``values``'s look at rewards), an ``obs`` that neither
continues its env's stream (its newest frame the one the stream's last transition ended on) nor starts an episode
with the padding before its newest frame, and an ended row whose ``next_obs`` does not continue its ``obs``
(``check_ends``: it is then the next episode's reset stack, and the message names ``final_obs``).

Copy contract: the rings are the buffer's, allocated at construction; a row's action, reward, flags and newest frame
of ``next_obs`` (and of ``obs`` where it starts an episode) are copied into them (a frame compressed, where the buffer
compresses: ``frame_store``), and nothing of the caller's is kept.
New memory only for a tensor's value on the host (``checked``) and for ``next_obs`` with the endings' rows replaced
(``_with_final``). Tensors are read through ``detach()``; the rings are numpy memory, which autograd never sees.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from copy_correct.replay import fields
from copy_correct.replay.values import F32_MAX, F32_MIN, finite_rewards

__all__ = ["add_for", "check_ends", "checked", "one_env", "vector_env"]


def add_for(buffer: Any) -> Callable[..., None]:
    """The path of ``buffer``'s every ``add``: ``one_env`` for one env reset by hand, else ``vector_env``."""
    return one_env if buffer.num_envs is None else vector_env


def one_env(buffer: Any, obs: Any, action: Any, reward: Any, next_obs: Any, terminated: Any, truncated: Any,
            final_obs: Any) -> None:  # fmt: skip
    """One env reset by hand, on Python numbers and plain indices: the numbers a loop has from ``env.step`` are
    written as they are, after the same checks (a third of the time of ``vector_env``, which takes ``final_obs``)."""
    if final_obs is not None:
        vector_env(buffer, obs, action, reward, next_obs, terminated, truncated, final_obs)
        return
    spec = buffer._fields["obs"]  # next_obs's too: stacks as the env gives them are taken as they are
    shape, takes = spec.shape, spec.accepted
    o = obs if type(obs) is np.ndarray and obs.shape == shape and obs.dtype in takes else checked(buffer, "obs", obs)[0]
    n = next_obs
    if not (type(next_obs) is np.ndarray and next_obs.shape == shape and next_obs.dtype in takes):
        n = checked(buffer, "next_obs", next_obs)[0]
    a = action if _plain_action(buffer, action) else checked(buffer, "action", action)[0]
    r = reward if type(reward) is float and F32_MIN <= reward <= F32_MAX else checked(buffer, "reward", reward)[0]
    te = terminated if type(terminated) is bool else bool(checked(buffer, "terminated", terminated)[0])
    tr = truncated if type(truncated) is bool else bool(checked(buffer, "truncated", truncated)[0])
    length, current = buffer._length, int(buffer._current[0])
    if current < 0:
        _check_starts(buffer, o[None], buffer._envs, "obs")
    elif o[-1].tobytes() != (
        buffer._frames[0, current % length].tobytes() if buffer._store is None else buffer._store.newest[0]
    ):  # compared as bytes: a third of np.array_equal's time right after a network's forward (cold caches)
        _check_continues(buffer, o[None], buffer._envs)  # raises, naming what is wrong
    if (te or tr) and buffer.stack > 1 and not np.array_equal(n[:-1], o[1:]):
        check_ends(buffer, o[None], n[None], buffer._envs)  # raises, naming final_obs
    if current < 0:
        current = _write_one(buffer, o[-1], None)
    slot = current % length
    buffer._valid[0, slot] = True
    buffer._stored += 1
    buffer._action[0, slot] = a
    buffer._reward[0, slot] = r
    buffer._terminated[0, slot] = te
    buffer._truncated[0, slot] = tr
    position = _write_one(buffer, n[-1], int(buffer._start[0, slot]))
    buffer._current[0] = -1 if te or tr else position
    buffer._at_boundary = te or tr


def vector_env(buffer: Any, obs: Any, action: Any, reward: Any, next_obs: Any, terminated: Any, truncated: Any,
               final_obs: Any) -> None:  # fmt: skip
    """Every env's row, each field checked as a whole step; ``final_obs`` in place of ``next_obs`` for the envs whose
    episode ended. In ``"next_step"`` mode an env's reset step is not stored."""
    if buffer.num_envs is not None and isinstance(truncated, (bool, np.bool_)):  # one flag for every env
        truncated = buffer._flag_rows[bool(truncated)]
    if _as_given(buffer, obs, action, next_obs, terminated, truncated):  # arrays as a vector env gives them
        o, n, a, te, tr = obs, next_obs, action, terminated, truncated
    else:
        o = checked(buffer, "obs", obs)
        n = checked(buffer, "next_obs", next_obs)
        a = checked(buffer, "action", action)
        te = checked(buffer, "terminated", terminated)
        tr = checked(buffer, "truncated", truncated)
    r = _rewards(buffer, reward)
    done = te | tr
    ends = np.count_nonzero(done)
    if ends and final_obs is not None:
        n = _with_final(buffer, n, final_obs, done)
    step = _boundary_step if buffer._at_boundary else _common_step
    moving = step(buffer, o, a, r, n, te, tr, done, ends)
    if ends:
        ended = moving[done[moving]]
        if buffer.autoreset_mode == "next_step":
            buffer._ended[ended] = True
        else:
            buffer._current[ended] = -1
    if ends or buffer._at_boundary:
        buffer._at_boundary = bool(buffer._ended.any()) or bool((buffer._current < 0).any())


def _common_step(buffer: Any, o: np.ndarray, a: np.ndarray, r: np.ndarray, n: np.ndarray, te: np.ndarray,
                 tr: np.ndarray, done: np.ndarray, ends: int) -> np.ndarray:  # fmt: skip
    """Every env continues an episode: checked and written at once. Returns the envs that stored a transition."""
    _check_continue_all(buffer, o)
    if ends:
        check_ends(buffer, o, n, np.flatnonzero(done))
    _step_all(buffer, a, r, te, tr, n[:, -1])
    return buffer._envs


def _boundary_step(buffer: Any, o: np.ndarray, a: np.ndarray, r: np.ndarray, n: np.ndarray, te: np.ndarray,
                   tr: np.ndarray, done: np.ndarray, ends: int) -> np.ndarray:  # fmt: skip
    """Some env starts an episode or takes its reset step (``"next_step"``: stored as no transition; its
    ``next_obs`` starts the next episode). Returns the envs that stored a transition."""
    envs = buffer._envs
    reset_row = buffer._ended  # next_step: these envs' rows are their reset steps
    starting = ~reset_row & (buffer._current < 0)
    _check_starts(buffer, o, envs[starting], "obs")
    _check_starts(buffer, n, envs[reset_row], "next_obs")
    _check_continues(buffer, o, envs[~starting])  # a reset step's obs is still its episode's last one
    moving = envs[~reset_row]
    if ends:
        check_ends(buffer, o, n, moving[done[moving]])
    for at, stacks in ((envs[starting], o), (envs[reset_row], n)):  # episodes' first frames
        buffer._current[at] = _write_frames(buffer, at, stacks[at, -1], None)
    _store(buffer, moving, a[moving], r[moving], te[moving], tr[moving], n[moving, -1])
    buffer._ended[:] = False
    return moving


def _as_given(buffer: Any, obs: Any, action: Any, next_obs: Any, terminated: Any, truncated: Any) -> bool:
    """Whether these fields are numpy arrays of a step's shapes in dtypes they take as they are: ``checked``'s
    first test for all of them in one expression (a call per field costs as much as the common step's writes)."""
    if buffer.num_envs is None:
        return False
    nd, stacks, flags = np.ndarray, buffer._step_obs, buffer._step
    specs = buffer._fields
    takes_obs, takes_action, takes_flag = specs["obs"].accepted, specs["action"].accepted, specs["terminated"].accepted
    return (
        type(obs) is nd and type(next_obs) is nd and type(action) is nd and type(terminated) is nd
        and type(truncated) is nd and obs.shape == stacks and next_obs.shape == stacks
        and action.shape == buffer._step_action and terminated.shape == flags and truncated.shape == flags
        and obs.dtype in takes_obs and next_obs.dtype in takes_obs and action.dtype in takes_action
        and terminated.dtype in takes_flag and truncated.dtype in takes_flag
    )  # fmt: skip


def _rewards(buffer: Any, reward: Any) -> np.ndarray:
    """``reward`` checked: rewards as a vector env gives them (float64) cost a dtype lookup and one dot product
    (``finite_rewards``); anything else, or rewards that fail that look, take ``checked``'s way, which looks at
    each value and refuses one that is not finite or beyond float32, naming the field."""
    if (
        type(reward) is np.ndarray
        and reward.shape == buffer._step
        and reward.dtype in buffer._reward_takes
        and finite_rewards(reward)
    ):
        return reward if buffer.num_envs is not None else reward[None]
    return checked(buffer, "reward", reward)


def _check_continue_all(buffer: Any, stacks: np.ndarray) -> None:
    """``_check_continues`` for every env, in the common step: one gather of the streams' current frames, compared
    as bytes (a copy and a ``memcmp``: a fifth of the time of ``np.array_equal`` for one 84x84 frame)."""
    if buffer._store is not None:  # compressed frames: each stream's newest is kept whole
        if stacks[:, -1].tobytes() != b"".join(buffer._store.newest):
            _check_continues(buffer, stacks, buffer._envs)  # raises, naming the env
        return
    if buffer._few:
        frames, current, length = buffer._frames_flat, buffer._current.tolist(), buffer._length
        for env, row in enumerate(buffer._frame_rows.tolist()):
            if stacks[env, -1].tobytes() != frames[row + current[env] % length].tobytes():
                _check_continues(buffer, stacks, buffer._envs)  # raises, naming the env
        return
    kept = buffer._frames_flat[buffer._frame_rows + buffer._current % buffer._length]
    if stacks[:, -1].tobytes() != kept.tobytes():
        _check_continues(buffer, stacks, buffer._envs)  # raises, naming the env


def _step_all(
    buffer: Any, action: np.ndarray, reward: np.ndarray, te: np.ndarray, tr: np.ndarray, nxt: np.ndarray
) -> None:
    """``_store`` for every env, each of which continues its episode (so its current frame is the last it wrote):
    the rows computed once, no index of envs; one or two envs by plain indices (a third of the time)."""
    if buffer._few:
        _step_few(buffer, action, reward, te, tr, nxt)
        return
    length, written, valid = buffer._length, buffer._written, buffer._valid_flat
    rows = buffer._slot_rows + buffer._current % length
    following = buffer._slot_rows + written % length  # where each stream's next frame goes
    valid[rows] = True
    buffer._action_flat[rows] = action
    buffer._reward_flat[rows] = reward
    buffer._terminated_flat[rows] = te
    buffer._truncated_flat[rows] = tr
    buffer._stored += len(rows) - np.count_nonzero(valid[following])  # less those whose first frame is overwritten
    if buffer._store is None:
        buffer._frames_flat[following + buffer._envs] = nxt  # a frame row is env * (length + 1) + slot
    else:
        for env, position in enumerate(written.tolist()):
            buffer._store.put(env, position, nxt[env])
    buffer._start_flat[following] = buffer._start_flat[rows]
    valid[following] = False
    buffer._current[:] = written
    written += 1


def _step_few(
    buffer: Any, action: np.ndarray, reward: np.ndarray, te: np.ndarray, tr: np.ndarray, nxt: np.ndarray
) -> None:
    """``_step_all`` env by env, on Python integers."""
    length, valid, start = buffer._length, buffer._valid_flat, buffer._start_flat
    current, written = buffer._current, buffer._written
    for env, (now, position) in enumerate(zip(current.tolist(), written.tolist(), strict=True)):
        row, following = env * length + now % length, env * length + position % length
        valid[row] = True
        buffer._action_flat[row] = action[env]
        buffer._reward_flat[row] = reward[env]
        buffer._terminated_flat[row] = te[env]
        buffer._truncated_flat[row] = tr[env]
        buffer._stored += 1 - bool(valid[following])  # less the transition whose first frame is overwritten
        if buffer._store is None:
            buffer._frames_flat[following + env] = nxt[env]
        else:
            buffer._store.put(env, position, nxt[env])
        start[following] = start[row]
        valid[following] = False
        current[env] = position
        written[env] = position + 1


def _store(
    buffer: Any, at: np.ndarray, action: np.ndarray, reward: np.ndarray, te: np.ndarray, tr: np.ndarray, nxt: np.ndarray
) -> None:
    """A transition from each env of ``at``'s current frame, and the newest frame of its next observation."""
    current = buffer._current[at]
    rows = at * buffer._length + current % buffer._length
    buffer._valid_flat[rows] = True
    buffer._stored += len(at)
    buffer._action_flat[rows] = action
    buffer._reward_flat[rows] = reward
    buffer._terminated_flat[rows] = te
    buffer._truncated_flat[rows] = tr
    buffer._current[at] = _write_frames(buffer, at, nxt, buffer._start_flat[rows])


def _write_frames(buffer: Any, at: np.ndarray, frames: np.ndarray, start: np.ndarray | None) -> np.ndarray:
    """Write one frame into each stream of ``at``; ``start``: its episode's first position (``None``: the frame
    starts an episode). Returns the positions written."""
    positions = buffer._written[at]
    slots = positions % buffer._length
    rows = at * buffer._length + slots
    buffer._stored -= int(buffer._valid_flat[rows].sum())  # transitions whose first frame this overwrites
    if buffer._store is None:
        buffer._frames_flat[at * (buffer._length + 1) + slots] = frames
    else:
        for env, position, frame in zip(at.tolist(), positions.tolist(), frames, strict=True):
            buffer._store.put(env, position, frame)
    buffer._start_flat[rows] = positions if start is None else start
    buffer._valid_flat[rows] = False
    buffer._written[at] = positions + 1
    return positions


def _write_one(buffer: Any, frame: np.ndarray, start: int | None) -> int:
    """``_write_frames`` for the one env of a single-env buffer, on plain indices."""
    position = int(buffer._written[0])
    slot = position % buffer._length
    if buffer._valid[0, slot]:
        buffer._stored -= 1  # the transition whose first frame this overwrites
    if buffer._store is None:
        buffer._frames[0, slot] = frame
    else:
        buffer._store.put(0, position, frame)
    buffer._start[0, slot] = position if start is None else start
    buffer._valid[0, slot] = False
    buffer._written[0] = position + 1
    return position


def _plain_action(buffer: Any, action: Any) -> bool:
    """Whether ``action`` is one discrete action as a loop has it (a Python or numpy int in the stored dtype's
    range), or an array of the stored shape and a dtype the field takes as it is: written without conversion."""
    if buffer._action_range is not None:
        return (type(action) is int or type(action) is np.int64) and (
            buffer._action_range[0] <= action <= buffer._action_range[1]
        )
    accepted = buffer._fields["action"].accepted
    return type(action) is np.ndarray and action.dtype in accepted and action.shape == buffer.action_shape


def _with_final(buffer: Any, next_obs: np.ndarray, final_obs: Any, done: np.ndarray) -> np.ndarray:
    """``next_obs`` with the rows of ended episodes taken from ``final_obs`` (an array, or gymnasium's object
    array with ``None`` for the envs that did not end)."""
    if not done.any():
        return next_obs
    rows = next_obs.copy()
    finals = [final_obs] if buffer.num_envs is None else final_obs
    for env in buffer._envs[done]:
        rows[env] = checked(buffer, "final_obs", finals[env], one=True)[0]
    return rows


def _check_continues(buffer: Any, stacks: np.ndarray, at: np.ndarray) -> None:
    """Each stack of ``at`` must continue its env's stream: its newest frame is the stream's current one."""
    if not len(at):
        return
    if buffer._store is None:
        kept = buffer._frames_flat[at * (buffer._length + 1) + buffer._current[at] % buffer._length]
    else:
        kept = buffer._store.newest_frames(at)
    newest = stacks[at, -1] if len(at) < len(stacks) else stacks[:, -1]
    if np.array_equal(newest, kept):
        return
    bad = ~(newest == kept).reshape(len(at), -1).all(axis=1)
    where = "" if buffer.num_envs is None else f" of env {int(at[bad][0])}"
    raise ValueError(
        f"obs{where} does not continue its stream: its newest frame is not the one its last transition ended on "
        f"(autoreset_mode={buffer.autoreset_mode!r}: is it the env's? was the env reset without an episode end?)"
    )


def _check_starts(buffer: Any, stacks: np.ndarray, at: np.ndarray, name: str) -> None:
    """Each stack of ``at`` starts an episode: the frames before its newest must be the padding."""
    if not len(at) or buffer.stack == 1:
        return
    first = stacks[at, -1:]
    padding = first if buffer.padding == "reset" else np.zeros_like(first)
    bad = ~(stacks[at, :-1] == padding).reshape(len(at), -1).all(axis=1)
    if bad.any():
        env = int(at[bad][0])
        where = "" if buffer.num_envs is None else f" of env {env}"
        raise ValueError(
            f"{name}{where} starts an episode but its earlier frames are not the {buffer.padding} padding: "
            f"the env pads otherwise (padding={'zero' if buffer.padding == 'reset' else 'reset'}?) or the "
            "buffer missed an episode end"
        )


def check_ends(buffer: Any, obs: np.ndarray, next_obs: np.ndarray, at: np.ndarray) -> None:
    """Each row of ``at`` ends an episode: its ``next_obs`` must continue its ``obs`` (the frames before its newest
    are ``obs``'s after the oldest), or it would be stored as a stack reaching into the next episode."""
    if buffer.stack == 1 or not len(at):
        return
    bad = ~(next_obs[at, :-1] == obs[at, 1:]).reshape(len(at), -1).all(axis=1)
    if bad.any():
        where = "" if buffer.num_envs is None else f" of env {int(at[bad][0])}"
        raise ValueError(
            f"next_obs{where} ends an episode but does not continue obs (its earlier frames are not obs's later "
            "ones): it is the next episode's first observation, as same_step autoreset gives it; pass the real "
            "last ones, final_obs=infos['final_obs'] (or next_obs with every ended row replaced, terminated too)"
        )


def checked(buffer: Any, name: str, value: Any, one: bool = False) -> np.ndarray:
    """``value`` for field ``name`` as a numpy array with a leading env dimension (a view where it is one
    already), after ``fields.checked``'s checks: its shape, and a dtype that the field stores without changing its
    values (``ValueError`` naming both). ``one``: a single env's value, whatever ``num_envs``."""
    field = buffer._fields[name]
    single = one or buffer.num_envs is None
    expected = field.shape if one else field.add_shape
    if type(value) is np.ndarray and value.dtype in field.accepted and value.shape == expected:  # as envs give them
        return value[None] if single else value
    array = np.asarray(fields.checked(field, value, buffer.num_envs, one=one))
    return array[None] if single else array
