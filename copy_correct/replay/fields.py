"""What ``ReplayBuffer`` and ``FrameReplayBuffer`` share: a field's per-transition shape and stored dtype from a space
or a shape, the source dtypes a field stores as they are, the one-line refusals of a value's shape and dtype, a single
``truncated`` flag as every env's, ``sample``'s arguments, the settings a saved state must match, and a field's batch
gathered into new host memory.

A refusal names the field and both shapes or dtypes, and is raised before the buffer writes anything. Refused: what
storing would change (a float into an integer field, a bool into a floating one, anything but a bool into a bool
one, an integer array whose dtype the field cannot hold, a number out of range); the values a dtype lets through are
``values``'s to look at (non-finite rewards, finite values beyond a floating field). ``NotCopied``: a buffer's
``pickle``, ``copy.copy`` and ``copy.deepcopy`` refused in one line naming ``state_dict()`` (each buffer says why).

Copy contract: nothing here keeps a buffer's storage or a caller's value. A refusal reads a value (a tensor on another
device: on the host, a copy and a sync). ``taken`` gathers rows into new host memory (pinned for a CUDA batch:
``host_batch``), which shares nothing with the field it reads; nothing here is seen by autograd.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from copy_correct.core.checks import integer, integral, shown
from copy_correct.replay import host_batch
from copy_correct.replay.values import may_overflow, value_refusal

__all__ = [
    "TORCH_OF", "DTypeLike", "NotCopied", "Space", "check_num_envs", "check_sample", "check_settings", "flag_rows",
    "layout", "refusal", "refuse_dtype", "shape_error", "taken", "unseen",
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


class Space(Protocol):
    """What a buffer reads of a gymnasium space: ``shape`` (``None`` for ``Dict`` / ``Tuple``) and ``dtype``."""

    @property
    def shape(self) -> tuple[int, ...] | None: ...

    @property
    def dtype(self) -> Any: ...


DTypeLike = torch.dtype | np.dtype | type | str


class NotCopied:
    """Mixed into a buffer: ``pickle``, ``copy.copy`` and ``copy.deepcopy`` raise one ``TypeError`` line naming the
    class and the way that copies it, ``state_dict()`` loaded into a new one (``load_state_dict`` copies)."""

    def __reduce_ex__(self, protocol: Any) -> Any:
        name = type(self).__name__
        raise TypeError(
            f"a {name} cannot be pickled or copied (pickle, copy.copy, copy.deepcopy): save its state_dict() and "
            f"load_state_dict() it into a new {name}"
        )


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


def check_sample(batch_size: Any, generator: Any) -> None:
    """``sample``'s arguments: ``batch_size`` an integer >= 1 (``"64"`` and ``True`` are ``TypeError``s), ``generator``
    a ``torch.Generator`` or ``None``; a plain call costs two type checks."""
    if type(batch_size) is not int or batch_size < 1:
        integer("batch_size", batch_size, 1)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {shown(generator)}")


def check_settings(state: Mapping[str, Any], buffer: Any, keys: Sequence[str]) -> None:
    """A saved state's settings (``autoreset_mode``, ``padding``) must be ``buffer``'s: one line naming the first
    that is not."""
    for key in keys:
        if state[key] != getattr(buffer, key):
            raise ValueError(f"saved buffer has {key}={state[key]!r}, this one {getattr(buffer, key)!r}")


def taken(field: np.ndarray, rows: np.ndarray, pinned: bool) -> torch.Tensor:
    """``field``'s ``rows`` gathered into new host memory (``pinned``: page-locked, for a copy to a CUDA device)."""
    if not pinned:
        return torch.from_numpy(field.take(rows, axis=0))
    array, out = host_batch.empty((len(rows), *field.shape[1:]), field.dtype, pinned)
    field.take(rows, axis=0, out=array, mode="clip")  # rows are in range: clip skips numpy's buffering
    return out
