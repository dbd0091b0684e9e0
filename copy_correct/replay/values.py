"""What the replay buffers check of a value's numbers, beyond its dtype: a finite number that the stored floating dtype
cannot hold (float64 ``1e300`` into float32 would be stored as ``inf``), and a reward that is not finite (NaN or inf:
every TD target it enters would be NaN or inf). A refusal is one line naming the field, or ``None``.

Only sources that could hold such a number are looked at: a dtype whose range fits the stored one (float32 into
float32, uint8 into float16) never is, so frames and the common calls cost nothing; rewards always are.

Copy contract: values are read, never kept; a tensor on another device is read on the host (a copy, and a sync).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import numpy as np
import torch

__all__ = ["F32_MAX", "F32_MIN", "SQUARES", "finite_rewards", "may_overflow", "value_refusal"]

F32_MIN, F32_MAX = float(np.finfo(np.float32).min), float(np.finfo(np.float32).max)
_SMALL = 16  # up to this many values, a Python loop over them is cheaper than numpy's reductions
SQUARES = F32_MAX * F32_MAX  # 1.16e77: float32's largest value squared, finite in float64


def _largest(dtype: np.dtype | torch.dtype | type) -> float:
    """The largest magnitude a value of ``dtype`` can have (a Python number's type: unbounded)."""
    if isinstance(dtype, type):
        return 1.0 if dtype is bool else float("inf")
    if isinstance(dtype, torch.dtype):
        if dtype == torch.bool:
            return 1.0
        return float(torch.finfo(dtype).max if dtype.is_floating_point else torch.iinfo(dtype).max)
    if dtype.kind == "b":
        return 1.0
    return float(np.finfo(dtype).max if dtype.kind == "f" else np.iinfo(dtype).max)


@cache
def may_overflow(source: np.dtype | torch.dtype | type, stored: torch.dtype) -> bool:
    """Whether a finite value of ``source`` may lie beyond the largest finite value of floating ``stored``."""
    return stored.is_floating_point and _largest(source) > torch.finfo(stored).max


@cache
def _limit(stored: torch.dtype) -> float:
    return float(torch.finfo(stored).max)


def finite_rewards(values: np.ndarray) -> bool:
    """A quick, conservative look at a vector of rewards: ``True`` only if every one is finite and within float32's
    range. One dot product (0.3 µs for 1-8 rewards, a third of a Python loop over them): the sum of the squares is NaN
    or inf if a reward is, and beyond float32's largest value squared (finite in float64) if one is beyond float32's.
    ``False`` may still be rewards that fit (huge ones whose squares add up beyond it): the caller then looks at each
    (``value_refusal``). Integer rewards are finite and within float32's range whatever they are."""
    if values.dtype.kind != "f":
        return True
    return float(values.dot(values)) <= SQUARES  # a Python float: float32 would make the bound inf


def value_refusal(name: str, value: Any, stored: torch.dtype, finite: bool) -> str | None:
    """Why ``value`` (an array, a tensor or a number) cannot be stored in floating ``stored``: a non-finite value where
    ``finite`` (rewards), or a finite one beyond ``stored``'s range. ``None`` if it can."""
    if not stored.is_floating_point:
        return None
    limit = _limit(stored)
    if isinstance(value, float) and (-limit <= value <= limit or (not finite and value != value)):
        return None  # a Python (or numpy) float that fits: the common number
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()  # the rare path: a host copy, a sync for a device tensor
        array = value.double().numpy() if value.dtype != torch.bool else value.numpy().astype(np.float64)
    else:
        array = np.asarray(value, dtype=np.float64)
    if array.size <= _SMALL and all(-limit <= x <= limit for x in array.reshape(-1).tolist()):
        return None  # every value fits (NaN fails the comparisons: looked at below)
    bounded = np.isfinite(array)
    if finite and not bounded.all():
        return f"{name} is {array[~bounded].flat[0]}, the buffer stores finite {name}s only"
    beyond = bounded & (np.abs(np.where(bounded, array, 0.0)) > limit)
    if beyond.any():
        return (
            f"{name} holds {array[beyond].flat[0]:g}, beyond the largest {str(stored).removeprefix('torch.')} "
            f"({limit:g}): it would be stored as inf"
        )
    return None
