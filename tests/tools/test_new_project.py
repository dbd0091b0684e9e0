"""``scripts/new_project.py``: each recipe's starter is a standalone project whose own tests pass there, holding
only what the recipe needs; bad arguments stop with one line."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from scripts import new_project
from scripts.new_project import ROOT, known_recipes, main, normalise_name, plan, quickstart
from tests.conftest import env_without_checkout, write_images

RECIPES = known_recipes()

# Runs the starter's suite as `.venv/bin/pytest` would (pyproject's `pythonpath = ["."]` is what finds DEST's code,
# not the working directory), then names every module that came from the main repository instead.
PYTEST_IN_DEST = """
import os, sys
import pytest

sys.path[:] = [p for p in sys.path if p not in ("", os.getcwd())]


class Origins:
    def pytest_sessionfinish(self):
        for name, module in sorted(sys.modules.items()):
            path = getattr(module, "__file__", None) or ""
            if path.startswith(sys.argv[1] + os.sep) and not path.startswith(sys.prefix + os.sep):
                print("from the main repository:", name, path)
        for name in ("copy_correct", "recipes", "tests"):
            print("origin:", name, sys.modules[name].__file__)


# -n 0: in this process (not pytest-xdist's workers), where the origins are looked up
sys.exit(pytest.main(["-q", "-rfE", "-p", "no:cacheprovider", "-n", "0", *sys.argv[2:]], plugins=[Origins()]))
"""


def generate(recipe: str, dest: Path) -> Path:
    assert main([recipe, str(dest)]) == 0
    return dest


def commands(readme: str) -> list[str]:
    """The commands of the Quickstart's bash block, as ``.ci/run`` reads them."""
    block = re.search(r"```bash\n(.*?)```", quickstart(readme), re.S)
    assert block is not None
    return [line for line in block[1].splitlines() if line.strip() and not line.startswith("#")]


def docstring_paragraph(recipe: str, prefix: str) -> str:
    docstring = ast.get_docstring(ast.parse((ROOT / "recipes" / f"{recipe}.py").read_text())) or ""
    paragraph = next(p for p in docstring.split("\n\n") if p.startswith(prefix))
    return " ".join(paragraph.removeprefix(prefix).split()).replace("``", "`")


# The default suite leaves out, in the starters, the tests that train a recipe in full, start 2 processes or kill
# a checkpoint writer: the main suite runs the same files from the same source, and the slow test below runs a
# starter's whole suite.
FAST = "not default_run and not ddp and not two_processes and not writer_killed"


# One starter's suite in CI's long runs (each costs one to two minutes of test processes on 2 cores); the others are
# marked slow. The generator and the import discovery are the same for every recipe, and every starter's layout is
# checked by the default suite's test after this one.
IN_CI = "ema"


@pytest.mark.parametrize(
    "recipe", [pytest.param(r, marks=pytest.mark.long if r == IN_CI else pytest.mark.slow) for r in RECIPES]
)
def test_starter_suite_passes_importing_only_its_own_code(recipe: str, tmp_path: Path) -> None:
    dest = generate(recipe, tmp_path / f"my-{recipe}")
    result = subprocess.run(
        [sys.executable, "-c", PYTEST_IN_DEST, str(ROOT), "-k", FAST],
        cwd=dest, env=env_without_checkout(), capture_output=True, text=True,
        timeout=1200,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "from the main repository:" not in result.stdout
    origins = re.findall(r"origin: (\w+) (\S+)", result.stdout)
    assert len(origins) == 3 and all(Path(path).resolve().is_relative_to(dest.resolve()) for _, path in origins)
    assert re.search(r"\d+ passed", result.stdout)


@pytest.mark.parametrize("recipe", RECIPES)
def test_starter_has_the_readme_conf_and_project_of_its_recipe(recipe: str, tmp_path: Path) -> None:
    dest = generate(recipe, tmp_path / f"My_{recipe.title()}.Project")
    readme = (dest / "README.md").read_text()
    ours = commands((ROOT / "README.md").read_text())
    assert commands(readme) == [re.sub(r"\+recipe=\w+", f"+recipe={recipe}", c) for c in ours]
    assert commands(readme)[0].endswith(f"train.py +recipe={recipe}")
    assert docstring_paragraph(recipe, "Change first:") in " ".join(readme.split())
    assert docstring_paragraph(recipe, "Recipe ") in " ".join(readme.split())
    assert sorted(p.name for p in (dest / "conf" / "recipe").iterdir()) == [f"{recipe}.yaml"]
    assert f'name = "my-{recipe}-project"' in (dest / "pyproject.toml").read_text()
    assert normalise_name("  Digits GAN (v2)") == "digits-gan-v2"
    lint = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=dest, capture_output=True, text=True
    )
    assert lint.returncode == 0, lint.stdout
    no_recipe = subprocess.run(
        [sys.executable, "train.py"], cwd=dest, env=env_without_checkout(), capture_output=True, text=True, timeout=120
    )
    listed = set(re.findall(r"\w+", no_recipe.stderr)) & set(RECIPES)
    assert no_recipe.returncode == 2 and listed == {recipe}, no_recipe.stderr


def test_starter_holds_only_the_modules_and_tests_it_needs(tmp_path: Path) -> None:
    metrics, ema, dqn = (generate(r, tmp_path / r) for r in ("metrics", "ema", "dqn"))
    assert (ema / "copy_correct" / "averages" / "ema.py").is_file()
    assert (ema / "tests" / "parts" / "test_ema.py").is_file()
    assert not (metrics / "copy_correct" / "averages" / "ema.py").exists()
    assert not (metrics / "tests" / "parts" / "test_ema.py").exists()
    # Probes come as the code that measures with them needs them: metrics' conf runs the graph guard's callback, dqn's
    # tests measure memory and storage but guard no graph; each starter's __init__ files export only what it has.
    probes = {dest.name: {p.name for p in (dest / "copy_correct" / "probes").glob("*.py")} for dest in (metrics, dqn)}
    assert {"graph_guard.py", "graph_refs.py"} <= probes["metrics"]
    assert (metrics / "copy_correct" / "lightning" / "graph_guard.py").is_file()
    assert not {"graph_guard.py", "graph_refs.py"} & probes["dqn"]
    assert not (dqn / "copy_correct" / "lightning" / "step_probe.py").exists()
    assert {"memory_probe.py", "storage.py"} <= probes["dqn"]
    dqn_probes = (dqn / "copy_correct" / "probes" / "__init__.py").read_text()
    assert "MemoryProbe" in dqn_probes and "GraphRetentionGuard" not in dqn_probes
    assert "StepProbe" not in (dqn / "copy_correct" / "lightning" / "__init__.py").read_text()
    assert (dqn / "copy_correct" / "replay" / "buffer.py").is_file()
    assert (dqn / "tests" / "parts" / "test_replay.py").is_file()
    assert not (dqn / "recipes" / "data" / "digits.py").exists()
    assert (metrics / "recipes" / "data" / "digits.py").is_file()
    assert (ema / "tests" / "workers" / "ddp_ema.py").is_file()  # named by test_ema_weights.py, which is copied
    for dest in (metrics, ema, dqn):
        assert not {"test_benchmarks.py", "test_new_project.py", "test_layout.py"} & {p.name for p in dest.rglob("*")}
        assert not {"scripts", "tools", "benchmarks"} & {p.name for p in dest.iterdir()}
    # The entry point's tests come with the recipe they run (their strings name `+recipe=metrics`), and no other.
    assert [dest.name for dest in (metrics, ema, dqn) if (dest / "tests" / "recipes" / "test_train.py").exists()] == [
        "metrics"
    ]
    lightning = (metrics / "copy_correct" / "lightning" / "__init__.py").read_text()
    assert "GraphRetentionCheck" in lightning and "EMAWeights" not in lightning
    init = (metrics / "copy_correct" / "__init__.py").read_text()
    assert "copy_correct.averages.ema import" not in init and '"EMA"' not in init and "ReplayBuffer" not in init
    assert '"gymnasium' in (dqn / "pyproject.toml").read_text()
    assert '"gymnasium' not in (metrics / "pyproject.toml").read_text()
    assert "mkdocs" not in (metrics / "pyproject.toml").read_text()  # no docs site, no docs extra
    assert "\nbench = " not in (metrics / "pyproject.toml").read_text()  # nor the peers (a list over three lines)
    assert f'"{metrics.name}[recipes,test,compress,fast-digest]"' in (metrics / "pyproject.toml").read_text()
    pinned = generate("pinned", tmp_path / "pinned")
    assert (pinned / "conf" / "pinned" / "gpu_scale.yaml").is_file()  # the recipe's own option group comes along
    assert (pinned / "recipes" / "data" / "pinned_digits.py").is_file()  # the data module its conf names
    assert not (metrics / "conf" / "pinned").exists()  # another recipe's does not
    # The data group comes with the recipes that choose from it (`- /data: digits`), with the modules it names.
    assert (ema / "conf" / "data" / "images.yaml").is_file()
    assert (ema / "recipes" / "data" / "image_folder.py").is_file()
    assert not (metrics / "conf" / "data").exists() and not (dqn / "recipes" / "data" / "image_folder.py").exists()
    assert "## Your own data" in (ema / "README.md").read_text()
    assert "## Your own data" not in (metrics / "README.md").read_text()


def test_the_posthoc_command_comes_with_the_callback_installed_as_ours_is(tmp_path: Path) -> None:
    """The gan starter has ``PostHocEMASnapshots``, so it gets ``copy-correct`` (``copy_correct/cli.py``, what it runs,
    and ``__main__.py``) and the ``[project.scripts]`` entry that installs it; the ema starter, without the callback,
    gets neither (an entry naming a module it lacks would install a command that fails). No ``scripts/`` folder."""
    gan, ema = generate("gan", tmp_path / "gan"), generate("ema", tmp_path / "ema")
    entry = 'copy-correct = "copy_correct.cli:main"'
    command = ("cli.py", "__main__.py", "averages/posthoc_command.py")
    assert all((gan / "copy_correct" / name).is_file() for name in command)
    assert entry in (gan / "pyproject.toml").read_text() and not (gan / "scripts").exists()
    assert not (ema / "copy_correct" / "cli.py").exists()
    assert "[project.scripts]" not in (ema / "pyproject.toml").read_text()
    assert entry in (ROOT / "pyproject.toml").read_text()  # the control: ours has it, so dropping it is a choice
    run_help = "import copy_correct.cli as c; print(c.__file__); raise SystemExit(c.main(['posthoc', '-h']))"
    result = subprocess.run(
        [sys.executable, "-c", run_help],
        cwd=gan,
        env=env_without_checkout(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    origin, usage = result.stdout.split("\n", 1)
    assert Path(origin).resolve() == (gan / "copy_correct" / "cli.py").resolve()  # the starter's own module
    assert usage.startswith("usage: copy-correct posthoc")


@pytest.mark.long  # a training run of the generated starter
def test_a_gan_starter_trains_on_a_folder_of_64x64_rgb_images_with_no_code_edits(tmp_path: Path) -> None:
    """The starter as generated, a folder of unlabelled 64x64 RGB PNG files, and the command its README gives (plus
    a short run's sizes): the images are decoded by the data module's workers, DCGAN's networks take them, and the
    sample grid is of 64x64 images."""
    dest = generate("gan", tmp_path / "my-gan")
    images = write_images(tmp_path / "photos", 40, size=64)
    run_dir = tmp_path / "run"
    short = ["trainer.max_epochs=1", "trainer.check_val_every_n_epoch=1", "model.eval_samples=100",
             "model.judge_epochs=1", "model.conv_width=8", "trainer.enable_progress_bar=false"]  # fmt: skip
    result = subprocess.run(
        [sys.executable, "train.py", "+recipe=gan", "data=images", f"data.root={images}", *short,
         f"hydra.run.dir={run_dir}"],
        cwd=dest, env=env_without_checkout(), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    with Image.open(run_dir / "samples.png") as grid:
        assert grid.size == (10 * 66, 10 * 66) and grid.mode == "RGB"  # 10x10 images of 64x64, a pixel of border
    metrics = json.loads((run_dir / "summary.json").read_text())["metrics"]
    assert {"quality/fid_ema", "quality/fid_floor"} <= set(metrics) and "quality/confidence_ema" not in metrics
    hparams = (run_dir / ".hydra" / "config.yaml").read_text()
    assert "recipes.data.image_folder.ImageFolderDataModule" in hparams


def make_default_a_grey_folder(dest: Path, recipe: str, root: Path) -> None:
    """What the own-data guide says to do in a starter, with a grey 32x32 folder whose size and channels are written
    out: ``- /data: images`` in the recipe's config; ``root``, ``image_size`` and ``channels`` in its data config."""
    recipe_conf = dest / "conf" / "recipe" / f"{recipe}.yaml"
    assert "  - /data: digits\n" in recipe_conf.read_text()
    recipe_conf.write_text(recipe_conf.read_text().replace("  - /data: digits\n", "  - /data: images\n"))
    data_conf = dest / "conf" / "data" / "images.yaml"
    text, count = re.subn(
        r"^(root|image_size|channels): \S+", lambda m: f"{m[1]}: {dict(root=root, image_size=32, channels=1)[m[1]]}",
        data_conf.read_text(), flags=re.M,
    )  # fmt: skip
    assert count == 3
    data_conf.write_text(text)


@pytest.mark.parametrize(
    "recipe", [pytest.param("gan", marks=pytest.mark.long), pytest.param("ema", marks=pytest.mark.slow)]
)  # each about 10 s
def test_a_starter_whose_default_is_a_grey_folder_passes_its_own_images_cases(recipe: str, tmp_path: Path) -> None:
    """The own-images cases compose the project's config as its owner has it, so they write grey test images where
    the default data is grey, and pass. (Before, they wrote RGB images and inherited ``channels: 1``: ema failed 1
    of its cases, gan 5.)"""
    dest = generate(recipe, tmp_path / f"my-{recipe}")
    make_default_a_grey_folder(dest, recipe, write_images(tmp_path / "grey", 30, size=32, channels=1, classes=3))
    result = subprocess.run(
        [sys.executable, "-c", PYTEST_IN_DEST, str(ROOT), "tests/recipes", "-k", "own and images"],
        cwd=dest, env=env_without_checkout(), capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "from the main repository:" not in result.stdout
    passed = re.search(r"(\d+) passed", result.stdout)
    assert passed and int(passed[1]) >= (1 if recipe == "ema" else 5), result.stdout[-2000:]


SMALL_TREE = {
    "train.py": '"""Entry point."""\n',
    "README.md": "# x\n\n## Quickstart\n\n```bash\npython train.py +recipe=b\n.venv/bin/pytest\n```\n\n## Other\n",
    "pyproject.toml": '[project]\nname = "x"\ndescription = "d"\n'
    'dependencies = [\n    "torch>=2",\n    "gymnasium>=1",\n]\n\n[project.optional-dependencies]\ndev = ["pytest"]\n',
    "conf/config.yaml": "seed: 0\n",
    "conf/recipe/a.yaml": "model:\n  _target_: recipes.a.Model\ncallbacks:\n  x:\n    _target_: copy_correct.X\n",
    "conf/recipe/b.yaml": "model:\n  _target_: recipes.b.Model\n",
    "conf/recipe/c.yaml": "model:\n  _target_: recipes.c.Model\n",
    "recipes/__init__.py": "",
    "recipes/a.py": '"""Recipe ``a``: teaches a.\n\nChange first: the ``Model``.\n"""\n\nimport torch\n',
    "recipes/b.py": "import gymnasium\n",
    "recipes/c.py": "from copy_correct import Y\n",  # a tensor part whose test needs no probe
    "copy_correct/__init__.py": '"""Parts.\n\nThings:\n    X      the x\n\nOthers:\n    Y      the y\n"""\n\n'
    "from copy_correct.x import X\nfrom copy_correct.y import Y\n\n"
    '__all__ = [\n    "X",\n    "Y",\n]\n',
    "copy_correct/probes/__init__.py": '"""Probes.\n\n    Other  measures\n    Probe  measures\n"""\n\n'
    "from copy_correct.probes.other import Other\nfrom copy_correct.probes.probe import Probe\n\n"
    '__all__ = [\n    "Other",\n    "Probe",\n]\n',
    "copy_correct/probes/other.py": "",
    "copy_correct/probes/probe.py": "",
    "copy_correct/x.py": "from copy_correct._helper import h\n",
    "copy_correct/_helper.py": "h = 1\n",
    "copy_correct/y.py": "",
    "scripts/tool.py": "",
    "tests/__init__.py": "",
    "tests/conftest.py": "",
    "tests/parts/__init__.py": "",
    "tests/recipes/__init__.py": "",
    "tests/tools/__init__.py": "",
    "tests/recipes/test_a.py": "from recipes.a import Model\n",
    # x's own test, and the probe it measures with
    "tests/parts/test_x.py": "from copy_correct import X\nfrom copy_correct.probes import Probe\n\n"
    'HELPER = "helper_x.py"\n',
    "tests/workers/__init__.py": "",
    "tests/workers/helper_x.py": "from copy_correct import X\n",
    "tests/parts/test_y.py": "from copy_correct import Y\n",  # imports what the starter lacks
    "tests/recipes/test_runs_both.py": 'from copy_correct import X\n\nARGS = [f"+recipe={r}" for r in ("a", "b")]\n',
    "tests/tools/test_tool.py": 'from copy_correct import X\n\nTOOL = "scripts/tool.py"\n',  # names a file it lacks
    "tests/recipes/test_entry.py": "import train\n",  # tests none of the copied packages
}


def test_discovery_rules_on_a_small_tree(tmp_path: Path) -> None:
    for relative, text in SMALL_TREE.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(text)
    starter = plan("a", "p", root=tmp_path)
    assert set(starter.files) == {
        "README.md", "pyproject.toml", "train.py", "conf/config.yaml", "conf/recipe/a.yaml",
        "recipes/__init__.py", "recipes/a.py",
        "copy_correct/__init__.py", "copy_correct/_helper.py", "copy_correct/x.py",
        "copy_correct/probes/__init__.py", "copy_correct/probes/probe.py",
        "tests/__init__.py", "tests/conftest.py", "tests/recipes/__init__.py", "tests/recipes/test_a.py",
        "tests/parts/__init__.py", "tests/parts/test_x.py", "tests/workers/__init__.py", "tests/workers/helper_x.py",
    }  # fmt: skip
    init = str(starter.files["copy_correct/__init__.py"])
    assert "from copy_correct.y" not in init and '"Y"' not in init and "the y" not in init and "Others:" not in init
    assert "X      the x" in init and '"X",' in init
    probes = str(starter.files["copy_correct/probes/__init__.py"])  # a subpackage is reduced the same way
    assert "from copy_correct.probes.probe import Probe" in probes and '"Probe",' in probes and "Other" not in probes
    no_probe = plan("c", "q", root=tmp_path)  # its code and tests measure nothing: no probes at all
    assert {p for p in no_probe.files if p.startswith("copy_correct/")} == {
        "copy_correct/__init__.py",
        "copy_correct/y.py",
    }
    assert "probes" not in str(no_probe.files["copy_correct/__init__.py"])
    assert starter.dependencies == ["torch"] and starter.dropped == ["gymnasium"]
    readme = str(starter.files["README.md"])
    assert "python train.py +recipe=a\n" in readme and "the `Model`." in readme and "teaches a." in readme


def test_no_starter_takes_the_peers_tests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/peers compare with packages a starter does not install, against pages of our manual it does not have: a
    starter whose code is all a peers' test imports still leaves it out (control: without the rule it is taken)."""
    for relative, text in {**SMALL_TREE, "tests/peers/__init__.py": "", "tests/peers/test_x.py": PEERS_TEST}.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(text)
    assert "tests/peers/test_x.py" not in plan("a", "p", root=tmp_path).files
    monkeypatch.setattr(new_project, "NOT_TAKEN", ())
    assert "tests/peers/test_x.py" in plan("a", "p", root=tmp_path).files


PEERS_TEST = "from copy_correct import X\n"


def test_refuses_a_non_empty_dest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    assert main([RECIPES[0], str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_unknown_recipe_lists_the_known_ones(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["nope", str(tmp_path / "dest")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: unknown recipe 'nope': recipe must be one of: {', '.join(RECIPES)}"
    assert not (tmp_path / "dest").exists()


def test_no_arguments_prints_usage() -> None:
    result = subprocess.run([sys.executable, "scripts/new_project.py"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr.startswith("usage: new_project.py")


@pytest.mark.slow
def test_readme_commands_install_train_and_test_in_a_fresh_venv(tmp_path: Path) -> None:
    """The starter's two README commands, verbatim: a new venv, pip install, the default gan run, its tests."""
    dest = generate("gan", tmp_path / "digits-gan")
    for command in commands((dest / "README.md").read_text()):
        result = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", command], cwd=dest, env=env_without_checkout(), capture_output=True,
            text=True, timeout=3600,
        )  # fmt: skip
        assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert len(list(dest.glob("outputs/gan/*/summary.json"))) == 1


def test_a_starters_suite_runs_without_this_checkout_but_with_the_machines_python_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    site = "/opt/machine-site"  # where a GPU machine without a registry gets hydra-core
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), site]))
    assert env_without_checkout()["PYTHONPATH"] == site
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    assert "PYTHONPATH" not in env_without_checkout()
