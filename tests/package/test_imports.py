"""What importing each layer costs, in a fresh interpreter: ``import copy_correct`` and every tensor part, and
``copy_correct.probes`` and every probe, load no Lightning, torchmetrics, Hydra or matplotlib, nor the sympy that
``torch.distributed.tensor`` brings (which only a process that shards needs). The control: the adapters,
``copy_correct.lightning``, do load Lightning, so the check sees it. ``tests/package/test_packaging.py`` repeats the
first check on the built wheel, installed where no checkout is on the path. And importing a recipe sets no warning
filter: the filters a recipe's runs need are set by ``train.py`` for that run (``expected_warnings``)."""

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


# Every recipe module, and the third-party packages they import (which may set filters of their own when imported).
RECIPE_MODULES = sorted(
    ".".join(path.relative_to(ROOT).with_suffix("").parts)
    for path in (ROOT / "recipes").rglob("*.py")
    if path.name != "__init__.py"
)
THIRD_PARTY = ("lightning.pytorch", "torchmetrics", "gymnasium", "sklearn.datasets", "PIL.Image", "hydra", "tqdm")
FILTERS_AFTER = """
import importlib, importlib.util, json, sys, warnings
for name in {third_party!r}:
    if importlib.util.find_spec(name.split(".")[0]) is not None:  # a starter has only what its recipe needs
        importlib.import_module(name)
before = [repr(f) for f in warnings.filters]
{statement}
for name in {modules!r}:
    importlib.import_module(name)
print(json.dumps([f for f in map(repr, warnings.filters) if f not in before]))
"""


def filters_added_by_importing_the_recipes(statement: str = "") -> list[str]:
    code = FILTERS_AFTER.format(third_party=THIRD_PARTY, modules=RECIPE_MODULES, statement=statement)
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, env=child_env()
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_importing_a_recipe_sets_no_warning_filter_and_the_control_one_that_does_shows() -> None:
    assert {"recipes.gan", "recipes.dqn", "recipes.data.pinned_digits"} <= set(RECIPE_MODULES)
    assert filters_added_by_importing_the_recipes() == []
    control = "warnings.filterwarnings('ignore', message='Found .* module')"  # what gan.py and dqn.py did before
    assert len(filters_added_by_importing_the_recipes(control)) == 1
