"""The manual (``mkdocs.yml``, ``docs/``) builds with ``--strict``, and a broken link, a missing page or an API entry
that no longer exists makes that build fail; each quoted line range still starts and ends where it is meant to; the
README's links work on GitHub. The controls break a temporary copy of the docs, one thing at a time."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import copy_correct
import copy_correct.lightning
import copy_correct.probes
from scripts.new_project import known_recipes

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
# The API page's sections, one per layer of the package, each listing every name its package exports.
LAYERS = {"Tensor parts": copy_correct, "Lightning adapters": copy_correct.lightning, "Probes": copy_correct.probes}
# Modules of a layer documented whole (their ``__all__`` under the module's name): imported as ``from MODULE import``
SUBMODULES = {
    "Tensor parts": ("decay_schedule", "averages.peer_schedules", "averages.peer_states", "averages.power_function")
}

# Every line range the docs quote (`--8<-- "PATH:FIRST:LAST"`), with the text its first and last lines must hold
# (stripped): an edit above the quoted code moves it, and this names the quote instead of letting it drift.
QUOTED_RANGES = {
    "README.md:17:18": (
        'python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e ".[dev]" && .venv/bin/python train.py '
        "+recipe=metrics",
        ".venv/bin/pytest",
    ),
    "conf/recipe/metrics.yaml:25:28": ("callbacks:", "mode: raise"),
    "conf/recipe/ema.yaml:30:35": ("callbacks:", "evaluate: both"),
    "recipes/dqn.py:216:217": (
        "# Copy decision: one deep copy, once. From here on the target is only written in place.",
        "self.target = make_target(self.q)",
    ),
    "recipes/dqn.py:272:274": (
        "next_obs, reward, terminated, truncated, _ = self.env.step(action)",
        "self.buffer.add(self.obs, action, reward, next_obs, terminated, truncated)",
    ),
    "recipes/dqn.py:287:289": (
        "# Copy decision: sample gathers the batch into new memory; later adds cannot change it.",
        "batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}",
    ),
    "recipes/dqn.py:290:301": (
        "with torch.no_grad():  # Copy decision: no graph through the target, so nothing of it is kept",
        "loss = F.smooth_l1_loss(value, td_target)",
    ),
    "recipes/dqn.py:307:313": ("self.updates += 1", "hard_update(self.target, self.q)"),
}
# The build needs the docs extra, which `dev` includes (as CI installs it); a machine given only the runtime
# packages (the GPU check's) skips the builds and still runs the checks that read the sources.
needs_mkdocs = pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None, reason="the docs extra: pip install -e '.[docs]' (included in dev)"
)
_SNIPPET = re.compile(r'^(?P<fence>```\w*(?P<attrs>.*))\n--8<-- "(?P<spec>[^"]+)"\n```', re.M)


def build(root: Path, site: Path) -> subprocess.CompletedProcess[str]:
    """``mkdocs build --strict`` of the manual under ``root``, from there (snippet paths start at the working
    directory), into ``site``."""
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(root / "mkdocs.yml"), "-d", str(site)],
        cwd=root, capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip


@needs_mkdocs
def test_the_manual_builds_strict_with_every_recipe_page_quoting_its_code(tmp_path: Path) -> None:
    result = build(ROOT, tmp_path / "site")
    assert result.returncode == 0, result.stderr[-4000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    for package in LAYERS.values():
        assert all(f'id="{package.__name__}.{name}"' in api for name in package.__all__)
    for recipe in known_recipes():
        page = (tmp_path / "site" / "recipes" / recipe / "index.html").read_text()
        quoted = set(re.findall(r"Source code in <code>([\w/]+\.py)</code>", page))
        quoted |= set(re.findall(r"([\w/]+\.py), lines \d+", page))
        assert quoted & recipe_sources(recipe), (recipe, quoted)


def recipe_sources(recipe: str) -> set[str]:
    """The recipe's own file and the files of the modules its config names (``recipes.data.pinned_digits.X``)."""
    targets = re.findall(
        r"_target_:\s*(recipes(?:\.\w+)+)\.\w+", (ROOT / "conf" / "recipe" / f"{recipe}.yaml").read_text()
    )
    return {f"recipes/{recipe}.py"} | {target.replace(".", "/") + ".py" for target in targets}


def test_the_dev_extra_pulls_in_the_docs_extra() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^dev = \[[^\]]*"copy-correct\[[\w,-]*docs[\w,-]*\]"', pyproject, re.M)
    assert re.search(r'^docs = \[.*"mkdocs>=.*"mkdocs-material>=.*"mkdocstrings\[python\]>=', pyproject, re.M)


def test_the_nav_has_a_page_per_recipe_and_the_api_page_every_name_in_its_group() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    assert all(
        f"recipes/{recipe}.md" in nav and (DOCS / "recipes" / f"{recipe}.md").is_file() for recipe in known_recipes()
    )
    sections = re.split(r"^## ", (DOCS / "api.md").read_text(), flags=re.M)[1:]
    entries = {section.split("\n", 1)[0]: re.findall(r"^::: ([\w.]+)$", section, re.M) for section in sections}
    assert set(LAYERS) <= set(entries)
    assert not any(entries[heading] for heading in set(entries) - set(LAYERS))  # "The command": no API entries
    for heading, package in LAYERS.items():
        names = [f"{package.__name__}.{name}" for name in package.__all__]
        names += [f"{package.__name__}.{module}" for module in SUBMODULES.get(heading, ())]
        assert sorted(entries[heading]) == sorted(names), heading


# The layout guide's layer table: each layer's row (its first cell) and the package whose every public name it lists.
TABLE_ROWS = {"tensor parts": copy_correct, "Lightning adapters": copy_correct.lightning, "probes": copy_correct.probes}


def names_missing_from_the_layer_table(layout: str) -> list[str]:
    """``package.name`` for each public name (``__all__``) that its row of the layout guide's layer table does not
    show as code (`` `name` ``), or ``package: no row`` for a row that is not there."""
    rows = {line.split("|")[1].strip(): line for line in layout.splitlines() if line.startswith("| ")}
    missing = []
    for layer, package in TABLE_ROWS.items():
        if layer not in rows:
            missing.append(f"{package.__name__}: no row")
            continue
        missing += [f"{package.__name__}.{name}" for name in package.__all__ if f"`{name}`" not in rows[layer]]
    return missing


def test_the_layout_guide_lists_every_public_name_in_its_layer() -> None:
    assert names_missing_from_the_layer_table((DOCS / "guides" / "layout.md").read_text()) == []


def test_control_a_public_name_dropped_from_the_layer_table_is_reported() -> None:
    layout = (DOCS / "guides" / "layout.md").read_text()
    assert "`PowerEMA`, " in layout and "`PostHocEMASnapshots`, " in layout
    dropped = layout.replace("`PowerEMA`, ", "").replace("`PostHocEMASnapshots`, ", "")
    assert names_missing_from_the_layer_table(dropped) == [
        "copy_correct.PowerEMA",
        "copy_correct.lightning.PostHocEMASnapshots",
    ]
    no_probes = "\n".join(line for line in layout.splitlines() if not line.startswith("| probes "))
    assert names_missing_from_the_layer_table(no_probes) == ["copy_correct.probes: no row"]


def quoted_range_problems(root: Path) -> list[str]:
    """What is wrong with the line ranges the docs under ``root`` quote, against ``QUOTED_RANGES``."""
    problems, found = [], set()
    for page in sorted((root / "docs").rglob("*.md")):
        for match in _SNIPPET.finditer(page.read_text()):
            path, sep, lines = match["spec"].partition(":")
            if not sep:
                continue  # a whole file: nothing to drift
            first, last = (int(n) for n in lines.split(":"))
            found.add(match["spec"])
            said = dict(re.findall(r'(title|linenums)="([^"]*)"', match["attrs"]))  # what the reader is told
            meant = {"title": f"{path}, lines {first}-{last}", "linenums": str(first)}
            if any(said[key] != meant[key] for key in said):
                problems.append(f"{page.name}: {match['fence']} does not say {match['spec']}")
            quoted = (root / path).read_text().splitlines()[first - 1 : last]
            if (quoted[0].strip(), quoted[-1].strip()) != QUOTED_RANGES.get(match["spec"]):
                problems.append(
                    f"{page.name}: {match['spec']} now quotes {quoted[0].strip()!r} ... {quoted[-1].strip()!r}"
                )
    return problems + [f"{spec} is not quoted any more" for spec in sorted(set(QUOTED_RANGES) - found)]


def test_each_quoted_line_range_starts_and_ends_on_the_lines_it_is_meant_to() -> None:
    assert quoted_range_problems(ROOT) == []


def test_control_a_line_added_above_a_quoted_range_is_reported(tmp_path: Path) -> None:
    (tmp_path / "docs").symlink_to(DOCS)
    for name in ("README.md", "conf"):
        (tmp_path / name).symlink_to(ROOT / name)
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "dqn.py").write_text("# a new first line\n" + (ROOT / "recipes" / "dqn.py").read_text())
    problems = quoted_range_problems(tmp_path)
    assert problems[0] == (
        "dqn.md: recipes/dqn.py:216:217 now quotes "
        "'self.q = QNetwork(math.prod(observations.shape), actions.n, hidden)' ... "
        "'# Copy decision: one deep copy, once. From here on the target is only written in place.'"
    )
    dqn = [spec for spec in QUOTED_RANGES if spec.startswith("recipes/dqn.py:")]
    assert [problem.split(" now quotes ")[0] for problem in problems] == [f"dqn.md: {spec}" for spec in dqn]


def test_the_readme_links_to_files_that_exist_and_to_every_recipe_page() -> None:
    readme = (ROOT / "README.md").read_text()
    targets = [t for t in re.findall(r"\]\(([^)#\s]+)", readme) if "://" not in t]
    assert targets and [t for t in targets if not (ROOT / t).exists()] == []
    assert all(f"(docs/recipes/{recipe}.md)" in readme for recipe in known_recipes())


def broken_copy(tmp_path: Path, page: str, line: str) -> Path:
    """The manual in ``tmp_path``: ``mkdocs.yml`` and ``docs/`` copied, with ``line`` added to ``page``; the code it
    quotes and links to linked in as it is."""
    root = tmp_path / "repo"
    root.mkdir()
    shutil.copy(ROOT / "mkdocs.yml", root / "mkdocs.yml")
    shutil.copytree(DOCS, root / "docs")
    for name in ("README.md", "train.py", "copy_correct", "recipes", "conf", "tests", "scripts", "tools", "benchmarks"):
        (root / name).symlink_to(ROOT / name)
    with (root / "docs" / page).open("a") as out:
        out.write(f"\n{line}\n")
    return root


@needs_mkdocs
@pytest.mark.parametrize(
    ("page", "line", "reported"),
    [
        ("index.md", "See [a page that is not there](no-such-page.md).", "no-such-page.md"),
        ("api.md", "::: copy_correct.NoSuchName", "copy_correct.NoSuchName"),
        ("recipes/ema.md", "[a renamed test](../../tests/parts/test_ema.py#test_renamed)", "#test_renamed"),
    ],
    ids=["broken-link", "removed-api-entry", "renamed-test"],
)
def test_control_a_broken_copy_of_the_docs_fails_the_build(tmp_path: Path, page: str, line: str, reported: str) -> None:
    result = build(broken_copy(tmp_path, page, line), tmp_path / "site")
    assert result.returncode != 0
    assert reported in result.stderr, result.stderr[-4000:]
