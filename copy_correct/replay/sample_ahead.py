"""``SampleAhead``: a replay buffer's next batch drawn on a background thread while the loop trains on this one.

    with SampleAhead(buffer, 32, generator=torch.Generator().manual_seed(0), device="cuda") as ahead:
        ahead.add(obs, action, reward, next_obs, terminated, truncated)   # buffer.add, once no draw is in flight
        batch = ahead.sample()                                            # drawn at the call before; the next starts

Which state each batch is drawn from, whatever the thread's timing: call ``k`` of ``sample()`` returns batch ``k``
and starts drawing batch ``k + 1`` from the buffer as it stands then; the first call draws batches 0 and 1 in turn.
So batch ``k + 1`` misses the transitions added between calls ``k`` and ``k + 1``: one sample stale, by design. The
draws are ``buffer.sample(batch_size, generator, device=)`` calls, one at a time on one thread, in that order, and
``add`` waits for the draw in flight before it writes: the same seeds give the same batches, bit for bit, as those
synchronous calls at those points. ``state_dict()`` holds the batch in flight: loaded with the buffer's state (taken
after it, before an ``add``), a resumed run draws the uninterrupted one's batches (the saved one misses later adds).
Priorities are one sample stale alike: ``update_priorities`` waits for the draw in flight, so those set from batch
``k`` are seen from batch ``k + 2`` on; ``sample(beta=)`` is the ``beta`` of the draw the call starts.

Copy contract:

* New storage: each batch, as ``buffer.sample`` makes it (new memory; nothing shared with the buffer, so training
  code may change it in place); ``SampleAhead`` keeps no reference to a batch it has handed over. ``state_dict()``
  copies the batch in flight (on its device) and the generator's state; ``load_state_dict`` copies them again.
* Shared: the buffer and the generator, which only the background thread draws from, from the first ``sample()`` to
  ``close()`` (the default generator would be the loop's too: drawn from two threads, the order would be timing's).
  Between calls, read or write the buffer only through ``add``, or after ``wait()`` (``state_dict`` waits). A thread
  cannot be copied: ``pickle`` and ``copy`` are refused in one line naming ``state_dict()``.
* What autograd sees: what ``buffer.sample`` gives (no graph) and what ``buffer.add`` writes (detached values).

A compressed ``FrameReplayBuffer`` compresses new frames at the next draw, on the thread. A draw's error is raised by
the ``sample()`` that would have returned its batch. ``close()`` (or leaving the ``with``) waits for the draw in flight
and ends the thread, as collecting an unclosed one does. A CUDA batch is copied on the thread's (default) stream.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import torch

from copy_correct.core.checks import device as checked_device
from copy_correct.core.checks import integer, shown
from copy_correct.loading.prefetch import map_tensors

__all__ = ["SampleAhead"]

STATE = ("batch_size", "generator", "batch")  # the keys of a saved state


class Buffer(Protocol):
    """What ``SampleAhead`` calls: ``ReplayBuffer``'s and ``FrameReplayBuffer``'s ``add`` and ``sample``."""

    def add(self, *args: Any, **kwargs: Any) -> None: ...

    def sample(self, batch_size: int, generator: torch.Generator | None = None, *, device: Any = ...) -> Any: ...

    def update_priorities(self, indices: Any, priorities: Any) -> None: ...


class SampleAhead:
    """Batches of ``buffer`` drawn one call ahead on a background thread (module docstring: which state each is from).

    Args:
        buffer: a ``ReplayBuffer``, ``FrameReplayBuffer`` or anything with their ``add`` and ``sample``.
        batch_size: the transitions of every batch.
        generator: the generator of every draw, used by the background thread only (required: the default
            generator is shared with the loop's thread).
        device: passed to every ``buffer.sample`` call; ``None``: the buffer's default.
    """

    def __init__(
        self, buffer: Buffer, batch_size: int, *, generator: torch.Generator, device: str | torch.device | None = None
    ) -> None:
        integer("batch_size", batch_size, 1)
        if not isinstance(generator, torch.Generator):
            raise TypeError(
                f"generator must be a torch.Generator of its own (the default one is the loop's too, and draws from "
                f"two threads would interleave by timing), got {shown(generator)}"
            )
        self.buffer, self.batch_size, self.generator = buffer, batch_size, generator
        self._options = {} if device is None else {"device": checked_device("device", device)}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="SampleAhead")
        self._pending: Future[Any] | None = None
        self._closed = False  # garbage collected, the pool ends its thread itself (it holds only a weak reference)

    def _draw(self, beta: float | None) -> Future[Any]:
        options = self._options if beta is None else self._options | {"beta": beta}
        return self._pool.submit(self.buffer.sample, self.batch_size, self.generator, **options)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this SampleAhead is closed: sample and add on its buffer directly, or make another")

    def sample(self, beta: float | None = None) -> Any:
        """Batch ``k`` at call ``k`` (drawn at call ``k - 1``; at the first call, now), the draw of batch ``k + 1``
        started before it returns, with ``beta`` for a prioritized buffer (``None``: the buffer's default). A draw's
        error is raised here, and the next call draws anew, as the first."""
        self._check_open()
        pending = self._pending if self._pending is not None else self._draw(beta)
        self._pending = None
        batch = pending.result()
        self._pending = self._draw(beta)
        return batch

    def update_priorities(self, indices: Any, priorities: Any) -> None:
        """``buffer.update_priorities(indices, priorities)``, once the draw in flight is done: it is drawn from the
        priorities before these (module docstring)."""
        self._check_open()
        self.wait()
        self.buffer.update_priorities(indices, priorities)

    def add(self, *args: Any, **kwargs: Any) -> None:
        """``buffer.add(*args, **kwargs)``, once the draw in flight (if any) is done: the buffer is never written
        while the thread reads it."""
        self._check_open()
        self.wait()
        self.buffer.add(*args, **kwargs)

    def wait(self) -> None:
        """Return once no draw is in flight (its batch, or error, kept for the next ``sample()``); until that call,
        the buffer may be read or written and the generator read."""
        if self._pending is not None:
            self._pending.exception()

    def state_dict(self) -> dict[str, Any]:
        """Once the draw in flight is done: ``batch``, a copy of its batch on its device (new storage: the loop may
        change the batch in place once handed over; ``None`` before the first ``sample()``), ``generator``, the
        generator's state after that draw, and ``batch_size``. Take the buffer's ``state_dict()`` after this one and
        before the next ``add``: no draw is in flight until the next ``sample()``. A draw's error is raised here too,
        and kept for that ``sample()``."""
        self._check_open()
        batch = None if self._pending is None else map_tensors(torch.clone, self._pending.result())
        return {"batch_size": self.batch_size, "generator": self.generator.get_state(), "batch": batch}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Go on from a saved ``state_dict()`` (its buffer's state loaded into this buffer): the next ``sample()``
        returns a copy of the saved batch (on this wrapper's ``device``, else where it was saved; nothing shared with
        ``state``) and starts the next draw with the saved generator state. A draw in flight here is waited for and
        dropped. Refused in one line, nothing changed: a state without those keys, or of another ``batch_size``."""
        self._check_open()
        missing = [key for key in STATE if key not in state]
        if missing:
            raise ValueError(f"not a SampleAhead state: it lacks {', '.join(missing)} (state_dict() gives {STATE})")
        if state["batch_size"] != self.batch_size:
            raise ValueError(
                f"saved SampleAhead drew batches of {state['batch_size']}, this one draws {self.batch_size}"
            )
        device = self._options.get("device")
        batch = state["batch"]
        if batch is not None:
            batch = map_tensors(torch.clone if device is None else lambda t: t.to(device, copy=True), batch)
        self.wait()
        self.generator.set_state(state["generator"])
        self._pending = None
        if batch is not None:
            self._pending = Future()
            self._pending.set_result(batch)

    def close(self) -> None:
        """Wait for the draw in flight, drop its batch and end the thread; closing again does nothing."""
        self.wait()
        self._pending, self._closed = None, True
        self._pool.shutdown(wait=True)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "a SampleAhead cannot be pickled or copied (pickle, copy.copy, copy.deepcopy: it runs a thread): save its "
            "state_dict() and its buffer's, and load_state_dict() them into a new buffer and a new SampleAhead over it"
        )

    def __enter__(self) -> SampleAhead:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
