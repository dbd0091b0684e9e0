"""The benchmark scripts run end to end (small sizes) and write their section; no timing is asserted."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.peers import Missing, load, timm_model_ema
from benchmarks.report import bandwidth_table, write_section
from tools.gpu_check.check import (
    MAX_DATA_WAIT,
    MIN_COPY_SHARE,
    MIN_LIMIT_SHARE,
    MIN_PREFETCH_GAIN,
    copy_share_claims,
    prefetch_claims,
    read_tables,
)

ROOT = Path(__file__).resolve().parents[2]


PEERS = {  # the rows each benchmark has for a peer library: (import name, row text)
    "benchmarks.ema": [("timm", "timm "), ("diffusers", "diffusers "), ("ema_pytorch", "ema-pytorch ")],
    "benchmarks.posthoc_ema": [("ema_pytorch", "ema-pytorch ")],
    "benchmarks.compiled_ema": [("timm", "timm "), ("diffusers", "diffusers "), ("ema_pytorch", "ema-pytorch ")],
    "benchmarks.lora_ema": [("timm", "timm "), ("diffusers", "diffusers "), ("ema_pytorch", "ema-pytorch ")],
    "benchmarks.target": [("stable_baselines3", "stable-baselines3 "), ("torchrl", "torchrl ")],
    "benchmarks.replay": [("stable_baselines3", "stable-baselines3 "), ("torchrl", "torchrl ")],
    "benchmarks.frame_replay": [("stable_baselines3", "stable-baselines3 "), ("torchrl", "torchrl ")],
    "benchmarks.n_step": [("stable_baselines3", "stable-baselines3 ")],
}
NEEDS_ALE = pytest.mark.skipif(importlib.util.find_spec("ale_py") is None, reason="the atari extra (ale-py)")


@pytest.mark.long  # each a benchmark's quick run in a process of its own, 5-15 s
@pytest.mark.parametrize(("module", "key", "first_row", "ratio"), [
    ("benchmarks.ema", "ema-cpu", "| copy_correct.EMA.update, skip_nonfinite=False |", "time / ours"),
    ("benchmarks.lora_ema", "lora-ema-cpu", "| copy_correct EMA(trainable_only=True) |", "time / ours"),
    ("benchmarks.compiled_ema", "compiled-ema-cpu", "| copy_correct EMA, eager step | 0 |",
     "time / eager step with our EMA"),
    ("benchmarks.posthoc_ema", "posthoc-ema-cpu", "| copy_correct.PowerEMA.update, skip_nonfinite=False |",
     "mean error / ours"),
    ("benchmarks.model_changes", "model-changes-cpu", "| EMA.update (the check: one integer compare) |",
     "time / update"),
    ("benchmarks.target", "target-cpu", "| copy_correct.hard_update |", "time / ours"),
    ("benchmarks.stream", "stream-cpu", "| copy | `c.copy_(a)` | 2 | 3 |", "% of DAXPY moved"),
    ("benchmarks.gan", "gan-cpu", "| 64, 256 | ours: G once, detach, frozen D |", "time / ours"),
    ("benchmarks.loading", "loading-cpu", "| DeviceDataLoader (cpu) |", "time / bare loader"),
    ("benchmarks.sharded", "sharded-cpu", "| copy_correct.EMA (sharded) | 2 |", "each rank alone (/ N=1)"),
    ("benchmarks.replay", "replay-cpu", "| 10 adds + sample 128 (CleanRL's cadence) |", "copy_correct.ReplayBuffer µs"),
    ("benchmarks.n_step", "n-step-cpu", "| sample 32, one env |", "copy_correct.ReplayBuffer(n_steps=3) µs"),
    ("benchmarks.prioritized", "prioritized-cpu", "| sample 32 + update_priorities 32 |",
     "ours, uniform / ours"),
    pytest.param("benchmarks.frame_replay", "frame-replay-cpu", "| copy_correct.FrameReplayBuffer | ",
                 "Pong: size / ours", marks=NEEDS_ALE),
])  # fmt: skip
def test_benchmark_writes_its_section_beside_the_others_with_a_row_per_peer(
    module: str, key: str, first_row: str, ratio: str, tmp_path: Path
) -> None:
    """The quick mode of each benchmark. A peer library that is installed (the ``bench`` extra) has timed rows;
    one that is not has rows that say so and how to install it, and the script still succeeds."""
    output = tmp_path / "benchmarks.md"
    output.write_text("# Benchmarks\n\n<!-- other:start -->\nkept\n<!-- other:end -->\n")
    result = subprocess.run(
        [sys.executable, "-m", module, "--quick", "--budget", "0.3", "--output", str(output)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    text = output.read_text()
    assert text.count(f"<!-- {key}:start -->") == 1 and "kept" in text
    assert first_row in text and ratio in text
    for peer, name in PEERS.get(module, []):
        lines = [line for line in text.splitlines() if name in line]
        said_missing = [line for line in lines if "not installed" in line or "not run" in line.lower()]
        if importlib.util.find_spec(peer) is not None:  # the bench extra is installed: real rows, no excuses
            assert lines and not said_missing, (peer, said_missing)
        else:
            assert said_missing and all("not installed" in line for line in said_missing), (peer, lines)


def test_stream_measures_every_kernel_counted_both_ways_with_positive_rates(tmp_path: Path) -> None:
    """``benchmarks.stream``'s quick run: STREAM's four kernels and our updates' calls, each with its streams counted
    STREAM's way and with write-allocate, and a positive rate; no time is asserted."""
    output = tmp_path / "benchmarks.md"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.stream", "--quick", "--budget", "0.2", "--output", str(output)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    tables = read_tables(output.read_text())
    stream = next(rows for caption, rows in tables.items() if caption.startswith("STREAM"))
    assert list(stream)[:5] == ["copy", "scale", "add", "triad", "daxpy"] and len(stream) == 8
    counts = {"copy": ("2", "3"), "scale": ("2", "3"), "add": ("3", "4"), "triad": ("3", "4"), "daxpy": ("3", "3")}
    for kernel, cells in stream.items():
        assert set(cells) >= {"streams (STREAM)", "streams moved (write-allocate)", "best GB/s (STREAM)",
                              "median GB/s (STREAM)", "best GB/s moved", "% of copy moved",
                              "% of DAXPY moved"}  # fmt: skip
        if kernel in counts:
            assert (cells["streams (STREAM)"], cells["streams moved (write-allocate)"]) == counts[kernel]
        assert float(cells["best GB/s (STREAM)"]) > 0 and float(cells["% of DAXPY moved"].rstrip("%")) > 0
    assert stream["copy"]["% of copy moved"] == stream["daxpy"]["% of DAXPY moved"] == "100%"
    copies = next(rows for caption, rows in tables.items() if caption.startswith("A copy"))
    assert "STREAM copy" in copies and all(float(cells["best GB/s (STREAM)"]) > 0 for cells in copies.values())


def test_a_limit_holds_a_copy_to_stream_copy_and_an_update_in_place_to_daxpy() -> None:
    from benchmarks.stream import StreamLimit

    limit = StreamLimit("cpu", 140.0, copy_median=20.0, triad_median=30.0, daxpy_median=48.0, write_allocate=True)
    assert [limit.moved(k) for k in ("copy", "triad", "daxpy")] == [30.0, 40.0, 48.0]  # 3 of 2 streams, 4 of 3, 3
    times = {"ours": 1.0, "copy": 1.0}  # 1M elements a ms: 8 GB/s a copy, 12 an update, counted STREAM's way
    table = bandwidth_table("**t**: x", 1_000_000, times, {"ours": 12, "copy": 8}, "ours", "copy", limit=limit)
    rows = read_tables(table)["t"]
    assert rows["copy"]["GB/s moved"] == "12.0" and rows["copy"]["held to"] == "STREAM copy"  # + write-allocate
    assert rows["copy"]["% of it"] == "40%"
    assert rows["ours"]["GB/s moved"] == "12.0" and rows["ours"]["held to"] == "DAXPY"  # in place: none
    assert rows["ours"]["% of it"] == "25%"  # not triad's 30%: triad is no ceiling for an update in place
    assert rows["ours"]["% of copy bandwidth"] == "150%"  # the old column, kept
    gpu = bandwidth_table("**t**: x", 1_000_000, times, {"ours": 12, "copy": 8}, "ours", "copy",
                          limit=StreamLimit("cuda", 1.0, 20.0, 30.0, 30.0, write_allocate=False))  # fmt: skip
    assert read_tables(gpu)["t"]["copy"]["GB/s moved"] == "8.0"
    assert "DAXPY (in place) 48.0" in limit.sentence() and "48.0" in limit.sentence().split("write-allocate")[1]


def test_the_limits_timed_in_a_benchmarks_rounds_need_no_refill() -> None:
    """A benchmark's rounds time a batch of calls whole: ``in_rounds``' kernels keep their arrays' values bounded
    however often they run, so no refill (three more streams) is timed with them. The control: STREAM's own
    rotation grows the arrays 15x a round, and needs its refill."""
    from benchmarks.stream import Arrays

    arrays = Arrays(1024, torch.device("cpu"))
    for _ in range(200):
        for kernel in arrays.limits().values():
            kernel()
    assert all(bool(torch.isfinite(t).all()) and float(t.abs().max()) < 1e6 for t in (arrays.a, arrays.b, arrays.c))
    arrays.refill()
    rotation = arrays.kernels(extra=False)
    for _ in range(7):  # fewer than a refill's 8 triads
        for name in ("copy", "scale", "add", "triad"):
            rotation[name]()
    assert float(arrays.a.abs().max()) > 1e6


def test_a_section_written_again_replaces_the_old_one(tmp_path: Path) -> None:
    output = tmp_path / "benchmarks.md"
    write_section(output, "ema-cpu", "EMA update (cpu)", "first header", "first body")
    write_section(output, "other", "Other", "kept header", "kept body")
    write_section(output, "ema-cpu", "EMA update (cpu)", "second header", "second body")
    text = output.read_text()
    assert text.count("<!-- ema-cpu:start -->") == 1 and "second body" in text and "first body" not in text
    assert "kept body" in text and text.index("second body") < text.index("kept body")  # in its old place


def test_a_peer_that_is_not_installed_is_a_row_saying_how_to_install_it() -> None:
    missing = load("no_such_peer.utils", "no-such-peer")
    assert isinstance(missing, Missing) and missing.startswith("no-such-peer not installed (pip install -e '.[bench]'")
    table = bandwidth_table("**t**: x", 10, {"ours": 1.0, "copy": 0.5}, {"ours": 8, "copy": 8}, "ours", "copy",
                            {"peer 1.0 EMA": missing})  # fmt: skip
    assert table.endswith(f"| peer 1.0 EMA | not run: {missing} | - | - | - |")


@pytest.mark.skipif(importlib.util.find_spec("timm") is None, reason="timm is not installed (the bench extra's note)")
def test_timms_ema_classes_load_from_the_installed_package_even_where_timm_cannot_import() -> None:
    """timm requires torchvision; without it ``import timm`` fails, and its EMA file, which needs only torch, is
    loaded from the installed package: the same code its users run."""
    module = timm_model_ema()
    assert not isinstance(module, Missing), module
    spec = importlib.util.find_spec("timm")
    assert spec is not None and spec.submodule_search_locations is not None
    assert Path(module.__file__).resolve() == Path(next(iter(spec.submodule_search_locations)), "utils",
                                                    "model_ema.py").resolve()  # fmt: skip
    model = torch.nn.Linear(3, 2)
    ema = module.ModelEmaV3(model, decay=0.5)
    with torch.no_grad():
        model.weight.add_(2.0)
    ema.update(model, step=10)
    assert torch.allclose(ema.module.weight, model.weight - 1.0)


@pytest.mark.parametrize("args", [["--budget", "0"], ["--budget", "soon"], ["--no-such-option"]])
def test_a_bad_argument_is_one_line_and_status_2(args: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.replay", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stderr.startswith("python -m benchmarks.replay: ")


def test_cuda_mode_without_a_gpu_is_a_clear_error() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.ema", "--device", "cuda"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 2 and "needs a CUDA GPU" in result.stderr


@pytest.mark.slow
def test_gpu_check_dry_run_writes_a_report(tmp_path: Path) -> None:
    """The GPU verification script's whole flow, rehearsed on the CPU (about a minute)."""
    report = tmp_path / "gpu-results.md"
    result = subprocess.run(
        [sys.executable, "-m", "tools.gpu_check.check", "--dry-run", "--output", str(report)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    text = report.read_text()
    assert "**all steps passed**" in text and "## Benchmarks" in text
    for recipe in ("metrics", "ema", "gan", "dqn", "pinned"):
        assert re.search(rf"^\| {recipe} \| [^|]* \| 0 \|", text, re.MULTILINE), recipe
    assert "## `pinned` at GPU scale" in text and re.search(r"^\| false \| [\d,]+ \|", text, re.MULTILINE)
    assert "## The manual's GPU claims (dry run" in text  # reported, not enforced


def test_gpu_check_past_its_time_limit_names_every_step_it_did_not_run(tmp_path: Path) -> None:
    """A check out of time writes a report that names each step it did not run, and fails."""
    report = tmp_path / "gpu-results.md"
    result = subprocess.run(
        [sys.executable, "-m", "tools.gpu_check.check", "--dry-run", "--time-limit", "1e-9", "--output", str(report)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    verdict = report.read_text().splitlines()[2]
    assert verdict.startswith("**INCOMPLETE: not run within --time-limit: pytest -m gpu, benchmarks.stream")
    assert verdict.count(", ") == 13 and "recipe pinned" in verdict  # 1 + 7 benchmarks + GPU scale + 5 recipes
    assert "## Copy bandwidth" in report.read_text() and "## Benchmarks" not in report.read_text()


def test_gpu_check_refuses_to_run_without_a_gpu() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    result = subprocess.run([sys.executable, "-m", "tools.gpu_check.check"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 2 and "--dry-run" in result.stderr


def test_bench_tables_read_back_as_written() -> None:
    times = {"copy_correct.hard_update": 0.1, "bare": 0.09, "plain copy": 0.05}
    text = bandwidth_table("**large conv net, hard update**: 24M", 1_000_000, times, dict.fromkeys(times, 8),
                           "copy_correct.hard_update", "plain copy")  # fmt: skip
    table = read_tables(f"# Section\n\n{text}\n\n**other**: x\n\n| a | b |\n| --- | --- |\n| 1 | 2 |\n")
    assert set(table) == {"large conv net, hard update", "other"}
    row = table["large conv net, hard update"]["copy_correct.hard_update"]
    assert row["% of copy bandwidth"] == "50%" and row["time / ours"] == "1.00x"
    assert table["other"] == {"1": {"a": "1", "b": "2"}}


def test_gpu_check_holds_our_large_model_updates_to_the_claimed_share_of_copy_bandwidth() -> None:
    times = {"copy_correct.soft_update": 0.1, "plain copy": 0.05}  # 12 vs 8 bytes per element: 75%
    good = bandwidth_table("**large model (conv net)**: x", 1000, times, {"copy_correct.soft_update": 12,
                           "plain copy": 8}, "copy_correct.soft_update", "plain copy")  # fmt: skip
    slow = good.replace("| 75%", "| 58%")
    small = good.replace("large model", "small model")
    assert copy_share_claims(good) == [("copy_correct.soft_update on large model (conv net): 75% of copy bandwidth "
                                        f"(claim: >= {MIN_COPY_SHARE}%)", True)]  # fmt: skip
    assert not copy_share_claims(slow)[0][1]
    assert copy_share_claims(small) == [("large-model rows of the EMA and target benchmarks: none found", False)]
    from benchmarks.stream import StreamLimit

    for daxpy, held in ((14.0, True), (16.0, False)):  # ours moves 12 GB/s: 86% of 14, 75% of 16
        limit = StreamLimit("cuda", 1.0, copy_median=20.0, triad_median=20.0, daxpy_median=daxpy, write_allocate=False)
        stated = bandwidth_table("**large model (conv net)**: x", 1000, {**times, "copy_correct.soft_update": 0.001},
                                 {"copy_correct.soft_update": 12, "plain copy": 8}, "copy_correct.soft_update",
                                 "plain copy", limit=limit)  # fmt: skip
        claim = copy_share_claims(stated)[1]
        assert claim == (f"copy_correct.soft_update on large model (conv net): {12 / daxpy:.0%} of DAXPY "
                         f"(claim: >= {MIN_LIMIT_SHARE}%)", held)  # fmt: skip


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
    assert f"at least {MIN_LIMIT_SHARE}% of the device's limit" in manual


@pytest.mark.parametrize(("code", "verdict"), [(0, "**all tests passed**"), (1, "**FAILED: 1 failed, 372 passed")])
def test_gpu_check_suite_mode_reports_pytests_verdict(
    code: int, verdict: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--suite`` runs the default suite (here a stand-in for it) and writes its own report."""
    import tools.gpu_check.check as gpu_check

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


def test_the_readmes_headline_figures_against_the_peer_libraries_are_in_the_benchmark_tables() -> None:
    """Each CPU ratio the README's headline table gives for the EMA, target and replay benchmarks is a ratio in
    docs/benchmarks.md, so that regenerating the tables without the headline (or the reverse) fails here."""
    readme = (ROOT / "README.md").read_text()
    tables = (ROOT / "docs" / "benchmarks.md").read_text()
    rows = [line for line in readme.split("## Headline figures")[1].split("\n## ")[0].splitlines()
            if line.startswith("| ") and re.search(r"benchmarks\.(ema|target|replay)\b", line)]  # fmt: skip
    assert len(rows) == 6, rows
    for row in rows:
        cpu = row.strip("|").split("|")[2]
        figures = re.findall(r"\d+\.\d+x", cpu)
        assert figures, row
        missing = [f for f in figures if f"| {f} |" not in tables]
        assert not missing, (row, missing)
