"""``python -m scripts.copy_report``: what one steady-state training step of a recipe copies, and the memory each
step leaves behind (``StepProbe``'s report), from the command line; a missing recipe is one line and exit 2."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT


def test_copy_report_script_on_the_metrics_recipe() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "scripts.copy_report", "+recipe=metrics", "--start", "3", "--steps", "30"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "one training batch (batch 3)" in result.stdout
    assert "memory over 30 batches: growth" in result.stdout
    assert "_fused_adamw_" in result.stdout


def test_copy_report_script_rejects_a_missing_recipe() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "scripts.copy_report"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and "no recipe given" in result.stderr
