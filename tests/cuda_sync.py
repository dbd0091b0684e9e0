"""``no_host_sync()``: a block in which any CUDA operation that synchronizes the host raises.

Only the call under test goes inside: a test's own set-up (a Python number written into a CUDA tensor, a pageable
batch copied to the device) synchronizes by itself and would fail the block before the call ran (the H200 run of
2026-12-04, ``docs/gpu-results.md``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def no_host_sync() -> Iterator[None]:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
