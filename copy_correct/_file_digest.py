"""The digest of a file ``torch.save`` wrote: written with it, checked before anything in it is unpickled or mapped.

Why: ``torch.save`` writes a zip archive of stored (uncompressed) records (the pickle ``ARCHIVE/data.pkl``, one record
per tensor storage, a few small ones), and ``torch.load`` checks no digest: 64 flipped bytes in a tensor's record
load as other numbers, without an error.

Copy contract (bytes only: no tensor is made, copied or seen by autograd):

* Written (``DigestWriter`` and ``seal``, which ``atomic_save`` uses): the CRC-32 of every byte ``torch.save`` writes,
  computed as the bytes pass to the file and stored in the archive's comment (``copy-correct crc32 HEX SIZE``; zip
  readers, ``torch.load`` included, skip it). A write of 1 MiB or more is digested in a second thread while the first
  writes it (``zlib.crc32`` and ``write`` release the GIL); ``torch.save``'s own per-record CRC-32, computed in line,
  is turned off for that save (``torch_crc32(False)``): it would cost a second pass.
* Checked (``verify_file``): a sealed file's bytes are read once (memory-mapped, in 16 MiB slices, no copy held) and
  compared with the seal; an unsealed one (``torch.save``'s, Lightning's) record by record against ``torch.save``'s
  per-record CRC-32s. Nothing is written. ``DamagedFile`` (a ``ValueError``), one line naming the file and what is
  wrong: empty, not a zip archive (cut short, random bytes, a raw pickle, the legacy format), not ``torch.save``'s
  (no ``data.pkl``, a compressed record), bytes or a record that do not match, or nothing to check against.
* Not detected: a change that keeps the CRC-32 (it catches accidental damage, any burst of up to 32 flipped bits and
  other changes but for one in 2**32; it is no authenticator against a forger). Safety to unpickle is a separate
  check, ``torch.load(..., weights_only=True)`` (``copy_correct.checked_load``).
"""

from __future__ import annotations

import contextlib
import importlib
import mmap
import os
import re
import struct
import zipfile
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

from copy_correct.errors import DamagedFile

__all__ = ["DamagedFile", "DigestWriter", "seal", "torch_crc32", "verify_file"]

_CHUNK = 1 << 20
_SLICE = 16 << 20
_PARALLEL = 1 << 20  # writes of at least this many bytes are digested in the second thread
_END = b"PK\x05\x06"  # the zip archive's end-of-directory record: 22 bytes, the last 2 the comment's length
_SEAL = re.compile(rb"copy-correct crc32 ([0-9a-f]{8}) (\d+)")


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


class DigestWriter:
    """The file ``torch.save`` writes into: each write passed on to ``file`` while its CRC-32 is computed (in a
    second thread for large writes), the bytes counted, and the first ``OSError`` of a write kept (``torch.save``
    replaces it with a ``RuntimeError``). Use it as a context manager (its thread is shut down at exit)."""

    def __init__(self, file: IO[bytes]) -> None:
        self.file = file
        self.crc = 0
        self.written = 0
        self.tail = b""  # the last 22 bytes written: the archive's end record, once torch.save is done
        self.error: OSError | None = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="copy-correct-digest")

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        digest = self._thread.submit(zlib.crc32, view, self.crc) if len(view) >= _PARALLEL else None
        try:
            count = self.file.write(view)
        except OSError as error:
            self.error = self.error or error
            raise
        finally:
            crc = digest.result() if digest is not None else zlib.crc32(view, self.crc)  # before torch reuses view
        self.crc = crc
        self.written += count
        self.tail = (self.tail + bytes(view[-22:]))[-22:]
        return count

    def flush(self) -> None:
        self.file.flush()

    def __enter__(self) -> DigestWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self._thread.shutdown()


def seal(file: IO[bytes], writer: DigestWriter) -> None:
    """Store ``writer``'s CRC-32 of what ``torch.save`` wrote into ``file`` in the archive's comment: the comment's
    length in the last 2 bytes ``torch.save`` wrote (0 until now), the comment after them."""
    end = writer.tail
    if len(end) != 22 or not end.startswith(_END) or end[-2:] != b"\0\0":
        raise RuntimeError(f"torch.save's archive does not end as expected (an end record without comment): {end!r}")
    file.flush()
    comment = f"copy-correct crc32 {writer.crc:08x} {writer.written}".encode()
    file.seek(writer.written - 2)
    file.write(struct.pack("<H", len(comment)) + comment)
    file.flush()


def verify_file(path: str | os.PathLike[str]) -> None:
    """Raise ``DamagedFile`` unless the ``torch.save`` archive at ``path`` matches the digests written with it
    (module docstring); an ``OSError`` reading it is reported the same way."""
    path = Path(path)
    try:
        if path.stat().st_size == 0:
            raise DamagedFile(f"{path} is empty (0 bytes): not a file torch.save wrote")
        if not zipfile.is_zipfile(path):
            raise DamagedFile(
                f"{path} is not the zip archive torch.save writes (cut short, other bytes, a raw pickle, or "
                "torch.save's legacy format, which carries no digests): not loaded"
            )
        with zipfile.ZipFile(path) as archive:
            records = archive.infolist()
            _check_layout(path, records)
            sealed = _SEAL.fullmatch(archive.comment)
            if sealed is not None:
                _check_seal(path, int(sealed[1], 16), int(sealed[2]), len(archive.comment))
                return
            _check_records_crc(path, records)
            for record in records:
                with archive.open(record) as stream:
                    while stream.read(_CHUNK):
                        pass  # ZipExtFile compares the CRC-32 at the end of the record
    except DamagedFile:
        raise
    except zipfile.BadZipFile as error:
        raise DamagedFile(f"{path} is damaged or not a file torch.save wrote: {_first_line(error)}") from None
    except OSError as error:
        raise DamagedFile(f"{path} cannot be read: {error.strerror or _first_line(error)}") from None
    except Exception as error:  # a header that does not parse (struct.error, EOFError, ...): the same to the user
        raise DamagedFile(f"{path} is damaged: {type(error).__name__}: {_first_line(error)}") from None


def _check_seal(path: Path, expected: int, size: int, comment: int) -> None:
    if path.stat().st_size != size + comment:
        raise DamagedFile(f"{path} is damaged: {path.stat().st_size:,} bytes, written as {size + comment:,}")
    crc = 0
    with (
        open(path, "rb") as file,
        mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped,
        memoryview(mapped) as view,
    ):
        for start in range(0, size - 2, _SLICE):
            crc = zlib.crc32(view[start : min(start + _SLICE, size - 2)], crc)
    crc = zlib.crc32(b"\0\0", crc)  # the comment's length as torch.save wrote it
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


def _check_records_crc(path: Path, records: list[zipfile.ZipInfo]) -> None:
    if all(r.CRC == 0 for r in records if r.file_size):
        raise DamagedFile(
            f"{path} carries no CRC-32 digests (written with torch.utils.serialization.config.save.compute_crc32 "
            "off, and not by atomic_save): its bytes cannot be verified; save it again with the setting on"
        )


def _first_line(error: BaseException) -> str:
    return (str(error).strip() or type(error).__name__).splitlines()[0]
