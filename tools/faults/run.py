"""The faults a demanding user tries, run the way a user runs things: ``train.py`` and ``copy-correct posthoc`` in
child processes, on real checkpoints of short recipe runs, each outcome checked and tabled.

    python -m tools.faults.run                                   # every fault; the table into the reliability page
    python -m tools.faults.run --only crafted damaged --output /tmp/faults.md

Each row says what was done, what came back (exit status, the last line on stderr, how many lines) and whether that
is what the manual promises: a refusal is a non-zero exit with one ``error:`` line and no traceback; a crafted file's
code never runs (its payload would create a marker file); a run ends with ``last.ckpt`` at its last step. The disk-full
row mounts a 3 MB tmpfs and needs root (else it says so). Nothing is downloaded; CPU only; a few minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from benchmarks.report import write_section
from copy_correct.files.checked_load import load_checked

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "guides" / "reliability.md"
QUIET = ["trainer=cpu", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]
GAN = ["+recipe=gan", *QUIET, "trainer.check_val_every_n_epoch=1", "model.judge_epochs=1", "seed=3"]
SNAPSHOTS = ["callbacks.posthoc_ema.snapshot_every=10"]


@dataclass
class Row:
    fault: str
    outcome: str
    held: bool


@dataclass
class Result:
    code: int
    stderr: str
    stdout: str = ""

    @property
    def lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.strip()]

    @property
    def errors(self) -> list[str]:
        return [line for line in self.lines if "error:" in line]

    def refused(self) -> bool:
        """Non-zero exit, one ``error:`` line and it last, no traceback (Lightning's own INFO lines may come before)."""
        return (
            self.code != 0
            and "Traceback" not in self.stderr
            and len(self.errors) == 1
            and self.errors[0] == self.lines[-1]
        )

    def said(self) -> str:
        last = self.lines[-1] if self.lines else "(nothing on stderr)"
        return (
            f"exit {self.code}, {len(self.errors)} error line(s) of {len(self.lines)} on stderr, last: `{last[:160]}`"
        )


def run(args: list[str], cwd: Path) -> Result:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, env=env, timeout=900)
    return Result(done.returncode, done.stderr, done.stdout)


def train(cwd: Path, run_dir: Path, *overrides: str) -> Result:
    return run([sys.executable, str(ROOT / "train.py"), *overrides, f"hydra.run.dir={run_dir}"], cwd)


def posthoc(cwd: Path, run_dir: Path, *extra: str) -> Result:
    return run([sys.executable, "-m", "copy_correct", "posthoc", str(run_dir), "--sigma-rel", "0.1", *extra], cwd)


class Payload:
    """Unpickled, creates ``marker``: the stand-in for ``os.system`` in a crafted checkpoint."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Callable[..., object], tuple[str, str]]:
        return open, (str(self.marker), "w")


def crafted(base: Path, marker: Path, into: Path) -> Path:
    """``base`` (a real checkpoint) with one more entry whose unpickling creates ``marker``."""
    checkpoint = torch.load(base, map_location="cpu", weights_only=True)
    checkpoint["hyper_parameters"] = {"note": Payload(marker)}
    torch.save(checkpoint, into)
    return into


def flipped(base: Path, into: Path, count: int = 64) -> Path:
    """``base`` with ``count`` bytes inverted in the middle of its largest tensor record."""
    data = bytearray(base.read_bytes())
    with zipfile.ZipFile(base) as archive:
        record = max((info for info in archive.infolist() if "/data/" in info.filename), key=lambda i: i.file_size)
    name_len, extra_len = (int.from_bytes(data[record.header_offset + k : record.header_offset + k + 2], "little")
                           for k in (26, 28))  # fmt: skip
    start = record.header_offset + 30 + name_len + extra_len + record.file_size // 2
    for k in range(count):
        data[start + k] ^= 0xFF
    into.write_bytes(bytes(data))
    return into


def broken_files(base: Path, folder: Path) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    whole = base.read_bytes()
    files = {
        "truncated to half": whole[: len(whole) // 2],
        "random bytes": random.Random(0).randbytes(len(whole)),
        "a raw pickle": pickle.dumps({"state_dict": {}}),
        "empty": b"",
    }
    paths = {}
    for number, (what, content) in enumerate(files.items()):
        paths[what] = folder / f"broken{number}.ckpt"
        paths[what].write_bytes(content)
    return paths


def case_crafted(work: Path, base_run: Path) -> list[Row]:
    rows = []
    base = base_run / "checkpoints" / "last.ckpt"
    for where in ("--checkpoint FILE", "newest in the run's checkpoints/", "train.py ckpt_path=FILE"):
        marker = work / f"ran-{len(rows)}"
        if where == "newest in the run's checkpoints/":
            copy = work / "crafted-run"
            subprocess.run(["cp", "-r", str(base_run), str(copy)], check=True)
            crafted(base, marker, copy / "checkpoints" / "zz-newest.ckpt")
            os.utime(copy / "checkpoints" / "zz-newest.ckpt")
            result = posthoc(work, copy)
        else:
            file = crafted(base, marker, work / f"crafted{len(rows)}.ckpt")
            if where.startswith("train.py"):
                result = train(work, work / "resume-crafted", *GAN, "trainer.max_epochs=3", f"ckpt_path={file}")
            else:
                result = posthoc(work, base_run, "--checkpoint", str(file))
        ran = marker.exists()
        outcome = f"payload ran: {'yes' if ran else 'no'}; {result.said()}"
        rows.append(Row(f"crafted checkpoint, post-hoc command with {where}" if "train" not in where
                        else f"crafted checkpoint, {where}", outcome, not ran and result.refused()))  # fmt: skip
    marker = work / "ran-control"
    torch.load(crafted(base, marker, work / "control.ckpt"), weights_only=False)
    rows.append(Row("control: the same crafted file under torch.load(weights_only=False)",
                    f"payload ran: {'yes' if marker.exists() else 'no'}", marker.exists()))  # fmt: skip
    return rows


def case_damaged(work: Path, base_run: Path) -> list[Row]:
    rows = []
    base = base_run / "checkpoints" / "last.ckpt"
    files = {"64 flipped bytes in a tensor record": flipped(base, work / "flipped.ckpt"), **broken_files(base, work)}
    for what, file in files.items():
        resumed = train(work, work / f"resume-{file.stem}", *GAN, "trainer.max_epochs=3", f"ckpt_path={file}")
        command = posthoc(work, base_run, "--checkpoint", str(file))
        for via, result in (("train.py ckpt_path=", resumed), ("post-hoc command --checkpoint", command)):
            named = file.name in (result.lines[-1] if result.lines else "")
            rows.append(Row(f"{what}, {via}", result.said(), result.refused() and named))
    return rows


def case_disk_full(work: Path, base_run: Path) -> list[Row]:
    rows = []
    for size in ("9m", "12k"):  # 9 MB: the first epoch's two checkpoints fit, the second's do not
        mount = work / f"tmpfs-{size}"
        mount.mkdir()
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True
        )
        if mounted.returncode:
            rows.append(Row(f"disk full (a {size}B tmpfs)", "not run: mounting a tmpfs needs root", False))
            continue
        try:
            result = train(work, mount / "run", *GAN, "trainer.max_epochs=3")
            files = [p for p in mount.rglob("*") if p.is_file()]
            empty = [str(p.relative_to(mount)) for p in files if p.stat().st_size == 0]
            temporaries = [p.name for p in mount.rglob("*.tmp-*")]
            kept, torn = [], []
            for path in sorted((mount / "run" / "checkpoints").glob("*.ckpt")):
                try:
                    load_checked(path)
                    kept.append(path.name)
                except ValueError:
                    torn.append(path.name)
            outcome = (f"{result.said()}; 0-byte files: {empty or 'none'}; temporary files: {temporaries or 'none'}; "
                       f"whole checkpoints: {kept or 'none'}; damaged: {torn or 'none'}")  # fmt: skip
            held = result.refused() and not (empty or temporaries or torn)
            rows.append(Row(f"disk full during a `gan` run (a {size}B tmpfs)", outcome, held))
        finally:
            subprocess.run(["umount", str(mount)], capture_output=True)
    return rows


def case_step_interval(work: Path, base_run: Path) -> list[Row]:
    """A run ending mid-epoch (``max_steps``) with a step interval on the resume point: it holds the last step."""
    run_dir = work / "interval"
    steps = 50  # a 2-epoch gan run has 46 steps an epoch: 50 ends inside the second, off the interval of 7
    overrides = [
        "trainer.max_epochs=2",
        f"trainer.max_steps={steps}",
        "callbacks.last_checkpoint.every_n_train_steps=7",
    ]
    result = train(work, run_dir, *GAN, *overrides)
    last = run_dir / "checkpoints" / "last.ckpt"
    saved = torch.load(last, map_location="cpu", weights_only=True)["global_step"] if last.exists() else None
    outcome = f"exit {result.code}; last.ckpt at step {saved}, the run ended at step {steps}"
    return [Row(f"`every_n_train_steps=7` on the resume point, a run ending at step {steps}", outcome, saved == steps)]


def case_stale_and_resume(work: Path, base_run: Path) -> list[Row]:
    crashed = work / "crashed"  # 2 of 3 epochs, then the resume; snapshots every 10 generator steps (23 an epoch)
    train(work, crashed, *GAN, *SNAPSHOTS, "trainer.max_epochs=2")
    stale = crashed / "checkpoints" / ".last.ckpt.tmp-999999"  # PID 999999: no live process
    stale.write_bytes(b"torn")
    resumed_dir = work / "resumed"
    result = train(work, resumed_dir, *GAN, *SNAPSHOTS, "trainer.max_epochs=3", f"ckpt_path={crashed}")
    left = stale.exists()
    rows = [Row("a dead process's temporary file beside the crashed run's last.ckpt, then a resume",
                f"exit {result.code}; left: {'yes' if left else 'no'}", result.code == 0 and not left)]  # fmt: skip
    whole_dir = work / "whole"
    train(work, whole_dir, *GAN, *SNAPSHOTS, "trainer.max_epochs=3")
    snapshots = {d: sorted(p.name for p in d.rglob("power-ema-*.pt")) for d in (resumed_dir, whole_dir)}
    same = snapshots[resumed_dir] == snapshots[whole_dir]
    rows.append(Row("post-hoc snapshots of a resumed run's directory against the uninterrupted run's",
                    f"{len(snapshots[resumed_dir])} against {len(snapshots[whole_dir])}", same))  # fmt: skip
    averages = [posthoc(work, d) for d in (resumed_dir, whole_dir)]
    if all(a.code == 0 for a in averages):
        a, b = (torch.load(r.stdout.split()[-1], weights_only=True)["state_dict"] for r in averages)
        gap = max(float((a[k].double() - b[k].double()).abs().max()) for k in b if torch.is_tensor(b[k]))
        rows.append(Row("the post-hoc command on both directories", f"max abs difference {gap:.3g}", gap == 0.0))
    else:
        rows.append(Row("the post-hoc command on both directories", "; ".join(a.said() for a in averages), False))
    gapped = work / "gapped"  # what a resumed run's directory held before: its own snapshots only
    subprocess.run(["cp", "-r", str(resumed_dir), str(gapped)], check=True)
    min(gapped.rglob("power-ema-*.pt")).unlink()
    result = posthoc(work, gapped)
    rows.append(Row("the post-hoc command on that directory with its first snapshot removed", result.said(),
                    result.refused() and "is missing" in result.errors[-1]))  # fmt: skip
    whole, resumed = (json.loads((d / "summary.json").read_text())["checkpoints"] for d in (whole_dir, resumed_dir))
    same = whole["best"] is not None and Path(resumed["best"] or "").name == Path(whole["best"]).name
    same = same and resumed["best_score"] == whole["best_score"]
    rows.append(Row("the resumed run's summary.json: best checkpoint and score against the uninterrupted run's",
                    f"{Path(resumed['best']).name} {resumed['best_score']} against "
                    f"{Path(whole['best']).name} {whole['best_score']}", same))  # fmt: skip
    return rows


def case_bad_values(work: Path, base_run: Path) -> list[Row]:
    rows = []
    for recipe, override, key in (
        ("ema", "model.lr=inf", "model.lr"), ("dqn", "model.lr=inf", "model.lr"), ("gan", "model.lr=inf", "model.lr"),
        ("ema", "data.batch_size=abc", "data.batch_size"), ("ema", "model.lr=fast", "model.lr"),
        ("ema", "seed=abc", "seed"), ("dqn", "model.buffer_size=1000000000000", "model.buffer_size"),
    ):  # fmt: skip
        result = train(work, work / f"bad-{len(rows)}", f"+recipe={recipe}", *QUIET, override)
        named = bool(result.lines) and key in result.lines[-1]
        rows.append(Row(f"`{recipe}` with `{override}`", result.said(), result.refused() and named))
    return rows


def case_diverging(work: Path, base_run: Path) -> list[Row]:
    """A finite learning rate so large that the weights turn NaN: the run stops naming the step, no checkpoint NaN."""
    run_dir = work / "diverging"
    result = train(work, run_dir, "+recipe=ema", *QUIET, "model.lr=1e30", "trainer.max_epochs=2")
    poisoned = []
    for path in sorted(run_dir.rglob("*.ckpt")):
        weights = load_checked(path)["state_dict"]
        if not all(torch.isfinite(v).all() for v in weights.values() if v.is_floating_point()):
            poisoned.append(path.name)
    outcome = f"{result.said()}; checkpoints holding NaN or Inf: {poisoned or 'none'}"
    held = result.code == 3 and result.refused() and "step" in result.errors[-1] and not poisoned
    return [Row("`ema` with `model.lr=1e30` (finite, diverges)", outcome, held)]


CASES = {
    "crafted": case_crafted,
    "damaged": case_damaged,
    "disk-full": case_disk_full,
    "step-interval": case_step_interval,
    "resume": case_stale_and_resume,
    "bad-values": case_bad_values,
    "diverging": case_diverging,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--output", type=Path, default=PAGE, help=f"default: {PAGE.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        base_run = work / "base"
        base = train(work, base_run, *GAN, "trainer.max_epochs=2")
        if base.code != 0:
            print(f"error: the base gan run failed: {base.said()}", file=sys.stderr)
            return 1
        for name in args.only:
            print(f"fault: {name}", flush=True)
            found = CASES[name](work, base_run)
            rows += found
            for row in found:
                print(f"  {'held' if row.held else 'NOT HELD'}: {row.fault}: {row.outcome}", flush=True)
    table = ["| fault | what came back | as promised |", "| --- | --- | --- |"]
    table += [f"| {row.fault} | {row.outcome.replace('|', '/')} | {'yes' if row.held else '**no**'} |" for row in rows]
    table = [line.replace(tmp, "$TMP") for line in table]  # the scratch folder's name changes from run to run
    command = "python -m tools.faults.run" + ("" if args.only == list(CASES) else f" --only {' '.join(args.only)}")
    header = (f"Measured {datetime.now(timezone.utc):%Y-%m-%d} on the CPU, torch {torch.__version__}, with "
              f"`{command}`, on a `gan` run of 2 epochs (seed 3).")  # fmt: skip
    write_section(args.output, "faults", "The faults tried", header, "\n".join(table))
    held = sum(row.held for row in rows)
    print(f"{held} of {len(rows)} as promised; wrote {args.output}")
    return 0 if held == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
