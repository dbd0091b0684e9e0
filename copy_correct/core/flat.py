"""One flat tensor and views of it shaped like a list of tensors: the staging area of a single collective.

Copy contract: allocates the flat tensor once (the summed size of the tensors); the views share its
storage, so ``torch._foreach_copy_(views, tensors)`` and back move the data without further allocation.
"""

from __future__ import annotations

import torch

__all__ = ["flat_views"]


def flat_views(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A new flat tensor of the tensors' common dtype and device, and one view of it per tensor."""
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype, device=tensors[0].device)
    return flat, [v.view_as(t) for v, t in zip(flat.split([t.numel() for t in tensors]), tensors, strict=True)]
