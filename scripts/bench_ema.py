"""Benchmark one EMA update against its peers, in one process, and write the table to docs/benchmarks.md.

    python scripts/bench_ema.py                  # CPU; both models; updates docs/benchmarks.md
    python scripts/bench_ema.py --device cuda    # the same on a GPU (also reports the device's copy bandwidth)
    python scripts/bench_ema.py --quick --output /tmp/b.md   # a smoke run with small sizes

Contenders, each updating a float32 shadow of the same model (parameters and BatchNorm buffers):

* ``components.EMA.update``
* Lightning's ``EMAWeightAveraging`` update path: ``AveragedModel(avg_fn=get_ema_avg_fn(decay))
  .update_parameters(model)``, one Python-level average per tensor
* ``AveragedModel(multi_avg_fn=get_ema_multi_avg_fn(decay))``: grouped, but lists rebuilt every call
* timm-style: ``_foreach_lerp_`` over lists freshly built from both ``state_dict()``s each call
* the articles' loop: ``e.copy_(decay * e + (1 - decay) * p)`` per tensor under ``no_grad``
* a bare ``_foreach_lerp_`` over prebuilt lists under ``no_grad`` (the floor for this work)
* a plain copy of the same number of bytes as one contiguous tensor (the memory-bandwidth limit)

Timings are medians over interleaved rounds, so all contenders see the same machine load; the table
reports milliseconds, each contender's time over ours, and effective bandwidth: an EMA update reads the
shadow and the weights and writes the shadow (12 bytes per float32 element), a copy reads and writes
(8 bytes). On caches that read a line before writing it, the copy's real traffic is 12 bytes too, so an
update can reach more than 100% of the copy's effective figure.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_avg_fn, get_ema_multi_avg_fn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from components import EMA  # noqa: E402
from scripts.bench_report import bandwidth_table, command_line, measured_on, median_ms, parse_args, write_section  # noqa: E402

DECAY = 0.999
OURS = "components.EMA.update"


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
    from recipes.ema import NoisyDigitsClassifier

    return NoisyDigitsClassifier().net


def contenders(model: nn.Module) -> dict[str, Callable[[], object]]:
    ema = EMA(model, decay=DECAY)
    lightning_path = AveragedModel(model, avg_fn=get_ema_avg_fn(DECAY), use_buffers=True)
    multi = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(DECAY), use_buffers=True)
    lightning_path.update_parameters(model)  # the first call copies; later ones average
    multi.update_parameters(model)
    timm_shadow = copy.deepcopy(model)
    floats = [t for t in model.state_dict().values() if t.is_floating_point()]
    shadow = [t.clone() for t in floats]

    def timm_style() -> None:
        with torch.no_grad():
            pairs = [
                (e, m)
                for e, m in zip(timm_shadow.state_dict().values(), model.state_dict().values(), strict=True)
                if e.is_floating_point()
            ]
            torch._foreach_lerp_([e for e, _ in pairs], [m for _, m in pairs], 1 - DECAY)

    def articles_loop() -> None:
        with torch.no_grad():
            for e, p in zip(shadow, floats, strict=True):
                e.copy_(DECAY * e + (1 - DECAY) * p)

    def bare_lerp() -> None:
        with torch.no_grad():
            torch._foreach_lerp_(shadow, floats, 1 - DECAY)

    elements = sum(t.numel() for t in floats)
    flat_source, flat_target = (
        torch.empty(elements, device=floats[0].device),
        torch.empty(elements, device=floats[0].device),
    )

    def plain_copy() -> None:
        flat_target.copy_(flat_source)

    return {
        OURS: lambda: ema.update(model),
        "Lightning EMAWeightAveraging path": lambda: lightning_path.update_parameters(model),
        "AveragedModel + get_ema_multi_avg_fn": lambda: multi.update_parameters(model),
        "timm-style lerp, lists rebuilt": timm_style,
        "articles' per-tensor copy_ loop": articles_loop,
        "bare _foreach_lerp_, prebuilt lists": bare_lerp,
        "plain copy of the same bytes": plain_copy,
    }


def table(title: str, model: nn.Module, times: dict[str, float]) -> str:
    floats = [t for t in model.state_dict().values() if t.is_floating_point()]
    elements = sum(t.numel() for t in floats)
    caption = (
        f"**{title}**: {elements / 1e6:.2f}M floating elements in {len(floats)} tensors "
        f"({12 * elements / 1e6:.0f} MB moved per update)"
    )
    per_element = {name: 8 if name.startswith("plain") else 12 for name in times}
    return bandwidth_table(caption, elements, times, per_element, OURS, "plain copy of the same bytes")


def main(argv: list[str]) -> int:
    args, device, budget = parse_args(__doc__, argv, 20.0, ROOT / "docs" / "benchmarks.md")
    models = {"small model (digits MLP)": small_model}
    if args.quick:
        models["medium model (conv net)"] = lambda: conv_net([(32, 2), (64, 2)])
    else:
        models["large model (conv net)"] = large_model
        models["large model (transformer blocks)"] = transformer_model
    sections = []
    for title, make in models.items():
        torch.manual_seed(0)
        model = make().to(device)
        times = median_ms(contenders(model), device, budget)
        sections.append(table(title, model, times))
        print(sections[-1], end="\n\n", flush=True)
    header = measured_on(device, command_line("bench_ema.py", args))
    write_section(args.output, f"ema-{device.type}", f"EMA update ({device.type})", header, "\n\n".join(sections))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
