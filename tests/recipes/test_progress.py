"""Progress off a terminal: a run whose stdout is a file writes one line per epoch, where Lightning's bars would write
every redraw (``recipes/progress.py``, ``callbacks.progress_bar`` in ``conf/callbacks/default.yaml``); after a resume
mid-epoch its line gives the seconds of the resumed run."""

from __future__ import annotations

import contextlib
import re
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar, TQDMProgressBar
from torch.utils.data import DataLoader, TensorDataset

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


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def fit_lines(run: Path, ckpt_path: Path | None = None) -> pl.Trainer:
    """2 epochs of 8 batches with ``EpochLines``, a checkpoint at step 12 (mid-epoch 2) in ``run``."""
    data = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=data)
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=2, logger=False, enable_model_summary=False, limit_val_batches=0,
        callbacks=[EpochLines(), ModelCheckpoint(run, "{step}", every_n_train_steps=12, save_top_k=-1)],
    )  # fmt: skip
    trainer.fit(Regressor(), DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4), ckpt_path=ckpt_path)
    return trainer


@pytest.mark.parametrize("control", [False, True])
def test_after_a_mid_epoch_resume_the_line_gives_the_seconds_of_this_run(
    control: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lightning calls no ``on_train_epoch_start`` for the epoch a run resumes mid-way; the control, the clock started
    only there (as before), gives the seconds since ``perf_counter``'s zero (1681.4 s for a 15 s run)."""
    fit_lines(tmp_path / "first")
    capsys.readouterr()
    if control:
        monkeypatch.setattr(EpochLines, "on_train_start", ProgressBar.on_train_start)
    started = time.perf_counter()
    fit_lines(tmp_path / "resumed", ckpt_path=tmp_path / "first" / "step=12.ckpt")
    took = time.perf_counter() - started
    (line,) = capsys.readouterr().out.splitlines()
    match = re.fullmatch(r"epoch 2/2  step 16  (\d+\.\d) s", line)
    assert match is not None, line
    assert (float(match[1]) <= took) != control, (line, took)
