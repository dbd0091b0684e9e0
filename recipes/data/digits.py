"""The 8x8 handwritten digits that ship inside scikit-learn (1,797 images, 10 classes): no download.

Copy contract: the whole data set is one float32 tensor made once from the NumPy array
(``torch.from_numpy`` shares its memory); each batch is a new tensor assembled by the DataLoader's
collate step, so training can never write into the data set.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, TensorDataset

__all__ = ["DigitsDataModule", "load_digits_split"]

NUM_CLASSES = 10


def load_digits_split(val_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """Stratified train/validation split; pixels scaled to [0, 1], flattened to 64 features.

    Each split must hold at least one digit of every class: a ``val_fraction`` that leaves fewer (an empty
    split, say) raises ``ValueError`` naming the range that works.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"data.val_fraction must be in (0, 1), got {val_fraction}")
    images, labels = load_digits(return_X_y=True)
    n = len(images)
    n_val = math.ceil(val_fraction * n)  # scikit-learn's rounding
    if min(n_val, n - n_val) < NUM_CLASSES:
        raise ValueError(
            f"data.val_fraction={val_fraction} leaves {n_val} validation and {n - n_val} training digits; each split "
            f"needs one per class ({NUM_CLASSES}): val_fraction must be in ({(NUM_CLASSES - 1) / n:.4g}, "
            f"{(n - NUM_CLASSES) / n:.4g}]"
        )
    x_train, x_val, y_train, y_val = train_test_split(
        (images / 16.0).astype(np.float32),
        labels.astype(np.int64),
        test_size=val_fraction,
        random_state=seed,
        stratify=labels,
    )
    return (
        TensorDataset(torch.from_numpy(x_train), torch.from_numpy(y_train)),
        TensorDataset(torch.from_numpy(x_val), torch.from_numpy(y_val)),
    )


class DigitsDataModule(pl.LightningDataModule):
    """Train and validation loaders over ``load_digits_split``; the training order is seeded and resumable.

    Batches are ``(pixels, labels)``, the pixels flat: ``(N, 64)`` float32 in [0, 1]. ``image_shape`` and
    ``num_classes`` say what they are (``train.py`` hands them to a model whose config leaves them ``null``).

    The split is made here, so a bad ``val_fraction`` stops the run before training. The training order
    comes from one generator seeded here and drawn once per epoch; its state is the module's
    ``state_dict``, so a run resumed from an end-of-epoch checkpoint shuffles the next epochs exactly as the
    uninterrupted run would.
    """

    image_shape = (1, 8, 8)
    num_classes = NUM_CLASSES
    classes = tuple(str(digit) for digit in range(NUM_CLASSES))

    def __init__(self, batch_size: int = 64, val_fraction: float = 0.2, seed: int = 0, num_workers: int = 0) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"data.batch_size must be >= 1, got {batch_size}")
        if num_workers < 0:
            raise ValueError(f"data.num_workers must be >= 0, got {num_workers}")
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.train_set, self.val_set = load_digits_split(val_fraction, seed)
        self.shuffle = torch.Generator().manual_seed(seed)

    @property
    def input_format(self) -> dict[str, Any]:
        """How a batch row is made from an 8x8 grey image file (ink bright), for ``recipes.inference.load_image``:
        pixels / 255, flattened."""
        return {"image_shape": [1, 8, 8], "mean": 0.0, "std": 1.0, "flat": True}

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True, generator=self.shuffle)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    def eval_images(self, split: str, limit: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``limit`` digits of ``split`` (``"train"`` or ``"val"``) and their labels: views of the split's
        tensors, shaped as the batches are."""
        images, labels = (self.train_set if split == "train" else self.val_set).tensors
        return images[:limit], labels[:limit]

    def _loader(self, dataset: TensorDataset, **kwargs: object) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            **kwargs,
        )

    # -- Resume: the training order's generator, in the checkpoint --

    def state_dict(self) -> dict[str, Any]:
        return {"shuffle": self.shuffle.get_state()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.shuffle.set_state(state_dict["shuffle"])  # in place: a loader made already draws from the restored state
