"""Your own images, from a folder (``data=images data.root=DIR``): decoded by Pillow in DataLoader workers into
``uint8``, pinned, and moved to the device by ``DevicePrefetcher``.

Layout (``torchvision.datasets.ImageFolder``'s)::

    DIR/cat/0001.png  DIR/dog/0001.jpg ...   labelled: one subfolder per class, classes in sorted name order
    DIR/0001.png DIR/0002.png ...            unlabelled: the images directly in DIR

Copy contract:
  * The data module holds file paths and labels only; files are opened read-only and never written.
  * A worker decodes each file into a new ``uint8`` tensor ``(C, H, W)`` (a quarter of float32's bytes), and the
    DataLoader's collation stacks a batch into one new tensor, in the worker. The loader's pin thread copies it into
    pinned memory when an accelerator receives it (not on a CPU-only machine: pinning would buy nothing).
  * ``DevicePrefetcher`` copies the pinned batch to the device once, on a side stream, overlapping the step before;
    the transform there makes a new float32 tensor in [0, 1]. On a CPU nothing is copied and the transform alone
    makes the float tensor. Autograd sees none of it: batches carry no graph.

Image size and channels: ``data.image_size`` and ``data.channels`` left ``null`` (the default) take them from the
files, when every file has one square size and every file is grey (``L``: 1 channel) or every file ``RGB`` (3). Set,
they are what every file must be, or is made by ``data.resize`` / ``data.convert`` as it loads.

Checked when the data module is made, before any training (``ValueError`` naming the key or the file, one line): the
folder exists and holds images, with no empty class folder; every file's size and mode (read from its header, one
lazy ``Image.open`` per file, no pixels decoded) give one shape, or fit the one configured; and, with ``data.verify``
(the default), every file decodes. A file that does not decode when a worker reads it (``data.verify=false``) raises
``recipes.launch.BadInput`` naming it, which ``train.py`` prints as one line.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import lightning.pytorch as pl
import numpy as np
import torch
from PIL import Image, ImageMode, UnidentifiedImageError
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from copy_correct import make_loader
from recipes.launch import BadInput

__all__ = ["IMAGE_EXTENSIONS", "ImageFiles", "ImageFolderDataModule", "scan_folder", "to_unit_float"]

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
MODES = {1: "L", 3: "RGB"}
CHANNELS = {mode: channels for channels, mode in MODES.items()}
Batch = tuple[torch.Tensor, ...]
Header = tuple[tuple[int, int], str]  # a file's (width, height) and Pillow mode
T = TypeVar("T")


def scan_folder(root: Path) -> tuple[list[Path], list[int] | None, list[str]]:
    """The image files under ``root`` in sorted order, their class indices (``None`` when unlabelled) and the class
    names; ``ValueError`` for a missing or empty folder, or one that mixes loose images with class subfolders."""
    if not root.is_dir():
        raise ValueError(f"data.root {str(root)!r} is not a folder: point it at a folder of images")

    def images_in(folder: Path, recursive: bool) -> list[Path]:
        found = folder.rglob("*") if recursive else folder.iterdir()
        return sorted(
            p for p in found if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file() and not p.name.startswith(".")
        )

    loose = images_in(root, recursive=False)
    folders = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    classes = [name for name in folders if images_in(root / name, recursive=True)]
    if classes and not loose and classes != folders:
        empty = next(name for name in folders if name not in classes)
        raise ValueError(
            f"data.root {str(root)!r} has class folders ({', '.join(classes[:3])}, ...), and {empty!r} holds no images "
            f"({', '.join(IMAGE_EXTENSIONS)}): put that class's images in it, or move it out of data.root"
        )
    if loose and classes:
        raise ValueError(
            f"data.root {str(root)!r} holds both images ({loose[0].name}, ...) and class subfolders "
            f"({', '.join(classes[:3])}, ...): put every image in a class subfolder, or none"
        )
    if loose:
        return loose, None, []
    files, labels = [], []
    for index, name in enumerate(classes):
        in_class = images_in(root / name, recursive=True)
        files += in_class
        labels += [index] * len(in_class)
    if not files:
        raise ValueError(
            f"data.root {str(root)!r} holds no images ({', '.join(IMAGE_EXTENSIONS)}): put them in it, "
            "or in one subfolder per class"
        )
    return files, labels, classes


class ImageFiles(Dataset):
    """Image files decoded on access into ``uint8`` tensors of shape ``(channels, image_size, image_size)``, with
    their labels when there are any: items are ``(image, label)`` or ``(image,)``."""

    def __init__(
        self,
        files: list[Path],
        labels: list[int] | None,
        image_size: int,
        channels: int,
        resize: bool = False,
        convert: bool = False,
    ) -> None:
        self.files, self.labels = [str(f) for f in files], labels
        self.image_size, self.channels, self.resize, self.convert = image_size, channels, resize, convert

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> Batch:
        image = torch.from_numpy(self.decode(self.files[index]))  # shares the decoded array: no copy
        image = image.unsqueeze(0) if image.ndim == 2 else image.permute(2, 0, 1)
        if self.labels is None:
            return (image,)
        return image, torch.tensor(self.labels[index])

    def check(self, path: str, header: Header, every_size: int | None = None, every_mode: str | None = None) -> None:
        """``BadInput`` naming ``path`` when its size or mode (``header``) does not fit and the config does not say to
        fit it. ``every_size`` / ``every_mode``: the one square side / mode that every file of the folder has, if they
        have one, which the line then offers as the value to set."""
        (width, height), mode = header
        wanted = MODES[self.channels]
        if mode != wanted and not self.convert:
            same = f"data.channels={CHANNELS[every_mode]} (every file's mode), or " if every_mode in CHANNELS else ""
            raise BadInput(
                f"{path} is a {mode} image and data.channels={self.channels} wants {wanted}: set {same}"
                "data.convert=true to convert them as they load"
            )
        side = self.image_size
        if (width, height) != (side, side) and not self.resize:
            same = f"data.image_size={every_size} (every file's size), or " if every_size else ""
            raise BadInput(
                f"{path} is {width}x{height} and data.image_size={side} wants {side}x{side}: set {same}"
                f"data.resize=true to scale the shorter side to {side} and crop the centre as they load"
            )

    def decode(self, path: str) -> np.ndarray:
        """The file's pixels as a new ``(H, W)`` or ``(H, W, C)`` ``uint8`` array, fitted to the config."""
        with _opened(path) as image:
            self.check(path, (image.size, image.mode))
            image = image.convert(MODES[self.channels])  # a copy even when the mode is already right
            if image.size != (self.image_size, self.image_size):
                image = _fit(image, self.image_size)
            return np.array(image, dtype=np.uint8)


@contextmanager
def _opened(path: str) -> Iterator[Image.Image]:
    """``Image.open(path)``; what Pillow raises for a file it cannot read (on opening it, or decoding its pixels in
    the ``with`` block) becomes one ``BadInput`` naming it."""
    try:
        with Image.open(path) as image:
            yield image
    except (OSError, UnidentifiedImageError, SyntaxError) as err:
        raise BadInput(f"{path} does not decode as an image: {' '.join(str(err).split())}") from None


def _fit(image: Image.Image, size: int) -> Image.Image:
    """Scale the shorter side to ``size`` (antialiased) and crop the centre square."""
    width, height = image.size
    scale = size / min(width, height)
    image = image.resize((max(size, round(width * scale)), max(size, round(height * scale))), Image.BICUBIC)
    left, top = (image.width - size) // 2, (image.height - size) // 2
    return image.crop((left, top, left + size, top + size))


def to_unit_float(batch: Batch) -> Batch:
    """``uint8`` images to float32 in [0, 1], on whatever device they are: a new tensor, the input untouched."""
    return (batch[0].float().div_(255.0), *batch[1:])


class ImageFolderDataModule(pl.LightningDataModule):
    """Train and validation loaders over ``root``'s images (see the module docstring for the layout).

    ``image_size`` and ``channels`` ``None``: the files' own (``image_shape`` then says what they were). The split is
    seeded and, for labelled folders, stratified (each class in both splits as far as its count allows). The training
    order is drawn from one generator whose state is the module's ``state_dict``, so a resumed run shuffles as the
    uninterrupted one would. ``prefetch=false`` leaves the copy to Lightning (on the compute stream); the transform then
    runs in ``on_after_batch_transfer``.
    """

    def __init__(
        self,
        root: str,
        image_size: int | None = None,
        channels: int | None = None,
        batch_size: int = 64,
        val_fraction: float = 0.1,
        seed: int = 0,
        num_workers: int = 2,
        resize: bool = False,
        convert: bool = False,
        verify: bool = True,
        prefetch: bool = True,
    ) -> None:
        super().__init__()
        bounds = (("image_size", image_size, 1), ("batch_size", batch_size, 1), ("num_workers", num_workers, 0))
        for name, value, low in bounds:
            if value is not None and value < low:
                raise ValueError(f"data.{name} must be >= {low}, got {value}")
        if channels is not None and channels not in MODES:
            raise ValueError(f"data.channels must be 1 (grey), 3 (RGB) or null (from the files), got {channels}")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be in (0, 1), got {val_fraction}")
        self.root = Path(str(root)).expanduser()
        self.batch_size, self.num_workers, self.prefetch = batch_size, num_workers, prefetch
        files, labels, self.classes = scan_folder(self.root)
        self.num_classes = len(self.classes) or None
        headers = _read_headers([str(f) for f in files], decode=verify)
        image_size, channels = _shape_of_files([str(f) for f in files], headers, image_size, channels, resize, convert)
        self.image_shape = (channels, image_size, image_size)
        options = {"image_size": image_size, "channels": channels, "resize": resize, "convert": convert}
        _check_files(ImageFiles(files, labels, **options), headers)
        train, val = _split(len(files), labels, val_fraction, seed, self.root)
        self.train_set = ImageFiles([files[i] for i in train], _take(labels, train), **options)
        self.val_set = ImageFiles([files[i] for i in val], _take(labels, val), **options)
        self.shuffle = torch.Generator().manual_seed(seed)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True, generator=self.shuffle)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    def eval_images(self, split: str, limit: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The first ``limit`` images of ``split`` (``"train"`` or ``"val"``, in the split's seeded order) as one
        float32 tensor in [0, 1] on the CPU, and their labels (``None`` when unlabelled); decoded by the workers."""
        dataset = self.train_set if split == "train" else self.val_set
        subset = torch.utils.data.Subset(dataset, range(min(limit, len(dataset))))
        # A generator of its own: the iterator draws a base seed from it, not from the global one training draws from.
        own = torch.Generator().manual_seed(0)
        batches = list(DataLoader(subset, batch_size=256, num_workers=self.num_workers, generator=own))
        images = torch.cat([b[0] for b in batches]).float().div_(255.0)
        return images, torch.cat([b[1] for b in batches]) if self.num_classes else None

    @property
    def input_format(self) -> dict[str, Any]:
        """How a batch row is made from an image file, for ``recipes.inference.load_image``: pixels / 255."""
        return {"image_shape": list(self.image_shape), "mean": 0.0, "std": 1.0, "flat": False}

    def on_after_batch_transfer(self, batch: Batch, dataloader_idx: int) -> Batch:
        # Copy decision: without the prefetcher Lightning has just copied the uint8 batch; make the floats here, on
        # the device. The prefetcher has already handed over the float batch.
        return batch if self.prefetch else to_unit_float(batch)

    def _loader(self, dataset: ImageFiles, **kwargs: object) -> DataLoader:
        # Copy decision: the device comes from the trainer, so under DDP each rank prefetches to its own GPU.
        device = self.trainer.strategy.root_device if self.trainer is not None else torch.device("cpu")
        return make_loader(
            dataset, self.batch_size, device=device, prefetch=self.prefetch,
            transform=to_unit_float if self.prefetch else None, num_workers=self.num_workers, **kwargs,
        )  # fmt: skip

    # -- Resume: the training order's generator, in the checkpoint --

    def state_dict(self) -> dict[str, Any]:
        return {"shuffle": self.shuffle.get_state()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.shuffle.set_state(state_dict["shuffle"])  # in place: a loader made already draws from the restored state


def _read_headers(files: list[str], decode: bool) -> list[Header]:
    """Each file's size and mode, read from its header (Pillow opens a file lazily: no pixels are decoded) and, with
    ``decode``, its pixels decoded once; the first file that does not open or decode is raised, named."""
    headers = []
    desc = "checking images" if decode else "reading image headers"
    for path in tqdm(files, desc=desc, unit="file", disable=len(files) < 2000, leave=False):
        with _opened(path) as image:
            if decode:
                image.load()
            headers.append((image.size, image.mode))
    return headers


def _shape_of_files(
    files: list[str], headers: list[Header], image_size: int | None, channels: int | None, resize: bool, convert: bool
) -> tuple[int, int]:
    """``image_size`` and ``channels``, each taken from the files' ``headers`` where it is ``None``: one square size,
    and one mode that is ``L`` (1 channel) or ``RGB`` (3). Otherwise ``BadInput`` naming a file that differs from
    the most common size or mode (the first file, when they all share one that gives no value), and the override
    that fits every file."""
    if channels is None:
        modes = [mode for _, mode in headers]
        path, mode, common, others = _odd_one_out(files, modes, str)
        if mode != common or common not in CHANNELS:
            fit = f"data.channels={1 if ImageMode.getmode(common).basemode == 'L' else 3}"
            raise BadInput(
                f"{path} is a {mode} image, {others}: data.channels=null takes 1 channel from files that are all L "
                f"(grey) and 3 from files that are all RGB; set {fit}{'' if convert else ' data.convert=true'} to "
                "convert them as they load"
            )
        channels = CHANNELS[common]
    if image_size is None:
        sizes = [size for size, _ in headers]
        path, (width, height), common, others = _odd_one_out(files, sizes, lambda size: "x".join(map(str, size)))
        if (width, height) != common or width != height:
            fit = min(common)
            raise BadInput(
                f"{path} is {width}x{height}, {others}: data.image_size=null takes the size from files that are all "
                f"one square size; set data.image_size={fit}{'' if resize else ' data.resize=true'} to scale the "
                f"shorter side to {fit} and crop the centre as they load"
            )
        image_size = width
    return image_size, channels


def _odd_one_out(files: list[str], values: list[T], show: Callable[[T], str]) -> tuple[str, T, T, str]:
    """The file to name, its value, the most common of ``values`` (one per file), and how the others compare: the
    first file whose value is not the most common one (``"but 700 of the 750 files are RGB"``), or the first file
    when all agree (``"as are all 750 files"``)."""
    (common, many), count = Counter(values).most_common(1)[0], len(values)
    index = next((i for i, value in enumerate(values) if value != common), None)
    if index is None:
        return files[0], common, common, f"as are all {count} files"
    return files[index], values[index], common, f"but {many} of the {count} files are {show(common)}"


def _check_files(dataset: ImageFiles, headers: list[Header]) -> None:
    """Check every file's size and mode (``headers``) against ``dataset``'s; the first that does not fit is raised,
    offering the size or mode that every file has, where they have one."""
    sizes, modes = {size for size, _ in headers}, {mode for _, mode in headers}
    (width, height), mode = headers[0]
    every_size = width if len(sizes) == 1 and width == height else None
    every_mode = mode if len(modes) == 1 else None
    for path, header in zip(dataset.files, headers, strict=True):
        dataset.check(path, header, every_size, every_mode)


def _split(
    count: int, labels: list[int] | None, val_fraction: float, seed: int, root: Path
) -> tuple[list[int], list[int]]:
    """Seeded train and validation indices; per class when labelled. ``ValueError`` when a split would be empty."""
    rng = np.random.default_rng(seed)
    groups = [np.arange(count)] if labels is None else [np.flatnonzero(np.array(labels) == c) for c in set(labels)]
    train, val = [], []
    for group in groups:
        order = rng.permutation(group).tolist()
        n_val = min(math.ceil(val_fraction * len(order)), len(order) - 1) if len(order) > 1 else 0
        val += order[:n_val]
        train += order[n_val:]
    if not val:
        raise ValueError(
            f"data.root {str(root)!r} holds {count} image(s): too few to leave any for validation with "
            f"data.val_fraction={val_fraction}; add images (two at least) or raise data.val_fraction"
        )
    return rng.permutation(train).tolist(), rng.permutation(val).tolist()


def _take(labels: list[int] | None, indices: list[int]) -> list[int] | None:
    return None if labels is None else [labels[i] for i in indices]
