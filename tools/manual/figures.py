"""Draw the manual's figures from real runs: the recipes trained here, and the benchmark tables the benchmarks wrote.

    python -m tools.manual.figures            # every figure (about 11 minutes on 2 CPU cores)
    python -m tools.manual.figures gan dqn    # only these parts
    python -m tools.manual.figures --quick    # every part on a few steps: a smoke test, not the manual's figures

Parts: ``metrics``, ``ema``, ``gan``, ``dqn``, ``pinned`` (each trains its recipe, as ``python train.py +recipe=NAME``
does, in this process) and ``benchmarks`` (charts of the ratio columns of ``docs/benchmarks.md``'s tables, which
``python -m benchmarks.NAME`` measured; a benchmark redraws its own chart when it rewrites its table). Each figure goes
to ``docs/figures/`` (SVG for charts, PNG for sample grids) and into its block on its page
(``<!-- figure:NAME:start -->``), with a caption naming this command, the commit and the machine. The runs are
left in ``--runs`` (``outputs/figures/``: each with its ``metrics.csv``, checkpoints and ``summary.json``).

Exit status 2, with one line, for an unknown part or option, or a ``--docs`` folder that is not the manual's.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass
from pathlib import Path

from matplotlib.figure import Figure

from tools.manual.figure_pages import FIGURES, ROOT, Provenance, provenance, save_figure


@dataclass
class Context:
    """What every part needs: where figures and runs go, whether this is the quick smoke run, and the provenance."""

    docs: Path
    runs: Path
    quick: bool
    provenance: Provenance
    command: str

    def save(self, fig: Figure, name: str, page: str, alt: str, caption: str) -> Path:
        """Write ``fig`` to ``docs/figures/`` and into its block on ``page``, under ``caption`` and the provenance."""
        return save_figure(fig, self.docs, page, name, alt, f"{caption} {self.provenance.sentence(self.command)}")


# Each part's module and function, imported only when the part runs: the recipe parts bring Lightning, the charts not.
PARTS = {
    "metrics": ("tools.manual.figure_recipes", "metrics_figures"),
    "ema": ("tools.manual.figure_recipes", "ema_figures"),
    "gan": ("tools.manual.figure_recipes", "gan_figures"),
    "dqn": ("tools.manual.figure_recipes", "dqn_figures"),
    "pinned": ("tools.manual.figure_recipes", "pinned_figures"),
    "benchmarks": ("tools.manual.figure_bench", "benchmark_figures"),
}


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse prints its usage too: one line says it, and --help has the rest
        self.exit(2, f"error: {message} (python -m tools.manual.figures --help)\n")


def main(argv: list[str] | None = None) -> int:
    parser = _OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("parts", nargs="*", metavar="PART", help=f"any of {', '.join(PARTS)} (default: all)")
    parser.add_argument("--quick", action="store_true", help="a few steps per run: checks the script, not the manual")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs", help="the manual's folder (default docs/)")
    parser.add_argument("--runs", type=Path, default=ROOT / "outputs" / "figures", help="where the runs are written")
    args = parser.parse_args(argv)
    unknown = [part for part in args.parts if part not in PARTS]
    if unknown:
        parser.error(f"unknown part {unknown[0]!r}: choose from {', '.join(PARTS)}")
    if not (args.docs / "index.md").is_file():
        parser.error(f"--docs {args.docs} is not the manual's folder (it has no index.md)")
    chosen = args.parts or list(PARTS)
    made_at = provenance()
    for part in chosen:
        print(f"figures: {part}", flush=True)
        command = f"python -m tools.manual.figures {part}" + (" --quick" if args.quick else "")
        module, function = PARTS[part]
        getattr(importlib.import_module(module), function)(Context(args.docs, args.runs, args.quick, made_at, command))
    print(f"figures: {', '.join(chosen)} written to {args.docs / FIGURES}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
