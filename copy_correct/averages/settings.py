"""The settings of ``EMA`` and ``PowerEMA``, checked without a model: each class checks its arguments here, and so do
the callbacks that build one later (``copy_correct.lightning``), so a bad value fails when it is given, in one line
naming it, and the callbacks build no throwaway average to find out. Each argument and its default are written once,
in its class's signature: ``ema_settings`` and ``power_ema_settings`` read the arguments by name, and ``defaults``
reads the signature for a callback given only some of them. Nothing here holds or copies a tensor."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from copy_correct.averages.power_function import SIGMA_REL_MAX, sigma_rel_to_gamma
from copy_correct.averages.selection import Selection
from copy_correct.core.checks import device as checked_device
from copy_correct.core.checks import flag, floating_dtype, integer, real, shown
from copy_correct.decay_schedule import DecaySchedule

__all__ = ["EMASettings", "PowerEMASettings", "defaults", "ema_settings", "power_ema_settings"]


@dataclass(frozen=True)
class EMASettings:
    """``EMA``'s arguments but the model, checked: see ``EMA``."""

    schedule: DecaySchedule
    update_every: int
    start_step: int
    selection: Selection
    shadow_dtype: torch.dtype | None
    device: torch.device | None
    skip_nonfinite: bool
    traceable: bool


@dataclass(frozen=True)
class PowerEMASettings:
    """``PowerEMA``'s arguments but the model, checked: see ``PowerEMA``."""

    sigma_rels: tuple[float, ...]
    gammas: tuple[float, ...]
    update_every: int
    snapshot_every: int | None
    snapshot_dir: Path | None
    selection: Selection
    shadow_dtype: torch.dtype | None
    skip_nonfinite: bool

    @property
    def device(self) -> None:
        """Where the profiles live: beside each model tensor (``PowerEMA`` takes no ``device``)."""
        return None


def defaults(average: Callable[..., Any]) -> dict[str, Any]:
    """The arguments of ``average`` (``EMA``, ``PowerEMA``) but the model, each with its default, read from its
    signature: what a callback given only some of them fills in the others with."""
    return {p.name: p.default for p in list(inspect.signature(average).parameters.values())[1:]}


def ema_settings(arguments: Mapping[str, Any]) -> EMASettings:
    """``EMA``'s arguments but the model, read by name (``EMA``'s own, or ``defaults(EMA)`` and a callback's), each
    checked: a ``TypeError`` for a value of the wrong type, a ``ValueError`` for one out of range, in one line naming
    the argument and what it takes. The schedule's arguments are ``DecaySchedule``'s fields, by the same names."""
    device = arguments["device"]
    return EMASettings(
        schedule=DecaySchedule(**{field.name: arguments[field.name] for field in fields(DecaySchedule)}),
        update_every=integer("update_every", arguments["update_every"], 1),
        start_step=integer("start_step", arguments["start_step"], 0),
        selection=Selection.of(arguments),
        shadow_dtype=floating_dtype("shadow_dtype", arguments["shadow_dtype"]),
        device=checked_device("device", device) if device is not None else None,
        skip_nonfinite=flag("skip_nonfinite", arguments["skip_nonfinite"]),
        traceable=flag("traceable", arguments["traceable"]),
    )


def power_ema_settings(arguments: Mapping[str, Any]) -> PowerEMASettings:
    """``PowerEMA``'s arguments but the model, read by name and checked as ``ema_settings`` checks ``EMA``'s."""
    sigma_rels = _sigma_rels(arguments["sigma_rels"])
    gammas = tuple(sigma_rel_to_gamma(s) for s in sigma_rels)
    update_every = integer("update_every", arguments["update_every"], 1)
    snapshot_every, snapshot_dir = arguments["snapshot_every"], arguments["snapshot_dir"]
    if snapshot_every is not None and (integer("snapshot_every", snapshot_every, 1) % update_every):
        raise ValueError(
            f"snapshot_every must be a positive multiple of update_every={update_every}, got {snapshot_every}"
        )
    if (snapshot_every is None) != (snapshot_dir is None):
        raise ValueError("snapshot_every and snapshot_dir go together: give both, or neither")
    if snapshot_dir is not None and not isinstance(snapshot_dir, (str, os.PathLike)):
        raise TypeError(f"snapshot_dir must be a path (str or os.PathLike) or None, got {shown(snapshot_dir)}")
    return PowerEMASettings(
        sigma_rels=sigma_rels,
        gammas=gammas,
        update_every=update_every,
        snapshot_every=snapshot_every,
        snapshot_dir=Path(snapshot_dir) if snapshot_dir is not None else None,
        selection=Selection.of(arguments),
        shadow_dtype=floating_dtype("shadow_dtype", arguments["shadow_dtype"]),
        skip_nonfinite=flag("skip_nonfinite", arguments["skip_nonfinite"]),
    )


def _sigma_rels(given: Any) -> tuple[float, ...]:
    """The ``sigma_rels`` argument as floats, checked: a sequence of distinct numbers (one number alone is a
    ``TypeError``: ``(0.05,)`` is one profile); ``sigma_rel_to_gamma`` refuses one outside ``(0, SIGMA_REL_MAX)``."""
    interval = f"(0, {SIGMA_REL_MAX:.4f})"
    if not isinstance(given, Iterable) or isinstance(given, (str, bytes)):
        raise TypeError(
            f"sigma_rels must be a sequence of numbers in {interval}, one per profile, such as (0.05, 0.10), got "
            f"{shown(given)}"
        )
    sigma_rels = tuple(real(f"sigma_rels[{i}]", s, f"a number in {interval}") for i, s in enumerate(given))
    if not sigma_rels or len(set(sigma_rels)) != len(sigma_rels):
        raise ValueError(f"sigma_rels must be one or more distinct values, got {sigma_rels}")
    return sigma_rels
