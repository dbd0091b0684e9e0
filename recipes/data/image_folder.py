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

Checked when the data module is made, before any training (``ValueError`` naming the key or the file, one line): the
folder exists and holds images, every file's size and mode fit ``data.image_size`` and ``data.channels`` (or
``data.resize`` / ``data.convert`` say to make them fit), and, with ``data.verify`` (the default), every file decodes.
A file that stops decoding later fails in the worker with its path named.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from copy_correct import make_loader

__all__ = ["IMAGE_EXTENSIONS", "ImageFiles", "ImageFolderDataModule", "scan_folder", "to_unit_float"]

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
MODES = {1: "L", 3: "RGB"}
Batch = tuple[torch.Tensor, ...]


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
    classes = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith(".") and images_in(d, True))
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

    def check(self, path: str, image: Image.Image) -> None:
        """``ValueError`` naming ``path`` when its size or mode does not fit and the config does not say to fit it."""
        mode = MODES[self.channels]
        if image.mode != mode and not self.convert:
            raise ValueError(
                f"{path} is a {image.mode} image and data.channels={self.channels} wants {mode}: convert the files, "
                f"set data.channels to match, or data.convert=true to convert them as they load"
            )
        if image.size != (self.image_size, self.image_size) and not self.resize:
            width, height = image.size
            raise ValueError(
                f"{path} is {width}x{height} and data.image_size={self.image_size} wants "
                f"{self.image_size}x{self.image_size}: resize the files, set data.image_size to match, or "
                "data.resize=true to scale the shorter side and crop the centre as they load"
            )

    def read_header(self, path: str) -> None:
        """Open ``path`` and check its size and mode, without decoding its pixels."""
        with _opened(path) as image:
            self.check(path, image)

    def decode(self, path: str) -> np.ndarray:
        """The file's pixels as a new ``(H, W)`` or ``(H, W, C)`` ``uint8`` array, fitted to the config."""
        with _opened(path) as image:
            self.check(path, image)
            image = image.convert(MODES[self.channels])  # a copy even when the mode is already right
            if image.size != (self.image_size, self.image_size):
                image = _fit(image, self.image_size)
            return np.array(image, dtype=np.uint8)


@contextmanager
def _opened(path: str) -> Iterator[Image.Image]:
    """``Image.open(path)``; what Pillow raises for a file it cannot read becomes one ``ValueError`` naming it."""
    try:
        with Image.open(path) as image:
            yield image
    except (OSError, UnidentifiedImageError, SyntaxError) as err:
        raise ValueError(f"{path} does not decode as an image: {' '.join(str(err).split())}") from None


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

    The split is seeded and, for labelled folders, stratified (each class in both splits as far as its count
    allows). The training order is drawn from one generator whose state is the module's ``state_dict``, so a resumed
    run shuffles as the uninterrupted one would. ``prefetch=false`` leaves the copy to Lightning (on the compute
    stream); the transform then runs in ``on_after_batch_transfer``.
    """

    def __init__(
        self,
        root: str,
        image_size: int = 64,
        channels: int = 3,
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
            if value < low:
                raise ValueError(f"data.{name} must be >= {low}, got {value}")
        if channels not in MODES:
            raise ValueError(f"data.channels must be 1 (grey) or 3 (RGB), got {channels}")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be in (0, 1), got {val_fraction}")
        self.root = Path(str(root)).expanduser()
        self.batch_size, self.num_workers, self.prefetch = batch_size, num_workers, prefetch
        self.image_shape = (channels, image_size, image_size)
        files, labels, self.classes = scan_folder(self.root)
        self.num_classes = len(self.classes) or None
        options = {"image_size": image_size, "channels": channels, "resize": resize, "convert": convert}
        _check_files(ImageFiles(files, labels, **options), decode=verify)
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
        batches = list(DataLoader(subset, batch_size=256, num_workers=self.num_workers))
        images = torch.cat([b[0] for b in batches]).float().div_(255.0)
        return images, torch.cat([b[1] for b in batches]) if self.num_classes else None

    def state_dict(self) -> dict[str, Any]:
        return {"shuffle": self.shuffle.get_state()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.shuffle.set_state(state_dict["shuffle"])  # in place: a loader made already draws from the restored state

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


def _check_files(dataset: ImageFiles, decode: bool) -> None:
    """Open every file (its header: size and mode) and, with ``decode``, decode it; the first problem is raised."""
    files = dataset.files
    desc = "checking images" if decode else "reading image headers"
    for path in tqdm(files, desc=desc, unit="file", disable=len(files) < 2000, leave=False):
        dataset.decode(path) if decode else dataset.read_header(path)


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
