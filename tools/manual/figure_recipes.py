"""The recipe pages' figures: each part trains its recipe as configured (``tools.manual.figure_runs.run_recipe``) and
draws what the run logged, or what a read-only callback saw during it.

The ``metrics`` controls are the classes ``tests/recipes/test_metrics.py`` proves things about, measured with the same
probe (``MemoryProbe``'s ledger), so the figure shows what the tests assert.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import matplotlib.pyplot as plt
import numpy as np
import torch

from copy_correct import synthesize
from copy_correct.averages.posthoc import load_snapshot, snapshot_paths
from copy_correct.lightning import PostHocEMASnapshots
from copy_correct.probes import MemoryProbe
from recipes.gan import GAN
from recipes.gan_quality import sample_grid
from tools.manual.figure_bench import read_section_tables
from tools.manual.figure_runs import Run, run_recipe

if TYPE_CHECKING:
    from tools.manual.figures import Context

KIB = 1024


# --- metrics: memory over steps, the recipe against its controls ------------------------------------------------


class MemoryTrace(pl.Callback):
    """Bytes allocated on the module's device since the end of training batch ``start`` and still alive, after each
    of the next ``steps`` batches (``MemoryProbe``'s ledger: what ``StepProbe`` and the tests read)."""

    def __init__(self, start: int, steps: int) -> None:
        self.start, self.steps = start, steps
        self.probe: MemoryProbe | None = None
        self.kept: list[int] = []
        self._batches = 0

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._batches += 1
        if self._batches == self.start:
            self.probe = MemoryProbe(pl_module.device).__enter__()
        elif self.probe is not None and self.probe.active:
            self.kept.append(self.probe.net_bytes)
            if len(self.kept) == self.steps:
                self.probe.__exit__(None, None, None)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.probe is not None and self.probe.active:
            self.probe.__exit__(None, None, None)


def _control(name: str, detach: bool) -> Callable[[pl.LightningModule], pl.LightningModule]:
    def replace(_: pl.LightningModule) -> pl.LightningModule:
        from tests.recipes import test_metrics

        return getattr(test_metrics, name)(detach=detach)

    return replace


def metrics_figures(ctx: Context) -> None:
    start, steps = (3, 12) if ctx.quick else (10, 200)
    base = ["+recipe=metrics", f"trainer.max_steps={start + steps + 1}", "trainer.max_epochs=-1"]
    without_guard = [*base, "~callbacks.graph_guard"]  # the guard would stop a control at its first step
    runs = {
        "the recipe as shipped": (base, None),
        "control: probe predictions fed to AUROC undetached (FeedsListStateMetric)": (
            without_guard, _control("FeedsListStateMetric", detach=False)),
        "... the same with .detach()": (without_guard, _control("FeedsListStateMetric", detach=True)),
        "control: this step's own logits kept undetached (KeepsLossPathLogits)": (
            without_guard, _control("KeepsLossPathLogits", detach=False)),
    }  # fmt: skip
    fig, ax = plt.subplots(figsize=(7.5, 4))
    slopes, commands = {}, []
    for i, (label, (overrides, replace)) in enumerate(runs.items()):
        trace = MemoryTrace(start, steps)
        run = run_recipe(overrides, ctx.runs / f"metrics-{i}", [trace], f"metrics {i + 1}/{len(runs)}", replace)
        commands.append(run.command)
        kept = np.array(trace.kept, dtype=float) - trace.kept[0]  # the first step replaces what was there: a constant
        slopes[label] = kept[-1] / (len(kept) - 1)
        ax.plot(np.arange(len(kept)), kept / KIB, label=f"{label}: {slopes[label] / KIB:.2f} KiB/step")
    ax.set_xlabel(f"training steps after step {start + 1}")
    ax.set_ylabel("memory kept (KiB)")
    ax.set_title("Live memory a training step leaves behind, recipe metrics (digits MLP, batch 64)")
    ax.legend(loc="upper left", fontsize=8)
    shipped, leak, fixed, logits = slopes.values()
    ctx.save(
        fig, "metrics-memory", "recipes/metrics.md",
        "Memory kept over training steps: flat for the recipe, climbing for the control that keeps a graph",
        f"Memory allocated since step {start + 1} and still alive after each of the next {steps} steps, "
        f"from `MemoryProbe`'s CPU ledger, the probe the tests read. The recipe: `{commands[0]}`; each control is "
        f"`{commands[1]}` with the module replaced by a class of `tests/recipes/test_metrics.py`. Measured slopes: "
        "the recipe "
        f"{shipped:,.0f} B/step; undetached probe predictions fed to a list-state metric {leak:,.0f} B/step (their "
        f"graph's activations); the same detached {fixed:,.0f} B/step (the predictions themselves); this step's own "
        f"undetached logits {logits:,.0f} B/step, no more than the logits: backward already freed what their graph "
        "saved.",
    )  # fmt: skip


# --- ema: live and averaged weights over training ----------------------------------------------------------------


def ema_figures(ctx: Context) -> None:
    quick = (
        [
            "trainer.max_epochs=2",
            "trainer.limit_train_batches=5",
            "trainer.limit_val_batches=2",
            "trainer.log_every_n_steps=1",
        ]
        if ctx.quick
        else []
    )
    runs = {
        "default": ["+recipe=ema", *quick],
        "warmup": ["+recipe=ema", "callbacks.ema.decay=0.999", "callbacks.ema.warmup=true", *quick],
        "no warmup": ["+recipe=ema", "callbacks.ema.decay=0.999", "callbacks.ema.warmup=false", *quick],
    }
    done = {name: run_recipe(o, ctx.runs / f"ema-{i}", description=f"ema {name}") for i, (name, o) in
            enumerate(runs.items())}  # fmt: skip
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6), sharey=True)
    _plot(left, done["default"], "val/acc", "live weights", "o-")
    _plot(left, done["default"], "val/acc_ema", "EMA weights (decay 0.995, warm-up)", "s-")
    left.set_title("the recipe as configured")
    _plot(right, done["warmup"], "val/acc", "live weights", "o-")
    _plot(right, done["warmup"], "val/acc_ema", "EMA, warm-up on (default)", "s-")
    _plot(right, done["no warmup"], "val/acc_ema", "EMA, warm-up off", "^-")
    right.set_title("decay 0.999")
    left.set_ylabel("validation accuracy")
    for ax in (left, right):
        ax.set_xlabel("epoch")
        ax.legend(loc="lower right", fontsize=8)
    final = {name: (run.series("val/acc")[-1][1], run.series("val/acc_ema")[-1][1]) for name, run in done.items()}
    ctx.save(
        fig, "ema-accuracy", "recipes/ema.md",
        "Validation accuracy of the live and the EMA weights after every epoch",
        f"Validation accuracy after each epoch of `{done['default'].command}` (left) and of the same run with "
        "`callbacks.ema.decay=0.999` and `callbacks.ema.warmup=true` or `false` (right), read from each run's "
        f"`metrics.csv`. Last epoch, live / EMA: {final['default'][0]:.3f} / {final['default'][1]:.3f} as configured; "
        f"at 0.999 {final['warmup'][1]:.3f} with the warm-up and {final['no warmup'][1]:.3f} without it.",
    )  # fmt: skip


def _plot(ax: Any, run: Run, key: str, label: str, style: str, x: str = "epoch") -> None:
    points = run.series(key, x)
    if points:
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, style, ms=3.5, lw=1.2, label=label)


# --- gan: samples of the live and the EMA generator, and the quality figures -------------------------------------


class SampleGrids(pl.Callback):
    """After the training epochs in ``epochs`` (counted from 1), the live and the EMA generator's images for one fixed
    set of latents. Read-only for the run: the generator is put in eval mode for the forward and back after it, the
    latents come from a generator of their own (the run's random stream is untouched), and ``average_weights``
    restores the live weights bit for bit."""

    def __init__(self, epochs: Sequence[int], count: int = 64) -> None:
        self.epochs, self.count = set(epochs), count
        self.grids: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch + 1 not in self.epochs or not isinstance(pl_module, GAN) or pl_module.g_ema is None:
            return
        generator = pl_module.generator
        z = torch.randn(self.count, pl_module.hparams.latent, generator=torch.Generator().manual_seed(1234))
        z = z.to(pl_module.device)
        was_training = generator.training
        generator.eval()
        with torch.no_grad():
            live = generator(z).cpu()
            with pl_module.g_ema.average_weights(generator):
                averaged = generator(z).cpu()
        generator.train(was_training)
        self.grids[trainer.current_epoch + 1] = (live, averaged)


def gan_figures(ctx: Context) -> None:
    if ctx.quick:
        overrides = [
            "+recipe=gan",
            "trainer.max_epochs=2",
            "trainer.limit_train_batches=3",
            "trainer.check_val_every_n_epoch=1",
            "trainer.log_every_n_steps=1",
            "model.eval_samples=100",
            "model.judge_epochs=1",
            "callbacks.posthoc_ema.snapshot_every=2",  # snapshots at steps 2, 4, 6: the last one ends the run
        ]
        epochs = [1, 2]
    else:
        overrides, epochs = ["+recipe=gan"], [5, 20, 60, 200]  # fmt: skip
    grids = SampleGrids(epochs)
    run = run_recipe(overrides, ctx.runs / "gan", [grids], "gan")

    fig, axes = plt.subplots(2, len(epochs), figsize=(2.3 * len(epochs), 5.0), squeeze=False)
    for column, epoch in enumerate(sorted(grids.grids)):
        for row, samples in enumerate(grids.grids[epoch]):
            ax = axes[row][column]
            ax.imshow(np.asarray(sample_grid(samples)), cmap="gray", interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            ax.grid(False)
            if row == 0:
                ax.set_title(f"epoch {epoch}")
        axes[0][0].set_ylabel("live generator")
        axes[1][0].set_ylabel("EMA generator")
    fig.tight_layout()
    ctx.save(
        fig, "gan-samples-grid", "recipes/gan.md",
        "Samples of the live and the EMA generator for the same latents at several epochs",
        f"The same 64 latent vectors through the live generator (top) and its EMA (bottom) after epochs "
        f"{', '.join(map(str, epochs))} of `{run.command}`, drawn in eval mode by a read-only callback.",
    )  # fmt: skip

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    _plot(left, run, "quality/fid", "live generator", "o-")
    _plot(left, run, "quality/fid_ema", "EMA generator", "s-")
    _plot(left, run, "quality/fid_floor", "floor: real train vs real validation", "--")
    left.set_yscale("log")
    left.set_ylabel("Frechet distance on the judge's features (lower is better)")
    _plot(right, run, "quality/confidence", "live generator", "o-")
    _plot(right, run, "quality/confidence_ema", "EMA generator", "s-")
    right.set_ylabel("judge's mean confidence on samples")
    for ax in (left, right):
        ax.set_xlabel("epoch")
        ax.legend(fontsize=8)
    fid, fid_ema, floor = (run.series(k)[-1][1] for k in ("quality/fid", "quality/fid_ema", "quality/fid_floor"))
    ctx.save(
        fig, "gan-quality", "recipes/gan.md",
        "Frechet distance and judge confidence of the live and the EMA generator over epochs, with the floor",
        f"Quality at every validation of `{run.command}`, read from its `metrics.csv`: the Frechet distance "
        f"between {run.model.hparams.eval_samples:,} samples and as many real training images on the judge's "
        f"features, and the judge's confidence. Last: EMA {fid_ema:.2f}, live {fid:.2f}, floor {floor:.2f}.",
    )  # fmt: skip
    _posthoc_figure(ctx, run)


# The post-hoc EMA widths the figure synthesizes: a dozen, about log-spaced inside (0, 1/sqrt(12)) = (0, 0.289), the
# two tracked ones (0.05, 0.10) among them.
POSTHOC_SIGMA_RELS = (0.02, 0.025, 0.03, 0.04, 0.05, 0.065, 0.08, 0.1, 0.125, 0.15, 0.2, 0.25)


def posthoc_frechet_distances(run: Run, sigma_rels: Sequence[float]) -> dict[str, Any]:
    """After a ``gan`` run: the Frechet distance of the generator synthesized at each of ``sigma_rels`` from the run's
    snapshots at its last step, of the two tracked profiles as they were snapshotted, and of the recipe's own EMA, each
    as the recipe's validation measures ``quality/fid_ema`` (the same latents, samples, real images and judge).
    Changes nothing of the run's module: the live generator's weights are put back bit for bit."""
    gan = run.model
    assert isinstance(gan, GAN) and gan.g_ema is not None and gan._real is not None
    (callback,) = (c for c in run.trainer.callbacks if isinstance(c, PostHocEMASnapshots))
    assert callback.power_ema is not None
    directory = Path(run.trainer.checkpoint_callback.dirpath) / "power_ema"
    paths = snapshot_paths(directory)
    last = load_snapshot(paths[-1])
    if last["step"] != callback.power_ema.step:  # the generator's optimizer steps (global_step counts D's too)
        raise ValueError(
            f"the last snapshot in {directory} is of step {last['step']}, the run ended at step "
            f"{callback.power_ema.step}: PostHocEMASnapshots's final snapshot is missing"
        )
    generator, prefix = gan.generator, "generator."  # the snapshots name tensors as the GAN's state_dict does
    z = torch.randn(
        gan.hparams.eval_samples, gan.hparams.latent, device=gan.device,
        generator=torch.Generator(gan.device).manual_seed(gan.hparams.seed),
    )  # fmt: skip
    live = {name: t.clone() for name, t in generator.state_dict().items()}
    was_training = generator.training

    def distance(weights: dict[str, torch.Tensor]) -> float:
        generator.load_state_dict({n.removeprefix(prefix): t for n, t in weights.items() if n.startswith(prefix)})
        return gan.judge.frechet_distance(gan._real, gan.sample(z))

    generator.eval()  # as validation samples
    try:
        with torch.no_grad():
            synthesized = {s: distance(synthesize(paths, s)) for s in sigma_rels}
            tracked = {
                float(s): distance(profile) for s, profile in zip(last["sigma_rels"], last["profiles"], strict=True)
            }
            generator.load_state_dict(live)
            with gan.g_ema.average_weights(generator):
                ema = gan.judge.frechet_distance(gan._real, gan.sample(z))
    finally:
        generator.load_state_dict(live)
        generator.train(was_training)
    return {
        "synthesized": synthesized,
        "tracked": tracked,
        "ema": ema,
        "step": int(last["step"]),
        "snapshots": len(paths),
    }


def _posthoc_figure(ctx: Context, run: Run) -> None:
    found = posthoc_frechet_distances(run, POSTHOC_SIGMA_RELS)
    synthesized, tracked, ema = found["synthesized"], found["tracked"], found["ema"]
    logged = run.series("quality/fid_ema")[-1][1]
    best = min(synthesized, key=synthesized.__getitem__)
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    ax.plot(list(synthesized), list(synthesized.values()), "o-", ms=4, lw=1.2, label="post-hoc EMA, synthesized")
    ax.plot(list(tracked), list(tracked.values()), "D", ms=8, mfc="none", mew=1.5,
            label="the two tracked profiles, as snapshotted")  # fmt: skip
    ax.axhline(ema, color="C3", ls="--", lw=1.2, label=f"recipe's EMA (decay {run.model.g_ema.decay}): quality/fid_ema")
    ax.axvline(best, color="0.6", ls=":", lw=1.0, label=f"lowest: sigma_rel {best:g}")
    ax.set_xscale("log")
    ax.set_xticks(list(synthesized), [f"{s:g}" for s in synthesized], fontsize=7, rotation=45)
    ax.minorticks_off()
    ax.set_xlabel("sigma_rel (EMA length relative to training time)")
    ax.set_ylabel("Frechet distance (lower is better)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    values = ", ".join(f"{s:g}: {d:.2f}" for s, d in synthesized.items())
    ctx.save(
        fig, "gan-posthoc-ema", "recipes/gan.md",
        "Frechet distance of the generator's post-hoc EMA against sigma_rel, the recipe's EMA marked",
        f"The generator of `{run.command}` synthesized at {len(synthesized)} values of sigma_rel from its "
        f"{found['snapshots']} snapshots (step {found['step']}, the last), each measured as `quality/fid_ema` is "
        f"(the same {run.model.hparams.eval_samples:,} latents and real images, the same judge): {values}. Best "
        f"{best:g}. Tracked profiles as snapshotted: "
        f"{', '.join(f'{s:g}: {d:.2f}' for s, d in tracked.items())}. The recipe's EMA: {ema:.2f} "
        f"(logged {logged:.2f}).",
    )  # fmt: skip


# --- dqn: episodic return over environment steps ------------------------------------------------------------------


def dqn_figures(ctx: Context) -> None:
    seeds = [0] if ctx.quick else [0, 1, 2]
    quick = ["model.total_env_steps=1200", "model.learning_starts=200", "model.eval_every=400", "model.train_freq=64",
             "model.gradient_steps=8", "model.eval_episodes=2"] if ctx.quick else []  # fmt: skip
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    solved, threshold, command = [], None, ""
    for seed in seeds:
        run = run_recipe(
            ["+recipe=dqn", f"seed={seed}", *quick], ctx.runs / f"dqn-{seed}", description=f"dqn seed {seed}"
        )
        command = run.command.replace(f"seed={seed}", "seed=S")
        model: Any = run.model
        threshold = model.reward_threshold
        steps, returns = zip(*model.curve, strict=True)
        smooth = np.convolve(returns, np.ones(10) / 10, mode="valid") if len(returns) >= 10 else np.array(returns)
        left.plot(steps[len(steps) - len(smooth) :], smooth, lw=1.2, label=f"seed {seed}")
        eval_steps, eval_returns = zip(*model.evals, strict=True)
        right.plot(eval_steps, eval_returns, "o-", ms=3.5, lw=1.2, label=f"seed {seed}")
        reached = [step for step, value in model.evals if threshold is not None and value >= threshold]
        solved.append(f"seed {seed}: {f'{reached[0]:,} steps' if reached else 'not reached'}")
    for ax, title in ((left, "training episodes (epsilon-greedy), mean of the last 10"),
                      (right, "greedy evaluation, mean of its episodes")):  # fmt: skip
        if threshold is not None:
            ax.axhline(threshold, color="grey", ls="--", lw=0.9, label=f"solved: {threshold:g}")
        ax.set_xlabel("environment steps")
        ax.set_title(title)
        ax.legend(fontsize=8, loc="upper left")
    left.set_ylabel("episode return (CartPole-v1)")
    ctx.save(
        fig, "dqn-returns", "recipes/dqn.md",
        "Episode return over environment steps for seeds 0, 1 and 2, with the solve threshold",
        f"`{command}` for S in {', '.join(map(str, seeds))}: the return of every training episode (left, a running "
        "mean of 10) and of each greedy evaluation (right), as the module records them. First evaluation at or above "
        f"the threshold: {'; '.join(solved)}.",
    )  # fmt: skip


# --- pinned: where a step's time goes, with and without the prefetcher --------------------------------------------


def pinned_figures(ctx: Context) -> None:
    if ctx.quick:
        epochs = ["trainer.max_epochs=2", "trainer.limit_train_batches=4", "trainer.limit_val_batches=1",
                  "trainer.log_every_n_steps=1"]  # fmt: skip
    else:
        epochs = ["trainer.max_epochs=5"]  # the split settles after an epoch; 15 would triple the time, not the figure
    sources = ["workers"] if ctx.quick else ["workers", "store"]
    bars: dict[str, tuple[float, float]] = {}
    for source in sources:
        for prefetch in ("true", "false"):
            overrides = ["+recipe=pinned", f"data.source={source}", f"data.prefetch={prefetch}", *epochs]
            name = f"{source}, prefetch {'on' if prefetch == 'true' else 'off'}"
            run = run_recipe(overrides, ctx.runs / f"pinned-{source}-{prefetch}", description=f"pinned {name}")
            bars[name] = _step_split(run)
    gpu = _h200_split(ctx.docs / "gpu-results.md")
    fig, axes = plt.subplots(2 if gpu else 1, 1, figsize=(8, 5.2 if gpu else 2.6), squeeze=False)
    _split_bars(
        axes[0][0], bars, "this machine: recipe pinned, batches of 128 uint8 images 64x64",
        ("the step (forward, backward, optimizer)", "waiting for the batch (loader, copy)"),
    )  # fmt: skip
    if gpu:
        _split_bars(
            axes[1][0], gpu, "H200, benchmarks/loading.py: 18.4 MiB batches, compute as long as one copy",
            ("compute", "the rest: copy time not hidden behind compute"),
        )  # fmt: skip
    fig.tight_layout()
    shares = "; ".join(f"{name}: {100 * wait / (wait + step):.0f}%" for name, (wait, step) in bars.items())
    ctx.save(
        fig, "pinned-step-time", "recipes/pinned.md",
        "Time per training step split into waiting for data and the step itself, with and without the prefetcher",
        f"Top: mean time per training step of `python train.py +recipe=pinned data.source=SOURCE data.prefetch=P "
        f"{' '.join(epochs)}` over the epochs after the first, split by the recipe's `DataWaitMonitor` into waiting "
        f"for the next batch (the loader and the copy to the device) and the step. Waiting: {shares}. On a CPU the "
        "prefetcher has no copy to hide, and the batches are ready before the step asks. "
        + ("Bottom: per batch, from `python -m benchmarks.loading --device cuda` on an H200 at commit `7f50130` "
           "([GPU results](../gpu-results.md#batch-loading-cuda)): the measured compute, and the rest of each batch's "
           "time, the copy left in the step's way; the prefetcher hides most of it." if gpu else ""),
    )  # fmt: skip


def _step_split(run: Run) -> tuple[float, float]:
    """Mean ms waiting for data and ms in the step, per training batch, over the epochs after the first (all of them
    when there is one), from the run's ``perf/samples_per_s`` and ``perf/data_wait_fraction``."""
    rate, wait = run.series("perf/samples_per_s"), run.series("perf/data_wait_fraction")
    epochs = list(zip(rate, wait, strict=True))[1:] or list(zip(rate, wait, strict=True))
    batch = run.trainer.datamodule.batch_size  # the configured data.batch_size: a step is one batch
    per_step = [batch / r * 1e3 for (_, r), _ in epochs]
    share = [w for _, (_, w) in epochs]
    ms = statistics.fmean(per_step)
    return ms * statistics.fmean(share), ms * (1 - statistics.fmean(share))


def _h200_split(report: Path) -> dict[str, tuple[float, float]]:
    """Per batch, ms not hidden behind compute and ms of compute, from the H200's loading benchmark in ``report``."""
    if not report.is_file():
        return {}
    text, tables = read_section_tables(report.read_text(), "loading-cuda")
    compute = float(re.search(r"compute per batch ([\d.]+) ms", text)[1])
    batches = int(re.search(r"(\d+) batches of", text)[1])
    rows = next(iter(tables.values()))
    return {path: (float(row["ms per epoch"]) / batches - compute, compute) for path, row in rows.items()}


def _split_bars(ax: Any, bars: dict[str, tuple[float, float]], title: str, labels: tuple[str, str]) -> None:
    """Horizontal bars, one per entry of ``bars`` ``(waiting, step)``: the step from 0, the waiting after it."""
    names = list(bars)
    wait = [bars[n][0] for n in names]
    compute = [bars[n][1] for n in names]
    y = np.arange(len(names))
    ax.barh(y, compute, height=0.6, color="#4c72b0", label=labels[0])
    ax.barh(y, wait, height=0.6, left=compute, color="#dd8452", label=labels[1])
    ax.set_yticks(y, names)
    ax.invert_yaxis()
    ax.set_xlabel("ms per batch")
    ax.set_title(title, loc="left")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(0, -0.32), ncol=2, frameon=False)
