"""Benchmark post-hoc EMA (EDM2's power-function profiles, snapshots, reconstruction) against ema-pytorch's
``PostHocEMA``, as installed and called the way its README shows, in one process; write the section to
docs/benchmarks.md.

    pip install -e ".[bench]"
    python -m benchmarks.posthoc_ema                  # CPU; the digits MLP and two ~25M-parameter models
    python -m benchmarks.posthoc_ema --device cuda    # the same on a GPU
    python -m benchmarks.posthoc_ema --quick --output /tmp/b.md   # a smoke run with small sizes

Both keep float32 profiles of the same model at ``sigma_rels`` (0.05, 0.10), updated once per optimizer step:

* ``copy_correct.PowerEMA(model, sigma_rels, skip_nonfinite=False).update()``: one ``_foreach_lerp_`` per profile
  (and dtype group), ``beta`` computed on the host: the reference row, ``ours``
* the same with ``skip_nonfinite=True``, the default for CPU profiles: one finite check per update for all profiles
  (its ``time / ours`` is the guard's cost)
* ema-pytorch ``PostHocEMA(model, sigma_rels=..., update_every=1, checkpoint_every_num_steps=...)``: ``.update()``,
  as its README calls it (``update_every=1``: its ``KarrasEMA`` default, 100, would average one step in a hundred);
  a deep copy of the module per profile, one ``lerp_`` per tensor, the step read back from the device
* a bare ``_foreach_lerp_`` per profile over prebuilt lists (the floor for this work)

Three tables. **Update**: milliseconds per call, medians over interleaved rounds, each time over ours (the snapshot
schedule off: a snapshot is one copy to the host every thousand steps or so). **Memory**: the bytes each keeps while
training (new storage made at construction, ``MemoryProbe``'s ledger, over the model's floating state), the bytes
one snapshot step writes, and the peak new storage of one reconstruction. **Reconstruction**: on a random walk of the
digits MLP's weights (``STEPS`` steps, a snapshot every ``STEPS / SNAPSHOTS``, the same schedule for both), each
library's post-hoc EMA at several ``sigma_rel`` at the last step against the profile of that ``sigma_rel`` tracked
directly (a ``PowerEMA`` in float64): ``|synthesized - tracked| / |tracked - live|`` over all weights. ema-pytorch is
run with its default float16 snapshots and with float32 ones, so the solve and the rounding show apart.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from benchmarks.ema import benchmark_models, small_model
from benchmarks.peers import Missing, label, load
from benchmarks.report import command_line, measured_on, median_ms, parse_args, write_section
from copy_correct import PowerEMA, synthesize
from copy_correct.averages.posthoc import snapshot_paths
from copy_correct.probes import MemoryProbe

ROOT = Path(__file__).resolve().parents[1]

SIGMA_RELS = (0.05, 0.10)
TARGETS = (0.03, 0.08, 0.15, 0.25)  # reconstructed at the last step: inside and outside the tracked two
STEPS, SNAPSHOTS = 2000, 20
OURS = "copy_correct.PowerEMA.update, skip_nonfinite=False"
GUARDED = "copy_correct.PowerEMA.update, skip_nonfinite=True"
FLOOR = "bare _foreach_lerp_ per profile, prebuilt lists"


def peer() -> ModuleType | Missing:
    return load("ema_pytorch", "ema-pytorch")


def peer_label(what: str) -> str:
    return label("ema-pytorch", what)


def floating(model: nn.Module) -> list[torch.Tensor]:
    return [t for t in model.state_dict().values() if t.is_floating_point()]


def state_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in floating(model))


# --- update time -------------------------------------------------------------------------------------------------


def update_contenders(model: nn.Module, folder: Path) -> tuple[dict[str, Callable[[], object]], dict[str, str]]:
    """``({row: one update}, {row: why it cannot run here})``."""
    ours = PowerEMA(model, SIGMA_RELS, skip_nonfinite=False)
    guarded = PowerEMA(model, SIGMA_RELS, skip_nonfinite=True)
    fns: dict[str, Callable[[], object]] = {OURS: ours.update, GUARDED: guarded.update}
    not_run: dict[str, str] = {}
    ema_pytorch = peer()
    name = "PostHocEMA.update, update_every=1"
    if isinstance(ema_pytorch, Missing):
        not_run[f"ema-pytorch {name}"] = ema_pytorch
    else:
        theirs = ema_pytorch.PostHocEMA(
            model, sigma_rels=SIGMA_RELS, update_every=1, checkpoint_every_num_steps="manual", checkpoint_folder=folder
        )
        fns[peer_label(name)] = theirs.update
    lives = floating(model)
    profiles = [[t.clone() for t in lives] for _ in SIGMA_RELS]

    def bare() -> None:
        with torch.no_grad():
            for profile in profiles:
                torch._foreach_lerp_(profile, lives, 0.001)

    fns[FLOOR] = bare
    return fns, not_run


def update_table(title: str, model: nn.Module, times: dict[str, float], not_run: dict[str, str]) -> str:
    floats = floating(model)
    elements = sum(t.numel() for t in floats)
    lines = [
        f"**{title}**: {elements / 1e6:.2f}M floating elements in {len(floats)} tensors, {len(SIGMA_RELS)} profiles",
        "",
        "| contender | ms per call | time / ours |",
        "| --- | ---: | ---: |",
    ]
    lines += [f"| {name} | {ms:.4f} | {ms / times[OURS]:.2f}x |" for name, ms in times.items()]
    lines += [f"| {name} | not run: {why} | - |" for name, why in not_run.items()]
    return "\n".join(lines)


# --- memory ------------------------------------------------------------------------------------------------------


def _new_bytes(fn: Callable[[], object]) -> tuple[object, int, int]:
    """``fn()``, and the net and peak bytes of storage it made on the CPU (``MemoryProbe``'s ledger)."""
    with MemoryProbe("cpu") as probe:
        out = fn()
    return out, probe.net_bytes, probe.peak_bytes


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def memory_rows(model: nn.Module, folder: Path) -> tuple[dict[str, tuple[int, int, int]], dict[str, str]]:
    """``{row: (bytes held, bytes one snapshot step writes, peak bytes of one reconstruction)}`` for a CPU model, the
    reconstruction from two snapshot steps."""
    rows: dict[str, tuple[int, int, int]] = {}
    not_run: dict[str, str] = {}
    ours_dir = folder / "ours"
    ours, held, _ = _new_bytes(lambda: PowerEMA(model, SIGMA_RELS, snapshot_every=1, snapshot_dir=ours_dir))
    assert isinstance(ours, PowerEMA)
    ours.update()
    written = _folder_bytes(ours_dir)
    ours.update()
    _, _, peak = _new_bytes(lambda: synthesize(ours_dir, 0.08))
    rows[OURS] = (held, written, peak)
    ema_pytorch = peer()
    for dtype in (torch.float16, torch.float32):
        name = f"PostHocEMA, checkpoint_dtype={str(dtype).removeprefix('torch.')}"
        if isinstance(ema_pytorch, Missing):
            not_run[f"ema-pytorch {name}"] = ema_pytorch
            continue
        theirs_dir = folder / f"theirs-{dtype}"
        theirs, held, _ = _new_bytes(
            lambda d=dtype, f=theirs_dir: ema_pytorch.PostHocEMA(
                model, sigma_rels=SIGMA_RELS, update_every=1, checkpoint_every_num_steps=1, checkpoint_folder=f,
                checkpoint_dtype=d,
            )
        )  # fmt: skip
        theirs.update()
        written = _folder_bytes(theirs_dir)
        theirs.update()
        _, _, peak = _new_bytes(lambda t=theirs: t.synthesize_ema_model(sigma_rel=0.08))
        rows[peer_label(name)] = (held, written, peak)
    return rows, not_run


def memory_table(title: str, model: nn.Module, rows: dict[str, tuple[int, int, int]], not_run: dict[str, str]) -> str:
    size = state_bytes(model)
    lines = [
        f"**{title}**: the model's floating state is {size / 1e6:.2f} MB; {len(SIGMA_RELS)} profiles",
        "",
        "| contender | MB held while training | held / model state | MB written per snapshot step "
        "| MB peak of one reconstruction | reconstruction peak / ours |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, (held, written, peak) in rows.items():
        lines.append(
            f"| {name} | {held / 1e6:.2f} | {held / size:.2f} | {written / 1e6:.2f} | {peak / 1e6:.2f} "
            f"| {peak / rows[OURS][2]:.2f}x |"
        )
    lines += [f"| {name} | not run: {why} | - | - | - | - |" for name, why in not_run.items()]
    return "\n".join(lines)


# --- reconstruction ----------------------------------------------------------------------------------------------


def reconstruction_errors(steps: int, snapshots: int, folder: Path) -> tuple[dict[str, list[float]], dict[str, str]]:
    """``{row: [relative error at each of TARGETS]}`` after ``steps`` steps of a seeded random walk of the digits
    MLP's weights, a snapshot every ``steps // snapshots``."""
    torch.manual_seed(0)
    model = small_model()
    every = steps // snapshots
    ours = PowerEMA(model, SIGMA_RELS, snapshot_every=every, snapshot_dir=folder / "ours")
    tracked = PowerEMA(model, TARGETS, shadow_dtype=torch.float64)  # the reference: each target tracked directly
    trackers: dict[str, object] = {}
    not_run: dict[str, str] = {}
    ema_pytorch = peer()
    for dtype in (torch.float16, torch.float32):
        name = f"PostHocEMA, checkpoint_dtype={str(dtype).removeprefix('torch.')}"
        if isinstance(ema_pytorch, Missing):
            not_run[f"ema-pytorch {name}"] = ema_pytorch
            continue
        trackers[peer_label(name)] = ema_pytorch.PostHocEMA(
            model, sigma_rels=SIGMA_RELS, update_every=1, checkpoint_every_num_steps=every,
            checkpoint_folder=folder / f"theirs-{dtype}", checkpoint_dtype=dtype,
        )  # fmt: skip
    walk = torch.Generator().manual_seed(1)
    lives = [p for p in model.parameters()]
    with torch.no_grad():
        for _ in range(steps - steps % every):
            for p in lives:
                p.add_(torch.randn(p.shape, generator=walk), alpha=0.01)
            ours.update()
            tracked.update()
            for tracker in trackers.values():
                tracker.update()  # type: ignore[attr-defined]
    live = dict(model.state_dict())
    names = [name for name, t in live.items() if t.is_floating_point()]

    def error(weights: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
        diff = sum(float((weights[n].double() - reference[n]).pow(2).sum()) for n in names)
        scale = sum(float((live[n].double() - reference[n]).pow(2).sum()) for n in names)
        return (diff / scale) ** 0.5

    rows: dict[str, list[float]] = {OURS: []}
    rows.update({name: [] for name in trackers})
    paths = snapshot_paths(folder / "ours")
    for target, reference in zip(TARGETS, tracked.profiles, strict=True):
        rows[OURS].append(error(synthesize(paths, target), reference))
        for name, tracker in trackers.items():
            synthesized = tracker.synthesize_ema_model(sigma_rel=target)  # type: ignore[attr-defined]
            rows[name].append(error(synthesized.ema_model.state_dict(), reference))
    return rows, not_run


def reconstruction_table(rows: dict[str, list[float]], not_run: dict[str, str], steps: int, snapshots: int) -> str:
    every = steps // snapshots
    columns = " | ".join(f"sigma_rel {t:g}" for t in TARGETS)
    lines = [
        f"**reconstruction at step {steps - steps % every}**: the digits MLP's weights on a random walk, profiles "
        f"{', '.join(map(str, SIGMA_RELS))} snapshotted every {every} steps ({snapshots} snapshot steps); relative "
        "error against the profile tracked directly (mean error / ours: the mean over the sigma_rels of each one's "
        "ratio)",
        "",
        f"| contender | {columns} | mean error / ours |",
        "| --- " + "| ---: " * (len(TARGETS) + 1) + "|",
    ]
    for name, errors in rows.items():
        ratio = sum(e / o for e, o in zip(errors, rows[OURS], strict=True)) / len(errors)
        lines.append(f"| {name} | " + " | ".join(f"{e:.2e}" for e in errors) + f" | {ratio:.3g}x |")
    lines += [f"| {name} | not run: {why} |" + " - |" * len(TARGETS) for name, why in not_run.items()]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args, device, budget = parse_args(__doc__, argv, 15.0, ROOT / "docs" / "benchmarks.md")
    models = benchmark_models(args.quick)
    steps, snapshots = (200, 4) if args.quick else (STEPS, SNAPSHOTS)
    sections = []
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        for index, (title, make) in enumerate(models.items()):
            torch.manual_seed(0)
            model = make().to(device)
            fns, not_run = update_contenders(model, folder / f"update-{index}")
            sections.append(update_table(f"update, {title}", model, median_ms(fns, device, budget), not_run))
            print(sections[-1], end="\n\n", flush=True)
        for index, (title, make) in enumerate(models.items()):
            torch.manual_seed(0)
            model = make()  # the ledger counts CPU storage
            rows, not_run = memory_rows(model, folder / f"memory-{index}")
            sections.append(memory_table(f"memory, {title}", model, rows, not_run))
            print(sections[-1], end="\n\n", flush=True)
        rows, not_run = reconstruction_errors(steps, snapshots, folder / "walk")
        sections.append(reconstruction_table(rows, not_run, steps, snapshots))
        print(sections[-1], end="\n\n", flush=True)
    header = measured_on(device, command_line("benchmarks.posthoc_ema", args)) + (
        " Memory and reconstruction are measured on the CPU whatever the device."
    )
    key = f"posthoc-ema-{device.type}"
    write_section(args.output, key, f"Post-hoc EMA ({device.type})", header, "\n\n".join(sections))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
