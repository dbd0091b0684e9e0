"""``GradientAverager``: average some parameters' gradients across processes, one collective per dtype.

For steps DDP's reducer cannot follow: a GAN runs two backward passes per forward, and each leaves the
other network without gradients. Run each backward under ``ddp_model.no_sync()`` (Lightning: the strategy's
``model``), then ``average()`` the parameters that step will update:

    averager = GradientAverager(generator.parameters())
    with ddp_model.no_sync():
        loss.backward()
    averager.average()  # every rank now holds the mean gradient, bit for bit the same

Copy contract: one flat tensor per (dtype, device) group, allocated on the first call and reused; each call
copies the gradients into views of it (``_foreach_copy_``), runs one ``all_reduce`` (sum) and one ``div_``
on it, and copies the result back into the gradients in place (their storage is unchanged). A parameter
without a gradient gets a zero one first, as DDP gives unused parameters, so every rank ends with the same
gradients. Autograd sees nothing: all of it runs under ``no_grad``. Without an initialised process group,
or with one process, ``average()`` does nothing.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from copy_correct.core.flat import flat_views
from copy_correct.core.foreach_writes import foreach_copy_

__all__ = ["GradientAverager"]


class GradientAverager:
    """Averages the gradients of ``params`` over the default process group."""

    def __init__(self, params: Iterable[nn.Parameter]) -> None:
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("GradientAverager needs at least one parameter that requires grad")
        self._groups: list[tuple[list[nn.Parameter], torch.Tensor, list[torch.Tensor]]] | None = None

    @staticmethod
    def world_size() -> int:
        """Processes in the default group; 1 when no group is initialised."""
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    @torch.no_grad()
    def average(self) -> None:
        """Replace every gradient by its mean over all processes."""
        world = self.world_size()
        if world == 1:
            return
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self._groups is None:
            grouped: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
            for p in self.params:
                grouped.setdefault((p.grad.dtype, p.grad.device), []).append(p)
            self._groups = [(members, *flat_views([p.grad for p in members])) for members in grouped.values()]
        for members, flat, views in self._groups:
            grads = [p.grad for p in members]
            foreach_copy_(views, grads)
            dist.all_reduce(flat)
            flat.div_(world)
            foreach_copy_(grads, views)
