"""The swap behind ``EMA.average_weights``: the average copied into the model for a block, the live values back after.

Copy contract: ``swap_in`` copies each group's live values into one new flat backup (views shaped like the live
tensors: one copy of the model's weights, allocated here and freed with the ``Swap``), then copies the shadows into the
live tensors; the shadows are only read. ``swap_out`` copies the backup back, bit for bit, so whatever the block wrote
into the model (BatchNorm statistics, an optimizer step) is discarded and never reaches the average; it returns the
parameters written in the block, which their version counters tell at no cost. Everything is under ``no_grad``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from copy_correct.averages.shadow import Group
from copy_correct.core.flat import flat_views
from copy_correct.core.foreach_writes import foreach_copy_, version
from copy_correct.core.sharding import reshard

__all__ = ["Swap", "swap_in", "swap_out", "written_error"]


@dataclass
class Swap:
    """A block in progress: the live values to put back, and the model's versions to check."""

    pairs: list[tuple[Group, list[torch.Tensor]]]
    backups: list[list[torch.Tensor]]  # per group: views of one flat tensor holding its live values
    versions: list[list[int | None]]  # per group: each live tensor's version once it holds the average

    def reload(self, model: nn.Module | None) -> None:
        """Copy the shadows into the model again (a load inside the block); the versions restart from there."""
        reshard(model)  # its next forward must gather what is loaded
        with torch.no_grad():
            for group, lives in self.pairs:
                foreach_copy_(lives, group.shadows)
        self.versions = _versions(self.pairs)


def swap_in(pairs: list[tuple[Group, list[torch.Tensor]]]) -> Swap:
    """Back the live values of ``pairs`` (resolved after the model was resharded) up and copy the shadows into them."""
    with torch.no_grad():
        backups = []
        for group, lives in pairs:
            _, views = flat_views(lives)
            foreach_copy_(views, lives)
            foreach_copy_(lives, group.shadows)
            backups.append(views)
    return Swap(pairs, backups, _versions(pairs))


def swap_out(model: nn.Module | None, swap: Swap) -> list[str]:
    """Put the live values back; the names of the parameters written since the swap (or the last reload)."""
    written = [
        name
        for (group, lives), versions in zip(swap.pairs, swap.versions, strict=True)
        for name, is_parameter, live, before in zip(group.names, group.parameters, lives, versions, strict=True)
        if is_parameter and version(live) != before
    ]
    reshard(model)
    with torch.no_grad():
        for (_, lives), backup in zip(swap.pairs, swap.backups, strict=True):
            foreach_copy_(lives, backup)
    return written


def written_error(written: list[str]) -> RuntimeError:
    """The error of a block that wrote parameters: undone, and said so."""
    more = f" and {len(written) - 3} more" if len(written) > 3 else ""
    return RuntimeError(
        f"EMA.average_weights: {len(written)} parameter(s) of the model were written inside the block "
        f"({', '.join(map(repr, written[:3]))}{more}; an optimizer step?): undone, the live weights are back "
        "as they were before the block and the average is unchanged; step optimizers and write parameters "
        "outside the block"
    )


def _versions(pairs: list[tuple[Group, list[torch.Tensor]]]) -> list[list[int | None]]:
    return [[version(t) for t in lives] for _, lives in pairs]
