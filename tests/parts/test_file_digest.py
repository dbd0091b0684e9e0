"""Damage detected: a file ``atomic_save`` wrote is checked against the CRC-32 of all its bytes sealed into it, one
``torch.save`` wrote (Lightning's writer) against its per-record CRC-32s, a distributed checkpoint's directory
against its ``digests.json``, on every load path (resume's ``check_checkpoint``, ``AtomicCheckpointIO
.load_checkpoint``, ``load_snapshot``/``synthesize``, ``copy-correct posthoc``, ``load_checked``), and refused in one
line naming the file. Controls: the same damaged file loads without a word through ``torch.load`` (64 flipped bytes
in a tensor's record: other numbers), and the cut-short, random, raw-pickle and empty files that the command now
refuses in one line raise, through ``torch.load``, exceptions that are not ``ValueError`` (what the command's
``main`` did not catch: a traceback); a legacy-format file loads, with no digest to check."""

from __future__ import annotations

import os
import pickle
import random
import re
import struct
import threading
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

import copy_correct.files.atomic_save as _atomic_save
import copy_correct.files.digest as _file_digest
from copy_correct.averages.posthoc import load_snapshot, synthesize
from copy_correct.cli import main
from copy_correct.files.atomic_save import atomic_save
from copy_correct.files.checked_load import load_checked, verify_checkpoint
from copy_correct.files.digest import verify_file
from copy_correct.files.shard_digest import verify_directory, write_digests
from copy_correct.lightning import AtomicCheckpointIO, ResumeState, check_checkpoint
from tests.package.test_crafted_files import run_dir

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized")


def record_offset(path: Path, suffix: str) -> tuple[str, int]:
    """The name of the record ending in ``suffix`` and where its bytes start in the file."""
    with zipfile.ZipFile(path) as archive:
        (info,) = [i for i in archive.infolist() if i.filename.endswith(suffix)]
    with open(path, "rb") as file:
        file.seek(info.header_offset)
        header = file.read(30)
    name_length, extra_length = struct.unpack("<HH", header[26:30])
    return info.filename, info.header_offset + 30 + name_length + extra_length


def flip(path: Path, offset: int, count: int = 64) -> None:
    data = bytearray(path.read_bytes())
    for i in range(offset, offset + count):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def checkpoint(path: Path) -> dict:
    state = {
        "state_dict": {"w": torch.linspace(0, 1, 4096), "b": torch.zeros(16)},
        "callbacks": {"ResumeState": ResumeState("alpha", 0).state_dict()},
    }
    atomic_save(state, path)
    return state


def test_64_flipped_bytes_in_a_tensor_record_are_refused_on_every_load_path_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "last.ckpt"
    state = checkpoint(path)  # atomic_save: sealed with the CRC-32 of all its bytes
    verify_file(path)  # whole: taken
    _, offset = record_offset(path, "data/0")
    flip(path, offset + 1000)
    loaded = torch.load(path, weights_only=True)  # the control: torch.load takes it, silently, with other numbers
    assert not torch.equal(loaded["state_dict"]["w"], state["state_dict"]["w"])
    loaded = TorchCheckpointIO().load_checkpoint(path, weights_only=True)  # and so does Lightning's own plugin
    assert not torch.equal(loaded["state_dict"]["w"], state["state_dict"]["w"])

    says = re.compile(rf"{re.escape(str(path))} is damaged: its bytes have CRC-32 [0-9a-f]{{8}}, written with "
                      r"[0-9a-f]{8} \(a changed byte\)")  # fmt: skip
    for load in (
        lambda: verify_file(path),
        lambda: load_checked(path),
        lambda: verify_checkpoint(path),
        lambda: check_checkpoint(path, "alpha", 0),
        lambda: AtomicCheckpointIO().load_checkpoint(path, weights_only=True),
    ):
        with pytest.raises(ValueError) as refused:
            load()
        assert says.fullmatch(str(refused.value)), refused.value

    run = run_dir(tmp_path)
    status = main(["posthoc", str(run), "--sigma-rel", "0.08", "--checkpoint", str(path)])
    err = capsys.readouterr().err
    assert status == 2 and err.startswith("copy-correct posthoc: error: ") and err.count("\n") == 1
    assert says.fullmatch(err.removeprefix("copy-correct posthoc: error: ").strip()), err


def test_a_file_torch_save_wrote_is_checked_record_by_record_naming_the_record(tmp_path: Path) -> None:
    path = tmp_path / "theirs.ckpt"
    torch.save({"state_dict": {"w": torch.linspace(0, 1, 4096)}}, path)  # torch.save's own CRC-32 per record
    verify_file(path)
    record, offset = record_offset(path, "data/0")
    flip(path, offset + 1000)
    assert not torch.equal(torch.load(path, weights_only=True)["state_dict"]["w"], torch.linspace(0, 1, 4096))
    with pytest.raises(ValueError) as refused:
        verify_file(path)
    assert re.fullmatch(rf"{path} is damaged: record '{record}' has CRC-32 [0-9a-f]{{8}}, written as [0-9a-f]{{8}}",
                        str(refused.value))  # fmt: skip


@pytest.mark.parametrize("writer", ["torch.save", "atomic_save"])
@pytest.mark.parametrize(
    "nbytes", [4 * _file_digest._CHUNK + 4096, _file_digest._SLICE + 2**20], ids=["read in chunks", "mapped"]
)
def test_a_record_damaged_past_its_first_chunk_or_slice_is_refused(writer: str, nbytes: int, tmp_path: Path) -> None:
    """Every byte of a large record is checked, not its first MiB, chunk or slice: the damage is in its last bytes,
    more than a chunk (``_CHUNK``, read into a buffer below ``_MAPPED`` bytes) or a slice (``_SLICE``, of a memory map
    from ``_MAPPED``) into it."""
    path = tmp_path / "large.ckpt"
    state = {"w": torch.arange(nbytes // 4, dtype=torch.float32), "b": torch.ones(3)}
    (torch.save if writer == "torch.save" else atomic_save)(state, path)
    record, offset = record_offset(path, "data/0")
    verify_file(path)
    flip(path, offset + state["w"].nbytes - 8, 8)
    assert not torch.equal(torch.load(path, weights_only=True)["w"], state["w"])  # the control: it loads, other numbers
    says = f"record '{record}' has CRC-32" if writer == "torch.save" else "its bytes have CRC-32"
    with pytest.raises(ValueError, match=f"{path} is damaged: {says}"):
        verify_file(path)


def test_a_damaged_snapshot_is_refused_by_load_snapshot_synthesize_and_the_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = run_dir(tmp_path)
    last = sorted((run / "checkpoints" / "power_ema").glob("*.pt"))[-1]
    before = synthesize(run, 0.08)
    _, offset = record_offset(last, "data/0")
    flip(last, offset, 8)
    after = synthesize([torch.load(p, mmap=True, weights_only=True) for p in sorted(last.parent.glob("*.pt"))], 0.08)
    assert not all(torch.equal(before[k], after[k]) for k in before)  # the control: the damage changes the average
    for load in (lambda: load_snapshot(last), lambda: synthesize(run, 0.08)):
        with pytest.raises(ValueError, match=f"{last} is damaged: its bytes have CRC-32"):
            load()
    status = main(["posthoc", str(run), "--sigma-rel", "0.08"])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and f"error: {last} is damaged" in err


@pytest.mark.parametrize("kind", ["truncated", "random", "raw pickle", "legacy torch.save", "empty", "text"])
def test_files_that_are_not_whole_archives_get_the_same_one_line_refusal_from_the_command(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = run_dir(tmp_path)
    path = tmp_path / f"{kind}.ckpt"
    whole = (run / "checkpoints" / "last.ckpt").read_bytes()
    if kind == "truncated":
        path.write_bytes(whole[: len(whole) // 2])
    elif kind == "random":
        path.write_bytes(random.Random(0).randbytes(len(whole)))
    elif kind == "raw pickle":
        path.write_bytes(pickle.dumps({"state_dict": {}}))
    elif kind == "legacy torch.save":
        torch.save({"state_dict": {}}, path, _use_new_zipfile_serialization=False)
    elif kind == "empty":
        path.touch()
    else:
        path.write_text("not a checkpoint\n")
    if kind == "legacy torch.save":
        torch.load(path, weights_only=True)  # the control: it loads, and carries no digest to check it against
    else:
        with pytest.raises(Exception) as control:  # the control: torch.load's own failure, which main did not catch
            torch.load(path, weights_only=True)
        assert not isinstance(control.value, ValueError)
    status = main(["posthoc", str(run), "--sigma-rel", "0.08", "--checkpoint", str(path)])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1, err
    assert err.startswith(f"copy-correct posthoc: error: {path} is ")
    assert ("empty (0 bytes)" if kind == "empty" else "is not the zip archive torch.save writes") in err


def test_a_file_written_without_digests_is_refused_and_atomic_save_always_writes_them(tmp_path: Path) -> None:
    from torch.utils.serialization import config

    before = config.save.compute_crc32
    try:
        config.save.compute_crc32 = False
        torch.save({"w": torch.ones(8)}, tmp_path / "plain.pt")  # the control: every CRC-32 stored as 0
        atomic_save({"w": torch.ones(8)}, tmp_path / "atomic.pt")
        assert config.save.compute_crc32 is False  # the setting restored
    finally:
        config.save.compute_crc32 = before
    with pytest.raises(ValueError, match=r"plain\.pt carries no CRC-32 digests"):
        verify_file(tmp_path / "plain.pt")
    assert all(i.CRC == 0 for i in zipfile.ZipFile(tmp_path / "plain.pt").infolist())
    verify_file(tmp_path / "atomic.pt")


def test_a_distributed_checkpoint_is_checked_file_by_file_against_its_digests(tmp_path: Path) -> None:
    directory = tmp_path / "last.ckpt"
    weights = {"state_dict": {"w": torch.linspace(0, 1, 1024)}}
    dcp.save(weights, checkpoint_id=directory, no_dist=True)
    torch.save({"callbacks": {"ResumeState": ResumeState("alpha", 0).state_dict()}}, directory / "meta.pt")
    write_digests(directory)
    verify_directory(directory)
    check_checkpoint(directory, "alpha", 0)
    (shard,) = directory.glob("*.distcp")
    middle = shard.stat().st_size // 2  # inside the tensor's bytes
    flip(shard, middle, 64)
    read = {"state_dict": {"w": torch.zeros(1024)}}
    dcp.load(read, checkpoint_id=directory, no_dist=True)  # the control: torch.distributed.checkpoint takes it
    assert not torch.equal(read["state_dict"]["w"], weights["state_dict"]["w"])
    for load in (
        lambda: verify_directory(directory),
        lambda: verify_checkpoint(directory),
        lambda: check_checkpoint(directory, "alpha", 0),
    ):
        with pytest.raises(ValueError, match=rf"{shard} is damaged: [\d,]+ bytes of CRC-32 [0-9a-f]{{8}}, written as"):
            load()
    flip(shard, middle, 64)  # flipped back: whole again
    verify_directory(directory)
    (directory / "__9_0.distcp").write_bytes(b"stray")
    with pytest.raises(ValueError, match=r"__9_0\.distcp is not listed in .*digests\.json"):
        verify_directory(directory)
    (directory / "__9_0.distcp").unlink()
    shard.unlink()
    with pytest.raises(ValueError, match=rf"{shard} is missing: .*digests\.json lists it"):
        verify_directory(directory)


@pytest.mark.parametrize("size", [2**12, 2**23], ids=["small", "32 MiB: fsync beside the digest"])
def test_the_seal_is_the_crc_of_the_bytes_torch_save_wrote_whichever_crc32_computes_it(
    size: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fsyncs: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (fsyncs.append(threading.get_ident()), real_fsync(fd))[1])
    path = tmp_path / "last.ckpt"
    atomic_save({"w": torch.randn(size), "b": torch.zeros(4)}, path)
    with zipfile.ZipFile(path) as archive:
        comment, records = archive.comment.split(), archive.infolist()
    written, sealed = int(comment[3]), int(comment[2], 16)
    data = path.read_bytes()
    assert comment[:2] == [b"copy-correct", b"crc32"] and len(data) == written + len(archive.comment)
    assert zlib.crc32(data[: written - 2] + b"\0\0") == sealed  # the CRC-32 of what torch.save wrote
    assert all(r.CRC == 0 for r in records)  # torch.save's own per-record pass was off: no second digest
    main_thread = threading.get_ident()
    large = size * 4 >= _atomic_save._OVERLAP
    assert [t == main_thread for t in fsyncs] == ([False, True, True] if large else [True, True])  # file, file, dir
    monkeypatch.setattr(_file_digest, "crc32", zlib.crc32)  # zlib's CRC-32 (no fast-digest extra): the same digest
    verify_file(path)
    torch.save({"w": torch.ones(2)}, tmp_path / "plain.pt")  # the control: torch.save alone stores them, unsealed
    with zipfile.ZipFile(tmp_path / "plain.pt") as archive:
        assert archive.comment == b"" and all(r.CRC != 0 for r in archive.infolist() if r.file_size)


def test_a_missing_file_is_a_file_not_found_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "gone.ckpt"
    with pytest.raises(FileNotFoundError) as missing:
        verify_file(path)
    assert isinstance(missing.value, ValueError) and str(missing.value) == f"{path} does not exist"
