"""Write one benchmark's section into docs/benchmarks.md, leaving the other benchmarks' sections as they are."""

from __future__ import annotations

import re
from pathlib import Path

INTRO = """# Benchmarks

Each section is written by the script it names, on the machine it names. Contenders run side by side in
one process, in interleaved rounds, and the tables report medians and ratios: absolute times on shared
machines are noisy, ratios much less so. Bandwidth is compared with a plain copy of the same bytes, the
physical limit of the machine.
"""


def write_section(path: Path, key: str, title: str, header: str, body: str) -> None:
    """Replace (or append) the section between ``<!-- key:start -->`` and ``<!-- key:end -->``."""
    start, end = f"<!-- {key}:start -->", f"<!-- {key}:end -->"
    section = f"{start}\n## {title}\n\n{header}\n\n{body}\n{end}"
    text = path.read_text() if path.exists() else INTRO
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip("\n") + f"\n\n{section}\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
