"""What ``ReplayBuffer`` and ``FrameReplayBuffer`` share of their fields: a field's per-transition shape and stored
dtype from a space or a shape, what a value of it must be (``Spec``), the one check of a value (``checked``), the
source dtypes a field stores as they are, the one-line refusals of a value's shape and dtype, a single ``truncated``
flag as every env's, and the settings a saved state must match.

A refusal names the field and both shapes or dtypes, and is raised before the buffer writes anything. Refused: what
storing would change (a float into an integer field, a bool into a floating one, anything but a bool into a bool
one, an integer array whose dtype the field cannot hold, a number out of range); the values a dtype lets through are
``values``'s to look at (non-finite rewards, finite values beyond a floating field). A value that is neither a numpy
array or number, a tensor nor a Python number is a ``TypeError``.

Copy contract: nothing here keeps a buffer's storage or a caller's value. ``checked`` reads a tensor through
``detach()`` (the buffer never holds, nor writes through, a graph) and makes new memory only for a host copy of a
tensor on another device, a float32 copy of a bfloat16 one (numpy has none) and, for a buffer off the host, a 0-d
tensor of a number beyond int64 for a uint64 field. Nothing here is seen by autograd.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from copy_correct.core.checks import integral
from copy_correct.replay.values import may_overflow, value_refusal

__all__ = [
    "TORCH_OF", "DTypeLike", "Space", "Spec", "check_num_envs", "check_settings", "checked", "field_spec", "flag_rows",
    "layout", "refusal", "refuse_dtype", "shape_error", "unseen",
]  # fmt: skip

# The dtypes a buffer stores, numpy's and torch's names for each.
TORCH_OF = {
    np.dtype(np.bool_): torch.bool,
    np.dtype(np.uint8): torch.uint8,
    np.dtype(np.uint16): torch.uint16,
    np.dtype(np.uint32): torch.uint32,
    np.dtype(np.uint64): torch.uint64,
    np.dtype(np.int8): torch.int8,
    np.dtype(np.int16): torch.int16,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.int64): torch.int64,
    np.dtype(np.float16): torch.float16,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float64): torch.float64,
}
_NUMPY_OF = {t: n for n, t in TORCH_OF.items()}
# What values may come in as: numpy dtypes, torch dtypes, Python number types (int counts as int64 here)
_SOURCE_DTYPES = [
    *TORCH_OF,
    *_NUMPY_OF,
    torch.bfloat16,
    bool,
    int,
    float,
]
# (source kind, field kind) stored without a check of values or widths: "b" bool, "i" integer, "f" floating
_STORED_AS_IS = frozenset({("b", "b"), ("b", "i"), ("i", "f"), ("f", "f")})
_NUMPY_VALUES, _NUMBERS = (np.ndarray, np.generic), (bool, int, float)  # what checked takes


class Space(Protocol):
    """What a buffer reads of a gymnasium space: ``shape`` (``None`` for ``Dict`` / ``Tuple``) and ``dtype``."""

    @property
    def shape(self) -> tuple[int, ...] | None: ...

    @property
    def dtype(self) -> Any: ...


DTypeLike = torch.dtype | np.dtype | type | str


@dataclass(frozen=True)
class Spec:
    """What a value of field ``name`` must be: of ``shape`` per transition and ``add_shape`` per ``add``, stored as
    ``dtype``; the source dtypes it takes without a look at the values (``accepted``: ``unseen``'s); ``finite``: its
    values must be finite (rewards, whose values are always looked at)."""

    name: str
    shape: tuple[int, ...]
    add_shape: tuple[int, ...]
    dtype: torch.dtype
    accepted: frozenset[np.dtype | torch.dtype | type]
    finite: bool


def field_spec(name: str, shape: tuple[int, ...], stored: torch.dtype, num_envs: int | None) -> Spec:
    """Field ``name``'s ``Spec``: ``num_envs`` values of ``shape`` per ``add`` (one without ``num_envs``); rewards take
    no dtype unseen, their values are always looked at (finite, within float32)."""
    finite = name == "reward"
    accepted = frozenset() if finite else unseen(name, stored)
    return Spec(name, shape, shape if num_envs is None else (num_envs, *shape), stored, accepted, finite)


def check_num_envs(num_envs: Any) -> None:
    """``num_envs``: ``None`` or an integer >= 1."""
    if num_envs is not None and integral("num_envs", num_envs, "None or an integer >= 1") < 1:
        raise ValueError(f"num_envs must be None or >= 1, got {num_envs}")


def layout(name: str, spec: Any, dtype: DTypeLike | None, default: type) -> tuple[tuple[int, ...], np.dtype]:
    """The per-transition shape and storage dtype of field ``name`` from a space or a shape, and a dtype or None."""
    if hasattr(spec, "shape") and hasattr(spec, "dtype") and not isinstance(spec, (np.ndarray, torch.Tensor)):
        if spec.shape is None:
            raise TypeError(
                f"{name}: a {type(spec).__name__} space has no single shape and dtype; flatten it first "
                "(gymnasium.wrappers.FlattenObservation for observations, gymnasium.spaces.flatten_space for actions)"
            )
        shape, space_dtype = tuple(int(d) for d in spec.shape), spec.dtype
    elif isinstance(spec, Sequence) and all(
        isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0 for d in spec
    ):
        shape, space_dtype = tuple(int(d) for d in spec), None
    else:
        raise TypeError(f"{name} must be a gymnasium space or a shape (a sequence of ints), got {spec!r}")
    chosen = dtype if dtype is not None else space_dtype if space_dtype is not None else default
    try:
        resolved = _NUMPY_OF.get(chosen) if isinstance(chosen, torch.dtype) else np.dtype(chosen)
    except TypeError:
        resolved = None
    if resolved not in TORCH_OF:
        allowed = ", ".join(str(d) for d in TORCH_OF)
        raise ValueError(f"{name} dtype {chosen} is not one the buffer stores ({allowed})")
    return shape, resolved


def unseen(name: str, stored: torch.dtype, any_range: bool = False) -> frozenset[np.dtype | torch.dtype | type]:
    """The source dtypes field ``name`` stores as ``stored`` without a look at the values: none whose values could
    change (``refusal``) and none with finite values beyond a floating ``stored``'s range (float64 into float32: those
    are looked at). A Python int is never taken unseen: it has no range (2**64 into int64). ``any_range``: the dtypes
    ``refusal`` allows, whatever their range (for rewards, whose values are looked at anyway)."""
    return frozenset(
        d
        for d in _SOURCE_DTYPES
        if d is not int and refusal(name, d, None, stored) is None and (any_range or not may_overflow(d, stored))
    )


def shape_error(name: str, shape: tuple[int, ...], per_transition: tuple[int, ...], expected: tuple[int, ...],
                num_envs: int | None) -> ValueError:  # fmt: skip
    """The refusal of a value of ``shape`` where ``expected`` (``per_transition``, or ``num_envs`` of them) goes."""
    per_add = "" if expected == per_transition else f" and {num_envs} per add: expected {expected}"
    return ValueError(f"{name} has shape {shape}, the buffer stores {per_transition} per transition{per_add}")


def refuse_dtype(name: str, dtype: Any, value: Any, stored: torch.dtype, finite: bool, values: Any) -> None:
    """Raise the refusal of ``value`` (of ``dtype``, a dtype the field does not take unseen) for field ``name``, if
    any: a dtype that would change it (a number: only if its value would), or numbers the field cannot hold
    (``values``, looked at where ``finite`` (rewards) or where ``dtype`` may exceed a floating ``stored``)."""
    number = value if isinstance(value, (bool, int, float, np.generic)) else None
    why = refusal(name, dtype, number, stored)
    if why is None and (finite or may_overflow(dtype, stored)):  # values the dtype cannot hold
        why = value_refusal(name, values, stored, finite)
    if why is not None:
        raise ValueError(why)


def refusal(name: str, dtype: np.dtype | torch.dtype | type, number: Any, stored: torch.dtype) -> str | None:
    """Why field ``name`` refuses a value of ``dtype`` (``number``: the value, for numbers), one line naming both
    dtypes, or None (module docstring: what is refused)."""
    kinds = (_kind(dtype), _kind(stored))
    if kinds in _STORED_AS_IS:
        return None
    if kinds == ("i", "i"):
        info = torch.iinfo(stored)
        if number is not None:
            fits = info.min <= int(number) <= info.max
            return None if fits else f"{name} is {int(number)}, outside the range of the buffer's {_name(stored)}"
        source = torch.iinfo(dtype) if isinstance(dtype, torch.dtype) else np.iinfo(dtype)
        if info.min <= source.min and source.max <= info.max:
            return None
        reason = "its values could wrap around (convert it first)"
    elif kinds[1] == "b":
        reason = "only bools are stored as bools"
    elif kinds[1] == "f":
        reason = "only integers and floats are stored as floats"
    else:
        reason = "a float would be truncated (convert it first, or store floats)"
    return f"{name} has dtype {_name(dtype)}, the buffer stores {_name(stored)}: {reason}"


def _kind(dtype: np.dtype | torch.dtype | type) -> str:
    """``"b"`` (bool), ``"i"`` (integer), ``"f"`` (floating) or another letter for anything else."""
    if isinstance(dtype, type):  # a Python number's type
        return {bool: "b", int: "i", float: "f"}[dtype]
    if isinstance(dtype, torch.dtype):
        if dtype == torch.bool:
            return "b"
        return "f" if dtype.is_floating_point else "c" if dtype.is_complex else "i"
    return {"b": "b", "i": "i", "u": "i", "f": "f"}.get(dtype.kind, dtype.kind)


def _name(dtype: np.dtype | torch.dtype | type) -> str:
    return dtype.__name__ if isinstance(dtype, type) else str(dtype).removeprefix("torch.")


def flag_rows(num_envs: int) -> tuple[np.ndarray, np.ndarray]:
    """A row of ``False`` and one of ``True`` for ``num_envs`` envs, read-only: a single flag given for all of them."""
    rows = np.zeros(num_envs, dtype=np.bool_), np.ones(num_envs, dtype=np.bool_)
    for row in rows:
        row.flags.writeable = False
    return rows


def check_settings(state: Mapping[str, Any], buffer: Any, keys: Sequence[str]) -> None:
    """A saved state's settings (``autoreset_mode``, ``padding``) must be ``buffer``'s: one line naming the first
    that is not."""
    for key in keys:
        if state[key] != getattr(buffer, key):
            raise ValueError(f"saved buffer has {key}={state[key]!r}, this one {getattr(buffer, key)!r}")


def checked(field: Spec, value: Any, num_envs: int | None, *, one: bool = False, host: bool = True) -> Any:
    """``value`` ready to be written into ``field`` once its shape (``add_shape``; ``one``: one env's, ``shape``) and
    dtype are checked (module docstring), before anything is written. ``host``: a tensor detached and on the host as
    numpy, anything else as it is; else (a buffer off the host, which torch writes) a tensor detached, a numpy array as
    a tensor, a numpy number as a Python one, and a uint64 field's Python int as a 0-d tensor (torch < 2.14 writes no
    int beyond int64's range)."""
    if isinstance(value, torch.Tensor):
        value = value.detach()  # Copy decision: the buffer never holds, nor writes through, a graph
        dtype, shape = value.dtype, tuple(value.shape)
    elif isinstance(value, _NUMPY_VALUES):
        dtype, shape = value.dtype, value.shape
    elif type(value) in _NUMBERS:
        dtype, shape = type(value), ()
    else:
        raise TypeError(f"{field.name} must be a numpy array, a tensor or a number, got {type(value).__name__}")
    expected = field.shape if one else field.add_shape
    if shape != expected:
        raise shape_error(field.name, shape, field.shape, expected, num_envs)
    if dtype not in field.accepted:  # a number's value may still fit; anything else is refused
        refuse_dtype(field.name, dtype, value, field.dtype, field.finite, value)
    if host:
        if isinstance(value, torch.Tensor):
            value = value.cpu()  # a host copy when the tensor is on another device
            return (value.float() if value.dtype == torch.bfloat16 else value).numpy()  # numpy has no bfloat16
        return value
    if isinstance(value, (np.ndarray, np.generic)):  # torch writes tensors and Python numbers
        value = torch.from_numpy(value) if isinstance(value, np.ndarray) else value.item()
    if type(value) is int and field.dtype is torch.uint64:
        return torch.from_numpy(np.array(value, dtype=np.uint64))
    return value
