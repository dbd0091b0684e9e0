"""The digest of a file ``torch.save`` wrote: sealed into it after the save, checked before anything in it is unpickled.

Why: ``torch.save`` writes a zip archive of stored (uncompressed) records (the pickle ``ARCHIVE/data.pkl``, one record
per tensor storage, a few small ones), and ``torch.load`` checks no digest: 64 flipped bytes in a tensor's record
load as other numbers, without an error.

Copy contract (bytes only: no tensor is made, copied or seen by autograd):

* Sealed (``seal``, which ``atomic_save`` calls once ``torch.save`` has written the file): the CRC-32 of every byte
  ``torch.save`` wrote, read back (in small chunks, or a memory map from 16 MiB: no copy held), stored in the comment
  (``copy-correct crc32 HEX SIZE``; zip readers, ``torch.load`` included, skip it). ``torch.save`` writes straight
  into the file and its own per-record CRC-32 is off for the save (``torch_crc32(False)``): one pass over the bytes.
* Checked (``verify_file``): a sealed file's end is read, then its bytes once, the same way; an unsealed one
  (``torch.save``'s, Lightning's) record by record against ``torch.save``'s per-record CRC-32s. Nothing is written.
  ``MissingFile`` (a ``FileNotFoundError`` and a ``DamagedFile``) for no file; else ``DamagedFile`` (a ``ValueError``),
  one line naming the file and what is wrong: empty, not a zip archive (cut short, random bytes, a raw pickle, the
  legacy format), not ``torch.save``'s (no ``data.pkl``, a compressed record), bytes or a record that do not match.
* The CRC-32 is ISA-L's (``isal``, the ``fast-digest`` extra: 22 GB/s here) where it is installed, else zlib's (4 GB/s):
  the same function, so either verifies what the other sealed, and files of earlier versions verify.
* Not detected: a change that keeps the CRC-32 (it catches accidental damage, any burst of up to 32 flipped bits and
  other changes but for one in 2**32; it is no authenticator against a forger). Safety to unpickle is a separate
  check, ``torch.load(..., weights_only=True)`` (``copy_correct.files.checked_load``).
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import mmap
import os
import re
import struct
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from copy_correct.errors import DamagedFile, MissingFile, first_line

try:
    from isal.isal_zlib import crc32
except ImportError:  # the fast-digest extra is not installed: the same CRC-32, at zlib's speed
    from zlib import crc32

__all__ = ["CRC32", "DamagedFile", "crc32", "file_crc32", "seal", "torch_crc32", "verify_file"]

CRC32 = crc32.__module__.split(".")[0]  # "isal" or "zlib": which implementation computes the digests here
_CHUNK = 256 << 10  # bytes read at a time below _MAPPED: a buffer that stays in cache (measured faster than a map)
_MAPPED = 16 << 20  # bytes from which a range is read through a memory map (measured faster than reads)
_SLICE = 16 << 20  # bytes handed to one crc32 call: the memory map's pages are read slice by slice
_END = b"PK\x05\x06"  # the zip archive's end-of-directory record: 22 bytes, the last 2 the comment's length
_SEAL = re.compile(rb"copy-correct crc32 ([0-9a-f]{8}) (\d+)")
_SEALED_END = re.compile(rb"PK\x05\x06[\s\S]{16}([\s\S]{2})(copy-correct crc32 ([0-9a-f]{8}) (\d+))\Z")
_TAIL = 22 + 64  # a sealed file's end record and comment fit in this many bytes
_BUFFER = threading.local()  # each thread's chunk buffer (256 KiB), made at its first digest


@contextlib.contextmanager
def torch_crc32(enabled: bool) -> Iterator[None]:
    """Within the block, ``torch.save`` computes its per-record CRC-32s or not (the setting restored after); a no-op
    on a torch without the setting."""
    try:
        save = importlib.import_module("torch.utils.serialization").config.save
        before = save.compute_crc32
    except (ImportError, AttributeError):
        yield
        return
    save.compute_crc32 = enabled
    try:
        yield
    finally:
        save.compute_crc32 = before


def file_crc32(file: IO[bytes], start: int, stop: int, crc: int = 0) -> int:
    """The CRC-32 of ``file``'s bytes ``start:stop`` continued from ``crc``: up to ``_MAPPED`` bytes read a chunk at a
    time into the thread's one small buffer (made once, it stays in cache), more through a memory map of the file, a
    slice at a time."""
    if stop - start < _MAPPED:
        chunk = getattr(_BUFFER, "chunk", None)
        if chunk is None:
            chunk = _BUFFER.chunk = memoryview(bytearray(_CHUNK))
        file.seek(start)
        while start < stop:
            read = file.readinto(chunk[: stop - start])
            if not read:
                raise EOFError(f"the file ends at byte {start:,}, not {stop:,}")
            crc = crc32(chunk[:read], crc)
            start += read
        return crc
    with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped, memoryview(mapped) as view:
        for first in range(start, stop, _SLICE):
            crc = crc32(view[first : min(first + _SLICE, stop)], crc)
    return crc


def seal(file: IO[bytes]) -> None:
    """Seal the archive ``torch.save`` has just written into ``file`` (opened for reading and writing, at its end):
    the CRC-32 of its bytes goes into the archive's comment, the comment's length into the last 2 bytes ``torch.save``
    wrote (0 until now)."""
    file.flush()
    size = os.fstat(file.fileno()).st_size
    file.seek(max(0, size - 22))
    end = file.read(22)
    if len(end) != 22 or not end.startswith(_END) or end[-2:] != b"\0\0":
        raise RuntimeError(f"torch.save's archive does not end as expected (an end record without comment): {end!r}")
    comment = f"copy-correct crc32 {file_crc32(file, 0, size):08x} {size}".encode()
    file.seek(size - 2)
    file.write(struct.pack("<H", len(comment)) + comment)
    file.flush()


def verify_file(path: str | os.PathLike[str]) -> None:
    """Raise ``DamagedFile`` unless the ``torch.save`` archive at ``path`` matches the digests written with it
    (module docstring); ``MissingFile`` when nothing is there, and an ``OSError`` reading it reported as damage."""
    path = Path(path)
    with _refusals(path), open(path, "rb") as file:
        _check(path, file)


@contextlib.contextmanager
def _refusals(path: Path) -> Iterator[None]:
    """What goes wrong checking ``path`` as one line: ``MissingFile`` for no file, else ``DamagedFile``."""
    try:
        yield
    except DamagedFile:
        raise
    except FileNotFoundError:
        raise MissingFile(errno.ENOENT, "no such file or directory", str(path)) from None
    except zipfile.BadZipFile as error:
        raise DamagedFile(f"{path} is damaged or not a file torch.save wrote: {first_line(error)}") from None
    except OSError as error:
        raise DamagedFile(f"{path} cannot be read: {error.strerror or first_line(error)}") from None
    except Exception as error:  # a header that does not parse (struct.error, EOFError, ...): the same to the user
        raise DamagedFile(f"{path} is damaged: {type(error).__name__}: {first_line(error)}") from None


def _check(path: Path, file: IO[bytes]) -> None:
    """A sealed archive against its seal, found at its end; any other against its records (``_check_archive``)."""
    size = file.seek(0, os.SEEK_END)
    if size == 0:
        raise DamagedFile(f"{path} is empty (0 bytes): not a file torch.save wrote")
    file.seek(max(0, size - _TAIL))
    sealed = _SEALED_END.search(file.read())
    if sealed is not None and struct.unpack("<H", sealed[1])[0] == len(sealed[2]):
        _check_seal(path, file, int(sealed[3], 16), int(sealed[4]), len(sealed[2]))
        return
    _check_archive(path, file)


def _check_archive(path: Path, file: IO[bytes]) -> None:
    """An archive whose end is not a seal: its layout, then its seal (where bytes follow it) or its records' CRC-32s."""
    if not zipfile.is_zipfile(file):
        raise DamagedFile(
            f"{path} is not the zip archive torch.save writes (cut short, other bytes, a raw pickle, or "
            "torch.save's legacy format, which carries no digests): not loaded"
        )
    with zipfile.ZipFile(file) as archive:
        records = archive.infolist()
        comment = archive.comment
    _check_layout(path, records)
    sealed = _SEAL.fullmatch(comment)
    if sealed is not None:
        _check_seal(path, file, int(sealed[1], 16), int(sealed[2]), len(comment))
        return
    if all(r.CRC == 0 for r in records if r.file_size):
        raise DamagedFile(
            f"{path} carries no CRC-32 digests (written with torch.utils.serialization.config.save.compute_crc32 "
            "off, and not by atomic_save): its bytes cannot be verified; save it again with the setting on"
        )
    for record in records:
        file.seek(record.header_offset)
        header = file.read(30)
        if len(header) != 30 or not header.startswith(b"PK\x03\x04"):
            raise DamagedFile(f"{path} is damaged: the header of record {record.filename!r} is not a zip header")
        start = record.header_offset + 30 + sum(struct.unpack("<HH", header[26:30]))
        crc = file_crc32(file, start, start + record.compress_size)
        if crc != record.CRC:
            raise DamagedFile(
                f"{path} is damaged: record {record.filename!r} has CRC-32 {crc:08x}, written as {record.CRC:08x}"
            )


def _check_seal(path: Path, file: IO[bytes], expected: int, size: int, comment: int) -> None:
    actual = file.seek(0, os.SEEK_END)
    if actual != size + comment:
        raise DamagedFile(f"{path} is damaged: {actual:,} bytes, written as {size + comment:,}")
    crc = crc32(b"\0\0", file_crc32(file, 0, size - 2))  # the comment's length as torch.save wrote it
    if crc != expected:
        raise DamagedFile(
            f"{path} is damaged: its bytes have CRC-32 {crc:08x}, written with {expected:08x} (a changed byte)"
        )


def _check_layout(path: Path, records: list[zipfile.ZipInfo]) -> None:
    if not any(r.filename.endswith("/data.pkl") or r.filename == "data.pkl" for r in records):
        raise DamagedFile(f"{path} is a zip archive without data.pkl: not a file torch.save wrote")
    compressed = [r.filename for r in records if r.compress_type != zipfile.ZIP_STORED]
    if compressed:
        raise DamagedFile(f"{path} has compressed records ({compressed[0]}): not a file torch.save wrote")
