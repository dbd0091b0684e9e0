"""Write scikit-learn's digits as a folder of PNG files, to try ``data=images`` without data of your own.

    python scripts/digits_folder.py DIR                      # DIR/0/0000.png ... DIR/9/...: labelled, 64x64 RGB
    python scripts/digits_folder.py DIR --unlabelled         # DIR/0000.png ...: no classes
    python scripts/digits_folder.py DIR --size 32 --grey     # 32x32, one channel

Each 8x8 digit is scaled up (bilinear) to ``--size`` pixels, drawn in a random colour on a random darker background
(seeded), so the folder looks like a small photo data set: colour, smooth edges, one image per file. Nothing is
downloaded. Exit status 2, with one line, for a bad argument or a ``DIR`` that is not empty.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from sklearn.datasets import load_digits
from tqdm import tqdm


def render(size: int, channels: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The 1,797 digits as ``uint8`` images ``(N, size, size, channels)``, and their labels."""
    images, labels = load_digits(return_X_y=True)
    ink = F.interpolate(torch.from_numpy(images / 16.0).float().view(-1, 1, 8, 8), size=size, mode="bilinear")
    rng = np.random.default_rng(seed)
    foreground = rng.uniform(0.5, 1.0, (len(images), channels, 1, 1))
    background = rng.uniform(0.0, 0.35, (len(images), channels, 1, 1))
    pixels = background + ink.numpy() * (foreground - background)
    return (pixels * 255).round().astype(np.uint8).transpose(0, 2, 3, 1), labels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dest", type=Path, help="the folder to write (must not exist, or be empty)")
    parser.add_argument("--size", type=int, default=64, help="side of each image in pixels (default 64)")
    parser.add_argument("--grey", action="store_true", help="one channel instead of RGB")
    parser.add_argument("--unlabelled", action="store_true", help="all images in DEST, no class subfolders")
    parser.add_argument("--count", type=int, default=None, help="write only the first COUNT digits")
    parser.add_argument("--seed", type=int, default=0, help="seed of the colours (default 0)")
    args = parser.parse_args(argv)
    if args.size < 8:
        parser.exit(2, f"error: --size must be >= 8, got {args.size}\n")
    if args.count is not None and args.count < 1:
        parser.exit(2, f"error: --count must be >= 1, got {args.count}\n")
    if args.dest.exists() and (not args.dest.is_dir() or any(args.dest.iterdir())):
        parser.exit(2, f"error: {args.dest} exists and is not an empty folder\n")
    images, labels = render(args.size, 1 if args.grey else 3, args.seed)
    count = len(images) if args.count is None else min(args.count, len(images))
    for i in tqdm(range(count), desc=f"writing {args.dest}", unit="image"):
        folder = args.dest if args.unlabelled else args.dest / str(labels[i])
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(images[i, :, :, 0] if args.grey else images[i]).save(folder / f"{i:04d}.png")
    print(f"{count} images in {args.dest}: python train.py +recipe=gan data=images data.root={args.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
