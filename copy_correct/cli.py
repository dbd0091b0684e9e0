"""The ``copy-correct`` command (installed with the package; also ``python -m copy_correct``), one subcommand a job:

    copy-correct posthoc RUN_DIR --sigma-rel 0.08 [0.12 ...] [--step N] [--checkpoint PATH]

``posthoc`` writes checkpoints of post-hoc EMA weights that ``MyModule.load_from_checkpoint(path)`` reads
(``copy_correct.averages.posthoc_command`` says how). ``main`` returns the exit status: 0, each written path printed on
its own line, once however often its width is given; 2, with one line on stderr (``copy-correct posthoc: error: ...``),
for bad arguments (a ``--step`` past the last snapshot or before the first among them, naming both steps), nothing to
synthesize from, a path given that does not exist (``MissingFile``, also a ``FileNotFoundError``: a file named on the
command line that is not there is an argument to fix, as a missing RUN_DIR is), or a file refused (damaged, cut short,
not a checkpoint, or one whose pickle would run code: nothing in it runs); 1, with one line, for a file that exists
but cannot be read or written (a full disk: ``DiskFull``). No traceback. ``--help`` prints plain text, with none of
the docstrings' markup.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from copy_correct.averages.posthoc_command import posthoc
from copy_correct.averages.power_function import SIGMA_REL_MAX, sigma_rel_to_gamma

__all__ = ["main"]


class _OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (the usage stays behind ``--help``)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _sigma_rel(text: str) -> float:
    try:
        value = float(text)
        sigma_rel_to_gamma(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number in (0, {SIGMA_REL_MAX:.4f}) (EDM2 uses 0.05 to 0.20)"
        ) from None
    return value


def _step(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an optimizer step (an integer >= 1)")
    return int(text)


def parser() -> argparse.ArgumentParser:
    """The command line: one subparser per subcommand."""
    top = _OneLineParser(prog="copy-correct", description=_plain(__doc__.split("\n\n")[0]))
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_OneLineParser)
    what = "write checkpoints of post-hoc EMA weights from a run's PostHocEMASnapshots snapshots"
    post = commands.add_parser("posthoc", help=what, description=f"{what[0].upper()}{what[1:]}.")
    post.add_argument(
        "run_dir",
        type=Path,
        help="the run's directory (the folder holding checkpoints/: a plain Lightning Trainer's "
        "lightning_logs/version_N), or its folder of snapshots (power_ema/)",
    )
    post.add_argument(
        "--sigma-rel",
        type=_sigma_rel,
        nargs="+",
        required=True,
        help="the EMA widths, in (0, 0.2887); a width given twice is written once",
    )
    post.add_argument(
        "--step",
        type=_step,
        default=None,
        help="the optimizer step, from the first snapshot's to the last's (default: the last snapshot's)",
    )
    post.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        help="the checkpoint to take the rest from (default: the newest *.ckpt beside the snapshots)",
    )
    return top


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); the exit status."""
    args = parser().parse_args(argv)
    try:
        for path in posthoc(args.run_dir, args.sigma_rel, args.step, args.checkpoint):
            print(path)
    except ValueError as error:  # bad input: DamagedFile, MissingFile and UnsafeFile among them
        print(f"copy-correct {args.command}: error: {_one_line(error)}", file=sys.stderr)
        return 2
    except OSError as error:  # a file that cannot be read or written: DiskFull among them
        print(f"copy-correct {args.command}: error: {_one_line(error)}", file=sys.stderr)
        return 1
    return 0


def _plain(text: str) -> str:
    """A docstring's text as a terminal shows it: without its ``double backticks``."""
    return text.replace("``", "")


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__
