"""``ReplayBase``: what ``ReplayBuffer`` and ``FrameReplayBuffer`` do alike, written once: the settings both check
first, ``add``'s signature and its dispatch to the path chosen at construction, ``sample`` from its checks to the batch
on its device, and the refusal of copies. Each buffer keeps what differs: its storage and ``add``'s paths into it
(``writes``, ``frame_writes``), which numbers a draw picks from, how a batch's rows are gathered (``_fields_at``), its
n-step windows (``_window``), ``len`` and its state.

``_draw`` is the one method that chooses a batch's rows: uniformly, or by priority (``prioritized=True``:
``priorities``, OpenAI baselines' names and definitions), and the rest of ``sample`` (the n-step windows, the gather,
the move to the device) takes the rows it returns. A prioritized buffer's rows are its leaves: ``ReplayBuffer``'s
ring rows, ``FrameReplayBuffer``'s slots of every stream; each buffer's ``add`` gives the rows it writes the largest
priority so far and takes it from the rows that no longer hold a transition that can be drawn
(``_with_priorities``), so a draw never finds one.

Copy contract:

* ``add`` copies the values given into the buffer's storage through its path: nothing of the caller's kept, tensors
  read through ``detach()``, so the buffer never holds a graph; a refused ``add`` writes nothing.
* ``sample`` gathers each field's rows into new memory (pinned for a CUDA batch and copied without a wait:
  ``host_batch``), shared with nothing, so training code may change a batch in place; nothing of it is seen by
  autograd. The draw's numbers come from ``generator`` alone. A prioritized batch's ``indices`` and ``weights`` are
  new memory too; ``update_priorities`` copies the values given (a CUDA tensor: one copy the host waits for).
* ``pickle``, ``copy.copy`` and ``copy.deepcopy`` raise one ``TypeError`` line naming the class and the way that
  copies it, ``state_dict()`` loaded into a new one (``load_state_dict`` copies; each buffer says why a copy would be
  wrong).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from copy_correct.core.checks import device as checked_device
from copy_correct.core.checks import integer, integral, shown
from copy_correct.replay import host_batch, n_step
from copy_correct.replay.fields import check_num_envs, flag_rows
from copy_correct.replay.priorities import Priorities, check_alpha, check_beta

__all__ = ["ReplayBase", "check_sample"]


class ReplayBase:
    """``add``, ``sample`` and the copy refusal of both buffers (module docstring). A subclass's ``__init__`` calls
    this one's first (``num_envs``, ``n_steps`` and ``gamma``, ``capacity`` an integer: checked in that order), then
    sets:

    * ``device`` (where ``sample`` puts a batch by default) and ``_on_cpu`` (its storage is host memory);
    * ``_add``: the path of every ``add``, ``add_for(self)`` of ``writes`` or ``frame_writes``, a function called
      with the buffer (a bound method kept on it would be a reference cycle);
    * ``_EMPTY``, the end of the refusal of a sample from an empty buffer, and ``_every_row_drawable``: whether every
      number ``_draw`` picks names a row that holds a transition (``ReplayBuffer``);

    and defines ``_span()`` (how many numbers a draw picks from, 0 while no transition is stored), ``_fields_at(rows,
    window, pinned)`` (each field's rows gathered into new memory, the n-step window's where given) and
    ``_window(rows)``; where not every row is drawable, ``_rows_at(numbers)`` and ``_drawable(rows)``. For priorities
    it calls ``_prioritize(rows)`` last and defines ``_with_priorities(add, priorities)`` and ``_row_written(rows)``.
    """

    _add: Callable[..., None]
    _EMPTY: str
    _every_row_drawable: bool
    device: torch.device
    _on_cpu: bool

    def __init__(
        self, capacity: Any, num_envs: Any, n_steps: Any, gamma: Any, prioritized: Any = False, alpha: Any = 0.6
    ) -> None:
        check_num_envs(num_envs)
        self.n_steps, self.gamma = n_step.settings(n_steps, gamma)
        integral("capacity", capacity, "an integer >= 1")
        if not isinstance(prioritized, bool):
            raise TypeError(f"prioritized must be True or False, got {shown(prioritized)}")
        self.prioritized, self.alpha = prioritized, check_alpha(alpha)
        self._priorities: Priorities | None = None
        self.num_envs = num_envs
        self._ended = np.zeros(num_envs or 1, dtype=np.bool_)  # next_step: the env's next row is its reset step
        self._flag_rows = flag_rows(num_envs or 1)  # truncated=False (the default) or True for every env

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
        """Store one transition (``num_envs=N``: N transitions, each field with a leading dimension N, one row per
        env), overwriting the oldest once full: ``ReplayBuffer`` copies every field into the next rows;
        ``FrameReplayBuffer`` keeps the newest frame of ``next_obs`` (and of ``obs`` where it starts an episode), the
        action, reward and flags. Fields: numpy arrays, tensors (detached; any device), or Python and numpy numbers; a
        single ``truncated`` flag (the default ``False``) is every env's.

        Checked before anything is written, each refusal one line naming the field (and env), the buffer unchanged: a
        shape or dtype that does not fit (a float never goes into an integer field nor a bool into a floating one), a
        reward that is not finite (NaN, inf) and a finite value beyond a floating field's range (float64 ``1e300``
        into float32, stored as ``inf`` otherwise). ``FrameReplayBuffer`` also refuses an ``obs`` that does not
        continue its stream, and an ended row whose ``next_obs`` does not continue its ``obs`` (the next episode's
        reset stack, as ``"same_step"`` gives it: the message names ``final_obs``).

        In ``"next_step"`` mode the rows of the envs whose last row ended an episode are their reset steps and are not
        stored; the rows written follow one another. ``final_obs`` (``infos.get("final_obs")``, ``"same_step"``
        mode): the real last observations, one per env (``None`` for an env that did not end), stored in place of
        ``next_obs`` for the rows whose episode ended; ``None``: ``next_obs`` is stored as it is.
        """
        self._add(self, obs, action, reward, next_obs, terminated, truncated, final_obs)

    def sample(
        self,
        batch_size: int,
        generator: torch.Generator | None = None,
        *,
        beta: float | None = None,
        device: str | torch.device | None = None,
    ) -> dict[str, torch.Tensor]:
        """``batch_size`` transitions drawn with replacement, uniformly by ``torch.randint`` on the CPU with
        ``generator``, as new tensors on ``device`` (default: the buffer's; ``FrameReplayBuffer``'s is the CPU) in the
        stored dtypes: ``obs``, ``action``, ``reward``, ``next_obs``, ``terminated``, ``truncated``
        (``FrameReplayBuffer``: ``obs`` and ``next_obs`` the stacks the env gave, ``(batch_size, stack, *frame)``).
        With ``n_steps > 1`` each is its window (``reward``, ``next_obs``, ``terminated``, ``truncated``: the
        ``n_steps`` argument); with ``gamma``, ``discounts`` (float32) is added. Refused in one line: a
        ``batch_size`` that is not an integer >= 1, a ``generator`` that is not a ``torch.Generator``, an empty buffer.

        ``prioritized=True``: transition ``i`` is drawn with probability ``P(i) = p_i^alpha / sum_k p_k^alpha`` (a
        mass from ``torch.rand`` with ``generator``), and the batch has ``indices`` (int64, the rows drawn: an n-step
        window's first transition) and ``weights`` (float32), ``(N P(i))^-beta`` over the largest weight in the buffer,
        that of its smallest priority (baselines' and TorchRL's normalisation); ``beta`` defaults to 0.4. A ``beta``
        given to a uniform buffer is refused.

        On the host the batch is new numpy memory, which ``MemoryProbe`` does not count (``tracemalloc`` does), each
        field gathered the faster way for its size (``ReplayBuffer``: numpy's ``take`` or torch's ``index_select``;
        ``FrameReplayBuffer``: one gather of each stack's frames). For a CUDA ``device`` it is gathered the same way
        into pinned host memory and copied with ``non_blocking=True``: one copy per field that the host does not wait
        for (``copy_correct.replay.host_batch``); another device: gathered on the host, then ``.to(device)``. A
        ``ReplayBuffer`` on CUDA gathers there, and copies to another ``device`` (to the CPU: a copy the host waits
        for)."""
        check_sample(batch_size, generator)
        if self._priorities is None and beta is not None:
            raise ValueError(f"beta weighs a prioritized buffer's draws; this {type(self).__name__} draws uniformly "
                             "(prioritized=False)")  # fmt: skip
        beta = 0.4 if beta is None else check_beta(beta)
        target = self.device if device is None else checked_device("device", device)
        span = self._span()
        if not span:
            raise ValueError(f"cannot sample from {self._EMPTY}")
        rows = self._draw(batch_size, generator, span)
        window = None if self.n_steps == 1 else self._window(rows)
        pinned = target.type == "cuda"
        batch = self._fields_at(rows, window, pinned)
        if self.gamma is not None:
            discounts = np.full(batch_size, self.gamma, np.float32) if window is None else window.discounts
            batch["discounts"] = host_batch.held(discounts, pinned)
        if self._priorities is not None:
            batch["indices"] = host_batch.held(rows, pinned)
            batch["weights"] = host_batch.held(self._priorities.weights(rows, beta), pinned)
        return batch if target.type == "cpu" and self._on_cpu else host_batch.moved(batch, target)

    def _draw(self, batch_size: int, generator: torch.Generator | None, span: int) -> np.ndarray:
        """The rows of a batch: ``batch_size`` drawn with replacement from the transitions that can be drawn now, by
        priority (``Priorities.draw``) or uniformly, numbers from ``torch.randint(span, ...)`` on the CPU with
        ``generator`` (``span``: ``_span()``, above 0). This is the one method that chooses which transitions a batch
        holds; the rest of ``sample`` takes the rows it returns.

        Where every number names a row that holds a transition (``ReplayBuffer``: rows ``0 .. size - 1``), the
        ``batch_size`` numbers are the rows. Otherwise (``FrameReplayBuffer``: a number is a frame of a stream,
        ``_rows_at``, and an episode's last frame starts no transition, nor one whose stack lost its first frames) a
        quarter more than needed are drawn, and 8, and the first that can be drawn (``_drawable``) are kept; more are
        drawn in the rare case that too few were."""
        if self._priorities is not None:
            return self._priorities.draw(batch_size, generator)
        if self._every_row_drawable:
            return torch.randint(span, (batch_size,), generator=generator, device="cpu").numpy()
        chosen, got = [], 0
        while got < batch_size:
            want = batch_size - got
            numbers = torch.randint(span, (want + want // 4 + 8,), generator=generator, device="cpu").numpy()
            rows = self._rows_at(numbers)
            rows = rows[self._drawable(rows)][:want]
            chosen.append(rows)
            got += len(rows)
        return np.concatenate(chosen) if len(chosen) > 1 else chosen[0]

    def update_priorities(self, indices: Any, priorities: Any) -> None:
        """Set the priorities of the rows ``indices`` (a batch's ``indices``) to ``priorities`` (say ``|TD error| +
        1e-6``), stored as ``p^alpha``; the largest given so far is every new row's. Both 1-D and of one length
        (tensors on any device, numpy arrays or sequences), indices integers, priorities positive and finite; a row
        given twice keeps its last. Refused in one line, nothing changed: a buffer that is not prioritized, lengths that
        differ, a priority that is 0, negative, NaN or inf, an index that is not a row written so far.
        ``FrameReplayBuffer``: a row whose transition the ring overwrote since the draw is left as it is (it holds no
        transition that can be drawn, or a new one with the largest priority)."""
        if self._priorities is None:
            raise ValueError(f"update_priorities needs a prioritized buffer; this {type(self).__name__} draws "
                             "uniformly (prioritized=False)")  # fmt: skip
        rows, values = _as_host(indices, "indices"), _as_host(priorities, "priorities")
        if rows.ndim != 1 or values.ndim != 1 or len(rows) != len(values):
            raise ValueError(f"indices and priorities must be 1-D and of one length, got shapes {rows.shape} and "
                             f"{values.shape}")  # fmt: skip
        if rows.dtype.kind not in "iu":
            raise ValueError(f"indices must be integers (a batch's indices), got {rows.dtype}")
        if values.dtype.kind not in "fiu" or not (np.isfinite(values) & (values > 0)).all():
            bad = values[~(np.isfinite(values) & (values > 0))][:1] if values.dtype.kind in "fiu" else values.dtype
            raise ValueError(f"priorities must be positive and finite, got {bad} among them")
        rows = rows.astype(np.int64, copy=False)
        unwritten = (rows < 0) | (rows >= self._priorities.rows)
        unwritten[~unwritten] = ~self._row_written(rows[~unwritten])
        if unwritten.any():
            raise ValueError(f"index {int(rows[unwritten][0])} is not a row this {type(self).__name__} has written")
        keep = self._priorities.drawable(rows)
        self._priorities.update(rows[keep], values[keep].astype(np.float64))

    def _prioritize(self, rows: int) -> None:
        """With ``prioritized=True``: a tree of ``rows`` leaves, and ``add`` that keeps it (``_with_priorities``)."""
        if self.prioritized:
            self._priorities = Priorities(rows, self.alpha)
            self._add = self._with_priorities(self._add, self._priorities)

    def _priority_state(self) -> dict[str, Any]:
        """The priorities' part of ``state_dict()``: none for a uniform buffer."""
        return {} if self._priorities is None else self._priorities.state()

    def _check_priority_state(self, state: Mapping[str, Any]) -> None:
        """Refuse a state whose priorities this buffer cannot take, in one line, before anything is loaded."""
        saved = "priorities" in state
        if saved != (self._priorities is not None):
            raise ValueError(
                f"saved buffer is {'' if saved else 'not '}prioritized, this one is {'not ' if saved else ''}"
                f"(prioritized={self.prioritized}): build it as the saved one was"
            )
        if self._priorities is not None:
            self._priorities.check(state)

    def _load_priorities(self, state: Mapping[str, Any]) -> None:
        if self._priorities is not None:
            self._priorities.load(state)

    def __reduce_ex__(self, protocol: Any) -> Any:
        name = type(self).__name__
        raise TypeError(
            f"a {name} cannot be pickled or copied (pickle, copy.copy, copy.deepcopy): save its state_dict() and "
            f"load_state_dict() it into a new {name}"
        )


def _as_host(values: Any, name: str) -> np.ndarray:
    """``values`` as a numpy array on the host: a tensor detached and copied there, else ``np.asarray``."""
    if isinstance(values, torch.Tensor):
        return values.detach().cpu().numpy()
    array = np.asarray(values)
    if array.dtype == object:
        raise ValueError(f"{name} must be numbers, got {shown(values)}")
    return array


def check_sample(batch_size: Any, generator: Any) -> None:
    """``sample``'s arguments: ``batch_size`` an integer >= 1 (``"64"`` and ``True`` are ``TypeError``s), ``generator``
    a ``torch.Generator`` or ``None``; a plain call costs two type checks."""
    if type(batch_size) is not int or batch_size < 1:
        integer("batch_size", batch_size, 1)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {shown(generator)}")
