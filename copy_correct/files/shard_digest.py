"""Digests of a distributed checkpoint's directory (``torch.distributed.checkpoint``'s shards and ``.metadata``,
Lightning's ``meta.pt``): written with it, checked before anything in it is read.

Contract:

* ``write_digests(directory)``: ``digests.json`` in the directory, the size and CRC-32 of every other file in it,
  written and ``fsync``-ed. ``AtomicModelParallelStrategy`` calls it on rank 0 once every rank's shards, ``.metadata``
  and ``meta.pt`` are written, before the directory is put in place (one more read of the checkpoint's bytes, from
  the page cache: ``torch.distributed.checkpoint``'s ``.distcp`` files are raw tensor bytes with no digest of their
  own).
* ``verify_directory(directory)`` raises ``MissingFile`` (a ``FileNotFoundError`` and a ``DamagedFile``) for no
  directory there; ``DamagedFile`` (a ``ValueError``, one line naming the file) for a directory without
  ``digests.json`` (written by Lightning's own ``ModelParallelStrategy``, or before digests were written: its shards
  cannot be verified), a listed file missing, of another size or CRC-32, or a file in the directory that the
  digests do not list; ``meta.pt`` is also checked against its own digests (``verify_file``); and ``UnsafeFile`` for a
  ``.metadata`` whose pickle names anything but ``torch.distributed.checkpoint``'s metadata classes, ``torch.Size``,
  dtypes, layouts and paths (``torch.distributed.checkpoint`` reads it with a plain ``pickle.load``, which would
  run whatever a crafted one asks for; here it is parsed with an unpickler that refuses every other global, before
  anything else reads it).
* What is not verified: a change that keeps every file's CRC-32 (a forger can recompute them: CRC-32 guards against
  accidents, not tampering); subfolders (``torch.distributed.checkpoint`` writes none).
"""

from __future__ import annotations

import io
import json
import os
import pickle
from pathlib import Path
from typing import Any

import torch

from copy_correct.errors import DamagedFile, UnsafeFile, check_exists
from copy_correct.files.digest import file_crc32, verify_file

__all__ = ["DIGESTS", "verify_directory", "write_digests"]

DIGESTS = "digests.json"
_FORMAT = "copy-correct digests 1"
_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                 "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
     ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict")}  # fmt: skip


def write_digests(directory: Path) -> Path:
    """Write ``directory/digests.json``: every other file's size and CRC-32 (module docstring); its path."""
    files = {p.name: {"bytes": p.stat().st_size, "crc32": _crc32(p)} for p in _files(directory)}
    path = directory / DIGESTS
    with open(path, "w") as file:
        json.dump({"format": _FORMAT, "files": files}, file, indent=0, sort_keys=True)
        file.flush()
        os.fsync(file.fileno())
    return path


def verify_directory(directory: Path) -> None:
    """Raise ``DamagedFile``/``UnsafeFile`` unless every file of the distributed checkpoint ``directory`` matches the
    digests written with it and its ``.metadata`` names nothing unsafe (module docstring); ``MissingFile`` when there
    is no ``directory``."""
    path = check_exists(directory) / DIGESTS
    if not path.is_file():
        raise DamagedFile(
            f"{directory} has no {DIGESTS} (written by Lightning's own ModelParallelStrategy, not by "
            "AtomicModelParallelStrategy): its shards cannot be verified"
        )
    try:
        listed = json.loads(path.read_text())
        if listed.get("format") != _FORMAT:
            raise ValueError(f"format {listed.get('format')!r}")
        files: dict[str, dict[str, int]] = listed["files"]
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise DamagedFile(f"{path} is damaged: not the digests {_FORMAT!r} ({error})") from None
    present = {p.name for p in _files(directory)}
    unlisted = sorted(present - set(files))
    if unlisted:
        raise DamagedFile(f"{directory / unlisted[0]} is not listed in {path}: a file added after the checkpoint")
    for name, digest in sorted(files.items()):
        file = directory / name
        if name not in present:
            raise DamagedFile(f"{file} is missing: {path} lists it")
        size, crc = file.stat().st_size, _crc32(file)
        written = (digest.get("bytes"), digest.get("crc32"))
        if (size, crc) != written:
            raise DamagedFile(f"{file} is damaged: {size:,} bytes of CRC-32 {crc:08x}, written as {_digest(*written)}")
    verify_file(directory / "meta.pt")
    check_metadata(directory / ".metadata")


def check_metadata(path: Path) -> None:
    """Parse ``torch.distributed.checkpoint``'s ``.metadata`` with an unpickler that builds only its metadata classes;
    ``UnsafeFile`` naming the first other global, ``DamagedFile`` for a pickle that does not parse."""
    try:
        _MetadataUnpickler(io.BytesIO(path.read_bytes()), path).load()
    except UnsafeFile:
        raise
    except Exception as error:  # a truncated or foreign pickle: the same one line
        raise DamagedFile(f"{path} does not parse as checkpoint metadata: {type(error).__name__}: {error}") from None


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that builds ``_METADATA_CLASSES`` and dtypes, and refuses any other global before it is called."""

    def __init__(self, file: io.BytesIO, path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in _METADATA_CLASSES or dtype:
            return super().find_class(module, name)
        raise UnsafeFile(
            f"{self.path} names {module}.{name} in its pickle, which is not checkpoint metadata (reading it with "
            "pickle could run code): not loaded"
        )


def _digest(size: object, crc: object) -> str:
    if isinstance(size, int) and isinstance(crc, int):
        return f"{size:,} bytes of CRC-32 {crc:08x}"
    return f"{size!r} bytes of CRC-32 {crc!r}"


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.name != DIGESTS and p.is_file())


def _crc32(path: Path) -> int:
    with open(path, "rb") as file:
        return file_crc32(file, 0, os.fstat(file.fileno()).st_size)
