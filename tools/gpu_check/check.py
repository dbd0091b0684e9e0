"""One run on a CUDA machine that proves the copy behaviour there, and writes docs/gpu-results.md.

    bash tools/gpu_check/run.sh                  # on the GPU machine (installs the wheels, then runs this)
    bash tools/gpu_check/run.sh --budget 4       # every benchmark with 4 s of timing per configuration
    bash tools/gpu_check/run.sh --suite          # only the default suite, on the GPU: docs/gpu-suite.md
    python -m tools.gpu_check.check --dry-run --output /tmp/gpu-results.md   # rehearse the flow on a CPU

Steps, each recorded in the report:
  1. the device, torch / lightning versions and the commit;
  2. the device's measured copy bandwidth, device-to-device and pinned host-to-device (the limits the
     benchmarks are compared against);
  3. ``pytest -m gpu``: every CUDA-only test and every device-parametrised test's ``cuda`` case;
  4. every benchmark in GPU mode (STREAM's limit, EMA with and without the non-finite guard, post-hoc EMA, target
     updates, replay buffer, GAN step, batch loading) against the same
     peer libraries as on the CPU where their wheels came along (a peer that is missing gets a row saying so), their
     tables copied into the report, with ``--budget`` passed on when given;
  5. the ``pinned`` recipe at GPU scale (``+pinned=gpu_scale``) with and without the prefetcher: samples/s,
     their ratio and the share of time spent waiting for data, from each run's summary.json;
  6. a short training run of each recipe with ``trainer=gpu``, its summary.json figures.

The report is rewritten after every step, so a check stopped from outside leaves what it measured, headed
``INCOMPLETE`` with the step it was in; ``--time-limit S`` skips the steps that would start after S seconds and names
them (the H200 run of 2026-12-04 with ``--budget 2`` took over 545 s and was stopped in the recipe runs).

The claims the manual makes for a GPU (``docs/guides/testing.md``, "What a GPU run must show") are checked against
what the run measured (``CLAIMS``); the report says which hold. Exit status 1 when a test, a benchmark, a recipe run
or a claim fails. ``--suite`` runs the default suite and the long runs (``pytest -m "not slow"``) instead, as a user
with a GPU would: a separate call, because it takes minutes. ``--dry-run`` runs the steps on the CPU with small
sizes (``-m gpu`` then skips everything, and the claims are reported but not enforced: CPU figures say nothing about a
GPU): it checks the script.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

# The GPU claims of the manual (docs/guides/testing.md, "What a GPU run must show"), checked here.
MIN_PREFETCH_GAIN = 1.3  # pinned at GPU scale: samples/s with the prefetcher over data.prefetch=false
MAX_DATA_WAIT = 0.10  # pinned at GPU scale, with the prefetcher: share of the time spent waiting for data
MIN_COPY_SHARE = 70  # percent of a plain copy's bandwidth: hard_update, soft_update, EMA.update, large models
MIN_LIMIT_SHARE = 85  # percent of the limit for the row's access pattern (STREAM copy, DAXPY): the same rows

RECIPE_RUNS = [
    ("metrics", ["trainer.max_epochs=3"]),
    ("ema", ["trainer.max_epochs=3"]),
    ("gan", ["trainer.max_epochs=20", "trainer.check_val_every_n_epoch=10"]),
    ("dqn", ["model.total_env_steps=5120", "model.eval_every=2560", "model.learning_starts=1024"]),
    ("pinned", ["trainer.max_epochs=5"]),
]
GPU_SCALE = ["+pinned=gpu_scale"]
GPU_SCALE_REHEARSAL = [  # the same configuration at a size a CPU runs in seconds
    "data.size=32", "data.batch_size=64", "data.store_size=256", "data.batches_per_epoch=4", "data.max_shift=4",
    "trainer.max_epochs=2", "trainer.log_every_n_steps=2",
]  # fmt: skip


def copy_bandwidth(device: torch.device, dry_run: bool) -> list[str]:
    """GB/s of a device-to-device copy and of a pinned host-to-device copy (read + write counted once each)."""
    nbytes = (64 if dry_run else 2048) << 20
    rows = []
    source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    rows.append(("device-to-device copy_", _gbs(lambda: target.copy_(source), 2 * nbytes, device)))
    if device.type == "cuda":
        host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        rows.append(
            ("pinned host-to-device copy_", _gbs(lambda: target.copy_(host, non_blocking=True), nbytes, device))
        )
        pageable = torch.empty(nbytes, dtype=torch.uint8)
        rows.append(("pageable host-to-device copy_", _gbs(lambda: target.copy_(pageable), nbytes, device)))
    return [f"| {name} | {gbs:.1f} |" for name, gbs in rows]


def _gbs(fn: object, nbytes: int, device: torch.device) -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()  # type: ignore[operator]
    sync()
    start = time.perf_counter()
    for _ in range(10):
        fn()  # type: ignore[operator]
    sync()
    return 10 * nbytes / (time.perf_counter() - start) / 1e9


def run(command: list[str], log: list[str], timeout: int = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    print("$", " ".join(command), flush=True)
    start = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    log.append(f"$ {' '.join(command)}  (exit {result.returncode}, {time.perf_counter() - start:.0f} s)")
    return result


def train_run(
    recipe: str, overrides: list[str], out: Path, dry_run: bool, log: list[str]
) -> tuple[int, dict[str, float]]:
    """``train.py +recipe=RECIPE`` on the GPU (the CPU in a dry run): exit status and summary.json's metrics."""
    trainer = "trainer=cpu" if dry_run else "trainer=gpu"
    result = run(
        [sys.executable, "train.py", f"+recipe={recipe}", trainer, "trainer.enable_progress_bar=false",
         *overrides, f"hydra.run.dir={out}"], log,
    )  # fmt: skip
    summary = out / "summary.json"
    metrics = json.loads(summary.read_text())["metrics"] if summary.exists() else {}
    return result.returncode, {k: v for k, v in metrics.items() if v is not None}


def read_tables(markdown: str) -> dict[str, dict[str, dict[str, str]]]:
    """The tables ``benchmarks.report.bandwidth_table`` wrote into ``markdown``: {caption: {contender: {column:
    cell}}}, where the caption is the bold text before the table (``**large conv net, hard update**: ...`` ->
    ``large conv net, hard update``)."""
    tables: dict[str, dict[str, dict[str, str]]] = {}
    caption, header = None, None
    for line in markdown.splitlines():
        if line.startswith("**") and "**" in line[2:]:
            caption, header = line[2 : line.index("**", 2)], None
        elif line.startswith("|") and caption is not None:
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            if header is None:
                header = cells
            elif not set(line) <= set("|-: "):
                tables.setdefault(caption, {})[cells[0]] = dict(zip(header, cells, strict=True))
        elif not line.strip() and header is not None:
            caption, header = None, None
    return tables


def copy_share_claims(bench_markdown: str) -> list[tuple[str, bool]]:
    """Each of our updates on each large model: its share of a plain copy's bandwidth against ``MIN_COPY_SHARE``,
    and where the table states rows against the machine's limit (``held to``), its share of that limit against
    ``MIN_LIMIT_SHARE``. No large-model row at all is a failed claim too: a check that finds nothing to check proves
    nothing."""
    claims = []
    for caption, rows in read_tables(bench_markdown).items():
        if not caption.startswith("large"):
            continue
        for contender, cells in rows.items():
            # a guarded update reads the weights more (a check; on a GPU a copy, a mask): its figure is its cost
            if contender.startswith("copy_correct.") and "skip_nonfinite=True" not in contender:
                share = float(cells["% of copy bandwidth"].rstrip("%"))
                claims.append((f"{contender} on {caption}: {share:.0f}% of copy bandwidth "
                               f"(claim: >= {MIN_COPY_SHARE}%)", share >= MIN_COPY_SHARE))  # fmt: skip
                if "% of it" in cells:
                    limit = float(cells["% of it"].rstrip("%"))
                    claims.append((f"{contender} on {caption}: {limit:.0f}% of {cells['held to']} "
                                   f"(claim: >= {MIN_LIMIT_SHARE}%)", limit >= MIN_LIMIT_SHARE))  # fmt: skip
    return claims or [("large-model rows of the EMA and target benchmarks: none found", False)]


def prefetch_claims(with_prefetcher: dict[str, float], without: dict[str, float]) -> list[tuple[str, bool]]:
    """The pinned recipe at GPU scale: the prefetcher's gain in samples/s and its share of time waiting."""
    rate, rate_off = with_prefetcher.get("perf/samples_per_s"), without.get("perf/samples_per_s")
    wait = with_prefetcher.get("perf/data_wait_fraction")
    if rate is None or rate_off is None or wait is None:
        return [("pinned at GPU scale: a run did not report perf/samples_per_s and perf/data_wait_fraction", False)]
    gain = rate / rate_off
    return [
        (f"pinned at GPU scale: the prefetcher runs {gain:.2f}x the samples/s of data.prefetch=false "
         f"(claim: >= {MIN_PREFETCH_GAIN}x)", gain >= MIN_PREFETCH_GAIN),
        (f"pinned at GPU scale, with the prefetcher: {wait:.1%} of the time waiting for data "
         f"(claim: <= {MAX_DATA_WAIT:.0%})", wait <= MAX_DATA_WAIT),
    ]  # fmt: skip


def header(device: torch.device) -> list[str]:
    import lightning

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (dry run: no GPU measured)"
    return [
        f"Written by `tools/gpu_check/check.py` on {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC.\n",
        f"| | |\n| --- | --- |\n| device | {name} |\n| torch | {torch.__version__} |\n"
        f"| lightning | {lightning.__version__} |\n| commit | `{commit or 'unknown'}` |\n",
    ]


def suite(args: argparse.Namespace, device: torch.device) -> int:
    """The default suite as a user with a GPU runs it (the recipes' ``accelerator: auto`` picks the GPU)."""
    log: list[str] = []
    result = run([sys.executable, "-m", "pytest", "-m", "not slow", "-q", "-rfEs", "-p", "no:cacheprovider",
                  "--durations=15"], log, 3600)  # fmt: skip
    lines = result.stdout.strip().splitlines()
    summary = next((line for line in reversed(lines) if re.search(r"\d+ (passed|failed)", line)), "no summary")
    verdict = "all tests passed" if result.returncode == 0 else f"FAILED: {summary}"
    report = [
        "# The default suite on a GPU\n",
        f"**{verdict}**\n",
        *header(device),
        f'## `pytest -m "not slow"`\n\n{summary}\n\n```\n{result.stdout.strip()[-12000:]}\n```',
        "## Commands\n\n" + "\n".join(f"- `{line}`" for line in log),
    ]
    _write(args.output, report)
    print(f"{verdict}\nwrote {args.output}")
    return 0 if result.returncode == 0 else 1


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="rehearse on the CPU with small sizes")
    parser.add_argument(
        "--suite", action="store_true", help='run the default suite and the long runs (-m "not slow") instead'
    )
    parser.add_argument("--budget", type=float, default=None, help="seconds of timing per benchmark configuration")
    parser.add_argument("--output", type=Path, default=None, help="default: docs/gpu-results.md (--suite: gpu-suite)")
    parser.add_argument(
        "--time-limit", type=float, default=None, help="seconds: steps that would start later are not run (named)"
    )
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA GPU is available: run on a GPU machine, or pass --dry-run to rehearse on the CPU")
    if args.budget is not None and not args.budget > 0:
        parser.error(f"--budget must be > 0 seconds, got {args.budget:g}")
    if args.time_limit is not None and not args.time_limit > 0:
        parser.error(f"--time-limit must be > 0 seconds, got {args.time_limit:g}")
    device = torch.device("cpu" if args.dry_run else "cuda")
    if args.output is None:
        args.output = ROOT / "docs" / ("gpu-suite.md" if args.suite else "gpu-results.md")
    if args.suite:
        return suite(args, device)

    log: list[str] = []
    failures: list[str] = []
    claims: list[tuple[str, bool]] = []
    sections = [
        *header(device),
        "## Copy bandwidth (the limit)\n\n| copy | GB/s |\n| --- | ---: |\n"
        + "\n".join(copy_bandwidth(device, args.dry_run)),
    ]
    report = Report(args.output, sections, failures, claims, log, enforced=not args.dry_run)
    clock = Clock(args.time_limit)

    with tempfile.TemporaryDirectory() as tmp:
        if clock.allows("pytest -m gpu", report):
            junit = Path(tmp) / "gpu-tests.xml"
            tests = run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rA", f"--junitxml={junit}"], log, 900)
            summary = tests.stdout.strip().splitlines()[-1] if tests.stdout.strip() else "no output"
            if tests.returncode not in (0, 5):  # 5: nothing collected (a dry run may select nothing)
                failures.append(f"gpu tests: {summary}")
            sections.append(f"## GPU tests (`pytest -m gpu`)\n\n{summary}\n\n" + _test_table(tests.stdout))
            report.write()

        bench_file = Path(tmp) / "bench.md"
        flags = ["--quick", "--budget", "0.5"] if args.dry_run else ["--device", "cuda"]
        if args.budget is not None and not args.dry_run:
            flags += ["--budget", f"{args.budget:g}"]
        sections.append("")  # the benchmarks' tables, as each script adds its section
        for module in BENCHMARKS:
            if not clock.allows(module, report):
                continue
            result = run([sys.executable, "-m", module, *flags, "--output", str(bench_file)], log)
            if result.returncode != 0:
                failures.append(f"{module}: exit {result.returncode}: {result.stderr.strip().splitlines()[-1:]}")
            if bench_file.exists():
                sections[-1] = "## Benchmarks\n\n" + bench_file.read_text().split("\n", 1)[1].strip()
            report.write()
        if bench_file.exists():
            claims += copy_share_claims(bench_file.read_text())

        scale = GPU_SCALE + (GPU_SCALE_REHEARSAL if args.dry_run else [])
        if clock.allows("pinned at GPU scale", report):
            pair = {}
            for prefetch in ("true", "false"):
                overrides = [*scale, f"data.prefetch={prefetch}"]
                code, metrics = train_run("pinned", overrides, Path(tmp) / f"scale-{prefetch}", args.dry_run, log)
                if code != 0:
                    failures.append(f"pinned at GPU scale, data.prefetch={prefetch}: exit {code}")
                pair[prefetch] = metrics
            claims += prefetch_claims(pair["true"], pair["false"])
            sections.append(_scale_table(pair, scale))
            report.write()

        rows = ["| recipe | overrides | exit | figures from summary.json |", "| --- | --- | ---: | --- |"]
        sections.append("")
        for number, (recipe, overrides) in enumerate(RECIPE_RUNS):
            if not clock.allows(f"recipe {recipe}", report):
                continue
            code, metrics = train_run(recipe, overrides, Path(tmp) / f"{number}-{recipe}", args.dry_run, log)
            if code != 0:
                failures.append(f"recipe {recipe}: exit {code}")
            figures = ", ".join(f"{k} {v:.4g}" for k, v in metrics.items() if _shown(k))
            rows.append(f"| {recipe} | `{' '.join(overrides)}` | {code} | {figures} |")
            sections[-1] = "## Recipes with `trainer=gpu`, short runs\n\n" + "\n".join(rows)
            report.write()

    verdict = report.write(finished=True)
    print(f"{verdict}\nwrote {args.output}")
    return 0 if verdict == "all steps passed" else 1


BENCHMARKS = (
    "benchmarks.stream",
    "benchmarks.ema",
    "benchmarks.posthoc_ema",
    "benchmarks.target",
    "benchmarks.replay",
    "benchmarks.gan",
    "benchmarks.loading",
)


class Clock:
    """``--time-limit``: a step that would start after the limit is not run, and the report names it (a device
    machine lent for minutes ends a call at its limit, and a stopped check writes nothing after that)."""

    def __init__(self, limit: float | None) -> None:
        self.limit, self.start, self.skipped = limit, time.perf_counter(), []

    def allows(self, step: str, report: Report) -> bool:
        elapsed = time.perf_counter() - self.start
        if self.limit is None or elapsed < self.limit:
            report.running = step
            report.write()
            return True
        self.skipped.append(step)
        report.skipped = self.skipped
        return False


class Report:
    """The report, rewritten after every step: a check stopped from outside (a call's time limit, a kill) leaves what
    it measured so far, headed ``INCOMPLETE`` with the step it was in."""

    def __init__(self, output: Path, sections: list[str], failures: list[str], claims: list[tuple[str, bool]],
                 log: list[str], enforced: bool) -> None:  # fmt: skip
        self.output, self.sections, self.failures, self.claims, self.log = output, sections, failures, claims, log
        self.enforced, self.running, self.skipped = enforced, "", []

    def write(self, finished: bool = False) -> str:
        unmet = [f"claim not met: {text}" for text, held in self.claims if self.enforced and not held]
        failures = self.failures + unmet
        if not finished:
            verdict = f"INCOMPLETE: stopped during {self.running or 'the first step'}"
        elif self.skipped:
            verdict = "INCOMPLETE: not run within --time-limit: " + ", ".join(self.skipped)
        else:
            verdict = "all steps passed" if not failures else ""
        if failures:
            verdict = "; ".join(filter(None, [verdict, "FAILED: " + "; ".join(failures)]))
        claims = [_claims_section(self.claims, self.enforced)] if finished else []
        commands = "## Commands\n\n" + "\n".join(f"- `{line}`" for line in self.log)
        _write(self.output, ["# GPU results\n", f"**{verdict}**\n", *claims, *self.sections, commands])
        return verdict


def _claims_section(claims: list[tuple[str, bool]], enforced: bool) -> str:
    note = "" if enforced else " (dry run: CPU figures, reported, not enforced)"
    lines = [f"- {'held' if held else 'NOT MET'}: {text}" for text, held in claims]
    return f"## The manual's GPU claims{note}\n\n" + "\n".join(lines)


def _scale_table(pair: dict[str, dict[str, float]], overrides: list[str]) -> str:
    rows = ["| data.prefetch | samples/s | waiting for data | val/acc |", "| --- | ---: | ---: | ---: |"]
    for prefetch, metrics in pair.items():
        rate, wait = (
            metrics.get("perf/samples_per_s", float("nan")),
            metrics.get("perf/data_wait_fraction", float("nan")),
        )
        rows.append(f"| {prefetch} | {rate:,.0f} | {wait:.1%} | {metrics.get('val/acc', float('nan')):.4f} |")
    command = f"python train.py +recipe=pinned {' '.join(overrides)} trainer=gpu data.prefetch=true|false"
    return f"## `pinned` at GPU scale\n\n`{command}`; last epoch's figures from summary.json.\n\n" + "\n".join(rows)


def _write(path: Path, sections: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join(section.strip() for section in sections if section.strip()) + "\n")


def _shown(key: str) -> bool:
    return key.startswith(("val/", "eval/", "quality/", "perf/")) and not key.endswith("_step")


def _test_table(output: str) -> str:
    lines = [line for line in output.splitlines() if re.match(r"^(PASSED|FAILED|SKIPPED|ERROR)", line)]
    return "```\n" + ("\n".join(lines) if lines else output.strip()[-2000:]) + "\n```"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
