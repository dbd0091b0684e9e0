"""``FrameReplayBuffer``: replay for frame-stacked observations that keeps each frame once.

    envs = gym.vector.SyncVectorEnv([make_env(i) for i in range(8)])      # each env ends in FrameStackObservation
    buffer = FrameReplayBuffer(1_000_000, envs.single_observation_space, envs.single_action_space,
                               num_envs=8, autoreset_mode=envs.metadata["autoreset_mode"])
    buffer.add(obs, actions, rewards, next_obs, terminations, truncations)   # what envs.step gave
    batch = buffer.sample(32, device="cuda")    # {"obs": (32, 4, 84, 84) uint8, ...}: the stacks the env gave

A stacked observation shares all its frames but one with the next. This buffer keeps one ring of frames per env
stream and, per transition, the newest frame of ``next_obs``, its action, reward and flags and where its episode began
(an episode's first frame costs one frame more); ``sample`` rebuilds both stacks of each drawn transition with one
gather each, padded before an episode's start as ``FrameStackObservation`` pads (``padding="reset"``: copies of the
first frame; ``"zero"``). ``compress="zstd"`` or ``"lz4"``: each frame compressed once, by the next ``sample`` (or
every 64th ``add``: ``frame_store``), the batches bit for bit the same. Vector envs and autoreset modes as
``ReplayBuffer``'s; what a row must be to be stored: ``frame_writes``; bytes and times: docs/recipes/dqn.md, "Atari".

Copy contract (``ReplayBuffer``'s, on the host):

* New storage, once, at construction: the rings, numpy memory in the observation's dtype, ``nbytes`` in all
  (compressed frames: blocks taken as the rings fill, and the frames waiting to be compressed, counted too). ``add``
  copies into them; ``sample`` gathers each field into new memory (``obs`` and ``next_obs`` share frames, not
  memory), pinned for a CUDA ``device`` and copied without a wait (``host_batch``).
* Shared: nothing with the caller, nor between a batch and the rings, so training code may change a batch in place.
  ``state_dict()`` shares the rings (not copied; compressed frames: their bytes copied) and every stream's position:
  a resumed run samples the transitions the uninterrupted one would; it loads with ``torch.load(...,
  weights_only=True)``. ``pickle`` and ``copy`` are refused in one line naming ``state_dict()``: a copy's ``add``
  wrote where its ``sample`` did not read (views split), and a compressed one's codec does not pickle.
* What autograd sees: nothing. Tensors are read through ``detach()``, the rings are numpy memory, and a batch is new
  tensors. Everything is checked before anything is written, each refusal one line naming the field and env.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from copy_correct.replay import host_batch, n_step
from copy_correct.replay.autoreset import AUTORESET_MODES, parse_mode
from copy_correct.replay.base import ReplayBase
from copy_correct.replay.fields import TORCH_OF, Space, check_settings, field_spec, layout, unseen
from copy_correct.replay.frame_codec import codec
from copy_correct.replay.frame_store import CompressedFrames
from copy_correct.replay.frame_writes import add_for
from copy_correct.replay.host_batch import held, taken
from copy_correct.replay.priorities import Priorities

__all__ = ["AUTORESET_MODES", "FrameReplayBuffer"]

PADDINGS = ("reset", "zero")
MAX_STACK = 32  # more frames than this in the first dimension: not a stack (channel-last, or one unstacked image)


class FrameReplayBuffer(ReplayBase):
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
        n_steps: the rewards summed into each sampled transition (n-step returns), as ``ReplayBuffer``'s: an env
            stream's next transition is the one that starts at the frame after.
        gamma: their discount, and ``discounts`` (``gamma**m``) in ``sample``'s batches, as ``ReplayBuffer``'s.
        compress: ``None`` (frames as they are) or a codec, ``"zstd"`` (the smallest) or ``"lz4"`` (the fastest):
            each frame compressed once (by the next ``sample``, ``state_dict``, or every 64th ``add``: with
            ``SampleAhead``, on its thread), decompressed at ``sample``; the batches are the same, bit for bit.
            Needs the ``compress`` extra (``pip install "copy-correct[compress]"``).
        prioritized: draw transitions by priority, as ``ReplayBuffer``'s: a priority per slot of every stream
            (about 17 bytes a frame), none for a slot that starts no transition that can be drawn (an episode's last
            frame, a reset step left out, a stack whose first frames the ring overwrote), so it is never drawn.
        alpha: how much the priorities count, ``P(i) ~ p_i^alpha``, as ``ReplayBuffer``'s.

    Attributes:
        stack, frame_shape: the frames per observation and the shape of one frame.
        nbytes: the bytes of storage: allocated at construction (compressed: and the blocks taken since, and the
            frames waiting to be compressed).
        device: where ``sample`` puts a batch by default: the CPU, where the rings are.
    """

    _EMPTY = "a FrameReplayBuffer that holds no transition yet"
    _every_row_drawable = False  # an episode's last frame starts no transition, nor one whose stack lost its start

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
        n_steps: int = 1,
        gamma: float | None = None,
        compress: str | None = None,
        prioritized: bool = False,
        alpha: float = 0.6,
    ) -> None:
        super().__init__(capacity, num_envs, n_steps, gamma, prioritized, alpha)
        self.autoreset_mode = parse_mode(autoreset_mode, num_envs)
        if padding not in PADDINGS:
            raise ValueError(f"padding must be one of {', '.join(PADDINGS)}, got {padding!r}")
        obs_shape, frame_dtype = layout("obs", obs, None, np.uint8)
        _check_stacked(obs_shape)
        self.action_shape, action_np = layout("action", action, action_dtype, np.int64)
        self.padding = padding
        self.device, self._on_cpu = torch.device("cpu"), True
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
        self.compress, self._frame_dtype = compress, np.dtype(frame_dtype)
        if compress is None:  # slot `length` of each stream is a frame of zeros: what zero padding gathers
            self._frames = np.zeros((envs, self._length + 1, *self.frame_shape), dtype=frame_dtype)
            self._store = None
        else:
            frame_bytes = int(np.prod(self.frame_shape)) * self._frame_dtype.itemsize
            self._store = CompressedFrames(
                codec(compress, frame_bytes), envs, self._length, self.frame_shape, self._frame_dtype
            )
        self._start = np.zeros((envs, self._length), dtype=np.int64)  # where each frame's episode began
        self._valid = np.zeros((envs, self._length), dtype=np.bool_)  # a transition starts at this frame
        self._action = np.zeros((envs, self._length, *self.action_shape), dtype=action_np)
        self._reward = np.zeros((envs, self._length), dtype=np.float32)
        self._terminated = np.zeros((envs, self._length), dtype=np.bool_)
        self._truncated = np.zeros((envs, self._length), dtype=np.bool_)
        self._written = np.zeros(envs, dtype=np.int64)  # frames written to each stream, ever
        self._current = np.full(envs, -1, dtype=np.int64)  # the position of the current obs's newest frame, or -1
        self._stored = 0  # transitions in the rings (a few at the oldest end may have lost their stack's start)
        self._at_boundary = True  # some env starts an episode or takes its reset step next
        self._envs = np.arange(envs)
        self._offsets = np.arange(-(self.stack - 1), 1, dtype=np.int64)
        # Flat views: a row is env * length + slot (env * (length + 1) + slot for frames); one index per write.
        if compress is None:
            self._frames_flat = self._frames.reshape(-1, *self.frame_shape)
            self._frames_torch = torch.from_numpy(self._frames_flat)
        self._start_flat, self._valid_flat = self._start.reshape(-1), self._valid.reshape(-1)
        self._action_flat = self._action.reshape(-1, *self.action_shape)
        self._reward_flat = self._reward.reshape(-1)
        self._terminated_flat, self._truncated_flat = self._terminated.reshape(-1), self._truncated.reshape(-1)
        # Each field's shape per transition and the stored dtype; the source dtypes it takes without a look at values.
        frame_torch = TORCH_OF[frame_dtype]
        stored_as = {
            "obs": frame_torch, "next_obs": frame_torch, "final_obs": frame_torch, "action": TORCH_OF[action_np],
            "reward": torch.float32, "terminated": torch.bool, "truncated": torch.bool,
        }  # fmt: skip
        shapes = {"action": self.action_shape, "reward": (), "terminated": (), "truncated": ()}
        self._fields = {
            name: field_spec(name, shapes.get(name, obs_shape), stored, num_envs) for name, stored in stored_as.items()
        }
        self._reward_takes = unseen("reward", torch.float32, any_range=True)  # then looked at by finite_rewards
        self._step = (envs,) if num_envs is not None else ()
        self._step_obs, self._step_action = (*self._step, *obs_shape), (*self._step, *self.action_shape)
        self._frame_rows = self._envs * (self._length + 1)  # each stream's first row in _frames_flat
        self._slot_rows = self._envs * self._length  # each stream's first row in the per-slot fields
        self._few = envs <= 2  # the common step env by env, on plain indices (faster for one or two)
        integer = not self.action_shape and action_np.kind in "iu"
        self._action_range = (int(np.iinfo(action_np).min), int(np.iinfo(action_np).max)) if integer else None
        self._fixed_nbytes = sum(a.nbytes for a in self._arrays().values())
        self._add = add_for(self)  # every add's path (frame_writes), chosen once
        self._prioritize(envs * self._length)
        if self._priorities is not None:
            self._fixed_nbytes += self._priorities.nbytes

    def _with_priorities(self, add: Callable[..., None], priorities: Priorities) -> Callable[..., None]:
        """``add``, then the priorities of the slots whose transitions it changed: of each stream, the slots of the
        positions it wrote and the one before (a new transition starts at its ``obs``'s newest frame: the largest
        priority so far, where it can be drawn; an overwritten one, none) and those at the ring's oldest end whose
        stacks may have lost their first frames (none, where they cannot be drawn now)."""
        length, envs = self._length, self._envs[:, None]
        touched = np.arange(-1, 2)  # an add writes at most two frames of a stream: its obs's and its next_obs's
        edge = np.arange(self.stack + 2) - length  # the oldest positions, before and after

        def add_tracked(buffer: Any, *fields: Any) -> None:
            before = buffer._written.copy()
            add(buffer, *fields)
            after = buffer._written[:, None]
            at = before[:, None] + touched
            new = (at >= 0) & (at < after)
            oldest = before[:, None] + edge
            old = (oldest >= 0) & (oldest < after - length + self.stack)
            rows = np.concatenate([(envs * length + at % length)[new], (envs * length + oldest % length)[old]])
            drawable = buffer._drawable(rows)
            fresh = drawable[: int(new.sum())]
            if fresh.any():
                priorities.set_new(rows[: len(fresh)][fresh])
            if not drawable.all():
                priorities.clear(rows[~drawable])

        return add_tracked

    def _row_written(self, rows: np.ndarray) -> np.ndarray:
        envs, slots = np.divmod(rows, self._length)
        return slots < self._written[envs]

    def _arrays(self) -> dict[str, np.ndarray]:
        """The arrays of storage of fixed shape (compressed frames: ``_store``'s, apart)."""
        frames = {"frames": self._frames} if self._store is None else {}
        return frames | {
            "start": self._start, "valid": self._valid, "action": self._action,
            "reward": self._reward, "terminated": self._terminated, "truncated": self._truncated,
            "written": self._written, "current": self._current, "ended": self._ended,
        }  # fmt: skip

    @property
    def nbytes(self) -> int:
        """The bytes of storage (compressed: with every block taken, in use or free, and the frames waiting)."""
        return self._fixed_nbytes + (0 if self._store is None else self._store.nbytes)

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

    def _span(self) -> int:
        """The frames of every stream's ring that hold one, which a draw's numbers name in turn (``_rows_at``); 0 while
        no transition is stored."""
        return int(np.minimum(self._written, self._length).sum()) if self._stored else 0

    def _rows_at(self, numbers: np.ndarray) -> np.ndarray:
        """The slot row of each number below ``_span()``: the streams' filled frames one after another, each stream's
        from its oldest."""
        filled = np.minimum(self._written, self._length)
        bounds = np.cumsum(filled)
        envs = np.searchsorted(bounds, numbers, side="right") if len(bounds) > 1 else np.zeros_like(numbers)
        return envs * self._length + (self._written[envs] - bounds[envs] + numbers) % self._length  # oldest + offset

    def _drawable(self, rows: np.ndarray) -> np.ndarray:
        """Whether a transition starts at each row's frame and both its stacks are still in the ring (an episode's
        last frame starts none)."""
        return self._sampleable(*np.divmod(rows, self._length))

    def _fields_at(self, rows: np.ndarray, window: n_step.Window | None, pinned: bool) -> dict[str, torch.Tensor]:
        """The transitions at ``rows`` (the n-step ``window``'s where given) gathered into new memory: both stacks of
        each rebuilt from the rings (``_stacks``), the other fields by numpy's ``take``; ``pinned``: page-locked."""
        envs, slots = np.divmod(rows, self._length)
        positions = self._positions(envs, slots)
        start = self._start_flat.take(rows)[:, None]
        obs_at = positions[:, None] + self._offsets
        last, steps = (rows, 1) if window is None else (window.last, window.steps[:, None])
        return {
            "obs": self._stacks(envs, obs_at, start, pinned),
            "action": taken(self._action_flat, rows, pinned),
            "reward": taken(self._reward_flat, rows, pinned) if window is None else held(window.returns, pinned),
            "next_obs": self._stacks(envs, obs_at + steps, start, pinned),
            "terminated": taken(self._terminated_flat, last, pinned),
            "truncated": taken(self._truncated_flat, last, pinned),
        }

    def _window(self, rows: np.ndarray) -> n_step.Window:
        """The n-step windows of the transitions at ``rows`` (``copy_correct.replay.n_step``): a stream's next
        transition starts at the next slot, if one was stored there (its episode's first frame, or its current one, is
        none)."""
        length = self._length
        slots = rows % length
        window = (rows - slots)[:, None] + (slots[:, None] + np.arange(self.n_steps)) % length
        written = self._valid_flat[window]  # the first, a drawn transition's, is valid
        reward, terminated, truncated = self._reward_flat, self._terminated_flat, self._truncated_flat
        return n_step.windows(window, written, reward, terminated, truncated, self.gamma)

    def _stacks(self, envs: np.ndarray, positions: np.ndarray, start: np.ndarray, pinned: bool) -> torch.Tensor:
        """The frames at ``positions`` (batch, stack) of each row's env: those before the row's episode start are its
        padding. One gather of the flattened rings into new numpy memory, by torch's ``index_select``, which splits the
        copy over its threads (measured by ``benchmarks/frame_replay.py``: 10-15% under numpy's ``take``; indexing the
        rings with two index arrays took ten times as long). Compressed: each distinct frame decompressed once, then the
        same gather (``frame_store``)."""
        before = positions < start
        if self.padding == "reset":
            slots = np.where(before, start, positions) % self._length
        else:
            slots = np.where(before, self._length, positions % self._length)
        index = torch.from_numpy(envs[:, None] * (self._length + 1) + slots).reshape(-1)
        _, out = host_batch.empty((index.numel(), *self.frame_shape), self._frame_dtype, pinned)
        if self._store is None:
            torch.index_select(self._frames_torch, 0, index, out=out)
        else:
            self._store.gather(index.numpy(), out)
        return out.view(*positions.shape, *self.frame_shape)

    # -- checkpoints ---------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The rings and the streams' positions, as tensors sharing the buffer's memory (not copied); compressed
        frames as their bytes (copied, not decompressed), oldest first, and each slot's size."""
        compressed = {} if self._store is None else self._store.state(self._written)
        return (
            {name: torch.from_numpy(array) for name, array in (self._arrays() | compressed).items()}
            | {
                "autoreset_mode": self.autoreset_mode,
                "padding": self.padding,
                "compress": self.compress,
            }
            | self._priority_state()
        )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Copy a saved buffer into this one's storage; its shapes, dtypes, mode, padding and codec must be this
        one's (a state saved before buffers compressed is one of ``compress=None``)."""
        if state.get("compress") != self.compress:
            raise ValueError(
                f"saved buffer has compress={state.get('compress')!r}, this one {self.compress!r}: a state loads "
                "into a buffer that stores frames as it did"
            )
        check_settings(state, self, ("autoreset_mode", "padding"))
        arrays = self._arrays()
        shapes = {name: (array.shape, array.dtype) for name, array in arrays.items()}
        if self._store is not None:
            shapes["frame_size"] = (self._store.size.shape, np.dtype(np.int32))
            shapes["frame_bytes"] = ((len(state["frame_bytes"]),), np.dtype(np.uint8))
        for name, (shape, dtype) in shapes.items():
            saved = state[name]
            if tuple(saved.shape) != shape or saved.dtype != TORCH_OF[dtype]:
                raise ValueError(
                    f"saved {name} is {tuple(saved.shape)} {saved.dtype}, this buffer's is {shape} {dtype}"
                )
        if self._store is not None:
            self._store.check({k: state[k].numpy() for k in ("frame_bytes", "frame_size")}, state["written"].numpy())
        self._check_priority_state(state)
        for name, into in arrays.items():
            into[...] = state[name].numpy()
        if self._store is not None:
            self._store.load({k: state[k].numpy() for k in ("frame_bytes", "frame_size")}, self._written)
        self._stored = int(self._valid.sum())
        self._at_boundary = bool(self._ended.any()) or bool((self._current < 0).any())
        self._load_priorities(state)


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
