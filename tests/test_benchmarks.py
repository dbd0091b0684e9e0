"""The benchmark scripts run end to end (small sizes) and write their section; no timing is asserted."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.bench_report import bandwidth_table, read_tables
from scripts.gpu_check import MAX_DATA_WAIT, MIN_COPY_SHARE, MIN_PREFETCH_GAIN, copy_share_claims, prefetch_claims

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("script", "key", "first_row", "ratio"), [
    ("bench_ema.py", "ema-cpu", "| components.EMA.update |", "time / ours"),
    ("bench_target.py", "target-cpu", "| components.hard_update |", "time / ours"),
    ("bench_gan.py", "gan-cpu", "| 64, 256 | ours: G once, detach, frozen D |", "time / ours"),
    ("bench_loading.py", "loading-cpu", "| DeviceDataLoader (cpu) |", "time / bare loader"),
    ("bench_sharded.py", "sharded-cpu", "| components.EMA (sharded) | 2 |", "each rank alone (/ N=1)"),
    ("bench_replay.py", "replay-cpu", "| 10 adds + sample 128 (CleanRL's cadence) |", "peer / ours"),
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


@pytest.mark.parametrize("args", [["--budget", "0"], ["--budget", "soon"], ["--no-such-option"]])
def test_a_bad_argument_is_one_line_and_status_2(args: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, "scripts/bench_replay.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stderr.startswith("bench_replay.py: ")


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
    assert "## `pinned` at GPU scale" in text and re.search(r"^\| false \| [\d,]+ \|", text, re.MULTILINE)
    assert "## The manual's GPU claims (dry run" in text  # reported, not enforced


def test_gpu_check_refuses_to_run_without_a_gpu() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    result = subprocess.run([sys.executable, "scripts/gpu_check.py"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 2 and "--dry-run" in result.stderr


def test_bench_tables_read_back_as_written() -> None:
    times = {"components.hard_update": 0.1, "bare": 0.09, "plain copy": 0.05}
    text = bandwidth_table("**large conv net, hard update**: 24M", 1_000_000, times, dict.fromkeys(times, 8),
                           "components.hard_update", "plain copy")  # fmt: skip
    table = read_tables(f"# Section\n\n{text}\n\n**other**: x\n\n| a | b |\n| --- | --- |\n| 1 | 2 |\n")
    assert set(table) == {"large conv net, hard update", "other"}
    row = table["large conv net, hard update"]["components.hard_update"]
    assert row["% of copy bandwidth"] == "50%" and row["time / ours"] == "1.00x"
    assert table["other"] == {"1": {"a": "1", "b": "2"}}


def test_gpu_check_holds_our_large_model_updates_to_the_claimed_share_of_copy_bandwidth() -> None:
    times = {"components.soft_update": 0.1, "plain copy": 0.05}  # 12 vs 8 bytes per element: 75%
    good = bandwidth_table("**large model (conv net)**: x", 1000, times, {"components.soft_update": 12,
                           "plain copy": 8}, "components.soft_update", "plain copy")  # fmt: skip
    slow = good.replace("| 75%", "| 58%")
    small = good.replace("large model", "small model")
    assert copy_share_claims(good) == [("components.soft_update on large model (conv net): 75% of copy bandwidth "
                                        f"(claim: >= {MIN_COPY_SHARE}%)", True)]  # fmt: skip
    assert not copy_share_claims(slow)[0][1]
    assert copy_share_claims(small) == [("large-model rows of the EMA and target benchmarks: none found", False)]


def test_gpu_check_holds_the_prefetcher_to_its_claimed_gain_and_waiting_share() -> None:
    on = {"perf/samples_per_s": 13000.0, "perf/data_wait_fraction": 0.05}
    off = {"perf/samples_per_s": 10000.0, "perf/data_wait_fraction": 0.01}
    assert [held for _, held in prefetch_claims(on, off)] == [True, True]
    assert [held for _, held in prefetch_claims({**on, "perf/samples_per_s": 12000.0}, off)] == [False, True]
    assert [held for _, held in prefetch_claims({**on, "perf/data_wait_fraction": 0.2}, off)] == [True, False]
    assert [held for _, held in prefetch_claims({}, off)] == [False]


def test_the_manual_states_the_claims_the_gpu_check_enforces() -> None:
    manual = " ".join((ROOT / "docs" / "guides" / "testing.md").read_text().split())  # lines wrap anywhere
    assert f"at least {MIN_PREFETCH_GAIN}x" in manual and f"at most {MAX_DATA_WAIT:.0%}" in manual
    assert f"at least {MIN_COPY_SHARE}% of a plain copy's bandwidth" in manual


@pytest.mark.parametrize(("code", "verdict"), [(0, "**all tests passed**"), (1, "**FAILED: 1 failed, 372 passed")])
def test_gpu_check_suite_mode_reports_pytests_verdict(
    code: int, verdict: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--suite`` runs the default suite (here a stand-in for it) and writes its own report."""
    import scripts.gpu_check as gpu_check

    summary = "1 failed, 372 passed, 106 skipped in 463.52s" if code else "373 passed, 106 skipped in 463.52s"
    ran: list[list[str]] = []

    def fake_run(command: list[str], log: list[str], timeout: int = 600) -> subprocess.CompletedProcess[str]:
        ran.append(command)
        log.append(f"$ {' '.join(command)}  (exit {code})")
        return subprocess.CompletedProcess(command, code, stdout=f"....\n{summary}\n", stderr="")

    monkeypatch.setattr(gpu_check, "run", fake_run)
    report = tmp_path / "suite.md"
    assert gpu_check.main(["--dry-run", "--suite", "--output", str(report)]) == code
    (command,) = ran
    assert command[command.index("-m", 2) + 1] == "not slow"
    text = report.read_text()
    assert text.startswith("# The default suite on a GPU") and verdict in text and summary in text
