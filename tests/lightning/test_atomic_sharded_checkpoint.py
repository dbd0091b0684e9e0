"""``AtomicModelParallelStrategy``: a distributed checkpoint directory (or a file replacing one) is written beside its
target and put in its place in one step, so a kill at any moment leaves the previous checkpoint or the new one.

* 2 gloo processes (``tests/workers/sharded_kill.py``; on a GPU also 1 NCCL process) killed while rewriting
  ``last.ckpt``, once every shard is written and once only ``meta.pt`` is missing: ``last.ckpt`` is the previous
  checkpoint, whole. Control: Lightning's ``ModelParallelStrategy`` killed at the same points leaves new weights under
  the old ``meta.pt`` (loop counters, callback states, random states), a checkpoint of no step that loads without an
  error.
* ``put_in_place`` in a process killed after the exchange and before the previous checkpoint is removed: the new one
  is in place. Control: the two-rename fallback killed between its renames leaves nothing under the name.
* In this process (rank 0, no process group): replacing directories, files and links, the fallback, a failed save,
  and a directory that is not a checkpoint.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch

from copy_correct.lightning import AtomicCheckpointIO, AtomicModelParallelStrategy
from copy_correct.lightning import atomic_sharded_checkpoint as atomic
from copy_correct.lightning.atomic_sharded_checkpoint import put_in_place
from tests.conftest import DEVICES, ROOT, child_env, free_port
from tests.distributed.test_fsdp import read
from tests.recipes.test_resume import differences

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized")


def killed_run(strategy: str, point: str, out: Path, device: str = "cpu") -> Path:
    """``tests/workers/sharded_kill.py``'s run, killed (SIGKILL to its process group) at ``point`` of its second
    ``last.ckpt`` save: 2 gloo processes on the CPU, 1 NCCL process on a GPU."""
    process = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "workers" / "sharded_kill.py"), str(out), strategy, point, device],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=child_env(TEST_PORT=free_port()),
        start_new_session=True,
    )  # fmt: skip
    assert process.returncode == -signal.SIGKILL, process.stderr[-3000:]
    assert (out / "epoch=1.ckpt" / "meta.pt").is_file()  # the second epoch's checkpoint, whole: what the new one holds
    return out / "last.ckpt"


@pytest.mark.long  # each a Lightning fit in 2 processes, killed and read back
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("point", ["shards", "meta"])
def test_a_run_killed_while_rewriting_a_directory_leaves_the_previous_checkpoint_whole(
    point: str, device: str, tmp_path: Path
) -> None:
    last = killed_run("ours", point, tmp_path, device)
    assert differences(read(last, tmp_path / "last.pt"), read(tmp_path / "epoch=0.ckpt", tmp_path / "first.pt")) == []
    (hidden,) = tmp_path.glob(".last.ckpt.tmp-*")  # the new one, part-written, under a name nothing reads
    assert not (hidden / "meta.pt").exists()


@pytest.mark.long
@pytest.mark.parametrize("point", ["shards", "meta"])
def test_control_lightnings_strategy_killed_there_leaves_new_weights_under_old_counters(
    point: str, tmp_path: Path
) -> None:
    last = read(killed_run("lightning", point, tmp_path), tmp_path / "last.pt")
    first = read(tmp_path / "epoch=0.ckpt", tmp_path / "first.pt")
    second = read(tmp_path / "epoch=1.ckpt", tmp_path / "second.pt")
    assert differences(last["state_dict"], second["state_dict"]) == []  # the new weights
    assert differences(last["state_dict"], first["state_dict"]) != []
    assert last["global_step"] == first["global_step"] < second["global_step"]  # the old loop counters
    assert not list(tmp_path.glob(".last.ckpt*"))


def make(path: Path, kind: str, content: str) -> Path:
    """A checkpoint-like ``path``: a ``file``, a ``directory`` (of a distributed checkpoint) or a ``link`` to one."""
    if kind == "file":
        path.write_text(content)
    elif kind == "directory":
        path.mkdir()
        (path / "meta.pt").write_text(content)
        (path / f"__{content}.distcp").write_text(content)
    else:
        make(path.with_name(f"{content}-linked"), "directory", content)
        path.symlink_to(path.with_name(f"{content}-linked"))
    return path


def holds(path: Path) -> str:
    return path.read_text() if path.is_file() else (path / "meta.pt").read_text()


@pytest.mark.parametrize("new", ["directory", "file"])
@pytest.mark.parametrize("old", ["directory", "file", "link", "nothing"])
@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two renames"])
def test_put_in_place_replaces_what_the_target_held(
    new: str, old: str, exchange: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not exchange:
        monkeypatch.setattr(atomic, "_exchange", cannot_exchange)
    target = tmp_path / "last.ckpt"
    if old != "nothing":
        make(target, old, "old")
    with pytest.warns(UserWarning, match="cannot exchange") if not exchange and old != "nothing" else nullcontext():
        put_in_place(make(tmp_path / ".last.ckpt.tmp-1", new, "new"), target)
    assert holds(target) == "new" and target.is_dir() == (new == "directory") and not target.is_symlink()
    left = {p.name for p in tmp_path.iterdir()}
    assert left == ({"last.ckpt", "old-linked"} if old == "link" else {"last.ckpt"})  # a link's target is kept
    if old == "link":
        assert holds(tmp_path / "old-linked") == "old"


def cannot_exchange(a: Path, b: Path) -> None:
    raise OSError(errno.EINVAL, "Invalid argument", str(a))


def test_put_in_place_raises_other_errors_of_the_exchange(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def denied(a: Path, b: Path) -> None:
        raise OSError(errno.EACCES, "Permission denied", str(a))

    monkeypatch.setattr(atomic, "_exchange", denied)
    target = make(tmp_path / "last.ckpt", "directory", "old")
    with pytest.raises(PermissionError):
        put_in_place(make(tmp_path / ".last.ckpt.tmp-1", "directory", "new"), target)
    assert holds(target) == "old"


KILLED_SWAP = """
import os, signal, sys
from pathlib import Path
from copy_correct.lightning import atomic_sharded_checkpoint as atomic
directory, where = Path(sys.argv[1]), sys.argv[2]
kill = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
if where == "after the exchange":
    atomic._remove = kill
else:  # "between two renames"
    rename, renames = os.rename, []
    def second_kills(a, b):
        renames.append(a)
        if len(renames) == 2:
            kill()
        rename(a, b)
    def cannot(a, b):
        raise OSError(22, "Invalid argument")
    atomic._exchange, atomic.os.rename = cannot, second_kills
atomic.put_in_place(directory / ".last.ckpt.tmp-1", directory / "last.ckpt")
"""


@pytest.mark.parametrize("where", ["after the exchange", "between two renames"])
def test_a_swap_killed_midway(where: str, tmp_path: Path) -> None:
    """After the exchange the new checkpoint is in place (the old one left under the hidden name). Control: the
    fallback's two renames, killed between them, leave no checkpoint under the name."""
    make(tmp_path / "last.ckpt", "directory", "old")
    make(tmp_path / ".last.ckpt.tmp-1", "directory", "new")
    process = subprocess.run([sys.executable, "-c", KILLED_SWAP, str(tmp_path), where], cwd=ROOT, env=child_env())
    assert process.returncode == -signal.SIGKILL
    if where == "after the exchange":
        assert holds(tmp_path / "last.ckpt") == "new" and holds(tmp_path / ".last.ckpt.tmp-1") == "old"
    else:
        assert not (tmp_path / "last.ckpt").exists()
        (aside,) = tmp_path.glob(".last.ckpt.old-*")
        assert holds(aside) == "old"


def strategy(distributed: bool) -> AtomicModelParallelStrategy:
    built = AtomicModelParallelStrategy(save_distributed_checkpoint=distributed)
    built.checkpoint_io = AtomicCheckpointIO()
    return built


def state(value: float) -> dict[str, Any]:
    return {"state_dict": {"w": torch.full((4,), value)}, "epoch": int(value)}


def saved(path: Path) -> float:
    if path.is_file():
        return float(torch.load(path, weights_only=True)["state_dict"]["w"][0])
    return float(torch.load(path / "meta.pt", weights_only=True)["epoch"])


@pytest.mark.parametrize("forms", [(True, True), (False, True), (True, False)], ids=["dir-dir", "file-dir", "dir-file"])
def test_each_save_replaces_the_previous_checkpoint_and_leaves_nothing_beside_it(
    forms: tuple[bool, bool], tmp_path: Path
) -> None:
    path = tmp_path / "last.ckpt"
    for value, distributed in zip((1.0, 2.0), forms, strict=True):
        strategy(distributed).save_checkpoint(state(value), path)
        assert saved(path) == value and path.is_dir() == distributed
        assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_a_failed_save_leaves_the_previous_checkpoint_and_removes_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "last.ckpt"
    strategy(True).save_checkpoint(state(1.0), path)

    def fails_after_a_file(converted: dict, directory: Path) -> None:
        (directory / "__0_0.distcp").write_bytes(b"part")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("lightning.pytorch.strategies.model_parallel._distributed_checkpoint_save", fails_after_a_file)
    with pytest.raises(OSError, match="No space left"):
        strategy(True).save_checkpoint(state(2.0), path)
    assert saved(path) == 1.0 and [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_a_directory_that_is_not_a_checkpoint_is_never_replaced(tmp_path: Path) -> None:
    path = tmp_path / "results"
    (path / "notes").mkdir(parents=True)
    for distributed in (True, False):
        with pytest.raises(IsADirectoryError, match="is a directory that is not a checkpoint: not replaced"):
            strategy(distributed).save_checkpoint(state(1.0), path)
    assert [p.name for p in path.iterdir()] == ["notes"] and [p.name for p in tmp_path.iterdir()] == ["results"]


def test_a_leftover_of_a_killed_writer_with_this_pid_is_not_mixed_in(tmp_path: Path) -> None:
    leftover = tmp_path / f".last.ckpt.tmp-{os.getpid()}"
    make(leftover, "directory", "stale")
    strategy(True).save_checkpoint(state(1.0), tmp_path / "last.ckpt")
    written = sorted(p.name for p in (tmp_path / "last.ckpt").iterdir())
    assert written == [".metadata", "__0_0.distcp", "digests.json", "meta.pt"]


def test_a_directory_is_written_with_the_digests_of_its_files_which_loads_check(tmp_path: Path) -> None:
    """``digests.json`` lists every file the save wrote, and ``read_checkpoint`` (the post-hoc command's read) takes
    the directory; a changed shard is refused. Control: Lightning's own strategy writes no digests, and its directory
    is refused as one that cannot be verified."""
    import json

    from lightning.pytorch.strategies import ModelParallelStrategy

    from copy_correct.averages.posthoc_command import read_checkpoint
    from copy_correct.files.shard_digest import verify_directory

    path = tmp_path / "last.ckpt"
    strategy(True).save_checkpoint(state(1.0), path)
    listed = json.loads((path / "digests.json").read_text())["files"]
    assert sorted(listed) == [".metadata", "__0_0.distcp", "meta.pt"]
    assert all(listed[name]["bytes"] == (path / name).stat().st_size for name in listed)
    verify_directory(path)
    assert read_checkpoint(path)["state_dict"]["w"].tolist() == [1.0] * 4
    shard = path / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-8] + bytes(8))
    with pytest.raises(ValueError, match=rf"{shard} is damaged: "):
        read_checkpoint(path)

    theirs = ModelParallelStrategy(save_distributed_checkpoint=True)
    theirs.save_checkpoint(state(1.0), tmp_path / "theirs.ckpt")
    assert not (tmp_path / "theirs.ckpt" / "digests.json").exists()
    with pytest.raises(ValueError, match=r"has no digests\.json .*its shards cannot be verified"):
        read_checkpoint(tmp_path / "theirs.ckpt")
