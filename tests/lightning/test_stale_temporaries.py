"""Stale temporary files: ``remove_stale_temporaries`` removes the ``.NAME.tmp-PID`` files and directories of dead
processes and keeps a live process's (another writer's as well as this one's: the control, a liveness test that takes
every other process for dead, deletes it) and a set-aside ``.old-PID`` checkpoint; ``StaleTemporaries`` does it when
a resumed fit starts, in its own checkpoint folder and the resumed run's (the control, a fit without it, leaves
them)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.demos.boring_classes import BoringModel

import copy_correct.files.stale_temporaries as _stale_temporaries
from copy_correct.files.stale_temporaries import is_live, remove_stale_temporaries
from copy_correct.lightning import LastCheckpoint, StaleTemporaries


def dead_pid() -> int:
    """The PID of a process that has exited (and been reaped)."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    assert not is_live(process.pid)
    return process.pid


def leave_a_killed_writers_files(folder: Path, dead: int) -> dict[str, Path]:
    """What SIGKILLs during saves leave, and what must stay: a live process's save and a set-aside checkpoint."""
    (folder / "power_ema").mkdir(parents=True, exist_ok=True)
    files = {
        "checkpoint": folder / f".last.ckpt.tmp-{dead}",
        "snapshot": folder / "power_ema" / f".power-ema-000000004.pt.tmp-{dead}",
        "sharded": folder / f".epoch001.ckpt.tmp-{dead}",  # a distributed checkpoint's hidden directory
        "live": folder / f".last.ckpt.tmp-{os.getpid()}",
        "set aside": folder / f".last.ckpt.old-{dead}",
    }
    for name, path in files.items():
        if name == "sharded":
            path.mkdir()
            (path / "__0_0.distcp").write_bytes(b"x" * 1000)
        else:
            path.write_bytes(b"x" * 500)
    return files


def test_only_the_temporaries_of_dead_processes_are_removed(tmp_path: Path) -> None:
    files = leave_a_killed_writers_files(tmp_path, dead_pid())
    removed = remove_stale_temporaries(tmp_path)
    assert sorted(removed) == sorted([(files["checkpoint"], 500), (files["snapshot"], 500), (files["sharded"], 1000)])
    assert [name for name, path in files.items() if path.exists()] == ["live", "set aside"]
    assert remove_stale_temporaries(tmp_path / "missing") == []


# A writer in another process: it writes 500 bytes of its .NAME.tmp-PID, says so, and holds the file open until its
# stdin closes (a save in progress).
WRITER = """
import os, sys
with open(os.path.join(sys.argv[1], f".last.ckpt.tmp-{os.getpid()}"), "wb") as file:
    file.write(b"x" * 500)
    file.flush()
    print("written", flush=True)
    sys.stdin.read()
"""


def start_writer(folder: Path) -> tuple[subprocess.Popen[str], Path]:
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(folder)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert writer.stdout is not None and writer.stdout.readline() == "written\n"
    return writer, folder / f".last.ckpt.tmp-{writer.pid}"


def test_another_live_writers_temporary_is_kept_and_a_killed_ones_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    live, live_file = start_writer(tmp_path)
    try:
        killed, killed_file = start_writer(tmp_path)
        killed.kill()  # SIGKILL mid-save, then reaped: its PID names no process
        killed.communicate()
        assert live.pid != os.getpid() and is_live(live.pid) and not is_live(killed.pid)
        assert remove_stale_temporaries(tmp_path) == [(killed_file, 500)]
        assert live_file.exists() and not killed_file.exists()

        # The control: a liveness test that takes every process but this one for dead deletes the live writer's file.
        monkeypatch.setattr(_stale_temporaries, "is_live", lambda pid: pid == os.getpid())
        assert remove_stale_temporaries(tmp_path) == [(live_file, 500)]
        assert not live_file.exists()
    finally:
        live.kill()
        live.communicate()


def fit(directory: Path, callbacks: list[pl.Callback], epochs: int, ckpt_path: Path | None = None) -> None:
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=epochs, limit_train_batches=4, limit_val_batches=0, logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=directory,
        callbacks=[LastCheckpoint(directory / "checkpoints"), *callbacks],
    )  # fmt: skip
    trainer.fit(BoringModel(), ckpt_path=ckpt_path)


def test_a_resumed_fit_removes_them_in_its_checkpoint_folder_and_the_resumed_runs(tmp_path: Path) -> None:
    dead = dead_pid()
    fit(tmp_path / "crashed", [], epochs=1)
    crashed = leave_a_killed_writers_files(tmp_path / "crashed" / "checkpoints", dead)
    own = leave_a_killed_writers_files(tmp_path / "resumed" / "checkpoints", dead)  # a folder reused
    stale = StaleTemporaries()
    fit(tmp_path / "resumed", [stale], epochs=2, ckpt_path=tmp_path / "crashed" / "checkpoints" / "last.ckpt")
    assert len(stale.removed) == 6
    for files in (crashed, own):
        assert [name for name, path in files.items() if path.exists()] == ["live", "set aside"]

    leave_a_killed_writers_files(tmp_path / "crashed" / "checkpoints", dead)  # the control: a fit without it
    fit(tmp_path / "control", [], epochs=2, ckpt_path=tmp_path / "crashed" / "checkpoints" / "last.ckpt")
    assert all(path.exists() for path in crashed.values())
