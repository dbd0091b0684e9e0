"""``scripts/digits_folder.py``: the digits as a folder of image files that ``data=images`` reads as it is."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from recipes.data.image_folder import ImageFolderDataModule
from scripts.digits_folder import main


def test_a_labelled_folder_has_one_subfolder_per_digit_and_the_data_module_reads_it(tmp_path: Path) -> None:
    assert main([str(tmp_path / "digits"), "--count", "40", "--size", "16"]) == 0
    classes = sorted(p.name for p in (tmp_path / "digits").iterdir())
    assert classes == [str(d) for d in range(10)]
    with Image.open(next((tmp_path / "digits" / "0").iterdir())) as image:
        assert image.size == (16, 16) and image.mode == "RGB"
    data = ImageFolderDataModule(str(tmp_path / "digits"), image_size=16, num_workers=0)
    assert data.num_classes == 10 and len(data.train_set) + len(data.val_set) == 40


def test_unlabelled_and_grey(tmp_path: Path) -> None:
    assert main([str(tmp_path / "grey"), "--count", "5", "--size", "8", "--grey", "--unlabelled"]) == 0
    files = sorted((tmp_path / "grey").iterdir())
    assert len(files) == 5 and all(f.suffix == ".png" for f in files)
    with Image.open(files[0]) as image:
        assert image.size == (8, 8) and image.mode == "L"


@pytest.mark.parametrize("args", [["--size", "4"], ["--count", "0"]])
def test_a_bad_argument_is_one_line_and_exit_2(args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as stopped:
        main([str(tmp_path / "out"), *args])
    assert stopped.value.code == 2 and capsys.readouterr().err.startswith("error: ")
    assert not (tmp_path / "out").exists()


def test_a_folder_that_is_not_empty_is_refused(tmp_path: Path) -> None:
    (tmp_path / "mine.txt").write_text("keep")
    with pytest.raises(SystemExit) as stopped:
        main([str(tmp_path), "--count", "3"])
    assert stopped.value.code == 2 and [p.name for p in tmp_path.iterdir()] == ["mine.txt"]
