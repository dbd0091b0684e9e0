"""What the recipes' LightningModules share when they are built: the checks of their arguments and FSDP2 sharding.

``check_args`` refuses a model argument in one line naming its config key (``model.lr must be > 0, got 0``);
``check_classes`` a list of class names of another length than the data's classes. ``shard_layers`` is the
``configure_model`` of the recipes that run under ``trainer=fsdp`` (``ema``, ``metrics``, ``pinned``).

Copy contract (``shard_layers``): each layer of the kinds given becomes an FSDP2 unit of its own, gathered for its
forward and freed after it, and the network's root keeps the rest (BatchNorm's weights, say); every rank then holds
1/N of each weight and no full copy. Without a device mesh (any trainer but ``fsdp``) nothing changes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import lightning.pytorch as pl
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

__all__ = ["at_least_one", "check_args", "check_classes", "shard_layers"]


def check_args(checks: Iterable[tuple[str, Any, bool, str]]) -> None:
    """``ValueError("model.NAME must be ALLOWED, got VALUE")`` for the first ``(name, value, ok, allowed)`` not
    ``ok``."""
    for name, value, ok, allowed in checks:
        if not ok:
            raise ValueError(f"model.{name} must be {allowed}, got {value}")


def at_least_one(**values: int) -> None:
    """``check_args`` for sizes and counts: each of ``values`` must be ``>= 1``."""
    check_args((name, value, value >= 1, ">= 1") for name, value in values.items())


def check_classes(classes: list[str] | None, num_classes: int, named: str | None = None) -> None:
    """``classes`` (``None``: not given) must name ``num_classes`` classes; ``named`` says where that number comes from
    (``model.num_classes=10``), else it is the number itself."""
    if classes is not None and len(classes) != num_classes:
        raise ValueError(f"model.classes must name {named or num_classes} classes, got {len(classes)}")


def shard_layers(module: pl.LightningModule, net: nn.Module, layers: tuple[type[nn.Module], ...]) -> None:
    """Under ``trainer=fsdp`` (Lightning's ``ModelParallelStrategy`` gives ``module`` a device mesh): shard ``net`` with
    FSDP2, each of its ``layers`` a unit of its own, then ``net`` itself. Otherwise, or once sharded: nothing."""
    if module.device_mesh is None or isinstance(net, FSDPModule):
        return
    mesh = module.device_mesh["data_parallel"]
    for layer in net.modules():
        if isinstance(layer, layers):
            fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
