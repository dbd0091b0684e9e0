"""Grouped in-place writes that autograd sees on every device: ``foreach_copy_`` and ``foreach_lerp_``.

Copy contract: each writes into ``dst``'s existing storage with one ``torch._foreach_*`` call (no allocation,
no host synchronisation) and leaves every ``dst`` tensor's version counter raised, so a tensor that was saved
for backward and is overwritten here makes ``backward()`` raise instead of computing with the new values.

Why this is needed: autograd detects such an overwrite by the version counter, which every per-tensor
in-place op raises. A foreach kernel either runs one per-tensor op per element of its lists (the "slow path":
CPU always, and CUDA for lists it cannot fuse), raising every version once, or one fused kernel (the CUDA
"fast path"), which raises them only if its author remembered to. Measured on an H200 with torch 2.11:
``torch._foreach_lerp_`` with a scalar weight left every CUDA tensor's version as it was, while
``torch._foreach_copy_`` raised it. A call takes one path for its whole list, so the first tensor's counter
tells: when the kernel left it unchanged, all of ``dst`` is bumped here (``increment_versions`` of
``copy_correct.core.torch_internals`` on the list: metadata only, no kernel, nothing allocated). Every ``dst`` tensor's
version therefore rises by exactly one per call, on every device.
"""

from __future__ import annotations

import torch

from copy_correct.core.torch_internals import increment_versions

__all__ = ["foreach_copy_", "foreach_lerp_", "version"]


def foreach_copy_(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for every i, in one call; every ``dst`` version raised by one."""
    first = dst[0]
    before = version(first)
    torch._foreach_copy_(dst, src)
    if before is not None and first._version == before:
        increment_versions(dst)


def foreach_lerp_(dst: list[torch.Tensor], src: list[torch.Tensor], weight: float) -> None:
    """``dst[i].lerp_(src[i], weight)`` for every i, in one call; every ``dst`` version raised by one."""
    first = dst[0]
    before = version(first)
    torch._foreach_lerp_(dst, src, weight)
    if before is not None and first._version == before:
        increment_versions(dst)


def version(t: torch.Tensor) -> int | None:
    """``t``'s version counter; ``None`` for an inference tensor, which has none (nothing to keep, and it cannot be
    written outside inference mode)."""
    try:
        return t._version
    except RuntimeError:
        return None
