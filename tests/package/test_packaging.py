"""The wheel installs one import package, ``copy_correct``, and nothing with a generic name: built from a copy of the
checkout (``pip wheel . --no-deps``), its top-level names are exactly the package and its metadata; installed into a
fresh virtual environment, it imports from a folder that holds a user's own ``components/`` and ``recipes/``
packages with neither side shadowing the other, and the repository's other folders (``recipes``, ``tests``,
``tools``, ``benchmarks``, ``scripts``, ``train``) are not installed. In a fresh interpreter there, ``import
copy_correct`` and a tensor part load no Lightning, Hydra, torchmetrics or matplotlib. The control: the same build
with the recipes packaged too (this project's layout before the package had a name of its own) ships a top-level
``recipes``, which the check of the wheel's names catches."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.conftest import ROOT, env_without_checkout

PACKAGE = "copy_correct"
# The repository's folders beside the package, none installed by the wheel into the fresh venv (``recipes`` is shown
# by the user's own importing). Other packages may install such names: torchrl 0.14.1 installs a top-level
# `benchmarks`, tensordict 0.14.3 a `scripts`; a name from this environment's site-packages is theirs, not ours.
NOT_INSTALLED = ("tests", "tools", "benchmarks", "scripts", "train")
HEAVY = ("lightning", "pytorch_lightning", "torchmetrics", "hydra", "omegaconf", "matplotlib")


def checkout_copy(dest: Path) -> Path:
    """The files git tracks (a clean checkout's), copied to ``dest``: the build sees no virtual environment, build
    folder or output of this one."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout: the tracked files are unknown")
    for relative in filter(None, listed.stdout.split("\0")):
        if (ROOT / relative).is_file():
            (dest / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / relative, dest / relative)
    return dest


def build_wheel(source: Path, out: Path) -> Path:
    """``pip wheel . --no-deps`` in ``source``, with this environment's setuptools (no download)."""
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-q", "-w", str(out)],
        cwd=source, capture_output=True, text=True, timeout=300, env=env_without_checkout(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    (wheel,) = out.glob("*.whl")
    return wheel


def top_level_names(wheel: Path) -> set[str]:
    """The first component of every path in the wheel, its ``.dist-info`` folder left out."""
    with zipfile.ZipFile(wheel) as archive:
        names = {name.split("/")[0] for name in archive.namelist()}
    return {name for name in names if not name.endswith(".dist-info")}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = checkout_copy(tmp_path_factory.mktemp("checkout"))
    return build_wheel(source, tmp_path_factory.mktemp("dist"))


def test_the_wheel_holds_one_top_level_package_and_no_other(wheel: Path) -> None:
    assert top_level_names(wheel) == {PACKAGE}
    with zipfile.ZipFile(wheel) as archive:
        files = set(archive.namelist())
    assert {f"{PACKAGE}/__init__.py", f"{PACKAGE}/lightning/__init__.py", f"{PACKAGE}/probes/__init__.py"} <= files


def test_control_packaging_the_recipes_too_ships_a_generic_top_level_name(tmp_path: Path) -> None:
    source = checkout_copy(tmp_path / "checkout")
    pyproject = source / "pyproject.toml"
    ours = f'include = ["{PACKAGE}*"]'
    assert ours in pyproject.read_text()
    pyproject.write_text(pyproject.read_text().replace(ours, f'include = ["{PACKAGE}*", "recipes*"]'))
    assert top_level_names(build_wheel(source, tmp_path / "dist")) == {PACKAGE, "recipes"}


# Run by the fresh environment's interpreter from the user's folder: where each module comes from, what is not
# installed, and which heavy packages a tensor part brought in (before the adapters are imported).
PROBE = f"""
import importlib.util, json, sys
import components, recipes
from copy_correct import EMA, ReplayBuffer, make_target
heavy = sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))
from copy_correct.lightning import EMACallback
from copy_correct.probes import MemoryProbe
import copy_correct
print(json.dumps({{
    "components": components.WHO, "recipes": recipes.WHO, "copy_correct": copy_correct.__file__,
    "heavy": heavy, "ours": [name for name in {NOT_INSTALLED!r} if (spec := importlib.util.find_spec(name))
                             and (spec.origin or list(spec.submodule_search_locations)[0]).startswith(sys.prefix)],
}}))
"""


def test_installed_in_a_fresh_venv_beside_a_users_components_and_recipes(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index", str(wheel)],
        capture_output=True, text=True, timeout=300, env=env_without_checkout(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    site = Path(subprocess.check_output([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        text=True, env=env_without_checkout()).strip())  # fmt: skip
    # The dependencies (torch, Lightning, ...) come from this environment's site-packages, appended after the fresh
    # one's: a .pth line adds the folder only, so this environment's editable install of the checkout is not loaded.
    dependencies = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "dependencies.pth").write_text("\n".join(sorted(dependencies)) + "\n")
    user = tmp_path / "user-project"
    for name in ("components", "recipes"):
        (user / name).mkdir(parents=True)
        (user / name / "__init__.py").write_text(f'WHO = "the user\'s {name}"\n')
    run = subprocess.run(
        [python, "-c", PROBE], cwd=user, capture_output=True, text=True, timeout=300, env=env_without_checkout()
    )
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.splitlines()[-1])
    assert found["components"] == "the user's components" and found["recipes"] == "the user's recipes"
    assert Path(found["copy_correct"]).resolve().is_relative_to(site.resolve())
    assert found["heavy"] == []
    assert found["ours"] == []  # none from the wheel (a peer may install one: torchrl has a top-level benchmarks)
