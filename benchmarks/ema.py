"""Benchmark one EMA update against the EMA classes of timm, diffusers, ema-pytorch, torch and Lightning, as
installed and called the way their docs show, in one process; write the table to docs/benchmarks.md.

    pip install -e ".[bench]" && pip install --no-deps timm==1.0.31   # the peers (see benchmarks/peers.py)
    python -m benchmarks.ema                  # CPU; the digits MLP and two ~25M-parameter models
    python -m benchmarks.ema --device cuda    # the same on a GPU
    python -m benchmarks.ema --quick --output /tmp/b.md   # a smoke run with small sizes

Contenders, each keeping a float32 average of the same model and updating it once per call:

* ``copy_correct.EMA.update`` with ``skip_nonfinite=False`` (parameters and floating buffers averaged, integer
  buffers copied): the reference row, ``ours``
* the same with ``skip_nonfinite=True``, the default for a CPU shadow: the update skipped when a live value is NaN or
  Inf (on the CPU decided on the host from one reduction per tensor; on a GPU on the device, with a staging copy); its
  ``time / ours`` is the guard's cost
* the CPU guard's check alone (``copy_correct.guards.host.FiniteCheck`` of the live values): one read of the
  weights, the work the guard adds to the update; the guarded row's floor is the two rows' sum
* timm ``ModelEmaV3(model, decay)`` (foreach, the default) and ``ModelEmaV2``: ``.update(model, step=n)`` /
  ``.update(model)``, as timm's ``train.py`` calls them; both average every ``state_dict`` entry
* diffusers ``EMAModel(model.parameters(), decay, foreach=False | True)``: ``.step(model.parameters())``, as
  diffusers' training examples call it; parameters only, buffers not averaged
* ema-pytorch ``EMA(model, beta, update_after_step=0, update_every=1, use_foreach=False | True)``: ``.update()``
* torch ``AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)``:
  ``.update_parameters(model)``, as torch's swa_utils docs show
* Lightning ``EMAWeightAveraging(decay)``: its ``on_train_batch_end`` hook, as the Trainer calls it after each
  optimizer step (an ``AveragedModel`` with ``avg_fn``, one Python-level average per tensor)
* the articles' loop: ``e.copy_(decay * e + (1 - decay) * p)`` per tensor under ``no_grad``
* a bare ``_foreach_lerp_`` over prebuilt lists under ``no_grad`` (the floor for this work)
* ``lerp_`` in place on one flat tensor of the same number of elements: the same update with one kernel, not one per
  tensor (on a CPU a foreach call runs a kernel per tensor, each its own parallel region)
* a plain copy of the same number of bytes as one contiguous tensor, from a written source
* STREAM's copy and triad and STREAM2's DAXPY (``a += q*b``, in place) on arrays four times the caches
  (``benchmarks.stream``), timed in the same rounds: the machine's limits the rows are held to

A peer that is not installed, or cannot run here, gets a row that says why. Timings are medians over interleaved
rounds, so all contenders see the same machine load; the table reports milliseconds, each contender's time over
ours, and effective bandwidth: an EMA update reads the shadow and the weights and writes the shadow (12 bytes per
float32 element), a copy reads and writes (8 bytes). On caches that read a line before writing it, the copy's real
traffic is 12 bytes too, so an update can reach more than 100% of the copy's effective figure; the STREAM columns
count what each row really moves (a copy's write-allocate read included on a CPU) and hold it to the kernel with its
access pattern: a copy to STREAM copy, an update in place to DAXPY.
diffusers' rows move only the parameters' bytes, so their bandwidth is counted on those.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import partial
from itertools import count
from pathlib import Path
from types import ModuleType, SimpleNamespace

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import EMAWeightAveraging
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from benchmarks.peers import Missing, label, load, timm_model_ema
from benchmarks.report import bandwidth_table, command_line, measured_on, median_ms, parse_args, write_section
from benchmarks.stream import StreamLimit, in_rounds
from copy_correct import EMA
from copy_correct.guards.device import NonFiniteGuard

ROOT = Path(__file__).resolve().parents[1]

DECAY = 0.999
OURS = "copy_correct.EMA.update, skip_nonfinite=False"
GUARDED = "copy_correct.EMA.update, skip_nonfinite=True"
CHECK = "the guard's check alone: one read of the weights"
COPY = "plain copy of the same bytes"
FLAT_LERP = "flat lerp_ of the same bytes (one tensor)"


def conv_net(widths: list[tuple[int, int]]) -> nn.Module:
    """A plain conv/BatchNorm stack: ``widths`` is (channels, layers) per stage."""
    layers: list[nn.Module] = []
    channels = 3
    for width, depth in widths:
        for _ in range(depth):
            layers += [nn.Conv2d(channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
            channels = width
    return nn.Sequential(*layers)


def large_model() -> nn.Module:
    """About 24M parameters in 66 tensors plus 66 BatchNorm buffers, shaped like a ResNet-50's."""
    return conv_net([(64, 3), (128, 4), (256, 6), (512, 9)])


class Block(nn.Module):
    """A transformer block's weights (LayerNorms, fused QKV, projection, 4x MLP)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)


def transformer_model() -> nn.Module:
    """About 28M parameters in 48 tensors (4 blocks of width 768): few, large tensors."""
    return nn.Sequential(*[Block(768) for _ in range(4)])


def small_model() -> nn.Module:
    """The ``ema`` recipe's digits MLP: about 85K parameters (overhead-bound)."""
    from recipes.ema import NoisyClassifier

    return NoisyClassifier(image_shape=(1, 8, 8), num_classes=10).net


class _Holder(LightningModule):
    """The LightningModule a Lightning user's network sits in: what ``EMAWeightAveraging`` averages."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net


def lightning_contender(model: nn.Module) -> Callable[[], object]:
    """``EMAWeightAveraging``'s per-step work, driven through its own hooks: ``setup`` builds its
    ``AveragedModel``; ``on_train_batch_end`` updates it once per new optimizer step (``trainer.global_step``)."""
    callback = EMAWeightAveraging(decay=DECAY)
    module = _Holder(model)
    trainer = SimpleNamespace(global_step=0)
    callback.setup(trainer, module, "fit")  # type: ignore[arg-type]

    def step() -> None:
        trainer.global_step += 1
        callback.on_train_batch_end(trainer, module, None, None, 0)  # type: ignore[arg-type]

    return step


def contenders(model: nn.Module) -> tuple[dict[str, Callable[[], object]], dict[str, str]]:
    """``({row: one update}, {row: why it cannot run here})``."""
    ema = EMA(model, decay=DECAY, skip_nonfinite=False)
    guarded = EMA(model, decay=DECAY, skip_nonfinite=True)
    fns: dict[str, Callable[[], object]] = {OURS: lambda: ema.update(model), GUARDED: lambda: guarded.update(model)}
    if guarded._guard is not None and not isinstance(guarded._guard, NonFiniteGuard):
        live = [t for t in model.state_dict().values() if t.is_floating_point()]
        fns[CHECK] = torch.no_grad()(lambda: guarded._guard.finite([live]))
    not_run: dict[str, str] = {}

    def timm_v3(timm: ModuleType) -> Callable[[], object]:
        averaged, steps = timm.ModelEmaV3(model, decay=DECAY), count(1)  # foreach by default
        return lambda: averaged.update(model, step=next(steps))

    def diffusers_ema(foreach: bool) -> Callable[[ModuleType], Callable[[], object]]:
        def build(diffusers: ModuleType) -> Callable[[], object]:
            averaged = diffusers.EMAModel(model.parameters(), decay=DECAY, foreach=foreach)
            return lambda: averaged.step(model.parameters())

        return build

    def ema_pytorch(foreach: bool) -> Callable[[ModuleType], Callable[[], object]]:
        return lambda module: (
            module.EMA(model, beta=DECAY, update_after_step=0, update_every=1, use_foreach=foreach).update
        )

    peers: list[tuple[ModuleType | Missing, str, dict[str, Callable[[ModuleType], Callable[[], object]]]]] = [
        (timm_model_ema(), "timm", {
            "ModelEmaV3 (foreach)": timm_v3,
            "ModelEmaV2": lambda timm: partial(timm.ModelEmaV2(model, decay=DECAY).update, model),
        }),
        (load("diffusers.training_utils", "diffusers"), "diffusers", {
            f"EMAModel (foreach={foreach}, parameters only)": diffusers_ema(foreach) for foreach in (False, True)
        }),
        (load("ema_pytorch", "ema-pytorch"), "ema-pytorch", {
            f"EMA (use_foreach={foreach})": ema_pytorch(foreach) for foreach in (False, True)
        }),
    ]  # fmt: skip
    for module, distribution, rows in peers:
        for what, build in rows.items():
            if isinstance(module, Missing):
                not_run[label(distribution, what)] = module
            else:
                fns[label(distribution, what)] = build(module)

    multi = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(DECAY), use_buffers=True)
    fns[f"torch {torch.__version__.split('+')[0]} AveragedModel + get_ema_multi_avg_fn"] = lambda: (
        multi.update_parameters(model)
    )
    fns[label("lightning", "EMAWeightAveraging")] = lightning_contender(model)

    floats = [t for t in model.state_dict().values() if t.is_floating_point()]
    shadow = [t.clone() for t in floats]

    def articles_loop() -> None:
        with torch.no_grad():
            for e, p in zip(shadow, floats, strict=True):
                e.copy_(DECAY * e + (1 - DECAY) * p)

    def bare_lerp() -> None:
        with torch.no_grad():
            torch._foreach_lerp_(shadow, floats, 1 - DECAY)

    elements = sum(t.numel() for t in floats)
    # a written source: an unwritten torch.empty reads as the kernel's one zero page, which stays in cache
    flat_source, flat_target = (
        torch.randn(elements, device=floats[0].device),
        torch.empty(elements, device=floats[0].device),
    )
    fns |= {
        "articles' per-tensor copy_ loop": articles_loop,
        "bare _foreach_lerp_, prebuilt lists": bare_lerp,
        FLAT_LERP: lambda: flat_target.lerp_(flat_source, 1 - DECAY),
        COPY: lambda: flat_target.copy_(flat_source),
    }
    return fns, not_run


def table(
    title: str, model: nn.Module, times: dict[str, float], not_run: dict[str, str], limit: StreamLimit | None = None
) -> str:
    floats = [t for t in model.state_dict().values() if t.is_floating_point()]
    elements = sum(t.numel() for t in floats)
    parameters = sum(p.numel() for p in model.parameters())
    caption = (
        f"**{title}**: {elements / 1e6:.2f}M floating elements in {len(floats)} tensors "
        f"({12 * elements / 1e6:.0f} MB moved per update)"
    )
    # bytes per element of the whole state: diffusers moves the parameters' 12 bytes each, not the buffers'; a copy
    # reads and writes (8), the check only reads (4)
    per_element = {name: 12.0 * parameters / elements if "parameters only" in name else 12.0 for name in times}
    per_element |= {COPY: 8.0, CHECK: 4.0}
    return bandwidth_table(caption, elements, times, per_element, OURS, COPY, not_run, limit=limit)


def benchmark_models(quick: bool) -> dict[str, Callable[[], nn.Module]]:
    """The models the EMA benchmarks time, by title: the digits MLP and two models of about 25M parameters (with
    ``quick``, a small conv net instead of those two)."""
    models: dict[str, Callable[[], nn.Module]] = {"small model (digits MLP)": small_model}
    if quick:
        models["medium model (conv net)"] = lambda: conv_net([(32, 2), (64, 2)])
    else:
        models["large model (conv net)"] = large_model
        models["large model (transformer blocks)"] = transformer_model
    return models


def main(argv: list[str]) -> int:
    args, device, budget = parse_args(__doc__, argv, 20.0, ROOT / "docs" / "benchmarks.md")
    models = benchmark_models(args.quick)
    sections = []
    for title, make in models.items():
        torch.manual_seed(0)
        model = make().to(device)
        fns, not_run = contenders(model)
        stream, limit_of = in_rounds(device, args.quick)  # the limit, timed in the same rounds as the rows
        times = median_ms(fns | stream, device, budget)
        limit = limit_of(times)
        sections.append(table(title, model, times, not_run, limit))
        print(sections[-1], end="\n\n", flush=True)
    header = measured_on(device, command_line("benchmarks.ema", args))
    write_section(args.output, f"ema-{device.type}", f"EMA update ({device.type})", header, "\n\n".join(sections))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
