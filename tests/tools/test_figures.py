"""The manual's figures: every one it shows exists, says where it came from, and matches what it was drawn from; the
script that draws them runs (quick mode, into a copy of the manual) and refuses a bad argument with one line."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from PIL import Image

from benchmarks.report import write_section
from tools.manual import figures
from tools.manual.figure_bench import digest, ratio_panels, read_section_tables, recorded_digest, sections
from tools.manual.figure_pages import FIGURES, IMAGE, figure_blocks, write_figure
from tools.manual.figure_recipes import SampleGrids
from tools.manual.figure_runs import run_recipe

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
MAX_BYTES = 150_000  # a figure is a picture for a page, not a data dump


def _shown_images() -> dict[Path, list[Path]]:
    """Every image a page of the manual shows: {file: [pages showing it]}."""
    shown: dict[Path, list[Path]] = {}
    for page in PAGES:
        for match in IMAGE.finditer(page.read_text()):
            shown.setdefault((page.parent / match["src"]).resolve(), []).append(page)
    return shown


def _without_blocks(text: str) -> str:
    return re.sub(r"<!-- figure:([\w-]+):start -->.*?<!-- figure:\1:end -->", "", text, flags=re.S)


def test_every_figure_the_manual_shows_exists_is_small_and_says_where_it_came_from() -> None:
    shown = _shown_images()
    missing = {
        str(path.relative_to(ROOT)): [p.name for p in pages] for path, pages in shown.items() if not path.exists()
    }
    assert not missing
    on_disk = {path.resolve() for path in (DOCS / FIGURES).glob("*")}
    assert on_disk and on_disk <= set(shown), f"figures no page shows: {sorted(p.name for p in on_disk - set(shown))}"
    blocks = {name: body for page in PAGES for name, body in figure_blocks(page.read_text()).items()}
    assert {
        "metrics-memory",
        "ema-accuracy",
        "gan-quality",
        "gan-samples-grid",
        "dqn-returns",
        "pinned-step-time",
    } <= set(blocks)
    for name, body in blocks.items():
        assert f"{FIGURES}/{name}.png)" in body, f"block {name} shows no figure"
        assert re.search(r"Made by `python -m [\w.]+[^`]*` at commit `[0-9a-f]{7,}", body), body
        assert "--quick" not in body, f"{name}: a smoke-test figure in the manual"
        assert "+changes" not in body, f"{name}: drawn from code that was not committed"
    for path in on_disk:
        with Image.open(path) as image:
            assert image.format == "PNG" and min(image.size) >= 150, path.name
        assert path.stat().st_size <= MAX_BYTES, f"{path.name}: {path.stat().st_size} bytes"


def test_each_benchmark_chart_was_drawn_from_the_table_beside_it() -> None:
    markdown = (DOCS / "benchmarks.md").read_text()
    charted = 0
    for key in sections(markdown):
        _, tables = read_section_tables(markdown, key)
        if ratio_panels(tables):
            charted += 1
            assert recorded_digest(markdown, key) == digest(tables), (
                f"{key}: rerun python -m tools.manual.figures benchmarks"
            )
    assert charted >= 6
    # Control: one changed cell is a different table, which the recorded digest no longer matches.
    key = "ema-cpu"
    changed = re.sub(r"(\| copy_correct\.EMA\.update, skip_nonfinite=False \| [0-9.]+)", r"\g<1>1", markdown, count=1)
    assert changed != markdown and recorded_digest(changed, key) != digest(read_section_tables(changed, key)[1])


def test_a_bench_script_rewriting_a_manual_page_redraws_its_chart_and_elsewhere_draws_none(tmp_path: Path) -> None:
    table = (
        "| contender | ms | time / ours |\n| --- | ---: | ---: |\n| ours | 1.0 | 1.00x |\n| peer 1.0 | 3.0 | 3.00x |"
    )
    manual, elsewhere = tmp_path / "docs", tmp_path / "report"
    manual.mkdir()
    elsewhere.mkdir()
    (manual / "index.md").write_text("# Manual\n")
    for folder in (manual, elsewhere):
        write_section(folder / "benchmarks.md", "x-cpu", "X (cpu)", "Measured with `python -m benchmarks.x`.", table)
    text = (manual / "benchmarks.md").read_text()
    assert (manual / FIGURES / "bench-x-cpu.png").is_file()
    assert recorded_digest(text, "x-cpu") == digest(read_section_tables(text, "x-cpu")[1])
    assert "Made by `python -m benchmarks.x`" in text
    assert "figure:" not in (elsewhere / "benchmarks.md").read_text() and not (elsewhere / FIGURES).exists()


def test_a_page_without_the_figures_block_is_named() -> None:
    with pytest.raises(ValueError, match=r"index\.md has no block for figure 'nowhere'"):
        write_figure(DOCS, "index.md", "nowhere", "alt", "caption")


def test_the_script_draws_every_figure_in_quick_mode_and_changes_nothing_else(tmp_path: Path) -> None:
    """Every part, on a few steps each, into a copy of the manual: each block gets a fresh PNG and a caption naming
    the quick command; no page changes outside its blocks."""
    docs = tmp_path / "docs"
    shutil.copytree(DOCS, docs)
    started = time.time()
    assert figures.main(["--quick", "--docs", str(docs), "--runs", str(tmp_path / "runs")]) == 0
    for page in PAGES:
        copy = docs / page.relative_to(DOCS)
        assert _without_blocks(copy.read_text()) == _without_blocks(page.read_text()), page.name
        for name, body in figure_blocks(copy.read_text()).items():
            path = docs / FIGURES / f"{name}.png"
            assert path.stat().st_mtime >= started, f"{name} was not redrawn"
            with Image.open(path) as image:
                assert image.format == "PNG"
            assert "--quick` at commit" in body or name.startswith("bench-"), body
    assert (tmp_path / "runs" / "gan" / "metrics.csv").is_file()  # the runs stay, with what they logged


class DrawsFromTheRunsStream(SampleGrids):
    """The control: the same grids, with latents drawn from the global random stream the run trains on."""

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        torch.randn(self.count, pl_module.hparams.latent)
        super().on_train_epoch_end(trainer, pl_module)


def test_the_sample_grids_leave_the_gan_run_as_it_would_have_been(tmp_path: Path) -> None:
    """The grids the gan figure shows are drawn inside the run; the run ends bit for bit as without them (eval-mode
    forward, latents from a generator of their own, ``average_weights`` restoring the live weights). The control
    draws its latents from the run's own stream, and the run trains on other noise."""
    short = ["+recipe=gan", "trainer.max_epochs=2", "trainer.limit_train_batches=3", "trainer.limit_val_batches=0",
             "trainer.log_every_n_steps=1", "model.eval_samples=100", "model.judge_epochs=1"]  # fmt: skip

    def weights(*callbacks: pl.Callback) -> dict[str, torch.Tensor]:
        run = run_recipe(short, tmp_path / f"run{len(list(tmp_path.iterdir()))}", callbacks)
        model: Any = run.model
        return {**model.state_dict(), **{f"ema.{k}": v for k, v in model.g_ema.state_dict()["shadow"].items()}}

    grids, control = SampleGrids([1, 2]), DrawsFromTheRunsStream([1, 2])
    plain, drawn, disturbed = weights(), weights(grids), weights(control)
    assert sorted(grids.grids) == [1, 2] and grids.grids[2][0].shape == (64, 1, 8, 8)
    assert plain.keys() == drawn.keys() and all(torch.equal(plain[k], drawn[k]) for k in plain)
    assert any(not torch.equal(plain[k], disturbed[k]) for k in plain if k.startswith("generator."))


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["nope"], "unknown part 'nope'"),
        (["--fast"], "unrecognized arguments: --fast"),
        (["--docs", "/nonexistent"], "is not the manual's folder"),
    ],
)
def test_a_bad_argument_is_one_line_and_exit_2(args: list[str], said: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        figures.main(args)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and said in err, err


def test_the_command_line_refuses_before_drawing() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tools.manual.figures", "gann"], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": ""},
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "error: unknown part 'gann': choose from metrics, ema, gan, dqn, pinned, benchmarks "
        "(python -m tools.manual.figures --help)"
    ]
