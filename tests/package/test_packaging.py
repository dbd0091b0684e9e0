"""The wheel installs one import package, ``copy_correct``, and nothing with a generic name: built from a copy of the
checkout (``pip wheel . --no-deps``), its top-level names are exactly the package and its metadata; installed into a
fresh virtual environment, it imports from a folder that holds a user's own ``components/`` and ``recipes/``
packages with neither side shadowing the other, and the repository's other folders (``recipes``, ``tests``,
``tools``, ``benchmarks``, ``scripts``, ``train``) are not installed. In a fresh interpreter there, ``import
copy_correct`` and a tensor part load no Lightning, Hydra, torchmetrics or matplotlib. The control: the same build
with the recipes packaged too (this project's layout before the package had a name of its own) ships a top-level
``recipes``, which the check of the wheel's names catches."""

from __future__ import annotations

import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from collections.abc import Iterable
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
from copy_correct.lightning import EMAWeights
from copy_correct.probes import MemoryProbe
import copy_correct
print(json.dumps({{
    "components": components.WHO, "recipes": recipes.WHO, "copy_correct": copy_correct.__file__,
    "heavy": heavy, "ours": [name for name in {NOT_INSTALLED!r} if (spec := importlib.util.find_spec(name))
                             and (spec.origin or list(spec.submodule_search_locations)[0]).startswith(sys.prefix)],
}}))
"""


def test_installed_in_a_fresh_venv_beside_a_users_components_and_recipes(wheel: Path, tmp_path: Path) -> None:
    python, site = fresh_venv(tmp_path / "venv")
    result = pip_install(python, wheel, "--no-deps")
    assert result.returncode == 0, result.stderr[-3000:]
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


def fresh_venv(venv: Path) -> tuple[Path, Path]:
    """A new virtual environment with nothing installed (no pip): its interpreter and its site-packages."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.check_output(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True,
        env=env_without_checkout(),
    )  # fmt: skip
    return python, Path(site.strip())


def pip_install(python: Path, wheel: Path, *options: str) -> subprocess.CompletedProcess[str]:
    """This environment's pip installs ``wheel`` into the venv of ``python``, from no index (nothing downloaded)."""
    return subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-index", *options, str(wheel)],
        capture_output=True, text=True, timeout=300, env=env_without_checkout(),
    )  # fmt: skip


def metadata_file(wheel: Path, name: str) -> str:
    """One file of the wheel's ``.dist-info`` folder, as text."""
    with zipfile.ZipFile(wheel) as archive:
        (path,) = [path for path in archive.namelist() if path.endswith(f".dist-info/{name}")]
        return archive.read(path).decode()


def requirements(wheel: Path) -> dict[str, set[str]]:
    """The wheel's ``Requires-Dist`` names, by extra (``""``: what every install takes)."""
    by_extra: dict[str, set[str]] = {}
    for requirement, marker in re.findall(r"^Requires-Dist: ([^;\n]+);?(.*)$", metadata_file(wheel, "METADATA"), re.M):
        extra = re.search(r"extra == \"([^\"]+)\"", marker)
        name = re.match(r"[\w.-]+(\[[^\]]*\])?", requirement)[0].lower()
        by_extra.setdefault(extra[1] if extra else "", set()).add(name)
    return by_extra


def test_each_layer_requires_only_what_it_imports(wheel: Path) -> None:
    needs = requirements(wheel)
    assert needs[""] == {"torch", "numpy"}  # the tensor parts and the probes
    assert needs["lightning"] == {"lightning", "torchmetrics"}  # the adapters (torchmetrics: for the LightningModules)
    recipes = {"copy-correct[lightning]", "hydra-core", "omegaconf", "scikit-learn", "gymnasium", "matplotlib"}
    assert needs["recipes"] == recipes | {"pillow", "tqdm"}
    assert needs["compress"] == {"zstandard", "lz4"}  # FrameReplayBuffer(compress=...)'s codecs, not the core's
    assert needs["fast-digest"] == {"isal"}  # the digests' CRC-32 at memory speed; zlib's without it
    assert "copy-correct[atari,compress,docs,fast-digest,recipes,test]" in needs["dev"]  # the README's install


def test_the_torch_floor_is_the_release_whose_weights_only_unpickler_is_safe(wheel: Path) -> None:
    # 2.10.0: earlier releases' weights_only unpickler can be made to corrupt the heap by a crafted file
    # (CVE-2026-24747).
    assert "Requires-Dist: torch>=2.10" in metadata_file(wheel, "METADATA").splitlines()


def test_the_lightning_floor_and_ceiling_are_the_tested_ones(wheel: Path) -> None:
    # 2.6.6: earlier releases run code named in a checkpoint (CVE-2026-58659); <2.7: the adapters use its internals.
    assert 'Requires-Dist: lightning<2.7,>=2.6.6; extra == "lightning"' in metadata_file(wheel, "METADATA")


def test_the_documented_command_is_a_console_script_of_the_wheel(wheel: Path) -> None:
    assert "copy-correct = copy_correct.cli:main" in metadata_file(wheel, "entry_points.txt").splitlines()


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def distributions_needed_by(names: Iterable[str]) -> set[str]:
    """These installed distributions and every installed one they require here, transitively (extras left out; a
    requirement not installed, as the nvidia-* of a CUDA build are not beside a CPU build, is skipped)."""
    from packaging.markers import Marker  # installed with pip's tools here

    seen: set[str] = set()
    todo = [canonical(name) for name in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for requirement in importlib.metadata.requires(name) or []:
            spec, _, marker = requirement.partition(";")
            if "extra" in marker or (marker.strip() and not Marker(marker).evaluate()):
                continue
            dependency = canonical(re.match(r"[\w.-]+", spec.strip())[0])
            try:
                importlib.metadata.distribution(dependency)
            except importlib.metadata.PackageNotFoundError:
                continue
            todo.append(dependency)
    return seen


def give_torch_only(site: Path, dest: Path) -> None:
    """Put torch and numpy, with what they require and nothing else of this environment, on the path of the venv
    whose site-packages is ``site``: ``dest`` holds links to their import packages and metadata (no copy, no
    download), named by a ``.pth`` file there. pip sees them as installed; Lightning and Hydra are not there."""
    dest.mkdir()
    for name in distributions_needed_by(["torch", "numpy"]):
        distribution = importlib.metadata.distribution(name)
        base = Path(distribution.locate_file(""))
        for top in {Path(str(f)).parts[0] for f in distribution.files or [] if not str(f).startswith("..")}:
            if (base / top).exists() and not (dest / top).exists():
                (dest / top).symlink_to(base / top)
    (site / "torch-only.pth").write_text(f"{dest}\n")


# The core install's check, run by the fresh venv's interpreter from a folder outside the checkout.
CORE_PROBE = f"""
import json, sys
import copy_correct, copy_correct.probes
from copy_correct import *
from copy_correct.probes import *
found = {{"parts": sorted(copy_correct.__all__), "probes": sorted(copy_correct.probes.__all__),
         "heavy": sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))}}
try:
    import copy_correct.lightning
except ImportError as refused:
    found["adapters"] = str(refused)
print(json.dumps(found))
"""


def test_the_core_alone_installs_beside_torch_and_numpy_and_imports_its_parts_and_probes(
    wheel: Path, tmp_path: Path
) -> None:
    import copy_correct.probes

    python, site = fresh_venv(tmp_path / "venv")
    give_torch_only(site, tmp_path / "torch-only")
    # Not --no-deps: pip checks the core's requirements against what the venv has, with no index to fetch from, so
    # the install fails if the core needs anything beyond torch and numpy (the control below).
    result = pip_install(python, wheel)
    assert result.returncode == 0, result.stderr[-3000:]
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    run = subprocess.run(
        [python, "-c", CORE_PROBE], cwd=outside, capture_output=True, text=True, timeout=300, env=env_without_checkout()
    )
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.splitlines()[-1])
    assert found["parts"] == sorted(copy_correct.__all__) and found["probes"] == sorted(copy_correct.probes.__all__)
    assert found["heavy"] == []
    assert found["adapters"] == (
        "copy_correct.lightning needs Lightning (lightning is missing): pip install 'copy-correct[lightning]'"
    )


def test_control_a_lightning_requirement_in_the_core_fails_the_torch_only_install(tmp_path: Path) -> None:
    source = checkout_copy(tmp_path / "checkout")
    pyproject = source / "pyproject.toml"
    ours = "\ndependencies = ["
    assert ours in pyproject.read_text()
    pyproject.write_text(pyproject.read_text().replace(ours, f'{ours}"lightning", ', 1))
    heavier = build_wheel(source, tmp_path / "dist")
    assert requirements(heavier)[""] == {"torch", "numpy", "lightning"}
    python, site = fresh_venv(tmp_path / "venv")
    give_torch_only(site, tmp_path / "torch-only")
    result = pip_install(python, heavier)
    assert result.returncode != 0 and "lightning" in result.stderr
