"""``data=images``: a folder of image files, labelled by subfolder or not, decoded in DataLoader workers into uint8,
made float on the device by the prefetcher's transform; the images' size and channels taken from the files' headers
(no pixel decoded) unless the config sets them; every problem with the folder is one line naming the key or the file
(and, for a folder of mixed shapes, the override that fits it), found when the data module is made (before training),
or, for a file that breaks later, where a worker reads it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from copy_correct import DeviceDataLoader
from recipes.data.image_folder import ImageFiles, ImageFolderDataModule, scan_folder, to_unit_float
from recipes.launch import BadInput
from tests.conftest import DEVICES, write_images


@pytest.fixture(scope="module")
def labelled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_images(tmp_path_factory.mktemp("labelled"), 30, size=16, classes=3)


@pytest.fixture(scope="module")
def unlabelled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_images(tmp_path_factory.mktemp("unlabelled"), 20, size=16)


def test_subfolders_are_classes_and_loose_images_are_unlabelled(labelled: Path, unlabelled: Path) -> None:
    files, labels, classes = scan_folder(labelled)
    assert classes == ["class0", "class1", "class2"] and len(files) == 30
    assert labels is not None and all(f.parent.name == classes[label] for f, label in zip(files, labels, strict=True))
    files, labels, classes = scan_folder(unlabelled)
    assert labels is None and classes == [] and len(files) == 20
    data = ImageFolderDataModule(str(labelled), image_size=16, num_workers=0)
    assert data.num_classes == 3 and data.image_shape == (3, 16, 16)
    assert ImageFolderDataModule(str(unlabelled), image_size=16, num_workers=0).num_classes is None


def test_the_split_is_seeded_disjoint_and_holds_every_class(labelled: Path) -> None:
    data = ImageFolderDataModule(str(labelled), image_size=16, val_fraction=0.2, num_workers=0, seed=3)
    again = ImageFolderDataModule(str(labelled), image_size=16, val_fraction=0.2, num_workers=0, seed=3)
    other = ImageFolderDataModule(str(labelled), image_size=16, val_fraction=0.2, num_workers=0, seed=4)
    assert data.val_set.files == again.val_set.files and data.val_set.files != other.val_set.files
    assert not set(data.train_set.files) & set(data.val_set.files)
    assert len(data.train_set) + len(data.val_set) == 30
    assert data.val_set.labels is not None and sorted(set(data.val_set.labels)) == [0, 1, 2]


def test_workers_decode_uint8_and_the_prefetchers_transform_makes_new_float_tensors(labelled: Path) -> None:
    data = ImageFolderDataModule(str(labelled), image_size=16, batch_size=8, num_workers=2)
    loader = data.train_dataloader()
    assert isinstance(loader, DeviceDataLoader) and loader.num_workers == 2 and loader.transform is to_unit_float
    assert not loader.pin_memory  # no accelerator receives these batches: pinning would buy nothing
    images, labels = next(iter(loader))
    assert images.dtype == torch.float32 and images.shape == (8, 3, 16, 16) and labels.dtype == torch.int64
    assert images.min() >= 0.0 and images.max() <= 1.0
    raw = torch.stack([data.train_set[i][0] for i in range(8)])
    assert raw.dtype == torch.uint8  # what crosses the bus (a quarter of float32's bytes)
    before = raw.clone()
    made = to_unit_float((raw, labels))[0]
    assert made.untyped_storage().data_ptr() != raw.untyped_storage().data_ptr() and torch.equal(raw, before)
    torch.testing.assert_close(made, raw.float() / 255)


@pytest.mark.parametrize("device", DEVICES)
def test_batches_arrive_on_the_device_pinned_on_the_way(labelled: Path, device: str) -> None:
    data = ImageFolderDataModule(str(labelled), image_size=16, batch_size=8, num_workers=0)
    data.trainer = type("T", (), {"strategy": type("S", (), {"root_device": torch.device(device)})()})()
    loader = data.train_dataloader()
    assert loader.pin_memory == (device != "cpu")
    images, _ = next(iter(loader))
    assert images.device.type == device and images.dtype == torch.float32


def test_a_resumed_module_shuffles_as_the_uninterrupted_one(labelled: Path) -> None:
    first = ImageFolderDataModule(str(labelled), image_size=16, batch_size=4, num_workers=0)
    next(iter(first.train_dataloader()))  # one epoch's order drawn
    state = first.state_dict()
    resumed = ImageFolderDataModule(str(labelled), image_size=16, batch_size=4, num_workers=0)
    resumed.load_state_dict(state)
    control = ImageFolderDataModule(str(labelled), image_size=16, batch_size=4, num_workers=0)
    expected = next(iter(first.train_dataloader()))[1]
    assert torch.equal(next(iter(resumed.train_dataloader()))[1], expected)
    assert not torch.equal(next(iter(control.train_dataloader()))[1], expected)  # without the state: epoch 1's order


def test_eval_images_are_the_first_of_the_split_in_unit_range(unlabelled: Path) -> None:
    data = ImageFolderDataModule(str(unlabelled), image_size=16, num_workers=0)
    images, labels = data.eval_images("train", 5)
    assert labels is None and images.shape == (5, 3, 16, 16) and images.dtype == torch.float32
    torch.testing.assert_close(images[0], data.train_set[0][0].float() / 255)


def test_resize_and_convert_fit_other_images_when_the_config_says_so(tmp_path: Path) -> None:
    Image.fromarray(np.full((20, 30, 4), 200, np.uint8), "RGBA").save(tmp_path / "wide.png")
    Image.fromarray(np.full((16, 16), 90, np.uint8), "L").save(tmp_path / "grey.png")
    data = ImageFolderDataModule(str(tmp_path), image_size=16, channels=3, num_workers=0, resize=True, convert=True)
    images = [data.train_set[i][0] for i in range(len(data.train_set))] + [data.val_set[0][0]]
    assert all(image.shape == (3, 16, 16) and image.dtype == torch.uint8 for image in images)


def _broken(folder: Path) -> Path:
    write_images(folder, 4)
    (folder / "0002.png").write_bytes(b"\x89PNG not really")
    return folder / "0002.png"


def _truncated(folder: Path) -> Path:
    write_images(folder, 4, size=64)
    path = folder / "0001.png"
    path.write_bytes(path.read_bytes()[:200])  # a valid header, the pixels cut short
    return path


def _mixed_sizes(folder: Path) -> Path:
    write_images(folder, 4)
    Image.fromarray(np.zeros((32, 16, 3), np.uint8)).save(folder / "tall.png")
    return folder / "tall.png"


def _mixed_modes(folder: Path) -> Path:
    write_images(folder, 4)
    Image.fromarray(np.zeros((16, 16), np.uint8)).save(folder / "grey.png")
    return folder / "grey.png"


def _both(folder: Path) -> Path:
    write_images(folder / "cats", 3)
    write_images(folder, 2)
    return folder


def _empty(folder: Path) -> Path:
    (folder / "notes.txt").write_text("no images here")
    return folder


def _one_image(folder: Path) -> Path:
    write_images(folder, 1)
    return folder


def _empty_class(folder: Path) -> Path:
    write_images(folder / "cats", 3)
    (folder / "dogs").mkdir()
    (folder / "dogs" / "notes.txt").write_text("the dog pictures are still on my phone")
    return folder


BAD_FOLDERS = [
    ("undecodable file", _broken, "does not decode as an image", {}),
    ("truncated file", _truncated, "does not decode as an image", {"image_size": 64}),
    ("mixed sizes", _mixed_sizes, "is 16x32 and data.image_size=16 wants 16x16", {}),
    ("mixed modes", _mixed_modes, "is a L image and data.channels=3 wants RGB", {"channels": 3}),
    ("images beside class folders", _both, "holds both images (0000.png, ...) and class subfolders (cats", {}),
    ("no images", _empty, "holds no images (.png, .jpg", {}),
    ("one image", _one_image, "holds 1 image(s): too few to leave any for validation", {}),
    ("an empty class folder", _empty_class, "has class folders (cats, ...), and 'dogs' holds no images", {}),
]


@pytest.mark.parametrize(("make", "phrase", "options"), [pytest.param(*case[1:], id=case[0]) for case in BAD_FOLDERS])
def test_a_bad_folder_is_one_line_naming_the_file_or_key(
    make: Callable[[Path], Path], phrase: str, options: dict, tmp_path: Path
) -> None:
    named = make(tmp_path)
    with pytest.raises(ValueError) as refused:
        ImageFolderDataModule(str(tmp_path), **{"image_size": 16, "num_workers": 0, **options})
    message = str(refused.value)
    assert phrase in message and str(named) in message and "\n" not in message, message


def _all_wide(folder: Path) -> Path:
    for i in range(4):
        Image.fromarray(np.zeros((16, 24, 3), np.uint8)).save(folder / f"{i:04d}.png")
    return folder / "0000.png"


def _all_rgba(folder: Path) -> Path:
    for i in range(4):
        Image.fromarray(np.zeros((16, 16, 4), np.uint8), "RGBA").save(folder / f"{i:04d}.png")
    return folder / "0000.png"


def _all_grey(folder: Path) -> Path:
    write_images(folder, 4, channels=1)
    return folder / "0000.png"


# (id, folder, options, phrases of the one line, the override it names, the shape that override then gives)
MIXED_FOLDERS = [
    ("sizes from mixed files", _mixed_sizes, {}, ["tall.png is 16x32, but 4 of the 5 files are 16x16"],
     {"image_size": 16, "resize": True}, (3, 16, 16)),
    ("channels from mixed files", _mixed_modes, {}, ["grey.png is a L image, but 4 of the 5 files are RGB"],
     {"channels": 3, "convert": True}, (3, 16, 16)),
    ("sizes from files that are not square", _all_wide, {}, ["0000.png is 24x16, as are all 4 files"],
     {"image_size": 16, "resize": True}, (3, 16, 16)),
    ("channels from RGBA files", _all_rgba, {}, ["0000.png is a RGBA image, as are all 4 files"],
     {"channels": 3, "convert": True}, (3, 16, 16)),
    ("a size the files do not have", _all_grey, {"image_size": 32}, [
        "0000.png is 16x16 and data.image_size=32 wants 32x32", "data.resize=true to scale the shorter side to 32",
    ], {"image_size": 16}, (1, 16, 16)),
    ("channels the files do not have", _all_grey, {"channels": 3}, [
        "0000.png is a L image and data.channels=3 wants RGB", "data.convert=true to convert them as they load",
    ], {"channels": 1}, (1, 16, 16)),
]  # fmt: skip


def _setting(override: dict) -> str:
    return " ".join(f"data.{key}={str(value).lower()}" for key, value in override.items())


@pytest.mark.parametrize(
    ("make", "options", "phrases", "override", "shape"), [pytest.param(*case[1:], id=case[0]) for case in MIXED_FOLDERS]
)
def test_a_folder_of_other_shapes_names_a_file_and_an_override_that_then_fits_it(
    make: Callable[[Path], Path], options: dict, phrases: list[str], override: dict, shape: tuple, tmp_path: Path
) -> None:
    """No refusal names an override that is itself refused: the data module made with the one it names takes the
    folder, in the shape it says."""
    make(tmp_path)
    with pytest.raises(BadInput) as refused:
        ImageFolderDataModule(str(tmp_path), num_workers=0, **options)
    message = str(refused.value)
    assert all(phrase in message for phrase in phrases) and "\n" not in message, message
    assert f"set {_setting(override)}" in message, message
    fitted = ImageFolderDataModule(str(tmp_path), num_workers=0, **{**options, **override})
    assert fitted.image_shape == shape and fitted.val_set[0][0].shape == shape


@pytest.mark.parametrize(("size", "channels"), [(32, 1), (48, 3)])
def test_a_uniform_folder_gives_its_size_and_channels(size: int, channels: int, tmp_path: Path) -> None:
    root = write_images(tmp_path, 8, size=size, channels=channels, classes=2)
    data = ImageFolderDataModule(str(root), batch_size=4, num_workers=0)
    assert data.image_shape == (channels, size, size)
    images, labels = next(iter(data.train_dataloader()))
    assert images.shape == (4, channels, size, size) and labels.shape == (4,)
    other = 3 if channels == 1 else 1  # the control: a value the config sets wins, converted as the key says
    converted = ImageFolderDataModule(str(root), channels=other, convert=True, num_workers=0)
    assert converted.image_shape == (other, size, size) and converted.val_set[0][0].shape == (other, size, size)


def test_reading_the_shape_decodes_no_pixels(labelled: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each file's size and mode come from its header: Pillow opens lazily, and ``load`` (the decoding) is called
    for no file without ``data.verify``; the control, with it, decodes every file once."""
    from PIL import ImageFile

    loaded, load = [], ImageFile.ImageFile.load
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda image: loaded.append(image.filename) or load(image))
    assert ImageFolderDataModule(str(labelled), num_workers=0, verify=False).image_shape == (3, 16, 16)
    assert loaded == []
    ImageFolderDataModule(str(labelled), num_workers=0)
    assert sorted(loaded) == sorted(str(f) for f in scan_folder(labelled)[0])


class _Refuses(torch.utils.data.Dataset):
    def __init__(self, error: type[ValueError]) -> None:
        self.error = error

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> torch.Tensor:
        raise self.error("/data/0003.png does not decode as an image")


def test_a_file_that_breaks_in_a_worker_is_one_line_naming_it(tmp_path: Path) -> None:
    """``data.verify=false``: the broken file is found by the DataLoader worker that reads it, which raises
    ``BadInput``; the DataLoader re-raises it in the main process, still one line naming the file. The control: a
    ``ValueError`` raised in a worker comes back carrying the worker's whole traceback."""
    path = _truncated(tmp_path)
    data = ImageFolderDataModule(str(tmp_path), num_workers=2, verify=False, val_fraction=0.25, batch_size=2)
    with pytest.raises(BadInput) as refused:
        for loader in (data.train_dataloader(), data.val_dataloader()):
            list(loader)
    message = str(refused.value)
    assert message.startswith(f"{path} does not decode as an image: ") and "\n" not in message, message
    for error in (ValueError, BadInput):
        with pytest.raises(error) as raised:
            next(iter(torch.utils.data.DataLoader(_Refuses(error), num_workers=1)))
        lines = str(raised.value).splitlines()
        assert lines == ["/data/0003.png does not decode as an image"] if error is BadInput else len(lines) > 3, lines


def test_missing_root_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"data.root '.*nowhere' is not a folder"):
        ImageFolderDataModule(str(tmp_path / "nowhere"))


def test_a_truncated_file_passes_the_header_check_and_fails_in_the_worker_named(tmp_path: Path) -> None:
    """The control for ``verify``: without the decoding pass the size and mode check passes, and the broken file is
    found only when a worker decodes it, still named."""
    path = _truncated(tmp_path)
    data = ImageFolderDataModule(str(tmp_path), image_size=64, num_workers=0, verify=False, val_fraction=0.25)
    dataset = data.train_set if str(path) in data.train_set.files else data.val_set
    with pytest.raises(ValueError, match=f"{path} does not decode as an image"):
        dataset[dataset.files.index(str(path))]


def test_images_of_files_keep_their_labels(labelled: Path) -> None:
    files, labels, _ = scan_folder(labelled)
    dataset = ImageFiles(files, labels, image_size=16, channels=3)
    image, label = dataset[4]
    assert image.shape == (3, 16, 16) and int(label) == labels[4]
