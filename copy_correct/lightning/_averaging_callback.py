"""What ``EMAWeights`` and ``PostHocEMASnapshots`` share: the module they average (``module=``, an attribute path of
the LightningModule), and the names a submodule's average goes by in a checkpoint (the LightningModule's).

Copy contract: nothing here holds or copies a tensor; the renamings build new dicts of the same tensor objects.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch

__all__ = ["averaged_module", "named_as_the_module", "named_as_the_submodule"]


def averaged_module(pl_module: pl.LightningModule, module: str | None, owner: str) -> torch.nn.Module:
    """The submodule ``module`` names (``None``: ``pl_module`` itself); a ``ValueError`` line naming it otherwise."""
    if module is None:
        return pl_module
    try:
        return pl_module.get_submodule(module)
    except AttributeError:
        children = ", ".join(name for name, _ in pl_module.named_children())
        raise ValueError(
            f"{owner} module={module!r}: {type(pl_module).__name__} has no such submodule (its children: {children})"
        ) from None


def named_as_the_module(state: Mapping[str, Any], keys: tuple[str, ...], module: str | None) -> dict[str, Any]:
    """``state`` with the names of its mappings under ``keys`` prefixed by ``module.``: the LightningModule's
    ``state_dict`` names for a submodule's tensors (``net.0.weight`` -> ``generator.net.0.weight``)."""
    if module is None:
        return dict(state)
    prefix = f"{module}."
    return {
        **state,
        **{key: {prefix + n: v for n, v in state[key].items()} for key in keys if isinstance(state.get(key), Mapping)},
    }


def named_as_the_submodule(state: Mapping[str, Any], keys: tuple[str, ...], module: str | None) -> dict[str, Any]:
    """The inverse of ``named_as_the_module``; a name outside ``module`` stays as it is (for the average's own
    ``check_state`` to name)."""
    if module is None:
        return dict(state)
    prefix = f"{module}."
    return {
        **state,
        **{
            key: {n.removeprefix(prefix): v for n, v in state[key].items()}
            for key in keys
            if isinstance(state.get(key), Mapping)
        },
    }
