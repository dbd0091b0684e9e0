"""A path handed over to be loaded where nothing is: ``MissingFile``, a ``FileNotFoundError`` (``errno`` ENOENT,
``filename`` the path) that is also a ``DamagedFile``, from every entry point that takes a user's path
(``load_checked``, ``verify_checkpoint``, ``load_snapshot``, ``synthesize``, the command's ``read_checkpoint``, a
distributed checkpoint's ``verify_directory``), in one line naming it. The control: the ``DamagedFile`` these raised
before for a missing file, which an ``except FileNotFoundError`` let through."""

from __future__ import annotations

import errno
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from copy_correct import DamagedFile, MissingFile, load_checked, synthesize, verify_checkpoint
from copy_correct.averages.posthoc import load_snapshot
from copy_correct.averages.posthoc_command import read_checkpoint
from copy_correct.files.shard_digest import verify_directory

LOADERS: dict[str, Callable[[Path], Any]] = {
    "load_checked": load_checked,
    "verify_checkpoint": verify_checkpoint,
    "load_snapshot": load_snapshot,
    "synthesize": lambda path: synthesize([path], 0.08),
    "read_checkpoint": read_checkpoint,
    "verify_directory": verify_directory,
}


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("kind", ["no file", "a broken link"])
def test_a_missing_path_is_a_file_not_found_error_naming_it_and_still_a_damaged_file(
    loader: str, kind: str, tmp_path: Path
) -> None:
    path = tmp_path / "run" / "checkpoints" / "epoch=3-step=20.ckpt"
    if kind == "a broken link":
        path.parent.mkdir(parents=True)
        path.symlink_to(tmp_path / "gone.ckpt")
    with pytest.raises(FileNotFoundError) as raised:  # as ``except FileNotFoundError`` catches
        LOADERS[loader](path)
    caught = raised.value
    assert isinstance(caught, MissingFile) and isinstance(caught, DamagedFile) and isinstance(caught, ValueError)
    assert (caught.errno, caught.filename, str(caught)) == (errno.ENOENT, str(path), f"{path} does not exist")
    copied = pickle.loads(pickle.dumps(caught))  # as it crosses processes (a worker's error, DDP)
    assert type(copied) is MissingFile and str(copied) == str(caught)


def test_a_file_that_is_there_loads_as_before(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(2)}, tmp_path / "there.pt")
    assert torch.equal(load_checked(tmp_path / "there.pt")["w"], torch.ones(2))
    verify_checkpoint(tmp_path / "there.pt")


def test_control_the_old_refusal_of_a_missing_file_escapes_except_file_not_found_error(tmp_path: Path) -> None:
    path = tmp_path / "epoch=3-step=20.ckpt"
    old = DamagedFile(f"{path} cannot be read: No such file or directory")  # what a missing file raised before
    with pytest.raises(DamagedFile):
        try:
            raise old
        except FileNotFoundError:  # a user's handler for a missing file: it misses this one
            pytest.fail("caught")
