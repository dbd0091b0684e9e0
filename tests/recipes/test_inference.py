"""``recipes/inference.py``: ``load_image`` makes an image file into the very row a training batch held for it, with
each data module's input format (the pages' blocks that use it: ``test_use_trained_model.py``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from recipes.data.image_folder import ImageFolderDataModule
from recipes.data.pinned_digits import PinnedDigitsDataModule, normalize
from recipes.inference import load_image
from tests.conftest import write_images


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"image_size": 16, "channels": 3}, id="as-trained"),
        pytest.param({"image_size": 16, "channels": 3, "resize": True}, id="resized"),
        pytest.param({"image_size": 16, "channels": 1, "convert": True}, id="to-grey"),
    ],
)
def test_load_image_gives_the_training_batch_row_bit_for_bit(options: dict, tmp_path: Path) -> None:
    root = write_images(tmp_path / "images", 12, size=24, classes=2)
    for file in root.glob("*/*.png"):  # 24x20 files: resizing them scales the shorter side and crops the centre
        with Image.open(file) as image:
            image.crop((0, 0, 24, 20) if options.get("resize") else (0, 0, 16, 16)).save(file)
    datamodule = ImageFolderDataModule(str(root), num_workers=0, val_fraction=0.5, **options)
    (images, _), files = next(iter(datamodule.val_dataloader())), datamodule.val_set.files
    for row, file in zip(images, files, strict=True):
        made = load_image(file, datamodule.input_format)
        assert made.shape == (1, *row.shape) and made.dtype == torch.float32
        assert torch.equal(made[0], row)
    if options.get("resize"):  # Control: the file squeezed to 16x16 (Pillow's resize, no crop) is another row
        with Image.open(files[0]) as image:
            squeezed = torch.from_numpy(np.array(image.resize((16, 16)), dtype=np.uint8)).permute(2, 0, 1)
        assert not torch.equal(squeezed.float().div_(255), images[0])


def test_load_image_applies_the_pinned_digits_normalisation_and_the_digits_flattening(tmp_path: Path) -> None:
    datamodule = PinnedDigitsDataModule(size=16, max_shift=2, num_workers=0)
    pixels, label = datamodule.val_set[0]  # uint8 (1, 16, 16), as the workers make it
    Image.fromarray(pixels[0].numpy()).save(tmp_path / "digit.png")
    expected = normalize((pixels.unsqueeze(0), label))[0]
    assert torch.equal(load_image(tmp_path / "digit.png", datamodule.input_format), expected)
    # Control: the image folder's format (pixels / 255, no normalisation) is not what this network was trained on.
    plain = {**datamodule.input_format, "mean": 0.0, "std": 1.0}
    assert not torch.allclose(load_image(tmp_path / "digit.png", plain), expected)
    flat = {**datamodule.input_format, "flat": True}
    assert load_image(tmp_path / "digit.png", flat).shape == (1, 256)
    with pytest.raises(ValueError, match="input_format lacks mean"):
        load_image(tmp_path / "digit.png", {"image_shape": [1, 16, 16], "std": 1.0, "flat": False})
