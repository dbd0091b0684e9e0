"""``FrameReplayBuffer``: replay for frame-stacked observations that keeps each frame once.

    envs = gym.vector.SyncVectorEnv([make_env(i) for i in range(8)])      # each env ends in FrameStackObservation
    buffer = FrameReplayBuffer(1_000_000, envs.single_observation_space, envs.single_action_space,
                               num_envs=8, autoreset_mode=envs.metadata["autoreset_mode"])
    buffer.add(obs, actions, rewards, next_obs, terminations, truncations)   # what envs.step gave
    batch = buffer.sample(32)                  # {"obs": (32, 4, 84, 84) uint8, ...}: the stacks the env gave
    batch = buffer.sample(32, device="cuda")   # gathered into pinned memory, copied without a wait

A stacked observation (``FrameStackObservation(env, 4)``: 4 frames of 84x84) shares 3 frames with the next one, and
a buffer of whole stacks (``ReplayBuffer``, stable-baselines3's, TorchRL's) stores every frame 8 times, 4 in ``obs``
and 4 in ``next_obs``: 56,448 bytes a transition, 56 GB for a million. This buffer keeps one ring of frames per env
stream and stores, per transition, the newest frame of ``next_obs`` (7,056 bytes at 84x84), its action, reward and
flags, and where its episode began; an episode's first frame costs one more frame. ``sample`` rebuilds both stacks of
each drawn transition with one gather each. A stack never reaches across an episode start: the frames before it are
padded as ``FrameStackObservation`` pads them (``padding="reset"``, its default: copies of the episode's first frame;
``"zero"``: zeros), so a network sees exactly the stacks the env gave.

Episodes and vector envs, by ``autoreset_mode`` (``envs.metadata["autoreset_mode"]``, or its name):

* ``"next_step"`` (gymnasium's default): the step after an episode ends is the env's reset step; its row (the last
  observation to the first, the action ignored) is no transition. The buffer knows which env ended and stores no row
  for it; that row's ``next_obs`` starts the env's next episode.
* ``"same_step"``: an env that ends resets in the same step and ``next_obs`` is already the next episode's first
  observation. Pass the real last one: ``final_obs=infos.get("final_obs")`` (or ``next_obs`` with every ended row
  replaced; CleanRL's lines for gymnasium replace only the truncated ones, so with them pass ``final_obs`` too). The
  next ``obs`` of that env starts its next episode.
* ``"disabled"`` (and a single env, ``num_envs=None``, reset by hand): the next ``obs`` of an env whose episode
  ended starts its next episode.

Every ``obs`` must continue its env's stream: its newest frame is the frame the env's last transition ended on (or it
starts an episode, and its frames before the newest are the padding). A row that does not (an autoreset mode that is
not the env's, a reset the buffer was not told of) is refused. So is a row that ends an episode with a ``next_obs``
that does not continue its ``obs`` (its frames before the newest are not ``obs``'s after the oldest): in
``"same_step"`` mode with ``final_obs`` forgotten, that ``next_obs`` is the next episode's reset stack, and the
stored stack would end on its frame. So no transition that crosses episodes is stored, as far as frames tell: a
reset stack equal to the episode's last frames (a game that resets to the screen it ended on) cannot be told apart.

The observation space must be stacks first, ``(stack, *frame)``, with at most 32 frames: a channel-last stack
(stable-baselines3's ``VecFrameStack``: ``(84, 84, 4)``) or an unstacked image (``(84, 84)``, ``(210, 160, 3)``) is
refused at construction, naming the layout.

Copy contract (as ``ReplayBuffer``'s):

* Storage is allocated once, at construction, in the observation's dtype (uint8 frames: one byte per pixel), on the
  host (numpy memory): ``nbytes`` bytes in all.
* ``add`` copies the newest frame of ``next_obs`` (and, at an episode start, of ``obs``) and the row's action, reward
  and flags into the rings; it keeps no reference to the caller's arrays. Numpy arrays, tensors on any device (read
  through ``detach()``: the buffer never holds a graph) and Python numbers are taken. Everything is checked before
  anything is written: a wrong shape, a dtype that would change values, or an ``obs`` that does not continue its
  stream is a one-line ``ValueError`` that names the field and env, and the buffer is left as it was. So is a reward
  that is not finite, or beyond float32 (``ReplayBuffer``'s checks). With ``num_envs``, a single ``truncated`` flag
  (the default ``False``) is every env's.
* ``sample`` gathers into new memory: nothing in a batch shares storage with the rings or with another field of
  the batch (``obs`` and ``next_obs`` overlap in frames but are gathered apart), so training code may change a batch
  in place. ``sample(..., device="cuda")`` gathers into pinned host memory and copies each field with
  ``non_blocking=True`` (``_host_batch``); the rings stay on the host.
* ``state_dict()`` holds the rings (sharing their memory, not copied) and every stream's position: a resumed run
  samples the same transitions as the uninterrupted one; it loads with ``torch.load(..., weights_only=True)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from copy_correct import _host_batch
from copy_correct._autoreset import AUTORESET_MODES, parse_mode
from copy_correct._checks import device as checked_device
from copy_correct._checks import integral
from copy_correct._replay_values import F32_MAX, F32_MIN, finite_rewards, may_overflow, value_refusal
from copy_correct.replay import Space, _check_sample, _flag_rows, _layout, _refusal, _unseen

__all__ = ["AUTORESET_MODES", "FrameReplayBuffer"]

PADDINGS = ("reset", "zero")
MAX_STACK = 32  # more frames than this in the first dimension: not a stack (channel-last, or one unstacked image)


class FrameReplayBuffer:
    """Rings of frames, one per env stream, from which transitions of frame-stacked observations are rebuilt.

    Args:
        capacity: frames kept, over all env streams (``capacity // num_envs`` each). Each transition takes one frame
            and each episode one more, so a full buffer holds ``capacity`` transitions less one per episode in it.
        obs: the stacked observation's space (``envs.single_observation_space``: ``Box`` of shape
            ``(stack, *frame)``) or that shape; frames are stored in its dtype (uint8 when a shape is given).
        action: the action space or the shape of one action (``()``: one discrete action index).
        num_envs: ``None``: one env, one transition per ``add``. ``N``: every field of ``add`` has a leading
            dimension ``N``, one row per env.
        autoreset_mode: how the envs reset (module docstring); with ``num_envs`` it must be given, as
            ``envs.metadata["autoreset_mode"]``. A single env is reset by hand: ``None`` or ``"disabled"``.
        padding: what stands before an episode's first frame in a stack: ``"reset"`` (copies of it, gymnasium's
            ``FrameStackObservation`` default) or ``"zero"`` (its ``padding_type="zero"``).
        action_dtype: storage dtype of actions; default: the space's (``Discrete``: int64), else int64.

    Attributes:
        stack, frame_shape: the frames per observation and the shape of one frame.
        nbytes: the bytes of storage, allocated at construction.
    """

    def __init__(
        self,
        capacity: int,
        obs: Space | Sequence[int],
        action: Space | Sequence[int] = (),
        *,
        num_envs: int | None = None,
        autoreset_mode: Any = None,
        padding: str = "reset",
        action_dtype: Any = None,
    ) -> None:
        if num_envs is not None and integral("num_envs", num_envs, "None or an integer >= 1") < 1:
            raise ValueError(f"num_envs must be None or >= 1, got {num_envs}")
        integral("capacity", capacity, "an integer >= 1")
        self.autoreset_mode = parse_mode(autoreset_mode, num_envs)
        if padding not in PADDINGS:
            raise ValueError(f"padding must be one of {', '.join(PADDINGS)}, got {padding!r}")
        obs_shape, frame_dtype = _layout("obs", obs, None, np.uint8)
        _check_stacked(obs_shape)
        self.action_shape, action_np = _layout("action", action, action_dtype, np.int64)
        self.num_envs, self.padding = num_envs, padding
        self.stack, self.frame_shape = obs_shape[0], obs_shape[1:]
        self.obs_shape = obs_shape
        envs = num_envs or 1
        self._length = capacity // envs  # frames per stream
        if self._length < self.stack + 2:
            raise ValueError(
                f"capacity must hold at least stack + 2 = {self.stack + 2} frames per env, got {capacity} "
                f"for {envs} env(s)"
            )
        self.capacity = self._length * envs
        # Slot `length` of each stream is a frame of zeros: what zero padding gathers.
        self._frames = np.zeros((envs, self._length + 1, *self.frame_shape), dtype=frame_dtype)
        self._start = np.zeros((envs, self._length), dtype=np.int64)  # where each frame's episode began
        self._valid = np.zeros((envs, self._length), dtype=np.bool_)  # a transition starts at this frame
        self._action = np.zeros((envs, self._length, *self.action_shape), dtype=action_np)
        self._reward = np.zeros((envs, self._length), dtype=np.float32)
        self._terminated = np.zeros((envs, self._length), dtype=np.bool_)
        self._truncated = np.zeros((envs, self._length), dtype=np.bool_)
        self._written = np.zeros(envs, dtype=np.int64)  # frames written to each stream, ever
        self._current = np.full(envs, -1, dtype=np.int64)  # the position of the current obs's newest frame, or -1
        self._ended = np.zeros(envs, dtype=np.bool_)  # next_step: the env's next row is its reset step
        self._stored = 0  # transitions in the rings (a few at the oldest end may have lost their stack's start)
        self._at_boundary = True  # some env starts an episode or takes its reset step next
        self._envs = np.arange(envs)
        self._offsets = np.arange(-(self.stack - 1), 1, dtype=np.int64)
        # Flat views: a row is env * length + slot (env * (length + 1) + slot for frames); one index per write.
        self._frames_flat = self._frames.reshape(-1, *self.frame_shape)
        self._frames_torch = torch.from_numpy(self._frames_flat)
        self._start_flat, self._valid_flat = self._start.reshape(-1), self._valid.reshape(-1)
        self._action_flat = self._action.reshape(-1, *self.action_shape)
        self._reward_flat = self._reward.reshape(-1)
        self._terminated_flat, self._truncated_flat = self._terminated.reshape(-1), self._truncated.reshape(-1)
        # Each field's shape per transition and the stored dtype; the source dtypes it takes without a look at values.
        frame_torch = _torch_dtype(frame_dtype)
        self._stored_as = {
            "obs": frame_torch, "next_obs": frame_torch, "final_obs": frame_torch, "action": _torch_dtype(action_np),
            "reward": torch.float32, "terminated": torch.bool, "truncated": torch.bool,
        }  # fmt: skip
        shapes = {"action": self.action_shape, "reward": (), "terminated": (), "truncated": ()}
        # rewards: no dtype taken unseen, their values are always looked at (finite, within float32)
        self._fields = {
            name: (shapes.get(name, obs_shape), frozenset() if name == "reward" else _unseen(name, stored))
            for name, stored in self._stored_as.items()
        }  # fmt: skip
        self._reward_takes = _unseen("reward", torch.float32, any_range=True)  # then looked at by finite_rewards
        self._step = (envs,) if num_envs is not None else ()
        self._step_obs, self._step_action = (*self._step, *obs_shape), (*self._step, *self.action_shape)
        self._flag_rows = _flag_rows(envs)  # truncated=False (the default) or True for every env
        self._frame_rows = self._envs * (self._length + 1)  # each stream's first row in _frames_flat
        self._slot_rows = self._envs * self._length  # each stream's first row in the per-slot fields
        self._few = envs <= 2  # the common step env by env, on plain indices (faster for one or two)
        integer = not self.action_shape and action_np.kind in "iu"
        self._action_range = (int(np.iinfo(action_np).min), int(np.iinfo(action_np).max)) if integer else None
        self.nbytes = sum(a.nbytes for a in self._arrays().values())

    def _arrays(self) -> dict[str, np.ndarray]:
        return {
            "frames": self._frames, "start": self._start, "valid": self._valid, "action": self._action,
            "reward": self._reward, "terminated": self._terminated, "truncated": self._truncated,
            "written": self._written, "current": self._current, "ended": self._ended,
        }  # fmt: skip

    @property
    def stored(self) -> int:
        """Transitions in the rings, drawable or not."""
        return self._stored

    def __len__(self) -> int:
        """Transitions that ``sample`` can draw now: those stored, less those at the oldest end of a ring whose
        stack's first frames were overwritten (at most ``stack - 1`` per stream; only those slots are looked at)."""
        full = self._envs[self._written >= self._length]
        if not len(full):
            return self._stored
        edge = self._written[full, None] - self._length + np.arange(self.stack - 1)
        envs, slots = np.broadcast_to(full[:, None], edge.shape), edge % self._length
        lost = self._valid[envs, slots] & ~self._sampleable(envs, slots)
        return self._stored - int(lost.sum())

    # -- writing -------------------------------------------------------------------------------------------------

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
        """Store one transition per env (``num_envs=N``: each field with a leading dimension N): the newest frame of
        ``next_obs``, and of ``obs`` where it starts an episode. In ``"next_step"`` mode an env's reset step is not
        stored. ``final_obs`` (``infos.get("final_obs")``, ``"same_step"`` mode): the real last observations, taken in
        place of ``next_obs`` for the envs whose episode ended. ``truncated``: one flag per env, or one for all (the
        default ``False``). Checked before anything is written, each refusal one line naming the field (and env): a
        shape or dtype that does not fit, a reward that is not finite, an ``obs`` that does not continue its stream,
        and an ended row whose ``next_obs`` does not continue its ``obs`` (the next episode's reset stack, as
        ``"same_step"`` gives it: the message names ``final_obs``)."""
        if self.num_envs is None and final_obs is None:
            self._add_one(obs, action, reward, next_obs, terminated, truncated)
            return
        if self.num_envs is not None and isinstance(truncated, (bool, np.bool_)):  # one flag for every env
            truncated = self._flag_rows[bool(truncated)]
        if self._as_given(obs, action, next_obs, terminated, truncated):  # arrays as a vector env gives them
            o, n, a, te, tr = obs, next_obs, action, terminated, truncated
        else:
            o = self._checked("obs", obs)
            n = self._checked("next_obs", next_obs)
            a = self._checked("action", action)
            te = self._checked("terminated", terminated)
            tr = self._checked("truncated", truncated)
        r = self._rewards(reward)
        done = te | tr
        ends = np.count_nonzero(done)
        if ends and final_obs is not None:
            n = self._with_final(n, final_obs, done)
        envs = self._envs
        if not self._at_boundary:  # every env continues an episode: the common step, checked and written at once
            self._check_continue_all(o)
            if ends:
                self._check_ends(o, n, np.flatnonzero(done))
            self._step_all(a, r, te, tr, n[:, -1])
            moving = envs
        else:
            reset_row = self._ended  # next_step: these envs' rows are their reset steps, stored as no transition
            starting = ~reset_row & (self._current < 0)
            self._check_starts(o, envs[starting], "obs")
            self._check_starts(n, envs[reset_row], "next_obs")
            self._check_continues(o, envs[~starting])  # a reset step's obs is still its episode's last one
            moving = envs[~reset_row]
            if ends:
                self._check_ends(o, n, moving[done[moving]])
            for at, stacks in ((envs[starting], o), (envs[reset_row], n)):  # episodes' first frames
                self._current[at] = self._write_frames(at, stacks[at, -1], None)
            self._store(moving, a[moving], r[moving], te[moving], tr[moving], n[moving, -1])
            self._ended[:] = False
        if ends:
            ended = moving[done[moving]]
            if self.autoreset_mode == "next_step":
                self._ended[ended] = True
            else:
                self._current[ended] = -1
        if ends or self._at_boundary:
            self._at_boundary = bool(self._ended.any()) or bool((self._current < 0).any())

    def _as_given(self, obs: Any, action: Any, next_obs: Any, terminated: Any, truncated: Any) -> bool:
        """Whether these fields are numpy arrays of a step's shapes in dtypes they take as they are: ``_checked``'s
        first test for all of them in one expression (a call per field costs as much as the common step's writes)."""
        if self.num_envs is None:
            return False
        nd, stacks, flags = np.ndarray, self._step_obs, self._step
        (_, takes_obs), (_, takes_action), (_, takes_flag) = (self._fields[k] for k in ("obs", "action", "terminated"))
        return (
            type(obs) is nd and type(next_obs) is nd and type(action) is nd and type(terminated) is nd
            and type(truncated) is nd and obs.shape == stacks and next_obs.shape == stacks
            and action.shape == self._step_action and terminated.shape == flags and truncated.shape == flags
            and obs.dtype in takes_obs and next_obs.dtype in takes_obs and action.dtype in takes_action
            and terminated.dtype in takes_flag and truncated.dtype in takes_flag
        )  # fmt: skip

    def _rewards(self, reward: Any) -> np.ndarray:
        """``reward`` checked: rewards as a vector env gives them (float64) cost a dtype lookup and one dot product
        (``finite_rewards``); anything else, or rewards that fail that look, take ``_checked``'s way, which looks at
        each value and refuses one that is not finite or beyond float32, naming the field."""
        if (
            type(reward) is np.ndarray
            and reward.shape == self._step
            and reward.dtype in self._reward_takes
            and finite_rewards(reward)
        ):
            return reward if self.num_envs is not None else reward[None]
        return self._checked("reward", reward)

    def _check_continue_all(self, stacks: np.ndarray) -> None:
        """``_check_continues`` for every env, in the common step: one gather of the streams' current frames, compared
        as bytes (a copy and a ``memcmp``: a fifth of the time of ``np.array_equal`` for one 84x84 frame)."""
        if self._few:
            frames, current, length = self._frames_flat, self._current.tolist(), self._length
            for env, row in enumerate(self._frame_rows.tolist()):
                if stacks[env, -1].tobytes() != frames[row + current[env] % length].tobytes():
                    self._check_continues(stacks, self._envs)  # raises, naming the env
            return
        kept = self._frames_flat[self._frame_rows + self._current % self._length]
        if stacks[:, -1].tobytes() != kept.tobytes():
            self._check_continues(stacks, self._envs)  # raises, naming the env

    def _step_all(
        self, action: np.ndarray, reward: np.ndarray, te: np.ndarray, tr: np.ndarray, nxt: np.ndarray
    ) -> None:
        """``_store`` for every env, each of which continues its episode (so its current frame is the last it wrote):
        the rows computed once, no index of envs; one or two envs by plain indices (a third of the time)."""
        if self._few:
            self._step_few(action, reward, te, tr, nxt)
            return
        length, written, valid = self._length, self._written, self._valid_flat
        rows = self._slot_rows + self._current % length
        following = self._slot_rows + written % length  # where each stream's next frame goes
        valid[rows] = True
        self._action_flat[rows] = action
        self._reward_flat[rows] = reward
        self._terminated_flat[rows] = te
        self._truncated_flat[rows] = tr
        self._stored += len(rows) - np.count_nonzero(valid[following])  # less those whose first frame is overwritten
        self._frames_flat[following + self._envs] = nxt  # a frame row is env * (length + 1) + slot
        self._start_flat[following] = self._start_flat[rows]
        valid[following] = False
        self._current[:] = written
        written += 1

    def _step_few(
        self, action: np.ndarray, reward: np.ndarray, te: np.ndarray, tr: np.ndarray, nxt: np.ndarray
    ) -> None:
        """``_step_all`` env by env, on Python integers."""
        length, valid, start = self._length, self._valid_flat, self._start_flat
        current, written = self._current, self._written
        for env, (now, position) in enumerate(zip(current.tolist(), written.tolist(), strict=True)):
            row, following = env * length + now % length, env * length + position % length
            valid[row] = True
            self._action_flat[row] = action[env]
            self._reward_flat[row] = reward[env]
            self._terminated_flat[row] = te[env]
            self._truncated_flat[row] = tr[env]
            self._stored += 1 - bool(valid[following])  # less the transition whose first frame is overwritten
            self._frames_flat[following + env] = nxt[env]
            start[following] = start[row]
            valid[following] = False
            current[env] = position
            written[env] = position + 1

    def _check_ends(self, obs: np.ndarray, next_obs: np.ndarray, at: np.ndarray) -> None:
        """Each row of ``at`` ends an episode: its ``next_obs`` must continue its ``obs`` (the frames before its newest
        are ``obs``'s after the oldest), or it would be stored as a stack reaching into the next episode."""
        if self.stack == 1 or not len(at):
            return
        bad = ~(next_obs[at, :-1] == obs[at, 1:]).reshape(len(at), -1).all(axis=1)
        if bad.any():
            where = "" if self.num_envs is None else f" of env {int(at[bad][0])}"
            raise ValueError(
                f"next_obs{where} ends an episode but does not continue obs (its earlier frames are not obs's later "
                "ones): it is the next episode's first observation, as same_step autoreset gives it; pass the real "
                "last ones, final_obs=infos['final_obs'] (or next_obs with every ended row replaced, terminated too)"
            )

    def _add_one(self, obs: Any, action: Any, reward: Any, next_obs: Any, terminated: Any, truncated: Any) -> None:
        """``add`` for one env reset by hand, on Python numbers and plain indices: the numbers a loop has from
        ``env.step`` are written as they are, after the same checks (a third of the time of the vector path)."""
        o = self._checked("obs", obs)[0]
        n = self._checked("next_obs", next_obs)[0]
        a = action if self._plain_action(action) else self._checked("action", action)[0]
        r = reward if type(reward) is float and F32_MIN <= reward <= F32_MAX else self._checked("reward", reward)[0]
        te = terminated if type(terminated) is bool else bool(self._checked("terminated", terminated)[0])
        tr = truncated if type(truncated) is bool else bool(self._checked("truncated", truncated)[0])
        length, current = self._length, int(self._current[0])
        if current < 0:
            self._check_starts(o[None], self._envs, "obs")
        elif not np.array_equal(o[-1], self._frames[0, current % length]):
            self._check_continues(o[None], self._envs)  # raises, naming what is wrong
        if (te or tr) and self.stack > 1 and not np.array_equal(n[:-1], o[1:]):
            self._check_ends(o[None], n[None], self._envs)  # raises, naming final_obs
        if current < 0:
            current = self._write_one(o[-1], None)
        slot = current % length
        self._valid[0, slot] = True
        self._stored += 1
        self._action[0, slot] = a
        self._reward[0, slot] = r
        self._terminated[0, slot] = te
        self._truncated[0, slot] = tr
        position = self._write_one(n[-1], int(self._start[0, slot]))
        self._current[0] = -1 if te or tr else position
        self._at_boundary = te or tr

    def _write_one(self, frame: np.ndarray, start: int | None) -> int:
        """``_write_frames`` for the one env of a single-env buffer, on plain indices."""
        position = int(self._written[0])
        slot = position % self._length
        if self._valid[0, slot]:
            self._stored -= 1  # the transition whose first frame this overwrites
        self._frames[0, slot] = frame
        self._start[0, slot] = position if start is None else start
        self._valid[0, slot] = False
        self._written[0] = position + 1
        return position

    def _plain_action(self, action: Any) -> bool:
        """Whether ``action`` is one discrete action as a loop has it (a Python or numpy int in the stored dtype's
        range), or an array of the stored shape and a dtype the field takes as it is: written without conversion."""
        if self._action_range is not None:
            return (type(action) is int or type(action) is np.int64) and (
                self._action_range[0] <= action <= self._action_range[1]
            )
        _, accepted = self._fields["action"]
        return type(action) is np.ndarray and action.dtype in accepted and action.shape == self.action_shape

    def _store(
        self, at: np.ndarray, action: np.ndarray, reward: np.ndarray, te: np.ndarray, tr: np.ndarray, nxt: np.ndarray
    ) -> None:
        """A transition from each env of ``at``'s current frame, and the newest frame of its next observation."""
        current = self._current[at]
        rows = at * self._length + current % self._length
        self._valid_flat[rows] = True
        self._stored += len(at)
        self._action_flat[rows] = action
        self._reward_flat[rows] = reward
        self._terminated_flat[rows] = te
        self._truncated_flat[rows] = tr
        self._current[at] = self._write_frames(at, nxt, self._start_flat[rows])

    def _check_continues(self, stacks: np.ndarray, at: np.ndarray) -> None:
        """Each stack of ``at`` must continue its env's stream: its newest frame is the stream's current one."""
        if not len(at):
            return
        kept = self._frames_flat[at * (self._length + 1) + self._current[at] % self._length]
        newest = stacks[at, -1] if len(at) < len(stacks) else stacks[:, -1]
        if np.array_equal(newest, kept):
            return
        bad = ~(newest == kept).reshape(len(at), -1).all(axis=1)
        where = "" if self.num_envs is None else f" of env {int(at[bad][0])}"
        raise ValueError(
            f"obs{where} does not continue its stream: its newest frame is not the one its last transition ended on "
            f"(autoreset_mode={self.autoreset_mode!r}: is it the env's? was the env reset without an episode end?)"
        )

    def _write_frames(self, at: np.ndarray, frames: np.ndarray, start: np.ndarray | None) -> np.ndarray:
        """Write one frame into each stream of ``at``; ``start``: its episode's first position (``None``: the frame
        starts an episode). Returns the positions written."""
        positions = self._written[at]
        slots = positions % self._length
        rows = at * self._length + slots
        self._stored -= int(self._valid_flat[rows].sum())  # transitions whose first frame this overwrites
        self._frames_flat[at * (self._length + 1) + slots] = frames
        self._start_flat[rows] = positions if start is None else start
        self._valid_flat[rows] = False
        self._written[at] = positions + 1
        return positions

    def _with_final(self, next_obs: np.ndarray, final_obs: Any, done: np.ndarray) -> np.ndarray:
        """``next_obs`` with the rows of ended episodes taken from ``final_obs`` (an array, or gymnasium's object
        array with ``None`` for the envs that did not end)."""
        if not done.any():
            return next_obs
        rows = next_obs.copy()
        finals = [final_obs] if self.num_envs is None else final_obs
        for env in self._envs[done]:
            rows[env] = self._checked("final_obs", finals[env], one=True)[0]
        return rows

    def _check_starts(self, stacks: np.ndarray, at: np.ndarray, name: str) -> None:
        """Each stack of ``at`` starts an episode: the frames before its newest must be the padding."""
        if not len(at) or self.stack == 1:
            return
        first = stacks[at, -1:]
        padding = first if self.padding == "reset" else np.zeros_like(first)
        bad = ~(stacks[at, :-1] == padding).reshape(len(at), -1).all(axis=1)
        if bad.any():
            env = int(at[bad][0])
            where = "" if self.num_envs is None else f" of env {env}"
            raise ValueError(
                f"{name}{where} starts an episode but its earlier frames are not the {self.padding} padding: "
                f"the env pads otherwise (padding={'zero' if self.padding == 'reset' else 'reset'}?) or the "
                "buffer missed an episode end"
            )

    def _checked(self, name: str, value: Any, one: bool = False) -> np.ndarray:
        """``value`` for field ``name`` as a numpy array with a leading env dimension (a view where it is one
        already), after the checks: its shape, and a dtype that the field stores without changing its values
        (``ValueError`` naming both). ``one``: a single env's value, whatever ``num_envs``."""
        shape, accepted = self._fields[name]
        single = one or self.num_envs is None
        expected = shape if single else (self.num_envs, *shape)
        if type(value) is np.ndarray and value.dtype in accepted and value.shape == expected:  # as envs give them
            return value[None] if single else value
        if isinstance(value, torch.Tensor):
            value = value.detach()  # Copy decision: the buffer never holds, nor writes through, a graph
            source: Any = value.dtype
            value = value.cpu()
            value = (value.float() if value.dtype == torch.bfloat16 else value).numpy()
        elif isinstance(value, (np.ndarray, np.generic)):
            source = value.dtype
        elif type(value) in (bool, int, float):
            source = type(value)
        else:
            raise TypeError(f"{name} must be a numpy array, a tensor or a number, got {type(value).__name__}")
        array = np.asarray(value)
        if array.shape != expected:
            per_add = "" if single else f" and {self.num_envs} per add: expected {expected}"
            raise ValueError(f"{name} has shape {array.shape}, the buffer stores {shape} per transition{per_add}")
        if source not in accepted:
            number = value if isinstance(value, (bool, int, float, np.generic)) else None
            stored = self._stored_as[name]
            refusal = _refusal(name, source, number, stored)
            if refusal is None and (name == "reward" or may_overflow(source, stored)):  # values it cannot hold
                refusal = value_refusal(name, array, stored, name == "reward")
            if refusal is not None:
                raise ValueError(refusal)
        return array[None] if single else array

    # -- reading -------------------------------------------------------------------------------------------------

    def _positions(self, envs: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """The position held by each ``slot`` of each env's ring now (the latest written there; negative: none)."""
        written = self._written[envs]
        oldest = written - self._length
        return np.where(written >= self._length, oldest + (slots - oldest) % self._length, slots)

    def _sampleable(self, envs: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Whether a transition starts at each slot and every frame of its two stacks is still in the ring."""
        positions = self._positions(envs, slots)
        first_needed = np.maximum(positions - (self.stack - 1), self._start[envs, slots])
        in_ring = (positions < self._written[envs]) & (first_needed >= self._written[envs] - self._length)
        return self._valid[envs, slots] & in_ring

    def sample(
        self, batch_size: int, generator: torch.Generator | None = None, *, device: str | torch.device = "cpu"
    ) -> dict[str, torch.Tensor]:
        """``batch_size`` transitions drawn uniformly with replacement, as new tensors on ``device``: ``obs`` and
        ``next_obs`` the stacks the env gave (shape ``(batch_size, stack, *frame)``), ``action``, ``reward``,
        ``terminated``, ``truncated``. Candidates are frames drawn by ``torch.randint`` with ``generator``, a quarter
        more than needed, and the first that start a transition whose stacks are still in the ring are kept (an
        episode's last frame starts none); more are drawn in the rare case that too few were.

        On the CPU (the default) the batch is new numpy memory. For a CUDA ``device`` it is gathered into pinned host
        memory and copied with ``non_blocking=True``, one copy per field that the host does not wait for
        (``copy_correct._host_batch``); another device: gathered on the host, then ``.to(device)``."""
        _check_sample(batch_size, generator)
        target = checked_device("device", device)
        pinned = target.type == "cuda"
        if self._stored == 0:  # with one stored, each stream's newest transition has its whole stack in the ring
            raise ValueError("cannot sample from a FrameReplayBuffer that holds no transition yet")
        length, written = self._length, self._written
        filled = np.minimum(written, length)
        bounds = np.cumsum(filled)
        chosen_envs, chosen_positions, got = [], [], 0
        while got < batch_size:
            want = batch_size - got
            draws = torch.randint(int(bounds[-1]), (want + want // 4 + 8,), generator=generator).numpy()
            envs = np.searchsorted(bounds, draws, side="right") if len(bounds) > 1 else np.zeros_like(draws)
            positions = written[envs] - filled[envs] + draws - (bounds[envs] - filled[envs])  # oldest + offset
            rows = envs * length + positions % length
            first_needed = np.maximum(positions - (self.stack - 1), self._start_flat[rows])
            kept = np.flatnonzero(self._valid_flat[rows] & (first_needed >= written[envs] - length))[:want]
            chosen_envs.append(envs[kept])
            chosen_positions.append(positions[kept])
            got += len(kept)
        envs = np.concatenate(chosen_envs) if len(chosen_envs) > 1 else chosen_envs[0]
        positions = np.concatenate(chosen_positions) if len(chosen_positions) > 1 else chosen_positions[0]
        rows = envs * length + positions % length  # into the per-slot fields, flattened
        start = self._start_flat.take(rows)[:, None]
        obs_at = positions[:, None] + self._offsets
        batch = {
            "obs": self._gather(envs, obs_at, start, pinned),
            "action": _taken(self._action_flat, rows, pinned),
            "reward": _taken(self._reward_flat, rows, pinned),
            "next_obs": self._gather(envs, obs_at + 1, start, pinned),
            "terminated": _taken(self._terminated_flat, rows, pinned),
            "truncated": _taken(self._truncated_flat, rows, pinned),
        }
        return batch if target.type == "cpu" else _host_batch.moved(batch, target)

    def _gather(self, envs: np.ndarray, positions: np.ndarray, start: np.ndarray, pinned: bool) -> torch.Tensor:
        """The frames at ``positions`` (batch, stack) of each row's env: those before the row's episode start are its
        padding. One gather of the flattened rings into new numpy memory, by torch's ``index_select``, which splits the
        copy over its threads (measured by ``benchmarks/frame_replay.py``: 10-15% under numpy's ``take``; indexing the
        rings with two index arrays took ten times as long)."""
        before = positions < start
        if self.padding == "reset":
            slots = np.where(before, start, positions) % self._length
        else:
            slots = np.where(before, self._length, positions % self._length)
        index = torch.from_numpy(envs[:, None] * (self._length + 1) + slots).reshape(-1)
        _, out = _host_batch.empty((index.numel(), *self.frame_shape), self._frames.dtype, pinned)
        torch.index_select(self._frames_torch, 0, index, out=out)
        return out.view(*positions.shape, *self.frame_shape)

    # -- checkpoints ---------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The rings and the streams' positions, as tensors sharing the buffer's memory (not copied)."""
        return {name: torch.from_numpy(array) for name, array in self._arrays().items()} | {
            "autoreset_mode": self.autoreset_mode,
            "padding": self.padding,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Copy a saved buffer into this one's storage; its shapes, dtypes, mode and padding must be this one's."""
        for key in ("autoreset_mode", "padding"):
            if state[key] != getattr(self, key):
                raise ValueError(f"saved buffer has {key}={state[key]!r}, this one {getattr(self, key)!r}")
        arrays = self._arrays()
        for name, into in arrays.items():
            saved = state[name]
            if tuple(saved.shape) != into.shape or saved.dtype != _torch_dtype(into.dtype):
                raise ValueError(
                    f"saved {name} is {tuple(saved.shape)} {saved.dtype}, this buffer's is {into.shape} {into.dtype}"
                )
        for name, into in arrays.items():
            into[...] = state[name].numpy()
        self._stored = int(self._valid.sum())
        self._at_boundary = bool(self._ended.any()) or bool((self._current < 0).any())


def _taken(field: np.ndarray, rows: np.ndarray, pinned: bool) -> torch.Tensor:
    """``field``'s ``rows`` gathered into new host memory (``pinned``: page-locked, for a copy to a CUDA device)."""
    if not pinned:
        return torch.from_numpy(field.take(rows, axis=0))
    array, out = _host_batch.empty((len(rows), *field.shape[1:]), field.dtype, pinned)
    field.take(rows, axis=0, out=array, mode="clip")  # rows are in range: clip skips numpy's buffering
    return out


def _check_stacked(shape: tuple[int, ...]) -> None:
    """``shape`` must be a stack of frames, ``(stack, *frame)`` with at most ``MAX_STACK`` frames: a channel-last stack
    (stable-baselines3's ``VecFrameStack``: ``(84, 84, 4)``) or a single image would otherwise be taken as 84 frames,
    and refused only at the first ``add``."""
    if len(shape) < 2 or shape[0] < 1:
        raise ValueError(f"obs must be a stack of frames, shape (stack, *frame), got {shape}")
    if shape[0] <= MAX_STACK:
        return
    if len(shape) == 3 and shape[-1] <= MAX_STACK:
        raise ValueError(
            f"obs has shape {shape}, a channel-last layout (height, width, stack), as stable-baselines3's "
            "VecFrameStack gives it: the buffer takes stacks first, (stack, *frame): move the axis "
            "(np.moveaxis(obs, -1, -3), VecTransposeImage) or stack with gymnasium's FrameStackObservation"
        )
    raise ValueError(
        f"obs has shape {shape}, not a stack of frames (stack, *frame) of at most {MAX_STACK}: an unstacked "
        "observation? wrap the env in gymnasium's FrameStackObservation(env, 4)"
    )


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.zeros(0, dtype=dtype)).dtype
