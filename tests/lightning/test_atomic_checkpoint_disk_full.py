"""Disk full: a write that the filesystem refuses part-way (the file object's ``write`` raises ``OSError(ENOSPC)``
once its room is used up, as a full disk does; no real tmpfs needed) gives one ``DiskFull`` line naming the path, the
bytes written, the bytes needed and the bytes free; the temporary file is removed and the last good checkpoint is
untouched (its bytes, and its digests). Through ``atomic_save``, ``AtomicCheckpointIO`` and ``train.py`` (one
``error: ...`` line, a non-zero exit; also for a full disk met by Lightning's ``CSVLogger``, a plain ``OSError``).
Controls: ``torch.save`` into the same file reports the full disk as ``RuntimeError: [enforce fail at
inline_container.cc:...] . unexpected pos``, the ``ENOSPC`` only in its context; an ``EIO`` is not called a full
disk."""

from __future__ import annotations

import builtins
import errno
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import copy_correct.files.atomic_save as _atomic_save
from copy_correct.files.atomic_save import atomic_save
from copy_correct.files.digest import verify_file
from copy_correct.files.disk_full import DiskFull
from copy_correct.lightning import AtomicCheckpointIO
from tests.conftest import ROOT, child_env


class FillingFile:
    """A real file opened for writing that takes ``room`` bytes and then refuses with ``code``, part of the refused
    write written first (as a filesystem fills)."""

    def __init__(self, path: str | os.PathLike[str], mode: str, room: int, code: int = errno.ENOSPC) -> None:
        self.file = builtins.open(path, mode)  # noqa: SIM115 - closed by __exit__
        self.room, self.code, self.written = room, code, 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if self.written + len(view) > self.room:
            self.written += self.file.write(view[: self.room - self.written])
            self.file.flush()
            raise OSError(self.code, os.strerror(self.code))
        self.written += self.file.write(view)
        return len(view)

    def flush(self) -> None:
        self.file.flush()

    def fileno(self) -> int:
        return self.file.fileno()

    def seek(self, offset: int) -> int:
        return self.file.seek(offset)

    def __enter__(self) -> FillingFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.file.close()


def fill_after(monkeypatch: pytest.MonkeyPatch, room: int, code: int = errno.ENOSPC) -> None:
    """``atomic_save``'s files take ``room`` bytes, then refuse with ``code``."""
    monkeypatch.setattr(_atomic_save, "open", lambda p, mode: FillingFile(p, mode, room, code), raising=False)


class Free:
    """``shutil.disk_usage``'s answer, as far as the message reads it."""

    free = 12_345


def checkpoint(value: float) -> dict[str, Any]:
    return {"state_dict": {f"w{i}": torch.full((50_000,), value) for i in range(4)}, "epoch": int(value)}


@pytest.mark.parametrize("writer", ["atomic_save", "AtomicCheckpointIO"])
def test_a_write_refused_part_way_is_one_line_and_leaves_the_last_good_checkpoint(
    writer: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save = atomic_save if writer == "atomic_save" else AtomicCheckpointIO().save_checkpoint
    path = tmp_path / "last.ckpt"
    save(checkpoint(1.0), path)
    before = path.read_bytes()
    monkeypatch.setattr("copy_correct.files.disk_full.shutil.disk_usage", lambda _: Free())
    fill_after(monkeypatch, room=300_000)
    with pytest.raises(DiskFull) as refused:
        save(checkpoint(2.0), path)
    message = str(refused.value)
    assert refused.value.errno == errno.ENOSPC and isinstance(refused.value, OSError) and "\n" not in message
    assert message == (
        f"no space left to write {path} (No space left on device): 300,000 bytes written when the filesystem refused "
        "more; it needs at least 800,000 (its tensors' bytes); 12,345 bytes free on it; the temporary file is removed "
        "and last.ckpt is as it was"
    )
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    verify_file(path)  # the last good checkpoint, whole

    with FillingFile(tmp_path / "control.ckpt", "wb", room=300_000) as file, pytest.raises(RuntimeError) as control:
        torch.save(checkpoint(2.0), file)  # the control: what a full disk looks like without atomic_save
    assert "unexpected pos" in str(control.value) and "inline_container" in str(control.value)
    assert isinstance(control.value.__context__, OSError) and control.value.__context__.errno == errno.ENOSPC


def test_a_full_disk_at_fsync_is_a_full_disk_and_another_error_is_not_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "last.ckpt"
    atomic_save(checkpoint(1.0), path)
    before = path.read_bytes()
    real_fsync = os.fsync

    def fsync_full(fd: int) -> None:
        if os.path.isfile(f"/proc/self/fd/{fd}") or not os.path.exists("/proc/self/fd"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    with monkeypatch.context() as patch:
        patch.setattr(_atomic_save.os, "fsync", fsync_full)
        with pytest.raises(DiskFull, match=r"no space left to write .*last\.ckpt .* bytes written when"):
            atomic_save(checkpoint(2.0), path)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]

    fill_after(monkeypatch, room=300_000, code=errno.EIO)  # the control: an I/O error is not called a full disk
    with pytest.raises(RuntimeError) as other:
        atomic_save(checkpoint(2.0), path)
    assert not isinstance(other.value, DiskFull) and path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


RUN_FULL = """
import errno, os, runpy, sys
import copy_correct.files.atomic_save as _atomic_save
from tests.lightning.test_atomic_checkpoint_disk_full import FillingFile
room, writer = int(sys.argv[1]), sys.argv[2]
if writer == "checkpoint":
    _atomic_save.open = lambda p, mode: FillingFile(p, mode, room)
else:  # Lightning's CSVLogger, whose hparams.yaml is the first file a run writes after Hydra's
    import lightning.pytorch.loggers.csv_logs as csv_logs
    def full(config_yaml, *args, **kwargs):  # as a full disk does it: the file made, nothing written into it
        open(config_yaml, "w").close()
        print("made", config_yaml)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    csv_logs.save_hparams_to_yaml = full
sys.argv = ["train.py", *sys.argv[3:]]
runpy.run_path("train.py", run_name="__main__")
"""


@pytest.mark.parametrize(("writer", "says"), [
    ("checkpoint", "error: no space left to write {run}/checkpoints/epoch000.ckpt (No space left on device): 2,000 "
                   "bytes written when the filesystem refused more; it needs at least "),
    ("logger", "error: no space left (No space left on device): "),
])  # fmt: skip
def test_train_py_stops_with_one_error_line_and_a_non_zero_exit(writer: str, says: str, tmp_path: Path) -> None:
    run = tmp_path / "run"
    overrides = [
        "+recipe=metrics", "trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1",
        f"hydra.run.dir={run}",
    ]  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-c", RUN_FULL, "2000", writer, *overrides],
        cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert errors[0].startswith(says.format(run=run)) and "bytes free" in errors[0], errors[0]
    assert not list(tmp_path.rglob(".*.tmp-*"))  # no temporary file left
    # No 0-byte file either: the logger's hparams.yaml, made and left empty (the control: it was made), is removed.
    assert writer == "checkpoint" or f"made {run}" in result.stdout, result.stdout[-2000:]
    assert not [p for p in run.rglob("*") if p.is_file() and p.stat().st_size == 0]
