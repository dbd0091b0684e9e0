"""``load_checked``: a checkpoint or snapshot file someone hands over, verified against its digests and loaded without
running anything its pickle asks for.

    from copy_correct.files.checked_load import load_checked, verify_checkpoint
    checkpoint = load_checked("outputs/ema/RUN/checkpoints/last.ckpt")  # instead of torch.load(path)
    verify_checkpoint(best)  # before MyModule.load_from_checkpoint(best), which checks no digest

Safety contract:

* First ``verify_file`` (``copy_correct.files.digest``): the file against the digests written with it (the CRC-32 of
  all its bytes ``atomic_save`` seals into it, or ``torch.save``'s per-record CRC-32s), so a damaged, cut-short,
  random or raw-pickle file is refused before anything in it is unpickled.
* Then ``torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)``: the unpickler builds tensors,
  containers and primitives only. A global the pickle names (``os.system``, any class or function) is refused before
  it is called, unless it is one of ``allow``; ``hyperparameter_classes()`` is the allowlist a Lightning checkpoint's
  hyperparameters need when a module saved a ``DictConfig`` (OmegaConf's containers, nodes and metadata, the
  builtin types they name as element types, ``typing.Any``, ``collections.defaultdict``): classes whose construction
  from a pickle sets attributes and calls nothing else. A user's dataclass named by a structured config is not on
  it, so such a checkpoint is refused, naming it.
* Refusals are one-line ``ValueError``s naming the file: ``MissingFile`` (nothing at the path: also a
  ``FileNotFoundError``), ``DamagedFile`` (the digests, or a load that fails on a file that passed them),
  ``UnsafeFile`` (the globals a ``weights_only`` load refuses, named by
  ``torch.serialization.get_unsafe_globals_in_checkpoint``). ``main()`` of ``copy-correct`` prints them as one line.
* Copies: with ``mmap=True`` the tensors are read-only memory maps of the file (nothing read until used); the
  verification reads the file once before, holding no copy of it.
"""

from __future__ import annotations

import collections
import os
import pickle
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from copy_correct.errors import DamagedFile, MissingFile, UnsafeFile, check_exists, first_line
from copy_correct.files.digest import verify_file
from copy_correct.files.shard_digest import verify_directory

__all__ = ["DamagedFile", "MissingFile", "UnsafeFile", "hyperparameter_classes", "load_checked", "verify_checkpoint"]


def hyperparameter_classes() -> tuple[Any, ...]:
    """The allowlist a Lightning checkpoint's ``DictConfig`` hyperparameters need (module docstring); empty without
    OmegaConf installed. Imported when called, so that importing this module imports no OmegaConf."""
    builtins_named = (int, float, bool, str, bytes, list, dict, tuple)
    try:
        from omegaconf import DictConfig, ListConfig, nodes
        from omegaconf.base import ContainerMetadata, Metadata
    except ImportError:  # no OmegaConf installed: no checkpoint that needs it can be loaded here anyway
        return ()
    node_types = (nodes.AnyNode, nodes.IntegerNode, nodes.FloatNode, nodes.BooleanNode, nodes.StringNode)
    return (DictConfig, ListConfig, ContainerMetadata, Metadata, *node_types, typing.Any,
            collections.defaultdict, *builtins_named)  # fmt: skip


def load_checked(path: str | os.PathLike[str], *, mmap: bool = False, allow: Iterable[Any] = ()) -> Any:
    """``torch.load(path, weights_only=True)`` on CPU after ``verify_file(path)``, with the globals ``allow`` lets
    through (``hyperparameter_classes()`` for a Lightning checkpoint's); ``MissingFile``/``DamagedFile``/``UnsafeFile``
    otherwise."""
    path, allow = check_exists(path), tuple(allow)
    verify_file(path)
    try:
        with torch.serialization.safe_globals(list(allow)):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:
        unsafe = _unsafe_globals(path, allow)
        if unsafe:
            raise UnsafeFile(
                f"{path} names {', '.join(unsafe[:4])}{', ...' if len(unsafe) > 4 else ''} in its pickle, which a "
                "weights_only load refuses (loading it otherwise could run code): not loaded"
            ) from None
        raise DamagedFile(f"{path} does not load with weights_only=True: {first_line(error)}") from None
    except Exception as error:  # a file that passed its digests and still fails: the same one line to the user
        raise DamagedFile(f"{path} does not load: {type(error).__name__}: {first_line(error)}") from None


def verify_checkpoint(path: str | os.PathLike[str]) -> None:
    """Check a checkpoint before ``Module.load_from_checkpoint(path)`` or a resume reads it: a file against its
    digests (``verify_file``), a distributed checkpoint's directory against its ``digests.json`` with its
    ``.metadata`` parsed safely (``copy_correct.files.shard_digest.verify_directory``); ``MissingFile`` when nothing is
    there, ``DamagedFile``/``UnsafeFile``."""
    path = check_exists(path)
    if path.is_dir():
        verify_directory(path)
    else:
        verify_file(path)


def _unsafe_globals(path: Path, allow: Iterable[Any]) -> list[str]:
    allowed = {f"{getattr(a, '__module__', '')}.{getattr(a, '__qualname__', getattr(a, '_name', ''))}" for a in allow}
    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # naming them is a courtesy; the refusal stands without it
        return ["a global"]
    plain = ("builtins.", "typing.", "collections.")  # named after what tells more: the classes, the functions
    return sorted((n for n in found if n not in allowed), key=lambda n: (n.startswith(plain), n)) or ["a global"]
