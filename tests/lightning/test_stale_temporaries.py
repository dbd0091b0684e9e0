"""Stale temporary files: ``remove_stale_temporaries`` removes the ``.NAME.tmp-PID`` files and directories of dead
processes and keeps a live process's and a set-aside ``.old-PID`` checkpoint; ``StaleTemporaries`` does it when a
resumed fit starts, in its own checkpoint folder and the resumed run's (the control, a fit without it, leaves them)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.demos.boring_classes import BoringModel

from copy_correct._stale_temporaries import is_live, remove_stale_temporaries
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
