"""A size that cannot be allocated, said in one line that names the key and the bytes, instead of numpy's ``Unable to
allocate 41.8 TiB`` or torch's ``DefaultCPUAllocator: can't allocate memory`` naming neither.

``too_big`` recognises a failed allocation (numpy's ``MemoryError``, which carries the bytes; torch's CPU allocator's
``RuntimeError`` and CUDA's ``OutOfMemoryError``, which say them) and makes the line: the bytes asked for, the memory
this machine has, and what to lower. ``recipes.build`` turns one raised while a config node is instantiated into a
``ValueError`` naming the node and the keys given for it; a recipe that knows which key sized the allocation names it
(``model.buffer_size`` in ``recipes.dqn``, with ``allocated``); one that fails once ``fit`` runs (a data module's
``setup``: the pinned store of ``data.store_size`` images) is named by ``train.py`` with the sizes given on the
command line (``run_too_big``).

Nothing here allocates or tries an allocation: a size is refused when the allocation itself fails, or (``allocated``)
when what was allocated is larger than the machine's memory.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

__all__ = ["allocated", "allocation_bytes", "machine_memory", "overrides_below", "readable", "run_too_big", "too_big"]

_TORCH_CPU = re.compile(r"can't allocate memory: you tried to allocate (\d+) bytes")
_TORCH_CUDA = re.compile(r"Tried to allocate ([\d.]+) (B|KiB|MiB|GiB|TiB)")
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def allocation_bytes(err: BaseException) -> int | None:
    """The bytes that the failed allocation ``err`` asked for, or None when ``err`` is not a failed allocation."""
    if isinstance(err, MemoryError):
        size = getattr(err, "_total_size", None)  # numpy's _ArrayMemoryError
        return int(size) if isinstance(size, int) else 0
    if not isinstance(err, RuntimeError):
        return None
    message = str(err)
    if match := _TORCH_CPU.search(message):
        return int(match[1])
    if (match := _TORCH_CUDA.search(message)) and "out of memory" in message:
        return int(float(match[1]) * 1024 ** _UNITS.index(match[2]))
    return None


def machine_memory() -> int | None:
    """This machine's physical memory in bytes, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def readable(size: int) -> str:
    """``size`` bytes in binary units, as numpy says them: ``41.8 TiB``."""
    value, unit = float(size), 0
    while value >= 1024 and unit < len(_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    return f"{value:.1f} {_UNITS[unit]}" if unit else f"{size} B"


def too_big(err: BaseException, what: str, lower: str) -> str | None:
    """The one line for ``err`` if it is a failed allocation, else None: ``what`` (``model.buffer_size=10**12 (the
    replay buffer)``) needs the bytes it asked for, more than can be allocated here; ``lower`` says what to lower."""
    size = allocation_bytes(err)
    if size is None:
        return None
    memory = machine_memory()
    asked = f"{readable(size)} ({size:,} bytes)" if size else "more memory"
    has = f"; this machine has {readable(memory)} ({memory:,} bytes)" if memory else ""
    return f"{what} needs {asked}, which cannot be allocated{has}: lower {lower}"


def allocated(make: Callable[[], T], what: str, key: str) -> T:
    """``make()``, an object that allocates its storage when made and says its size as ``nbytes`` (a replay buffer);
    ``ValueError`` of one line (``too_big``) when the allocation fails, or when it succeeds with more bytes than this
    machine has: a kernel that grants any allocation (``vm.overcommit_memory=1``) maps it lazily, and the run would
    be killed filling it."""
    try:
        made = make()
    except (MemoryError, RuntimeError) as err:
        line = too_big(err, what, key)
        if line is None:
            raise
        raise ValueError(line) from None
    size, memory = getattr(made, "nbytes", 0), machine_memory()
    if memory is not None and size > memory:
        raise ValueError(
            f"{what} needs {readable(size)} ({size:,} bytes), more than this machine's {readable(memory)} "
            f"({memory:,} bytes): lower {key}"
        )
    return made


def overrides_below(key: str = "") -> list[str]:
    """The command line's overrides (``model.hidden=100000``) of keys below ``key`` (all, for ``""``) whose value is a
    whole number, where Hydra runs this job; else none."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return []
    given = [o.lstrip("+~") for o in HydraConfig.get().overrides.task]
    prefix = f"{key}." if key else ""
    return [o for o in given if o.startswith(prefix) and o.partition("=")[2].lstrip("-").isdigit()]


def run_too_big(err: BaseException) -> str | None:
    """The one line for a failed allocation once the run is built (``trainer.fit``), naming the whole numbers given on
    the command line; None when ``err`` is not one."""
    given = overrides_below()
    what = f"this run (with {', '.join(given)})" if given else "this run"
    return too_big(err, what, " or ".join(o.split("=")[0] for o in given) or "its sizes (data.batch_size, model.*)")
