"""The layout shows the architecture: the probes (``components/probes/``) measure, the training parts (the other
modules of ``components/``) train, and a training part never imports a probe or a recipe, directly or through
another module. ``components`` still exports every name of both groups."""

from __future__ import annotations

from pathlib import Path

import pytest

import components
import components.probes
from scripts.new_project import ROOT, SourceTree

PROBES = "components.probes"


def training_parts(tree: SourceTree) -> list[str]:
    return sorted(m for m in tree.paths if m.startswith("components.") and not m.startswith(PROBES))


def reached(tree: SourceTree, module: str) -> set[str]:
    """The first-party modules ``module`` imports, anywhere in it (a function's body too), and what they import in
    turn. A name taken from a re-exporting package counts as the module it comes from; the package ``__init__``
    itself does not count (``components/__init__.py`` re-exports both groups, so a starter rewrites it)."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        for needed in sorted(tree.needs(todo.pop()).modules - seen):
            seen.add(needed)
            if tree.exports(needed) is None:
                todo.append(needed)
    return {m for m in seen if tree.exports(m) is None}


def forbidden(tree: SourceTree, module: str) -> list[str]:
    return sorted(m for m in reached(tree, module) if m.startswith((f"{PROBES}.", "recipes")))


def test_no_training_part_imports_a_probe_or_a_recipe() -> None:
    tree = SourceTree(ROOT)
    parts = training_parts(tree)
    assert {"components.ema", "components.ema_callback", "components.target", "components.prefetch"} <= set(parts)
    probes = {m.rpartition(".")[2] for m in tree.paths if m.startswith(f"{PROBES}.")}
    assert {"copy_audit", "memory_probe", "graph_refs", "_storage_events", "step_probe", "graph_guard"} <= probes
    assert {part: forbidden(tree, part) for part in parts} == {part: [] for part in parts}


# Controls: the same check, on a small tree, catches each way a training part could come to need a probe.
SMALL_TREE = {
    "components/__init__.py": '"""Parts."""\n\nfrom components.probes.probe import Probe\nfrom components.x import X\n',
    "components/probes/__init__.py": '"""Probes."""\n\nfrom components.probes.probe import Probe\n',
    "components/probes/probe.py": "",
    "components/helper.py": "from components.probes.probe import Probe\n",
    "recipes/__init__.py": "",
    "recipes/r.py": "",
    "conf/recipe/r.yaml": "",
}


@pytest.mark.parametrize(
    "source",
    [
        "from components import Probe\n",  # through the package's re-export
        "def f():\n    import components.probes.probe\n",  # at call time only
        "from .probes.probe import Probe\n",  # relative
        "from components import helper\n",  # through another training part
        "from recipes import r\n",  # a recipe
    ],
)
def test_control_each_way_to_import_a_probe_or_a_recipe_is_caught(source: str, tmp_path: Path) -> None:
    for relative, text in {**SMALL_TREE, "components/x.py": source}.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(text)
    tree = SourceTree(tmp_path)
    assert forbidden(tree, "components.x")
    (tmp_path / "components" / "x.py").write_text("import torch\n")
    assert not forbidden(SourceTree(tmp_path), "components.x")


def test_components_exports_both_groups_and_its_docstring_lists_them() -> None:
    assert set(components.probes.__all__) <= set(components.__all__)
    assert all(getattr(components, name) is getattr(components.probes, name) for name in components.probes.__all__)
    doc = components.__doc__ or ""
    probes_part, _, parts_part = doc.partition("\nTraining parts:\n")
    listed = {
        group: {line.split()[0] for line in text.splitlines() if line.startswith("    ")}
        for group, text in (("probes", probes_part), ("parts", parts_part))
    }
    assert listed == {
        "probes": set(components.probes.__all__),
        "parts": set(components.__all__) - set(components.probes.__all__),
    }
