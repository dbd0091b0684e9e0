"""``benchmarks/dqn_loop.py`` runs end to end at its smallest and writes its section, a row per contender: timed, or
saying why not (stable-baselines3 not installed; a ``compress=`` that ``FrameReplayBuffer`` does not take here); it
draws the DQN page's figure only into the manual. No timing is asserted."""

from __future__ import annotations

import importlib.util
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.dqn_loop import CONTENDERS, SB3
from benchmarks.report import write_section
from copy_correct import FrameReplayBuffer
from tools.manual.figure_bench import DQN_LOOP, dqn_loop_figure
from tools.manual.figure_pages import FIGURES, figure_blocks

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("ale_py") is None, reason="the atari extra (ale-py)")
def test_the_quick_run_writes_a_row_per_contender_beside_the_other_sections(tmp_path: Path) -> None:
    output = tmp_path / "benchmarks.md"
    output.write_text("# Benchmarks\n\n<!-- other:start -->\nkept\n<!-- other:end -->\n")
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.dqn_loop", "--quick", "--budget", "0.3", "--output", str(output)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    text = output.read_text()
    assert text.count("<!-- dqn-loop-cpu:start -->") == 1 and "kept" in text
    assert "loop: stable-baselines3 / ours" in text and "sample: stable-baselines3 / ours" in text
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}
    compress = "compress" in inspect.signature(FrameReplayBuffer).parameters
    for key, (name, _) in CONTENDERS.items():
        said = rows[name]
        if key == SB3 and importlib.util.find_spec("stable_baselines3") is None:
            assert "not installed" in said
        elif "compress=" in name and not compress:
            assert "not run: FrameReplayBuffer does not take it here" in said and "compress" in said
        else:
            assert "not run" not in said and float(said.split("|")[2]) > 0, said  # steps/s
    assert "figure:" not in text and not (tmp_path / FIGURES).exists()  # not the manual: no chart, no figure


def test_the_dqn_pages_chart_is_drawn_from_the_loops_tables_into_its_block(tmp_path: Path) -> None:
    """The tables as ``loop_table`` and ``calls_table`` write them; a buffer not run (``-``) has no bar."""
    (tmp_path / "index.md").write_text("# Manual\n")
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "dqn.md").write_text(
        "# dqn\n\n<!-- figure:dqn-loop:start -->\n<!-- figure:dqn-loop:end -->\n"
    )
    names = [name for name, _ in CONTENDERS.values()]
    loop = (
        "| buffer | steps/s | loop: stable-baselines3 / ours |\n| --- | ---: | ---: |\n"
        + "".join(f"| {name} | 100.0 | {1 + i / 10:.3f}x |\n" for i, name in enumerate(names[:3]))
        + f"| {names[3]} | not run: why | - |\n"
    )
    calls = "| buffer | add µs | add: stable-baselines3 / ours |\n| --- | ---: | ---: |\n" + "".join(
        f"| {name} | 5.0 | 0.80x |\n" for name in names[:3]
    )
    write_section(tmp_path / "benchmarks.md", DQN_LOOP, "The DQN loop (cpu)", "Measured with `x`.",
                  f"**The loop**: 2 rounds\n\n{loop}\n**The calls alone**: 2 rounds\n\n{calls}")  # fmt: skip
    assert dqn_loop_figure(tmp_path, "Made by `x`.") == tmp_path / FIGURES / "dqn-loop.png"
    body = figure_blocks((tmp_path / "recipes" / "dqn.md").read_text())["dqn-loop"]
    assert "](../figures/dqn-loop.png)" in body and "Made by `x`." in body
    assert (tmp_path / FIGURES / "dqn-loop.png").stat().st_size > 0


def test_control_no_chart_without_the_section_or_the_block(tmp_path: Path) -> None:
    (tmp_path / "benchmarks.md").write_text("# Benchmarks\n")
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "dqn.md").write_text("# dqn\n")
    assert dqn_loop_figure(tmp_path, "Made by `x`.") is None
    assert not (tmp_path / FIGURES).exists()
