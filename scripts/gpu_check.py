"""One run on a CUDA machine that proves the copy behaviour there, and writes docs/gpu-results.md.

    bash scripts/gpu_check.sh                 # on the GPU machine (installs the wheels, then runs this)
    python scripts/gpu_check.py --dry-run --output /tmp/gpu-results.md   # rehearse the flow on a CPU

Steps, each recorded in the report:
  1. the device, torch / lightning versions and the commit;
  2. the device's measured copy bandwidth, device-to-device and pinned host-to-device (the limits the
     benchmarks are compared against);
  3. ``pytest -m gpu``: every CUDA-only test and every device-parametrised test's ``cuda`` case;
  4. every benchmark in GPU mode (EMA, target updates, GAN step, batch loading), their tables copied into the
     report;
  5. a short training run of each recipe with ``trainer=gpu``, its summary.json figures.

Exit status 1 when a test or a recipe run fails. ``--dry-run`` runs the same steps on the CPU with small
sizes (``-m gpu`` then skips everything): it checks the script, not the GPU.
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

ROOT = Path(__file__).resolve().parents[1]

RECIPE_RUNS = [
    ("metrics", ["trainer.max_epochs=3"]),
    ("ema", ["trainer.max_epochs=3"]),
    ("gan", ["trainer.max_epochs=20", "trainer.check_val_every_n_epoch=10"]),
    ("dqn", ["model.total_env_steps=5120", "model.eval_every=2560", "model.learning_starts=1024"]),
    ("pinned", ["trainer.max_epochs=5"]),
    ("pinned", ["trainer.max_epochs=5", "data.prefetch=false"]),
]


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
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    log.append(f"$ {' '.join(command)}  (exit {result.returncode})")
    return result


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="rehearse on the CPU with small sizes")
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "gpu-results.md")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA GPU is available: run on a GPU machine, or pass --dry-run to rehearse on the CPU")
    device = torch.device("cpu" if args.dry_run else "cuda")
    log: list[str] = []
    failures: list[str] = []
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    import lightning

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (dry run: no GPU measured)"
    sections = [
        "# GPU results\n",
        f"Written by `scripts/gpu_check.py` on {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC.\n",
        f"| | |\n| --- | --- |\n| device | {name} |\n| torch | {torch.__version__} |\n"
        f"| lightning | {lightning.__version__} |\n| commit | `{commit or 'unknown'}` |\n",
        "## Copy bandwidth (the limit)\n\n| copy | GB/s |\n| --- | ---: |\n"
        + "\n".join(copy_bandwidth(device, args.dry_run)),
    ]

    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "gpu-tests.xml"
        tests = run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rA", f"--junitxml={junit}"], log, 900)
        summary = tests.stdout.strip().splitlines()[-1] if tests.stdout.strip() else "no output"
        if tests.returncode not in (0, 5):  # 5: nothing collected (a dry run may select nothing)
            failures.append(f"gpu tests: {summary}")
        sections.append(f"## GPU tests (`pytest -m gpu`)\n\n{summary}\n\n" + _test_table(tests.stdout))

        bench_file = Path(tmp) / "bench.md"
        flags = ["--quick", "--budget", "0.5"] if args.dry_run else ["--device", "cuda"]
        for script in ("bench_ema.py", "bench_target.py", "bench_gan.py", "bench_loading.py"):
            result = run([sys.executable, f"scripts/{script}", *flags, "--output", str(bench_file)], log)
            if result.returncode != 0:
                failures.append(f"{script}: exit {result.returncode}: {result.stderr.strip().splitlines()[-1:]}")
        if bench_file.exists():
            sections.append("## Benchmarks\n\n" + bench_file.read_text().split("\n", 1)[1].strip())

        rows = ["| recipe | overrides | exit | figures from summary.json |", "| --- | --- | ---: | --- |"]
        for number, (recipe, overrides) in enumerate(RECIPE_RUNS):
            out = Path(tmp) / f"{number}-{recipe}"
            trainer = "trainer=cpu" if args.dry_run else "trainer=gpu"
            result = run(
                [sys.executable, "train.py", f"+recipe={recipe}", trainer, "trainer.enable_progress_bar=false",
                 *overrides, f"hydra.run.dir={out}"], log,
            )  # fmt: skip
            figures = ""
            if (out / "summary.json").exists():
                metrics = json.loads((out / "summary.json").read_text())["metrics"]
                figures = ", ".join(f"{k} {v:.4g}" for k, v in metrics.items() if v is not None and _shown(k))
            if result.returncode != 0:
                failures.append(f"recipe {recipe}: exit {result.returncode}")
            rows.append(f"| {recipe} | `{' '.join(overrides)}` | {result.returncode} | {figures} |")
        sections.append("## Recipes with `trainer=gpu`, short runs\n\n" + "\n".join(rows))

    sections.append("## Commands\n\n" + "\n".join(f"- `{line}`" for line in log))
    verdict = "FAILED: " + "; ".join(failures) if failures else "all steps passed"
    sections.insert(1, f"**{verdict}**\n")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("\n\n".join(section.strip() for section in sections) + "\n")
    print(f"{verdict}\nwrote {args.output}")
    return 1 if failures else 0


def _shown(key: str) -> bool:
    return key.startswith(("val/", "eval/", "quality/", "perf/")) and not key.endswith("_step")


def _test_table(output: str) -> str:
    lines = [line for line in output.splitlines() if re.match(r"^(PASSED|FAILED|SKIPPED|ERROR)", line)]
    return "```\n" + ("\n".join(lines) if lines else output.strip()[-2000:]) + "\n```"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
