"""The benchmark scripts run end to end (small sizes) and write their section; no timing is asserted."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("script", "key", "first_row", "ratio"), [
    ("bench_ema.py", "ema-cpu", "| components.EMA.update |", "time / ours"),
    ("bench_target.py", "target-cpu", "| components.hard_update |", "time / ours"),
    ("bench_gan.py", "gan-cpu", "| 64, 256 | ours: G once, detach, frozen D |", "time / ours"),
    ("bench_loading.py", "loading-cpu", "| DeviceDataLoader (cpu) |", "time / bare loader"),
])  # fmt: skip
def test_benchmark_writes_its_section_and_keeps_the_others(
    script: str, key: str, first_row: str, ratio: str, tmp_path: Path
) -> None:
    output = tmp_path / "benchmarks.md"
    output.write_text("# Benchmarks\n\n<!-- other:start -->\nkept\n<!-- other:end -->\n")
    for _ in range(2):  # the second run replaces the section instead of appending another
        result = subprocess.run(
            [sys.executable, f"scripts/{script}", "--quick", "--budget", "0.3", "--output", str(output)],
            cwd=ROOT, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
    text = output.read_text()
    assert text.count(f"<!-- {key}:start -->") == 1 and "kept" in text
    assert first_row in text and ratio in text


def test_cuda_mode_without_a_gpu_is_a_clear_error() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    result = subprocess.run(
        [sys.executable, "scripts/bench_ema.py", "--device", "cuda"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 2 and "needs a CUDA GPU" in result.stderr


@pytest.mark.slow
def test_gpu_check_dry_run_writes_a_report(tmp_path: Path) -> None:
    """The GPU verification script's whole flow, rehearsed on the CPU (about a minute)."""
    report = tmp_path / "gpu-results.md"
    result = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--dry-run", "--output", str(report)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    text = report.read_text()
    assert "**all steps passed**" in text and "## Benchmarks" in text
    for recipe in ("metrics", "ema", "gan", "dqn", "pinned"):
        assert re.search(rf"^\| {recipe} \| [^|]* \| 0 \|", text, re.MULTILINE), recipe


def test_gpu_check_refuses_to_run_without_a_gpu() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    result = subprocess.run([sys.executable, "scripts/gpu_check.py"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 2 and "--dry-run" in result.stderr
