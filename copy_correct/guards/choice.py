"""Which guard a ``skip_nonfinite`` owner gets, chosen here alone for ``EMA``, ``PowerEMA``
(``copy_correct.averages.shadow``) and the target networks (``copy_correct.target``): the host check
(``copy_correct.guards.host``'s ``FiniteCheck``) when every tensor the owner writes is on the CPU, else the device
guard (``copy_correct.guards.device``). Why: on the CPU the values can be read on the host before anything is written,
with no staging copy and no sync to pay; off it, a read on the host would wait for the device at every update, so the
device decides.

Copy contract: none of its own; it reads only each tensor's device, and the guard built is the owner's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

import torch

__all__ = ["choose", "on_host"]

Host = TypeVar("Host")
Device = TypeVar("Device")


def on_host(written: Iterable[torch.Tensor]) -> bool:
    """Whether a guard of the tensors ``written`` checks on the host: every one of them is on the CPU."""
    return all(t.device.type == "cpu" for t in written)


def choose(written: Iterable[torch.Tensor], host: Callable[[], Host], device: Callable[[], Device]) -> Host | Device:
    """The guard of the tensors ``written``: ``host()`` when ``on_host`` says so, else ``device()``; only the one
    chosen is built."""
    return host() if on_host(written) else device()
