"""The parts' checks of what a user passes: each refusal is one line that names the argument, says what is allowed and
shows what was given; a ``TypeError`` for a value of the wrong type (a string for a number, a bool for an int, a
generator of parameters for a module), a ``ValueError`` for one of the right type out of range.

Copy contract: none; nothing here holds or touches a tensor's values.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torch import nn

__all__ = [
    "device",
    "flag",
    "floating_dtype",
    "integer",
    "integral",
    "module",
    "not_a_module",
    "number",
    "real",
    "shown",
]


def shown(value: Any) -> str:
    """A refused value as a message shows it: its type, and its ``repr`` when that is short and on one line."""
    text = repr(value)
    return type(value).__name__ if len(text) > 60 or "\n" in text else f"{type(value).__name__} {text}"


def not_a_module(name: str, value: Any) -> str:
    """The one line refusing ``value`` where a module is expected; an iterable (``model.parameters()``, a list of
    tensors, a ``state_dict``) is told to pass the module itself."""
    hint = ""
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes, torch.Tensor)):
        hint = ": pass the module itself, not its parameters() or state_dict (names and buffers come from the module)"
    return f"{name} must be an nn.Module, got {type(value).__name__}{hint}"


def module(name: str, value: Any) -> nn.Module:
    """``value`` if it is an ``nn.Module``, else a ``TypeError`` (``not_a_module``)."""
    if not isinstance(value, nn.Module):
        raise TypeError(not_a_module(name, value))
    return value


def real(name: str, value: Any, allowed: str) -> float:
    """``value`` as a float if it is a real number (Python's or numpy's, not a bool), else a ``TypeError`` saying that
    ``name`` must be ``allowed``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {allowed}, got {shown(value)}")
    return float(value)


def number(name: str, value: Any, interval: str) -> float:
    """``value`` as a float if it is a real number (not a bool) in ``interval``, written ``"[0, 1)"``, ``"(0, 1]"``,
    ``"(0, inf)"``; else a ``TypeError`` (not a number) or ``ValueError`` (outside it, NaN included)."""
    x = real(name, value, f"a number in {interval}")
    low, high = (float(bound) for bound in interval[1:-1].split(","))
    above = x > low if interval[0] == "(" else x >= low
    below = x < high if interval[-1] == ")" else x <= high
    if math.isnan(x) or not (above and below):
        raise ValueError(f"{name} must be in {interval}, got {value!r}")
    return x


def integral(name: str, value: Any, allowed: str) -> int:
    """``value`` as an int if it is an integer (Python's or numpy's, not a bool), else a ``TypeError`` saying that
    ``name`` must be ``allowed``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be {allowed}, got {shown(value)}")
    return int(value)


def integer(name: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    """``value`` as an int if it is an integer (Python's or numpy's, not a bool) of at least ``minimum`` and, where
    given, at most ``maximum``; else a ``TypeError`` or ``ValueError``."""
    allowed = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
    value = integral(name, value, f"an integer {allowed}")
    if value < minimum or (maximum is not None and value > maximum):
        raise ValueError(f"{name} must be {allowed}, got {value}")
    return int(value)


def flag(name: str, value: Any) -> bool:
    """``value`` if it is ``True`` or ``False`` (numpy's too), else a ``TypeError``: ``"no"`` is not ``False``."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {shown(value)}")
    return bool(value)


def floating_dtype(name: str, value: Any) -> torch.dtype | None:
    """``value`` if it is ``None`` or a floating ``torch.dtype``, else a ``TypeError`` or ``ValueError``."""
    if value is not None and not isinstance(value, torch.dtype):
        raise TypeError(f"{name} must be a floating torch.dtype (torch.float32) or None, got {shown(value)}")
    if value is not None and not value.is_floating_point:
        raise ValueError(f"{name} must be a floating dtype, got {value}")
    return value


def device(name: str, value: Any) -> torch.device:
    """``torch.device(value)`` for a ``torch.device``, a device string or a CUDA index; else a ``TypeError``
    (another type) or ``ValueError`` (a string torch does not read as a device)."""
    allowed = f"{name} must be a torch.device or a device string such as 'cpu' or 'cuda:0'"
    if isinstance(value, bool) or not isinstance(value, (str, torch.device, int)):
        raise TypeError(f"{allowed}, got {shown(value)}")
    try:
        return torch.device(value)
    except RuntimeError:
        raise ValueError(f"{allowed}, got {value!r}") from None
