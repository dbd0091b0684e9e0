"""Progress off a terminal: a run whose stdout is a file writes one line per epoch, where Lightning's bars would write
every redraw (``recipes/progress.py``, ``callbacks.progress_bar`` in ``conf/callbacks/default.yaml``)."""

from __future__ import annotations

import contextlib
import re
import sys
from pathlib import Path

import pytest
from lightning.pytorch.callbacks import ProgressBar, TQDMProgressBar

from recipes.build import build
from recipes.progress import EpochLines, progress_bar
from tests.conftest import ON_CPU, compose_config

EPOCHS = 3
QUICK = (ON_CPU, f"trainer.max_epochs={EPOCHS}", "trainer.enable_model_summary=false")


def run_to_file(path: Path, *overrides: str) -> bytes:
    """Build and fit ``metrics`` as ``train.py`` does, with stdout a file from before the build; the file's bytes."""
    with open(path, "w") as out, contextlib.redirect_stdout(out):
        trainer, model, datamodule = build(
            compose_config("+recipe=metrics", *QUICK, *overrides, output_dir=path.parent)
        )
        trainer.fit(model, datamodule=datamodule)
    return path.read_bytes()


def test_a_run_with_stdout_to_a_file_writes_one_line_per_epoch_where_bars_write_every_redraw(tmp_path: Path) -> None:
    lines = run_to_file(tmp_path / "lines")
    bars = run_to_file(tmp_path / "bars", "callbacks.progress_bar.style=bar")  # the control: forced bars
    print(f"{EPOCHS} epochs of metrics, stdout to a file: {len(lines)} bytes in lines, {len(bars)} with bars")
    written = lines.decode().splitlines()
    assert len(written) == EPOCHS and b"\r" not in lines
    for epoch, line in enumerate(written, start=1):
        assert re.fullmatch(rf"epoch {epoch}/{EPOCHS}  step {23 * epoch}  .*val/acc \d\.\d+.*  \d+\.\d s", line), line
    assert bars.count(b"\r") > 10 * EPOCHS and len(bars) > 10 * len(lines)


@pytest.mark.parametrize(
    ("style", "terminal", "made"),
    [("auto", True, TQDMProgressBar), ("auto", False, EpochLines), ("bar", False, TQDMProgressBar),
     ("lines", True, EpochLines)],
)  # fmt: skip
def test_auto_asks_whether_stdout_is_a_terminal_and_bar_or_lines_force_one(
    style: str, terminal: bool, made: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys.stdout, "isatty", lambda: terminal)
    assert type(progress_bar(style)) is made


def test_no_progress_callback_when_bars_are_off_and_an_unknown_style_is_refused_naming_the_key(tmp_path: Path) -> None:
    trainer, _, _ = build(compose_config("+recipe=metrics", "trainer.enable_progress_bar=false", output_dir=tmp_path))
    assert not any(isinstance(c, ProgressBar) for c in trainer.callbacks)
    with pytest.raises(
        ValueError, match=r"^callbacks\.progress_bar\.style must be one of auto, bar, lines, got 'tqdm'$"
    ):
        build(compose_config("+recipe=metrics", "callbacks.progress_bar.style=tqdm", output_dir=tmp_path))
