"""``from components import X`` imports X's module and what it needs, nothing else (``components/_lazy.py``): a
training part or probe that needs no Lightning imports no Lightning, torchmetrics or sympy (which
``torch.distributed.tensor`` brings, and which only a process that shards needs). The control: the Lightning
callbacks do import Lightning, so the check sees it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import components
import components.probes
from scripts.new_project import ROOT, SourceTree
from tests.conftest import child_env

FRAMEWORKS = ("lightning", "pytorch_lightning", "torchmetrics", "sympy")
# The names whose module needs Lightning: the Lightning callbacks and strategy, and what they share.
LIGHTNING = {
    "AtomicCheckpointIO", "AtomicModelParallelStrategy", "CheckpointMismatch", "DataWaitMonitor", "EMACallback",
    "GraphRetentionError", "GraphRetentionGuard", "ResumeState", "RunSummary", "StepProbe", "check_checkpoint",
}  # fmt: skip


def frameworks_after(*statements: str) -> list[list[str]]:
    """The framework packages one fresh interpreter has imported after each statement, run in turn."""
    lines = [
        "import json, sys",
        f"def seen(): return sorted({{m.split('.')[0] for m in sys.modules}} & set({FRAMEWORKS!r}))",
    ]
    for statement in statements:
        lines += [statement, "print(json.dumps(seen()))"]
    result = subprocess.run(
        [sys.executable, "-c", "\n".join(lines)], cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=child_env(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    return [json.loads(line) for line in result.stdout.splitlines()[-len(statements) :]]


def needs_lightning(tree: SourceTree, module: str) -> bool:
    seen, todo = set(), [module]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        needs = tree.needs(current)
        if needs.third_party & {"lightning", "pytorch_lightning", "torchmetrics"}:
            return True
        todo += [m for m in needs.modules if tree.exports(m) is None]
    return False


def test_the_names_that_need_lightning_are_the_lightning_callbacks() -> None:
    tree = SourceTree(ROOT)
    exports = {**tree.exports("components"), **tree.exports("components.probes")}  # type: ignore[arg-type]
    assert set(exports) == set(components.__all__)
    assert {name for name, module in exports.items() if needs_lightning(tree, module)} == LIGHTNING


def test_every_tensor_part_and_probe_imports_no_framework_and_the_control_a_callback_does() -> None:
    free = sorted(set(components.__all__) - LIGHTNING)
    assert {"EMA", "ReplayBuffer", "make_target", "MemoryProbe", "graph_bytes"} <= set(free)
    free_probes = sorted(set(components.probes.__all__) - LIGHTNING)
    assert frameworks_after(
        "import components",
        f"from components import {', '.join(free)}",
        f"from components.probes import {', '.join(free_probes)}",
        "from components import EMACallback",  # the control
    ) == [[], [], [], ["lightning", "sympy", "torchmetrics"]]


def test_every_export_resolves_lazily_and_an_unknown_name_is_a_clear_error() -> None:
    for package in (components, components.probes):
        assert set(package.__all__) <= set(dir(package))
        for name in package.__all__:
            assert getattr(package, name).__name__ == name
    with pytest.raises(AttributeError, match="module 'components' has no attribute 'EMAA'"):
        components.EMAA  # noqa: B018
    with pytest.raises(ImportError, match="cannot import name 'EMAA' from 'components'"):
        from components import EMAA  # noqa: F401
