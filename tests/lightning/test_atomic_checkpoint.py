"""AtomicCheckpointIO: a checkpoint is streamed to a file beside its target and renamed over it, so a failed or
killed write leaves the previous checkpoint whole, and no serialised copy of the checkpoint is held in memory."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from copy_correct.lightning import AtomicCheckpointIO
from copy_correct.probes import MemoryProbe
from recipes.launch import available_recipes
from tests.conftest import ROOT, child_env, compose_config


def checkpoint(value: float, tensors: int = 4, elements: int = 250_000, device: str = "cpu") -> dict:
    return {
        "state_dict": {f"w{i}": torch.full((elements,), value, device=device) for i in range(tensors)},
        "epoch": int(value),
    }


def assert_holds(path: Path, value: float) -> None:
    loaded = AtomicCheckpointIO().load_checkpoint(path, weights_only=True)
    assert loaded["epoch"] == int(value)
    assert all(torch.equal(t, torch.full_like(t, value)) for t in loaded["state_dict"].values())


def test_round_trip_through_a_weights_only_load_allocating_nothing_on_the_device(
    device: torch.device, tmp_path: Path
) -> None:
    path = tmp_path / "checkpoints" / "last.ckpt"  # the directory is made
    state = checkpoint(3.0, device=device.type)
    with MemoryProbe(device) as probe:
        AtomicCheckpointIO().save_checkpoint(state, path)
    assert probe.peak_bytes == 0  # on CUDA: each storage goes to the host once, no copy on the device
    assert_holds(path, 3.0)
    AtomicCheckpointIO().save_checkpoint(checkpoint(4.0, device=device.type), path)  # over an existing one
    assert_holds(path, 4.0)
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.ckpt"]  # no temporary file left
    loaded = AtomicCheckpointIO().load_checkpoint(path, map_location=device, weights_only=True)
    assert loaded["state_dict"]["w0"].device.type == device.type


def test_a_save_holds_no_serialised_copy_of_the_checkpoint_in_memory(tmp_path: Path) -> None:
    state = checkpoint(1.0, tensors=8, elements=1_000_000)  # 32 MB of tensors
    size = sum(t.numel() * t.element_size() for t in state["state_dict"].values())

    def peak(io: TorchCheckpointIO) -> int:
        tracemalloc.start()
        try:
            io.save_checkpoint(state, tmp_path / f"{type(io).__name__}.ckpt")
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    ours, lightning = peak(AtomicCheckpointIO()), peak(TorchCheckpointIO())
    print(f"tracemalloc peak of a save, over the checkpoint's {size} B: ours {ours / size:.4f}x, Lightning's "
          f"{lightning / size:.2f}x")  # fmt: skip
    assert ours < 0.01 * size
    assert lightning > size  # the control: Lightning's BytesIO holds the whole serialised file


def test_a_failed_write_leaves_the_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint(checkpoint(1.0), path)
    before = path.read_bytes()
    real_save = torch.save

    def dies_halfway(obj: object, file: io.BufferedWriter) -> None:  # a full disk, a failed device-to-host copy
        serialised = io.BytesIO()
        real_save(obj, serialised)
        file.write(serialised.getvalue()[: len(serialised.getvalue()) // 2])
        raise OSError("no space left on device")

    monkeypatch.setattr(torch, "save", dies_halfway)
    with pytest.raises(OSError, match="no space left"):
        AtomicCheckpointIO().save_checkpoint(checkpoint(2.0), path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # the temporary file is removed
    # Control: the same failure while writing into the target itself leaves half a checkpoint, which no load takes.
    with open(path, "wb") as file, pytest.raises(OSError):
        torch.save(checkpoint(2.0), file)
    with pytest.raises(RuntimeError):
        torch.load(path, weights_only=True)


def test_the_temporary_file_is_beside_its_target_and_renamed_over_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    renames: list[tuple[Path, Path]] = []
    real_replace = os.replace
    monkeypatch.setattr(
        os, "replace", lambda src, dst: (renames.append((Path(src), Path(dst))), real_replace(src, dst))
    )
    path = tmp_path / "checkpoints" / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint(checkpoint(1.0), path)
    ((source, target),) = renames
    assert target == path and source.parent == path.parent  # one filesystem: the rename is atomic
    assert source.name.startswith(".last.ckpt.tmp-")


WRITER = """
import sys, torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
import train
from copy_correct.lightning import AtomicCheckpointIO
from copy_correct.probes import MemoryProbe
path, io, n = sys.argv[1], {"ours": AtomicCheckpointIO, "lightning": TorchCheckpointIO}[sys.argv[2]](), 0
while True:
    value = float(n % 2 + 1)
    tensors = {f"w{i}": torch.full((8_000_000,), value) for i in range(4)}
    io.save_checkpoint({"state_dict": tensors, "epoch": int(value)}, path)
    n += 1
    print(n, flush=True)
"""  # alternates two 128 MB checkpoints into one path


def kill_mid_write(path: Path, io: str, writing: Callable[[int, int], bool], **env: str) -> int:
    """Start a writer, let its first checkpoint land, and SIGKILL it the moment ``writing(pid, whole_size)`` sees
    its second write under way. Returns the writer's pid."""
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path), io], cwd=ROOT, stdout=subprocess.PIPE, text=True,
        env=child_env(**env),
    )  # fmt: skip
    assert writer.stdout is not None
    assert writer.stdout.readline().strip() == "1"
    whole = path.stat().st_size
    deadline = time.monotonic() + 60
    while not writing(writer.pid, whole) and time.monotonic() < deadline:
        pass
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait(timeout=60)
    assert writer.returncode == -signal.SIGKILL
    return writer.pid


def size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def test_a_writer_killed_mid_write_leaves_the_previous_checkpoint_whole(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    temporary = lambda pid: tmp_path / f".last.ckpt.tmp-{pid}"  # noqa: E731
    pid = kill_mid_write(path, "ours", lambda pid, whole: 0 < size(temporary(pid)) < whole // 2)
    assert 0 < size(temporary(pid)) < size(path)  # killed mid-write: the second checkpoint is part-written
    assert_holds(path, 1.0)  # the first, whole


SECOND_FILESYSTEM = Path("/dev/shm")


@pytest.mark.skipif(
    not SECOND_FILESYSTEM.is_dir() or SECOND_FILESYSTEM.stat().st_dev == Path(tempfile.gettempdir()).stat().st_dev,
    reason="needs /dev/shm on another filesystem than the temporary directory",
)
def test_control_lightnings_writer_killed_while_it_moves_across_filesystems_leaves_a_torn_file(
    tmp_path: Path,
) -> None:
    """What AtomicCheckpointIO guards against: with ``TMPDIR`` on another filesystem, Lightning's final move is
    a copy into the target, and a kill during it leaves part of a checkpoint under the target's name."""
    path = tmp_path / "last.ckpt"
    with tempfile.TemporaryDirectory(dir=SECOND_FILESYSTEM) as elsewhere:
        kill_mid_write(path, "lightning", lambda pid, whole: 0 < size(path) < whole // 2, TMPDIR=elsewhere)
    # Where the cut falls decides torch's error: a zip reader's RuntimeError, or (torch 2.14) EINVAL from a read
    # past the end, an OSError.
    with pytest.raises((RuntimeError, OSError)):
        torch.load(path, weights_only=True)


def test_other_filesystems_go_through_lightnings_own_write() -> None:
    io = AtomicCheckpointIO()
    io.save_checkpoint(checkpoint(5.0), "memory://checkpoints/last.ckpt")
    assert io.load_checkpoint("memory://checkpoints/last.ckpt", weights_only=True)["epoch"] == 5


@pytest.mark.parametrize("trainer", ["default", "cpu", "ddp"])
def test_every_trainer_of_train_py_writes_through_it(trainer: str, tmp_path: Path) -> None:
    from hydra.utils import instantiate

    cfg = compose_config(f"+recipe={available_recipes()[0]}", f"trainer={trainer}", output_dir=tmp_path)
    built = instantiate(cfg.trainer, logger=False, enable_progress_bar=False)
    assert isinstance(built.strategy.checkpoint_io, AtomicCheckpointIO)
