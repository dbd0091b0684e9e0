"""Where the manual's figures go, and what their captions say about where they came from.

A page of ``docs/`` says where a figure goes with a block of its own::

    <!-- figure:NAME:start -->
    <!-- figure:NAME:end -->

``write_figure`` fills the block with the image (``docs/figures/NAME.png``) and a caption that names the
command, the commit and the machine that produced it (``Provenance``). Nothing else of the page changes. The tests
read the blocks back (``figure_blocks``) to check that every figure the manual shows exists.
"""

from __future__ import annotations

import io
import os
import platform
import re
import subprocess
from dataclasses import dataclass
from datetime import date
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from matplotlib.figure import Figure
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
FIGURES = "figures"  # the folder, under the docs folder, that holds the figures (PNG)
DPI = 110
STYLE = {  # every figure of the manual
    "font.size": 9,
    "axes.titlesize": 10,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "legend.framealpha": 0.9,
}
plt.rcParams.update(STYLE)
_BLOCK = re.compile(r"<!-- figure:(?P<name>[\w-]+):start -->\n(?P<body>.*?)<!-- figure:(?P=name):end -->", re.DOTALL)
IMAGE = re.compile(r"!\[[^\]]*\]\((?P<src>[^)\s]+)\)")


@dataclass(frozen=True)
class Provenance:
    """The commit, machine and date a figure was measured at; ``commit`` ends in ``+changes`` when a file that can
    change a run (anything but ``docs/`` and Markdown) differed from it."""

    commit: str
    machine: str
    day: str

    def sentence(self, command: str) -> str:
        return f"Made by `{command}` at commit `{self.commit}` on {self.machine}, {self.day}."


def _git(*args: str) -> str:
    result = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
    return result.stdout.strip() if result.returncode == 0 else ""


def machine(device: torch.device | str = "cpu") -> str:
    """The machine in words: the device, the host's cores, the torch threads and version."""
    device = torch.device(device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.machine()})"
    return f"{where}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, torch {torch.__version__}"


def provenance(device: torch.device | str = "cpu") -> Provenance:
    commit = _git("rev-parse", "--short", "HEAD") or "unknown"
    if _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)docs", ":(exclude,glob)**/*.md"):
        commit += "+changes"
    return Provenance(commit, machine(device), str(date.today()))


def figure_blocks(page: str) -> dict[str, str]:
    """The figure blocks of a page's text: {name: body}."""
    return {match["name"]: match["body"] for match in _BLOCK.finditer(page)}


def save_figure(fig: Figure, docs: Path, page: str, name: str, alt: str, caption: str, extra: str = "") -> Path:
    """Write ``fig`` as ``docs/figures/NAME.png`` and put it in its block on ``docs/PAGE`` (``write_figure``)."""
    path = docs / FIGURES / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=DPI, format="png", bbox_inches="tight", pad_inches=0.08)
    plt.close(fig)
    # A palette of 256 colours: the same picture to the eye, a third of the bytes; no version stamp in the file.
    Image.open(buffer).convert("RGB").quantize(colors=256).save(path, optimize=True)
    write_figure(docs, page, name, alt, caption, extra)
    return path


def write_figure(docs: Path, page: str, name: str, alt: str, caption: str, extra: str = "") -> None:
    """Put figure ``name`` (already written to ``docs/figures/NAME.png``) into its block on ``docs/PAGE``, with
    ``alt`` as the image's text, ``caption`` beneath it, then ``extra`` (markdown the reader does not see, such as a
    comment). Raises ``ValueError`` if the page has no such block."""
    path = docs / page
    text = path.read_text()
    image = os.path.relpath(docs / FIGURES / f"{name}.png", path.parent).replace(os.sep, "/")
    body = f"![{alt}]({image})\n\n*{caption}*\n{extra}"
    found = False

    def fill(match: re.Match[str]) -> str:
        nonlocal found
        if match["name"] != name:
            return match[0]
        found = True
        return f"<!-- figure:{name}:start -->\n{body}<!-- figure:{name}:end -->"

    text = _BLOCK.sub(fill, text)
    if not found:
        raise ValueError(f"{path} has no block for figure {name!r}: add <!-- figure:{name}:start/end --> lines")
    path.write_text(text)
