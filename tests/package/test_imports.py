"""What importing each layer costs, in a fresh interpreter: ``import copy_correct`` and every tensor part, and
``copy_correct.probes`` and every probe, load no Lightning, torchmetrics, Hydra or matplotlib, nor the sympy that
``torch.distributed.tensor`` brings (which only a process that shards needs). The control: the adapters,
``copy_correct.lightning``, do load Lightning, so the check sees it. ``tests/package/test_packaging.py`` repeats the
first check on the built wheel, installed where no checkout is on the path."""

from __future__ import annotations

import json
import subprocess
import sys

import copy_correct
import copy_correct.probes
from tests.conftest import ROOT, child_env

HEAVY = ("lightning", "pytorch_lightning", "torchmetrics", "hydra", "omegaconf", "matplotlib", "sympy")


def heavy_after(*statements: str) -> list[list[str]]:
    """The heavy packages one fresh interpreter has imported after each statement, run in turn."""
    lines = [
        "import json, sys",
        f"def seen(): return sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))",
    ]
    for statement in statements:
        lines += [statement, "print(json.dumps(seen()))"]
    result = subprocess.run(
        [sys.executable, "-c", "\n".join(lines)], cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=child_env(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    return [json.loads(line) for line in result.stdout.splitlines()[-len(statements) :]]


def test_the_tensor_parts_and_the_probes_load_no_framework_and_the_control_the_adapters_do() -> None:
    *free, control = heavy_after(
        "import copy_correct",
        f"from copy_correct import {', '.join(copy_correct.__all__)}",
        f"from copy_correct.probes import {', '.join(copy_correct.probes.__all__)}",
        "import copy_correct.lightning",  # the control
    )
    assert free == [[], [], []]
    assert "lightning" in control


def test_the_exceptions_a_user_catches_load_no_framework() -> None:
    caught = [
        f"from {package.__name__} import {name}"
        for package in (copy_correct, copy_correct.probes)
        for name in package.__all__
        if isinstance(getattr(package, name), type) and issubclass(getattr(package, name), Exception)
    ]
    assert caught  # CheckpointMismatch and GraphRetentionError, where a starter keeps them
    assert heavy_after(*caught) == [[]] * len(caught)
