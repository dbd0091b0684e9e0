"""``ReplayBase``: what ``ReplayBuffer`` and ``FrameReplayBuffer`` do alike, written once: the settings both check
first, ``add``'s signature and its dispatch to the path chosen at construction, ``sample`` from its checks to the batch
on its device, and the refusal of copies. Each buffer keeps what differs: its storage and ``add``'s paths into it
(``writes``, ``frame_writes``), which numbers a draw picks from, how a batch's rows are gathered (``_fields_at``), its
n-step windows (``_window``), ``len`` and its state.

``_draw`` is the one method that chooses a batch's rows (uniformly, for both buffers): prioritized sampling overrides
it, and the rest of ``sample`` (the n-step windows, the gather, the move to the device) takes the rows it returns.

Copy contract:

* ``add`` copies the values given into the buffer's storage through its path: nothing of the caller's kept, tensors
  read through ``detach()``, so the buffer never holds a graph; a refused ``add`` writes nothing.
* ``sample`` gathers each field's rows into new memory (pinned for a CUDA batch and copied without a wait:
  ``host_batch``), shared with nothing, so training code may change a batch in place; nothing of it is seen by
  autograd. The draw's numbers come from ``generator`` alone.
* ``pickle``, ``copy.copy`` and ``copy.deepcopy`` raise one ``TypeError`` line naming the class and the way that
  copies it, ``state_dict()`` loaded into a new one (``load_state_dict`` copies; each buffer says why a copy would be
  wrong).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from copy_correct.core.checks import device as checked_device
from copy_correct.core.checks import integer, integral, shown
from copy_correct.replay import host_batch, n_step
from copy_correct.replay.fields import check_num_envs, flag_rows

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
    ``_window(rows)``; where not every row is drawable, ``_rows_at(numbers)`` and ``_drawable(rows)``.
    """

    _add: Callable[..., None]
    _EMPTY: str
    _every_row_drawable: bool
    device: torch.device
    _on_cpu: bool

    def __init__(self, capacity: Any, num_envs: Any, n_steps: Any, gamma: Any) -> None:
        check_num_envs(num_envs)
        self.n_steps, self.gamma = n_step.settings(n_steps, gamma)
        integral("capacity", capacity, "an integer >= 1")
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
        self, batch_size: int, generator: torch.Generator | None = None, *, device: str | torch.device | None = None
    ) -> dict[str, torch.Tensor]:
        """``batch_size`` transitions drawn uniformly with replacement, by ``torch.randint`` on the CPU with
        ``generator``, as new tensors on ``device`` (default: the buffer's; ``FrameReplayBuffer``'s is the CPU) in the
        stored dtypes: ``obs``, ``action``, ``reward``, ``next_obs``, ``terminated``, ``truncated``
        (``FrameReplayBuffer``: ``obs`` and ``next_obs`` the stacks the env gave, ``(batch_size, stack, *frame)``).
        With ``n_steps > 1`` each is its window (``reward``, ``next_obs``, ``terminated``, ``truncated``: the
        ``n_steps`` argument); with ``gamma``, ``discounts`` (float32) is added. Refused in one line: a
        ``batch_size`` that is not an integer >= 1, a ``generator`` that is not a ``torch.Generator``, an empty buffer.

        On the host the batch is new numpy memory, which ``MemoryProbe`` does not count (``tracemalloc`` does), each
        field gathered the faster way for its size (``ReplayBuffer``: numpy's ``take`` or torch's ``index_select``;
        ``FrameReplayBuffer``: one gather of each stack's frames). For a CUDA ``device`` it is gathered the same way
        into pinned host memory and copied with ``non_blocking=True``: one copy per field that the host does not wait
        for (``copy_correct.replay.host_batch``); another device: gathered on the host, then ``.to(device)``. A
        ``ReplayBuffer`` on CUDA gathers there, and copies to another ``device`` (to the CPU: a copy the host waits
        for)."""
        check_sample(batch_size, generator)
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
        return batch if target.type == "cpu" and self._on_cpu else host_batch.moved(batch, target)

    def _draw(self, batch_size: int, generator: torch.Generator | None, span: int) -> np.ndarray:
        """The rows of a batch: ``batch_size`` drawn uniformly with replacement from the transitions that can be drawn
        now, numbers from ``torch.randint(span, ...)`` on the CPU with ``generator`` (``span``: ``_span()``, above 0).
        This is the one method that chooses which transitions a batch holds: prioritized sampling overrides it (rows
        drawn by priority, ``_drawable`` still the filter where not every row is drawable), and the rest of ``sample``
        takes the rows it returns.

        Where every number names a row that holds a transition (``ReplayBuffer``: rows ``0 .. size - 1``), the
        ``batch_size`` numbers are the rows. Otherwise (``FrameReplayBuffer``: a number is a frame of a stream,
        ``_rows_at``, and an episode's last frame starts no transition, nor one whose stack lost its first frames) a
        quarter more than needed are drawn, and 8, and the first that can be drawn (``_drawable``) are kept; more are
        drawn in the rare case that too few were."""
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

    def __reduce_ex__(self, protocol: Any) -> Any:
        name = type(self).__name__
        raise TypeError(
            f"a {name} cannot be pickled or copied (pickle, copy.copy, copy.deepcopy): save its state_dict() and "
            f"load_state_dict() it into a new {name}"
        )


def check_sample(batch_size: Any, generator: Any) -> None:
    """``sample``'s arguments: ``batch_size`` an integer >= 1 (``"64"`` and ``True`` are ``TypeError``s), ``generator``
    a ``torch.Generator`` or ``None``; a plain call costs two type checks."""
    if type(batch_size) is not int or batch_size < 1:
        integer("batch_size", batch_size, 1)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {shown(generator)}")
