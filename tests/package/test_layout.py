"""The tree shows the architecture: one package, ``copy_correct``, in three layers with one direction of imports.

* The tensor parts (``copy_correct/*.py``) import torch, numpy and the standard library only: no Lightning, no
  probe, no adapter, nothing of the repository outside the package.
* The Lightning adapters (``copy_correct/lightning/``) are the only modules that import Lightning (or torchmetrics);
  of them only the probes' Lightning halves import a probe.
* The probes (``copy_correct/probes/``) import no Lightning and no training part.
* Nothing in the package imports the recipes, the tests, the tools, the benchmarks, the scripts or ``train.py``.

Imports are read with ``ast`` anywhere in a module (a function's body too) and followed through other modules and
re-exports. The controls write a small tree that breaks each rule in each way, and the same checks must catch it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import copy_correct
import copy_correct.lightning
import copy_correct.probes
from scripts.new_project import ROOT, SourceTree

PACKAGE = "copy_correct"
LIGHTNING = f"{PACKAGE}.lightning"
PROBES = f"{PACKAGE}.probes"
# The adapters that are a probe's Lightning half: they import their probe, as a probe's own tests do.
PROBE_HALVES = {f"{LIGHTNING}.step_probe", f"{LIGHTNING}.graph_guard"}
TENSOR_THIRD_PARTY = {"torch", "numpy"}
# Optional packages a module does without (an ImportError caught): no dependency of its layer.
# checked_load.hyperparameter_classes imports OmegaConf only when called: the allowlist for a Lightning checkpoint's
# DictConfig hyperparameters (a checkpoint that holds them was written where OmegaConf is installed). files.digest
# takes ISA-L's CRC-32 where the fast-digest extra installed it, else zlib's, the same function.
OPTIONAL = {f"{PACKAGE}.files.checked_load": {"omegaconf"}, f"{PACKAGE}.files.digest": {"isal"}}
FRAMEWORKS = {"lightning", "pytorch_lightning", "torchmetrics"}


def modules_of(tree: SourceTree, package: str) -> list[str]:
    """The modules of ``package`` itself, not of its subpackages (its ``__init__`` aside)."""
    depth = package.count(".") + 1
    return sorted(m for m in tree.paths if m.startswith(f"{package}.") and m.count(".") == depth)


def reached(tree: SourceTree, module: str) -> set[str]:
    """The first-party modules ``module`` imports, anywhere in it, and what they import in turn. A name taken from a
    re-exporting package counts as the module it comes from; the package ``__init__`` itself does not count."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        for needed in sorted(tree.needs(todo.pop()).modules - seen):
            seen.add(needed)
            if tree.exports(needed) is None:
                todo.append(needed)
    return {m for m in seen if tree.exports(m) is None}


def third_party(tree: SourceTree, module: str) -> set[str]:
    """The third-party packages ``module`` and every first-party module it reaches import."""
    modules = {module} | reached(tree, module)
    return set().union(*(tree.needs(m).third_party - OPTIONAL.get(m, set()) for m in modules))


def problems(tree: SourceTree) -> dict[str, list[str]]:
    """Every module of the package that breaks a rule of its layer, with what it reaches that it must not."""
    found: dict[str, list[str]] = {}
    outside = tuple(f"{top}." for top in tree.first_party - {PACKAGE}) + tuple(tree.first_party - {PACKAGE})
    for module in sorted(m for m in tree.paths if m.startswith(f"{PACKAGE}.") and tree.exports(m) is None):
        own = reached(tree, module)
        bad = sorted(m for m in own if m.startswith(outside))
        if module.startswith(f"{LIGHTNING}."):
            bad += sorted(m for m in own if m.startswith(f"{PROBES}.") and module not in PROBE_HALVES)
        elif module.startswith(f"{PROBES}."):
            bad += sorted(m for m in own if m.startswith(f"{LIGHTNING}."))
            bad += sorted(FRAMEWORKS & third_party(tree, module))
        else:
            bad += sorted(m for m in own if m.startswith((f"{LIGHTNING}.", f"{PROBES}.")))
            bad += sorted(third_party(tree, module) - TENSOR_THIRD_PARTY)
        if bad:
            found[module] = bad
    return found


def test_without_isal_the_digests_are_zlibs_and_the_same() -> None:
    """What ``OPTIONAL`` lets through for ``files.digest``: without isal the package imports and seals with zlib's
    CRC-32, which verifies the same file (the control: with isal installed here, it is ISA-L's that runs)."""
    code = (
        "import sys, tempfile, pathlib, torch; sys.modules['isal'] = None; sys.modules['isal.isal_zlib'] = None; "
        "from copy_correct.files import digest as d; from copy_correct.files.atomic_save import atomic_save; "
        "assert d.CRC32 == 'zlib', d.CRC32; "
        "p = pathlib.Path(tempfile.mkdtemp()) / 'a.pt'; atomic_save({'w': torch.ones(9)}, p); d.verify_file(p)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    import copy_correct.files.digest as _file_digest

    assert _file_digest.CRC32 == "isal"  # the control: the README's install (dev) takes the fast-digest extra


def test_a_lazy_optional_import_is_imported_only_when_called_and_not_needed() -> None:
    """What ``OPTIONAL`` lets through for ``checked_load``: importing the module imports no OmegaConf, and without
    OmegaConf the call returns an empty allowlist (the control: the call with OmegaConf imports it)."""
    code = (
        "import sys; import copy_correct.files.checked_load as c; assert 'omegaconf' not in sys.modules; "
        "assert c.hyperparameter_classes() and 'omegaconf' in sys.modules; "
        "sys.modules['omegaconf'] = None; assert c.hyperparameter_classes() == ()"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_each_layer_imports_only_what_it_may() -> None:
    tree = SourceTree(ROOT)
    assert {"copy_correct.averages.ema", "copy_correct.target", "copy_correct.replay.buffer"} <= set(tree.paths)
    assert {f"{LIGHTNING}.ema_weights", f"{LIGHTNING}.resume"} | PROBE_HALVES <= set(modules_of(tree, LIGHTNING))
    assert {f"{PROBES}.copy_audit", f"{PROBES}.memory_probe", f"{PROBES}.graph_guard"} <= set(modules_of(tree, PROBES))
    assert problems(tree) == {}


def test_only_the_adapters_import_lightning() -> None:
    tree = SourceTree(ROOT)
    importers = {m for m in tree.paths if m.startswith(f"{PACKAGE}.") and tree.needs(m).third_party & FRAMEWORKS}
    # The adapters' package itself too: its ``__init__`` imports Lightning first, to name the extra if it is missing.
    assert importers and all(m == LIGHTNING or m.startswith(f"{LIGHTNING}.") for m in importers), sorted(importers)


# Controls: a small tree in which one module breaks its layer's rule in one way at a time.
SMALL_TREE = {
    "copy_correct/__init__.py": '"""Parts."""\n\nfrom copy_correct.helper import helper\n'
    "from copy_correct.x import X\n",
    "copy_correct/helper.py": "from copy_correct.probes.probe import Probe\n",
    "copy_correct/x.py": "import torch\n",
    "copy_correct/probes/__init__.py": '"""Probes."""\n\nfrom copy_correct.probes.probe import Probe\n',
    "copy_correct/probes/probe.py": "import torch\n",
    "copy_correct/lightning/__init__.py": '"""Adapters."""\n\nfrom copy_correct.lightning.cb import Cb\n',
    "copy_correct/lightning/cb.py": "import lightning\n",
    "recipes/__init__.py": "",
    "recipes/r.py": "",
    "conf/recipe/r.yaml": "",
}
BREAKS = [
    ("copy_correct/x.py", "import lightning.pytorch as pl\n"),  # a tensor part imports Lightning
    ("copy_correct/x.py", "def f():\n    import torchmetrics\n"),  # ... at call time only
    ("copy_correct/x.py", "from copy_correct.probes import Probe\n"),  # ... a probe, through its package
    ("copy_correct/x.py", "from .probes.probe import Probe\n"),  # ... relatively
    ("copy_correct/x.py", "from copy_correct import helper\n"),  # ... through another tensor part
    ("copy_correct/x.py", "from copy_correct.lightning import Cb\n"),  # ... an adapter
    ("copy_correct/x.py", "import sklearn\n"),  # ... another third-party package
    ("copy_correct/x.py", "from recipes import r\n"),  # ... a recipe
    ("copy_correct/lightning/cb.py", "from copy_correct.probes import Probe\n"),  # an adapter imports a probe
    ("copy_correct/probes/probe.py", "import lightning\n"),  # a probe imports Lightning
    ("copy_correct/probes/probe.py", "from copy_correct.lightning.cb import Cb\n"),  # ... an adapter
]


def small_tree(root: Path, breaking: tuple[str, str] | None) -> SourceTree:
    for relative, text in {**SMALL_TREE, **dict([breaking] if breaking else [])}.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(text)
    return SourceTree(root)


@pytest.mark.parametrize("breaking", BREAKS, ids=[f"{path}: {text.strip()}" for path, text in BREAKS])
def test_control_each_way_to_break_a_layer_is_caught(breaking: tuple[str, str], tmp_path: Path) -> None:
    module = breaking[0].removesuffix(".py").replace("/", ".")
    assert module in problems(small_tree(tmp_path, breaking))


def test_control_the_small_tree_as_it_is_keeps_its_layers_but_the_helper(tmp_path: Path) -> None:
    assert problems(small_tree(tmp_path, None)) == {"copy_correct.helper": ["copy_correct.probes.probe"]}


@pytest.mark.parametrize("package", [copy_correct, copy_correct.lightning, copy_correct.probes])
def test_each_package_exports_what_its_docstring_lists(package: object) -> None:
    names = set(package.__all__)  # type: ignore[attr-defined]
    assert all(getattr(package, name).__name__ == name for name in names)
    listed = {line.split()[0] for line in (package.__doc__ or "").splitlines() if line.startswith("    ")}
    assert listed == names


def test_the_layers_export_disjoint_names() -> None:
    layers = [set(p.__all__) for p in (copy_correct, copy_correct.lightning, copy_correct.probes)]
    assert sum(map(len, layers)) == len(set().union(*layers))
