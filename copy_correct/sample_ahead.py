"""``SampleAhead``: a replay buffer's next batch drawn on a background thread while the loop trains on this one.

    with SampleAhead(buffer, 32, generator=torch.Generator().manual_seed(0), device="cuda") as ahead:
        ahead.add(obs, action, reward, next_obs, terminated, truncated)   # buffer.add, once no draw is in flight
        batch = ahead.sample()                                            # drawn at the call before; the next starts

Which state each batch is drawn from, whatever the thread's timing: call ``k`` of ``sample()`` returns batch ``k``
and starts drawing batch ``k + 1`` from the buffer as it stands then; the first call draws batches 0 and 1 in turn.
So batch ``k + 1`` misses the transitions added between calls ``k`` and ``k + 1``: one sample stale, by design. The
draws are ``buffer.sample(batch_size, generator, device=)`` calls, one at a time on one thread, in that order, and
``add`` waits for the draw in flight before it writes: the same seeds give the same batches, bit for bit, as those
synchronous calls at those points. TorchRL's ``ReplayBuffer(prefetch=n)`` also hands over batches drawn earlier, but
its draws run on up to ``n`` threads whenever they start, a lock ordering them against ``extend`` by timing alone.

Copy contract:

* New storage: each batch, as ``buffer.sample`` makes it (new memory; nothing shared with the buffer, so training
  code may change it in place); ``SampleAhead`` keeps no reference to a batch it has handed over.
* Shared: the buffer and the generator, which only the background thread uses from the first ``sample()`` to
  ``close()`` (the default generator would be the loop's too: drawn from two threads, the order would be timing's).
  Between calls, read or write the buffer only through ``add``, or after ``wait()``.
* What autograd sees: what ``buffer.sample`` gives (no graph) and what ``buffer.add`` writes (detached values).

A ``FrameReplayBuffer(compress=...)`` compresses the frames added since the draw before at the next draw: on the
thread. A draw's error is raised by the ``sample()`` that would have returned its batch. ``close()`` (or leaving the
``with`` block) waits for the draw in flight and ends the thread; an unclosed ``SampleAhead`` that is garbage
collected ends it too. A CUDA batch is copied on the thread's current stream: the default stream, as the loop's.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import torch

from copy_correct._checks import device as checked_device
from copy_correct._checks import integer, shown

__all__ = ["SampleAhead"]


class Buffer(Protocol):
    """What ``SampleAhead`` calls: ``ReplayBuffer``'s and ``FrameReplayBuffer``'s ``add`` and ``sample``."""

    def add(self, *args: Any, **kwargs: Any) -> None: ...

    def sample(self, batch_size: int, generator: torch.Generator | None = None, *, device: Any = ...) -> Any: ...


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

    def _draw(self) -> Future[Any]:
        return self._pool.submit(self.buffer.sample, self.batch_size, self.generator, **self._options)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this SampleAhead is closed: sample and add on its buffer directly, or make another")

    def sample(self) -> Any:
        """Batch ``k`` at call ``k`` (drawn at call ``k - 1``; at the first call, now), the draw of batch ``k + 1``
        started before it returns. A draw's error is raised here, and the next call draws anew, as the first."""
        self._check_open()
        pending = self._pending if self._pending is not None else self._draw()
        self._pending = None
        batch = pending.result()
        self._pending = self._draw()
        return batch

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

    def close(self) -> None:
        """Wait for the draw in flight, drop its batch and end the thread; closing again does nothing."""
        self.wait()
        self._pending, self._closed = None, True
        self._pool.shutdown(wait=True)

    def __enter__(self) -> SampleAhead:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
