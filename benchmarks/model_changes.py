"""Benchmark what refusing a model changed under an average costs (``copy_correct.averages.model_changes``, and the
data-pointer check before an update's first write), against the update itself, on the EMA benchmark's models; write the
tables to docs/benchmarks.md.

    python -m benchmarks.model_changes                 # CPU; the digits MLP and two ~25M-parameter models
    python -m benchmarks.model_changes --quick --output /tmp/b.md

Rows, each timed in the same interleaved rounds:

* ``EMA.update``: the update as it runs in a loop (the check is one integer compared with the count of registrations)
* the same with that check removed (``stale`` answering ``False``): the update without the registrations' check
* ``EMA.update`` after a registration anywhere (the count raised before each call): the update plus the walk over the
  model's ``state_dict`` names, what an update pays once after a module is built or assigned
* the walk alone (``_check_model``), which ``average_weights``, ``copy_to`` and ``export`` make each time
* ``average_weights`` entered and left (its two copies of the weights, and the walk)

and for ``EMA.update``, ``PowerEMA.update`` (two profiles), ``soft_update`` and ``hard_update`` of a target of the
model: the update, and what the check it makes before its first write adds, alone (each live tensor's data pointer
compared with the one it was last checked with; a target pair's on both sides), the check's time over the update's.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import copy_correct.averages.model_changes as _model_changes
import copy_correct.target as target_module
from benchmarks.ema import benchmark_models
from benchmarks.report import command_line, measured_on, median_ms, parse_args, write_section
from copy_correct import EMA, PowerEMA, hard_update, make_target, soft_update
from copy_correct.averages.shadow import Shadows
from copy_correct.core.module_tensors import DATA_PTR

ROOT = Path(__file__).resolve().parents[1]
UPDATE = "EMA.update (the check: one integer compare)"


def contenders(model: nn.Module) -> dict[str, Callable[[], object]]:
    checked, unchecked, walked = (EMA(model, decay=0.999) for _ in range(3))
    unchecked._watch.stale = lambda: False  # the floor: no check at all

    def after_a_registration() -> None:
        _model_changes._registrations[0] += 1  # as a module built or assigned anywhere does
        walked.update(model)

    def swap() -> None:
        with checked.average_weights(model):
            pass

    return {
        UPDATE: lambda: checked.update(model),
        "EMA.update without the registrations' check": lambda: unchecked.update(model),
        "EMA.update after a registration (update + walk)": after_a_registration,
        "the walk alone (_check_model)": lambda: checked._check_model(model),
        "average_weights entered and left (two copies + walk)": swap,
    }


def pointer_checks(model: nn.Module) -> dict[str, Callable[[], object]]:
    """Each update, and what its data-pointer check adds, alone: the pointers of the tensors the update resolves
    anyway (resolved here once, outside the timing) compared with the ones kept."""
    ema, power, target = EMA(model, decay=0.999), PowerEMA(model, sigma_rels=(0.05, 0.1)), make_target(model)
    soft_update(target, model, 0.005)

    def averages_check(average: Shadows) -> Callable[[], object]:
        lists = [(g.live.resolve(), g.pointers) for g in average._groups]
        return lambda: [list(map(DATA_PTR, lives)) != kept for lives, kept in lists]

    groups, targets, onlines = target_module._checked(target_module._pairs(target, model, None), target, model)
    sides = [(t, g.target_pointers, o, g.online_pointers) for g, t, o in zip(groups, targets, onlines, strict=True)]

    def target_check() -> object:
        return [list(map(DATA_PTR, t)) != tp or list(map(DATA_PTR, o)) != op for t, tp, o, op in sides]

    return {
        "EMA.update": lambda: ema.update(model),
        "EMA.update check": averages_check(ema),
        "PowerEMA.update": lambda: power.update(model),
        "PowerEMA.update check": averages_check(power),
        "soft_update": lambda: soft_update(target, model, 0.005),
        "soft_update check": target_check,
        "hard_update": lambda: hard_update(target, model),
        "hard_update check": target_check,
    }


def pointer_table(title: str, times: dict[str, float]) -> str:
    lines = [
        f"**{title}**: the data-pointer check before an update's first write",
        "",
        "| update | ms per call | the check alone, ms | its share of the update |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name in ("EMA.update", "PowerEMA.update", "soft_update", "hard_update"):
        update, check = times[name], times[f"{name} check"]
        lines.append(f"| {name} | {update:.4f} | {check:.4f} | {check / update * 100:.1f}% |")
    return "\n".join(lines)


def table(title: str, model: nn.Module, times: dict[str, float]) -> str:
    tensors = len(model.state_dict())
    lines = [
        f"**{title}**: {tensors} state_dict entries",
        "",
        "| contender | ms per call | time / update |",
        "| --- | ---: | ---: |",
    ]
    lines += [f"| {name} | {ms:.4f} | {ms / times[UPDATE]:.2f}x |" for name, ms in times.items()]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args, device, budget = parse_args(__doc__, argv, 10.0, ROOT / "docs" / "benchmarks.md")
    sections = []
    for title, make in benchmark_models(args.quick).items():
        torch.manual_seed(0)
        model = make().to(device)
        sections.append(table(title, model, median_ms(contenders(model), device, budget)))
        print(sections[-1], end="\n\n", flush=True)
        sections.append(pointer_table(title, median_ms(pointer_checks(model), device, budget)))
        print(sections[-1], end="\n\n", flush=True)
    header = measured_on(device, command_line("benchmarks.model_changes", args))
    key = f"model-changes-{device.type}"
    write_section(
        args.output,
        key,
        f"A model changed under an average: the checks' cost ({device.type})",
        header,
        "\n\n".join(sections),
    )
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
