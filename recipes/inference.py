"""Use a trained classifier on new image files: ``load_image`` makes a file into the model's input the way its
training batches were made, ``classify`` names the file's class.

What a checkpoint holds for this (``ema``, ``metrics`` and ``pinned``): the classifiers take ``classes`` and
``input_format`` from their data module (``train.py`` passes them, as it passes ``image_shape``) and keep them in their
hyperparameters, so ``Model.load_from_checkpoint(best)`` alone can classify a file and name its class. Both are plain
lists, numbers and strings: the checkpoint still loads with ``weights_only=True``.

``input_format`` (a data module's ``input_format``)::

    {"image_shape": [C, H, W], "mean": m, "std": s, "flat": False}

A batch row is ``(pixels / 255 - mean) / std`` for the image's ``uint8`` pixels of shape ``(C, H, W)``, flattened to
``C * H * W`` values when ``flat``. ``load_image`` decodes a file as ``recipes.data.image_folder`` decodes training
files (converted to ``C`` channels; a file of another size has its shorter side scaled to ``H`` and its centre
cropped) and applies the same operations in the same order, so a file of the training folder gives its training
batch row bit for bit.

Copy contract: the file is read, never written; the result is a new float32 tensor on the CPU, carrying no graph.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from recipes.data.image_folder import ImageFiles

__all__ = ["classify", "load_image"]

FORMAT_KEYS = ("image_shape", "mean", "std", "flat")


def load_image(path: str | Path, input_format: Mapping[str, Any]) -> torch.Tensor:
    """The image file at ``path`` as a batch of one, ``(1, C, H, W)`` (``(1, C * H * W)`` when ``flat``), made as
    ``input_format`` says (module docstring); ``ValueError`` naming a missing key, or a file that does not decode."""
    missing = [key for key in FORMAT_KEYS if key not in input_format]
    if missing:
        raise ValueError(f"input_format lacks {', '.join(missing)}: it must hold {', '.join(FORMAT_KEYS)}")
    channels, height, width = input_format["image_shape"]
    if height != width:
        raise ValueError(f"input_format image_shape must be square (the data modules' are), got {height}x{width}")
    files = ImageFiles([Path(path)], None, image_size=height, channels=channels, resize=True, convert=True)
    (pixels,) = files[0]  # (C, H, W) uint8, decoded as a training file is
    image = (pixels.float() / 255.0).sub_(input_format["mean"]).div_(input_format["std"])
    return image.reshape(1, -1) if input_format["flat"] else image.unsqueeze(0)


def classify(model: nn.Module, path: str | Path) -> str:
    """The name of the class ``model`` gives the image file at ``path``, from the ``classes`` and ``input_format``
    in its hyperparameters (what ``load_from_checkpoint`` restores). The model is evaluated in eval mode, under
    ``torch.inference_mode``, and left in the mode it was in. ``ValueError`` when the model holds neither."""
    hparams = getattr(model, "hparams", {})
    for key in ("classes", "input_format"):
        if not hparams.get(key):
            raise ValueError(
                f"the model's hparams hold no {key}: it was built without them (a checkpoint written before they "
                f"were saved, or a model made by hand); pass {key}= from the data module when you build it"
            )
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            logits = model(load_image(path, hparams["input_format"]).to(device))
    finally:
        model.train(was_training)
    return hparams["classes"][int(logits.argmax(dim=1)[0])]
