"""``DevicePrefetcher``: batches arrive on the device with the next batch's copy already in flight.

    for images, labels in DevicePrefetcher(loader, "cuda", transform=to_float):
        loss = model(images, labels)  # batch k computes while batch k+1 is copied on a side stream

Copy contract:
  * CUDA target: each tensor of a batch is copied host-to-device once, from pinned memory (the loader's
    pinned batch, or pinned here when the loader did not pin), with ``non_blocking=True``, on one side
    stream created on first use and reused for every later epoch. Batch k+1's copy and transform are
    queued before batch k is handed over, so they overlap batch k's compute. At handover the compute
    stream waits on an event recorded after the copy (no host synchronisation), and every delivered
    tensor is ``record_stream``-ed on the compute stream, so the caching allocator cannot give its memory
    to another tensor while compute may still read it.
  * Meta or another accelerator: one ``.to(device, non_blocking=True)`` per tensor on the current stream
    (pinned memory is used when the loader pinned it).
  * Same device as the batch (CPU to CPU): no copy and no pinning; batches are the loader's own tensors.
  * The source batch is never written. The optional ``transform`` (for example ``uint8 -> float`` and
    normalisation, after the copy, so a quarter of the bytes cross the bus) receives the device copy; where
    no copy was made and the transform wrote into its input, a ``RuntimeError`` names the tensor instead of
    the loader's data changing silently.
  * Autograd: the prefetcher creates no graph of its own; batches come out as the loader made them.

Batches may be tensors or any nesting of tuples, lists, named tuples and dicts; other leaves pass
through unchanged. Order is preserved, ``len()`` is the wrapped loader's, and an empty loader yields
nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

__all__ = ["DevicePrefetcher", "map_tensors"]

Batch = Any


def map_tensors(fn: Callable[[torch.Tensor], Any], batch: Batch) -> Batch:
    """``batch`` with ``fn`` applied to every tensor in it, keeping tuples, lists, named tuples and dicts."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        items = {key: map_tensors(fn, value) for key, value in batch.items()}
        return items if type(batch) is dict else type(batch)(items)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(map_tensors(fn, value) for value in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(map_tensors(fn, value) for value in batch)
    return batch


def _tensors(batch: Batch) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    map_tensors(found.append, batch)
    return found


def _resolve(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device} was requested but CUDA is not available on this machine")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


class DevicePrefetcher:
    """Iterate ``loader``'s batches on ``device``, the next batch's copy overlapping the current compute.

    Args:
        loader: any iterable of batches (a ``DataLoader``, a list, a generator factory's output).
        device: where the batches are wanted; a CUDA device gets the side-stream pipeline.
        transform: applied to each batch after it reaches ``device`` (on the side stream for CUDA);
            returns the batch to deliver and must not write into tensors it did not make when no copy
            was made (checked).
    """

    def __init__(
        self, loader: Iterable[Batch], device: torch.device | str, transform: Callable[[Batch], Batch] | None = None
    ) -> None:
        self.loader = loader
        self.device = _resolve(device)
        self.transform = transform
        self._stream: torch.cuda.Stream | None = None

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Batch]:
        if self.device.type == "cuda":
            return self._pipelined()
        return (self._deliver(batch) for batch in self.loader)

    @property
    def stream(self) -> torch.cuda.Stream:
        """The side stream that carries the copies: made once, reused by every epoch."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def _move(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device == self.device:
            return tensor
        if self.device.type == "cuda" and tensor.device.type == "cpu" and not tensor.is_pinned():
            tensor = tensor.pin_memory()
        return tensor.to(self.device, non_blocking=True)

    def _deliver(self, batch: Batch) -> Batch:
        moved = map_tensors(self._move, batch)
        if self.transform is None:
            return moved
        uncopied = [(t, t._version) for t, src in zip(_tensors(moved), _tensors(batch), strict=True) if t is src]
        result = self.transform(moved)
        for tensor, version in uncopied:
            if tensor._version != version:
                raise RuntimeError(
                    f"the transform wrote in place into a {tuple(tensor.shape)} {tensor.dtype} tensor of the "
                    f"loader's own batch (no copy was made, the batch is already on {self.device}); "
                    "make the transform return new tensors, e.g. `x.float() / 255` instead of `x.div_(255)`"
                )
        return result

    def _pipelined(self) -> Iterator[Batch]:
        stream = self.stream
        compute = torch.cuda.current_stream(self.device)
        # Anything the transform reads that compute made (normalisation constants) is ready before use.
        stream.wait_stream(compute)
        batches = iter(self.loader)
        pending = self._launch(batches, stream)
        while pending is not None:
            ready, event = pending
            pending = self._launch(batches, stream)
            compute.wait_event(event)
            for tensor in _tensors(ready):
                if tensor.device.type == "cuda":
                    tensor.record_stream(compute)
            yield ready

    def _launch(self, batches: Iterator[Batch], stream: torch.cuda.Stream) -> tuple[Batch, torch.cuda.Event] | None:
        try:
            batch = next(batches)
        except StopIteration:
            return None
        with torch.cuda.stream(stream):
            moved = self._deliver(batch)
            event = torch.cuda.Event()
            event.record(stream)
        return moved, event
