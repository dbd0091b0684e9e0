"""Clone one recipe as the start of your own project: ``python scripts/new_project.py RECIPE DEST``.

Writes a standalone project into ``DEST`` (which must not exist or be empty): the recipe, its conf (only
that recipe), ``train.py``, the modules of ``copy_correct`` it imports and only those, the tests those files can
run, ``pyproject.toml`` and a README naming what to change first. Nothing is listed by hand; it is all found:

* Code: the imports (``ast``) of ``train.py``, ``recipes/RECIPE.py``, the conf's ``_target_``s and the
  recipe's own tests (``tests/conftest.py``, ``tests/recipes/test_RECIPE.py``), followed transitively. A
  name taken from ``copy_correct`` counts as the submodule ``copy_correct/__init__.py`` imports it from, and
  the starter gets a ``copy_correct/__init__.py`` that exports only the names of the modules it has. A
  subpackage that re-exports (``copy_correct/lightning/``, ``copy_correct/probes/``) is reduced the same way, and
  comes only when one of its modules does.
* A copied module's own test (``OWN_TESTS``: ``copy_correct/averages/ema.py`` -> ``tests/parts/test_ema.py``,
  ``copy_correct/lightning/ema_weights.py`` -> ``tests/lightning/test_ema_weights.py``) comes with it, and with
  the modules it needs (the probes it measures with), unless it needs a recipe or a script.
* A command that belongs with a copied module (``COMMANDS``: ``PostHocEMASnapshots`` -> ``copy-correct posthoc``,
  ``copy_correct/cli.py`` and ``copy_correct/__main__.py``) comes with it, installed by the starter's
  ``pyproject.toml`` as ours installs it (``[project.scripts]``); a starter without it has no ``[project.scripts]``.
* Other tests: each test file that imports something the starter has and nothing it lacks, and that names
  no file or module it lacks (``"scripts/x.py"``, ``"scripts.x"`` run with ``-m``) and no other recipe
  (``"+recipe=gan"``, or a recipe's name among
  the strings of a test that builds ``f"+recipe={name}"``); helpers under ``tests/`` that a copied test
  names (``"ddp_ema.py"``) come with it.
* Dependencies: ours, less those no copied file imports; a package the copied code imports that ours
  only bring in indirectly (``pillow``, ``numpy``) is listed explicitly. No ``docs`` extra: a starter
  has no docs site.

Exit status 2, with one line, for an unknown recipe or a non-empty ``DEST``.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import shutil
import sys
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib.metadata import packages_distributions
from itertools import pairwise
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = "tests"
ROOMS = ("averages", "core", "files", "guards", "loading", "replay")  # the tensor parts' subpackages
# Where a module's own test lives: the test tree follows the package's (``copy_correct/lightning/x.py`` ->
# ``tests/lightning/test_x.py``).
OWN_TESTS = {
    "copy_correct": f"{TESTS}.parts",
    **{f"copy_correct.{room}": f"{TESTS}.parts" for room in ROOMS},
    "copy_correct.lightning": f"{TESTS}.lightning",
    "copy_correct.probes": f"{TESTS}.probes",
    "recipes": f"{TESTS}.recipes",
    "recipes.data": f"{TESTS}.recipes",
}
# A command that belongs with a copied module: the starter that has the module gets the command's modules (and its
# test runs). The command itself is installed by pyproject.toml's [project.scripts] (CLI is the module it names).
# Test folders no starter takes: the peers' tests compare with packages a starter does not install, against pages of
# our manual it does not have.
NOT_TAKEN = (f"{TESTS}.peers.",)
COMMANDS = {"copy_correct.lightning.posthoc_ema_snapshots": ("copy_correct.cli", "copy_correct.__main__")}
CLI = "copy_correct.cli"
_RECIPE_REF = re.compile(r"(?<![\w.])\+{0,2}recipe=(\w+)")
_DEP_NAME = re.compile(r'^\s*"([A-Za-z0-9][A-Za-z0-9._-]*)')


class StarterError(Exception):
    """The recipe cannot be cloned as it stands (a name that does not resolve, a missing file)."""


def known_recipes(root: Path = ROOT) -> list[str]:
    """Recipe names, from ``conf/recipe/*.yaml`` (as ``train.py`` lists them)."""
    return sorted(path.stem for path in (root / "conf" / "recipe").glob("*.yaml"))


def normalise_name(name: str) -> str:
    """A valid project name from a directory name: lower case, runs of other characters as one ``-``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _dist_key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass
class Needs:
    """What one module needs: first-party modules, names that do not resolve, third-party imports, recipes named."""

    modules: set[str] = field(default_factory=set)
    unresolved: set[str] = field(default_factory=set)
    third_party: set[str] = field(default_factory=set)
    recipes: set[str] = field(default_factory=set)


class SourceTree:
    """Our first-party modules (``train``, ``copy_correct.averages.ema``, ``tests.workers.ddp_ema``) and what each
    needs."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.paths: dict[str, Path] = {path.stem: path for path in root.glob("*.py")}
        for top in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))):
            if any(top.glob("*.py")) and not (top / "pyproject.toml").exists():  # not a starter made in here
                for path in top.rglob("*.py"):
                    parts = path.relative_to(root).with_suffix("").parts
                    self.paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
        self.first_party = {name.split(".")[0] for name in self.paths}
        self.recipes = set(known_recipes(root))
        self._trees: dict[str, ast.Module] = {}
        self._needs: dict[str, Needs] = {}

    def tree(self, module: str) -> ast.Module:
        """The parsed source of ``module``."""
        if module not in self._trees:
            self._trees[module] = ast.parse(self.paths[module].read_text(), str(self.paths[module]))
        return self._trees[module]

    def is_package(self, module: str) -> bool:
        return self.paths[module].name == "__init__.py"

    def exports(self, package: str) -> dict[str, str] | None:
        """Name -> submodule for a package whose ``__init__`` only re-exports its submodules' names (it imports them
        at the top level and does nothing else), else None."""
        if package not in self.paths or not self.is_package(package):
            return None
        names: dict[str, str] = {}
        for node in self.tree(package).body:
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(f"{package}."):
                names.update({alias.asname or alias.name: node.module for alias in node.names})
            elif not (
                _is_docstring_or_all(node)
                or _is_requirement_check(node)
                or (isinstance(node, ast.ImportFrom) and node.module == "__future__")
            ):
                return None
        return names or None

    def resolve(self, dotted: str) -> set[str] | None:
        """The modules that importing ``dotted`` (a module, or an attribute of one) loads; None if it names nothing."""
        if dotted in self.paths:
            return {dotted}
        parts = dotted.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            module, attribute = ".".join(parts[:cut]), parts[cut]
            if module in self.paths:
                exports = self.exports(module)
                if exports is None:
                    return {module}
                return {module, exports[attribute]} if attribute in exports else None
        return None

    def loader(self, package: str) -> set[str]:
        """The first-party modules a re-exporting ``__init__`` imports to run, its exports aside (none today: it
        only re-exports)."""
        found = Needs()
        for node in self.tree(package).body:
            if isinstance(node, ast.ImportFrom) and node.module not in (None, "__future__"):
                for alias in node.names:
                    self.add_target(f"{_absolute(node, package)}.{alias.name}", found)
        exported = set((self.exports(package) or {}).values())
        return self.with_packages(found.modules - exported - {package}) - {package}

    def needs(self, module: str) -> Needs:
        """First-party modules (with their packages), third-party imports, and files and recipes it names."""
        if module not in self._needs:
            self._needs[module] = self._find_needs(module)
        return self._needs[module]

    def _find_needs(self, module: str) -> Needs:
        found = Needs()
        package = module if self.is_package(module) else module.rpartition(".")[0]
        for node in ast.walk(self.tree(module)):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
                base = _absolute(node, package)
                targets = [f"{base}.{alias.name}" if alias.name != "*" else base for alias in node.names]
            else:
                continue
            for target in targets:
                self.add_target(target, found)
        texts = list(_string_constants(self.tree(module)))
        for text in texts:
            if text.endswith(".py"):
                found.modules |= self._file_modules(text)
            elif "." in text and text in self.paths:  # a module run as a command: python -m scripts.x
                found.modules.add(text)
            found.recipes.update(set(_RECIPE_REF.findall(text)) & self.recipes)
        if _builds_recipe_argument(self.tree(module)):  # f"+recipe={name}": each recipe name may be run
            found.recipes.update(set(texts) & self.recipes)
        found.modules = self.with_packages(found.modules - {module})
        return found

    def add_target(self, target: str, found: Needs) -> None:
        """Record what importing ``target`` needs into ``found``."""
        top = target.split(".")[0]
        if top not in self.first_party:
            if top not in sys.stdlib_module_names:
                found.third_party.add(top)
            return
        modules = self.resolve(target)
        if modules is None:
            found.unresolved.add(target)
        else:
            found.modules.update(modules)

    def _file_modules(self, text: str) -> set[str]:
        """The modules a string like ``"scripts/x.py"`` or ``"ddp_ema.py"`` may name: the exact one, else all fits."""
        relatives = {path.relative_to(self.root).as_posix(): module for module, path in self.paths.items()}
        if text in relatives:
            return {relatives[text]}
        return {module for relative, module in relatives.items() if relative.endswith(f"/{text}")}

    def with_packages(self, modules: Iterable[str]) -> set[str]:
        """``modules`` plus every package ``__init__`` above them."""
        result = set(modules)
        for module in list(result):
            parts = module.split(".")
            result.update(p for cut in range(1, len(parts)) if (p := ".".join(parts[:cut])) in self.paths)
        return result


def _absolute(node: ast.ImportFrom, package: str) -> str:
    """The absolute module name of ``from [.]module import ...`` written inside ``package``."""
    if not node.level:
        return node.module or ""
    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join([*anchor, *([node.module] if node.module else [])])


def _builds_recipe_argument(tree: ast.Module) -> bool:
    """Whether an f-string in ``tree`` fills in a recipe name: ``f"+recipe={recipe}"``."""
    return any(
        isinstance(part, ast.Constant) and str(part.value).endswith("recipe=") and isinstance(after, ast.FormattedValue)
        for node in ast.walk(tree)
        if isinstance(node, ast.JoinedStr)
        for part, after in pairwise(node.values)
    )


def _is_docstring(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def _is_docstring_or_all(node: ast.stmt) -> bool:
    all_ = isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
    return all_ or _is_docstring(node)


def _is_requirement_check(node: ast.stmt) -> bool:
    """``try: import lightning.pytorch`` with a handler: an ``__init__`` that says in one line which extra to install
    when a third-party requirement is missing (``copy_correct/lightning/``) still only re-exports."""
    return (
        isinstance(node, ast.Try)
        and all(isinstance(stmt, ast.Import) for stmt in node.body)
        and all(not alias.name.startswith("copy_correct") for stmt in node.body for alias in stmt.names)
    )


def _string_constants(tree: ast.Module) -> Iterable[str]:
    """Every string literal outside docstrings (f-string parts included)."""
    scopes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, scopes) and node.body and _is_docstring(node.body[0])
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.value


@dataclass
class Starter:
    """The planned project: relative path -> source file to copy, or generated text."""

    recipe: str
    files: dict[str, Path | str]
    dependencies: list[str]
    dropped: list[str]
    added: list[str]


def plan(recipe: str, name: str, root: Path = ROOT) -> Starter:
    """Everything the ``recipe`` starter holds, found from imports, conf targets and test references."""
    tree = SourceTree(root)
    if f"recipes.{recipe}" not in tree.paths:
        raise StarterError(f"recipes/{recipe}.py does not exist")
    conf_files = _conf_files(root, recipe)
    roots = {"train", f"recipes.{recipe}", f"{TESTS}.conftest", f"{TESTS}.recipes.test_{recipe}"} & set(tree.paths)
    conf_third_party: set[str] = set()
    for path in conf_files:
        for target in re.findall(r"_target_:\s*([\w.]+)", path.read_text()):
            found = Needs()
            tree.add_target(target, found)
            if found.unresolved:
                raise StarterError(f"{path.relative_to(root)} names {target}, which does not exist")
            roots |= found.modules
            conf_third_party |= found.third_party
    modules = _closure(tree, tree.with_packages(roots), recipe)
    commands = {c for m in modules if m in COMMANDS for c in COMMANDS[m] if c in tree.paths}
    modules = _with_own_tests(tree, _closure(tree, tree.with_packages(modules | commands), recipe), recipe)
    modules |= tree.with_packages(_runnable_tests(tree, modules, recipe))
    third_party = conf_third_party.union(*(tree.needs(m).third_party for m in modules))
    pyproject, dependencies, dropped, added = _pyproject(root, name, recipe, third_party, CLI in modules)
    files: dict[str, Path | str] = {path.relative_to(root).as_posix(): path for path in conf_files}
    for module in sorted(modules):
        relative = tree.paths[module].relative_to(root).as_posix()
        exports = tree.exports(module)
        files[relative] = tree.paths[module] if exports is None else _reduced_init(tree, module, modules)
    if (root / ".gitignore").is_file():
        files[".gitignore"] = root / ".gitignore"
    files["pyproject.toml"] = pyproject
    files["README.md"] = _readme(root, recipe, name, files)
    return Starter(recipe, dict(sorted(files.items())), dependencies, dropped, added)


def _chosen_groups(recipe_yaml: Path) -> set[str]:
    """The config groups a recipe's defaults list chooses from (``- /data: digits`` chooses from ``data``)."""
    return set(re.findall(r"^\s*-\s*(?:override\s+)?/?(\w+)(?:@[\w.]+)?\s*:", recipe_yaml.read_text(), re.M))


def _conf_files(root: Path, recipe: str) -> list[Path]:
    """Every config file but the other recipes' ``conf/recipe/NAME.yaml``, their own groups (``conf/NAME/``), and the
    groups that recipes choose from in their defaults lists (``conf/data/``) unless this recipe does."""
    conf = root / "conf"
    others = set(known_recipes(root)) - {recipe}
    chosen = {name: _chosen_groups(conf / "recipe" / f"{name}.yaml") for name in known_recipes(root)}
    left_out = others | set().union(*chosen.values()) - chosen[recipe]
    return sorted(
        path
        for path in conf.rglob("*.yaml")
        if (path.parent != conf / "recipe" or path.stem == recipe) and path.relative_to(conf).parts[0] not in left_out
    )


def _closure(tree: SourceTree, start: set[str], recipe: str) -> set[str]:
    """``start`` and every first-party module it needs, transitively; a re-exporting ``__init__`` adds nothing."""
    seen, todo = set(start), list(start)
    while todo:
        module = todo.pop()
        if tree.exports(module) is not None:
            todo += sorted(tree.loader(module) - seen)
            seen |= tree.loader(module)
            continue
        needs = tree.needs(module)
        problems = sorted(needs.unresolved) + [f"recipe {r!r}" for r in sorted(needs.recipes - {recipe})]
        if problems:
            raise StarterError(f"{tree.paths[module].relative_to(tree.root)} needs {', '.join(problems)}")
        todo += sorted(needs.modules - seen)
        seen |= needs.modules
    return seen


def own_test(module: str) -> str | None:
    """The module name of ``module``'s own test (``OWN_TESTS``), or None for a module that has no test folder."""
    package, _, name = module.rpartition(".")
    return f"{OWN_TESTS[package]}.test_{name}" if package in OWN_TESTS else None


def _with_own_tests(tree: SourceTree, modules: set[str], recipe: str) -> set[str]:
    """``modules`` plus each copied module's own test (``own_test``) and what it needs, when that is more of the
    module's own top-level package (a probe it measures with), not a script or a recipe."""
    grew = True
    while grew:
        grew = False
        for module in sorted(modules):
            test = own_test(module)
            if test is None or test not in tree.paths or test in modules:
                continue
            try:
                grown = _closure(tree, tree.with_packages(modules | {test}), recipe)
            except StarterError:
                continue
            if all(m.split(".")[0] in (module.split(".")[0], TESTS) for m in grown - modules):
                modules, grew = grown, True
    return modules


def _runnable_tests(tree: SourceTree, modules: set[str], recipe: str) -> set[str]:
    """Test files (and the helpers they name) that exercise the starter's code and need nothing it lacks."""
    libraries = {m for m in modules if "." in m and not m.startswith(f"{TESTS}.")}
    pool = {
        m
        for m in tree.paths
        if m.startswith(f"{TESTS}.") and not m.startswith(NOT_TAKEN)
        and m not in modules and not tree.needs(m).unresolved
        and not tree.needs(m).recipes - {recipe}
        and (not _is_test_file(m) or tree.needs(m).modules & libraries)
    }  # fmt: skip
    while unmet := {m for m in pool if not tree.needs(m).modules <= modules | pool}:
        pool -= unmet
    reached, todo = set(), [m for m in pool if _is_test_file(m)]
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo += sorted(tree.needs(module).modules & pool)
    return reached


def _is_test_file(module: str) -> bool:
    return module.rpartition(".")[2].startswith("test_")


def _reduced_init(tree: SourceTree, package: str, modules: set[str]) -> str:
    """The package's ``__init__`` with only the imports, ``__all__`` entries and docstring lines of ``modules``."""
    module_tree = tree.tree(package)
    lines = tree.paths[package].read_text().splitlines(keepends=True)
    exports = tree.exports(package) or {}
    kept = [name for name, source in exports.items() if source in modules]
    dropped = set(exports) - set(kept)
    edits: list[tuple[int, int, str]] = []
    for node in module_tree.body:
        if isinstance(node, ast.ImportFrom) and node.module in exports.values() and node.module not in modules:
            edits.append((node.lineno, node.end_lineno or node.lineno, ""))
        elif _is_docstring_or_all(node) and isinstance(node, ast.Assign):
            order = [e.value for e in getattr(node.value, "elts", []) if isinstance(e, ast.Constant)]
            names = "".join(f'    "{n}",\n' for n in order if n in kept)
            edits.append((node.lineno, node.end_lineno or node.lineno, f"__all__ = [\n{names}]\n"))
        elif isinstance(node, ast.Expr) and node is module_tree.body[0]:
            text = _filter_docstring(str(ast.literal_eval(node.value)), dropped)
            edits.append((node.lineno, node.end_lineno or node.lineno, f'"""{text}"""\n'))
    for start, end, replacement in sorted(edits, reverse=True):
        lines[start - 1 : end] = [replacement]
    return "".join(lines)


def _filter_docstring(text: str, dropped: set[str]) -> str:
    """Drop the lines that describe a ``dropped`` name, then headings left with nothing under them."""
    paragraphs = []
    for paragraph in text.strip("\n").split("\n\n"):
        lines = [line for line in paragraph.split("\n") if not (line.split() and line.split()[0] in dropped)]
        heading_only = len(lines) == 1 and lines[0].endswith(":") and "\n" in paragraph
        if not heading_only:
            paragraphs.append("\n".join(lines))
    return "\n\n".join(paragraphs) + "\n"


def _pyproject(
    root: Path, name: str, recipe: str, imports: set[str], has_cli: bool
) -> tuple[str, list[str], list[str], list[str]]:
    """Ours with a new name and description, and only the dependencies the copied code imports; its
    ``[project.scripts]`` only when the starter has the command's module (``has_cli``)."""
    text = (root / "pyproject.toml").read_text()
    if not has_cli:
        text = re.sub(r"^\[project\.scripts\]\n.*?(?=^\[|\Z)", "", text, flags=re.M | re.S)
    # A starter has no docs site: no `docs` extra; nor our benchmarks' peers; nor the Atari games, unless its code
    # plays them. The extras it keeps that ours name itself (`copy-correct[atari]`) name the starter instead.
    ours = re.search(r'^name = "(.*)"$', text, re.M)[1]
    dropped_extras = ["docs", "bench"] + ([] if "ale_py" in imports else ["atari"])
    for extra in dropped_extras:
        text = re.sub(rf"^(#[^\n]*\n)*{extra} = \[.*?\]\n", "", text, flags=re.M | re.S)  # a list over lines too

    def own_extras(match: re.Match[str]) -> str:
        kept = [extra for extra in match[1].split(",") if extra not in dropped_extras]
        return f'"{name}[{",".join(kept)}]",{match[2]}' if kept else ""

    text = re.sub(rf'"{re.escape(ours)}\[([\w,-]+)\]",(\s*)', own_extras, text)
    providers = packages_distributions()
    needed = {_dist_key(d) for top in imports for d in providers.get(top, [top])}
    if re.search(r"^dependencies = \[\n(.*?)^\]", text, re.M | re.S) is None:
        raise StarterError("pyproject.toml has no `dependencies = [` list, one entry per line")
    optional = re.search(r"^\[project\.optional-dependencies\]\n(.*?)(?=^\[|\Z)", text, re.M | re.S)
    extras = {_dist_key(n) for n in re.findall(r'"([A-Za-z0-9][A-Za-z0-9._-]*)', optional[1] if optional else "")}
    kept, dropped = [], []
    # The core's requirements, and the `recipes` extra's (what the clone's recipes import), one entry per line: each
    # kept only if the starter's code imports it.
    for list_name in ("dependencies", "recipes"):
        block = re.search(rf"^{list_name} = \[\n(.*?)^\]", text, re.M | re.S)
        if block is None:
            continue
        lines = []
        for line in block[1].splitlines(keepends=True):
            match = _DEP_NAME.match(line)
            if match is None or _dist_key(match[1]) in needed or match[1] == name:
                lines.append(line)
                kept += [match[1]] if match and match[1] != name else []
            else:
                dropped.append(match[1])
        text = text[: block.start(1)] + "".join(lines) + text[block.end(1) :]
    added = sorted(needed - {_dist_key(d) for d in kept + dropped} - extras)
    block = re.search(r"^dependencies = \[\n(.*?)^\]", text, re.M | re.S)
    text = text[: block.end(1)] + "".join(f'    "{dist}",\n' for dist in added) + text[block.end(1) :]
    text = re.sub(r'^name = ".*"$', f'name = "{name}"', text, count=1, flags=re.M)
    summary = re.sub(r"^Recipe `\w+`:\s*", "", _first_paragraph(_docstring(root / "recipes" / f"{recipe}.py")))
    description = json.dumps(f"Started from copy-correct's {recipe} recipe: {summary}")
    text = re.sub(r"^description = .*$", lambda _: f"description = {description}", text, count=1, flags=re.M)
    return text, kept + added, dropped, added


def _docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text())) or ""


def _first_paragraph(docstring: str) -> str:
    return " ".join(docstring.split("\n\n")[0].split()).replace("``", "`")


def _change_first(docstring: str, recipe: str) -> str:
    for paragraph in docstring.split("\n\n"):
        if paragraph.startswith("Change first:"):
            return " ".join(paragraph.removeprefix("Change first:").split()).replace("``", "`")
    return f"the model in `recipes/{recipe}.py` and its values in `conf/recipe/{recipe}.yaml`."


def quickstart(readme: str) -> str:
    """The ``## Quickstart`` section of a README, without its heading."""
    match = re.search(r"^## Quickstart\n(.*?)(?=^## |\Z)", readme, re.M | re.S)
    if match is None:
        raise StarterError("README.md has no `## Quickstart` section")
    return match[1].strip()


def _readme(root: Path, recipe: str, name: str, files: dict[str, Path | str]) -> str:
    docstring = _docstring(root / "recipes" / f"{recipe}.py")
    start = re.sub(r"\+recipe=[\w-]+", f"+recipe={recipe}", quickstart((root / "README.md").read_text()))
    library = sorted(p.removeprefix("copy_correct/") for p in files if p.startswith("copy_correct/"))
    tests = sorted(p.removeprefix("tests/") for p in files if p.startswith("tests/") and "/test_" in p)
    groups = sorted({p.split("/")[1] for p in files if p.startswith("conf/") and p.count("/") == 2} - {"recipe"})
    return f"""# {name}

Started from the `{recipe}` recipe of copy-correct by its `scripts/new_project.py`.

## What it teaches

{textwrap.fill(_first_paragraph(docstring), 110)}

## Quickstart

{start}

## Change first

{textwrap.fill(_change_first(docstring, recipe), 110)}

The recipe is `recipes/{recipe}.py` (its docstring says what it shows), its hyperparameters are in
`conf/recipe/{recipe}.yaml`; override any of them on the command line: `python train.py +recipe={recipe} key=value`.
{_own_data(recipe, files)}
## What is here

| path | what |
| --- | --- |
| `train.py` | the Hydra entry point |
| `conf/` | `config.yaml`, {", ".join(f"`{g}/`" for g in groups)} groups, `recipe/{recipe}.yaml` |
| `recipes/` | {", ".join(f"`{p.removeprefix('recipes/')}`" for p in files if p.startswith("recipes/"))} |
| `copy_correct/` | {", ".join(f"`{c}`" for c in library)}: only the modules this recipe and its tests use |
| `tests/` | {", ".join(f"`{t}`" for t in tests)} |
"""


def _own_data(recipe: str, files: dict[str, Path | str]) -> str:
    """The README's section on training with your own images, for a starter that has the ``data=images`` option."""
    if "conf/data/images.yaml" not in files:
        return ""
    return f"""
## Your own data

```bash
python train.py +recipe={recipe} data=images data.root=DIR    # DIR/*.png, or DIR/CLASS/*.png for labelled images
```

The image size and channels come from the files when they all share one (`image_size` and `channels` are `null`);
set them, with `resize` or `convert`, for a folder that mixes them. The keys are in `conf/data/images.yaml`; the
networks follow the data's shape (`model.network`, `recipes/networks.py`). To make your data the default, change
`- /data: digits` to `- /data: images` in `conf/recipe/{recipe}.yaml` and set `root:` in `conf/data/images.yaml`: the
tests compose that configuration (their own-images cases write test images of your channels), so `pytest` then proves
the copies of your networks on your data.
"""


def write(starter: Starter, dest: Path) -> None:
    """Write ``starter`` into ``dest`` (created if missing)."""
    for relative, source in starter.files.items():
        target = dest / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(source, Path):
            shutil.copyfile(source, target)
        else:
            target.write_text(source)


def summary(starter: Starter, dest: Path) -> str:
    """What was written, a few lines."""
    groups: dict[str, list[str]] = {}
    for relative in starter.files:
        head, _, rest = relative.partition("/")
        groups.setdefault(f"{head}/" if rest else "", []).append(rest or head)
    lines = [f"wrote {dest} ({starter.recipe} starter, {len(starter.files)} files):"]
    lines += [f"  {group or '.'}: {', '.join(names)}" for group, names in groups.items()]
    lines.append(f"  dependencies: {', '.join(starter.dependencies)}")
    if starter.dropped or starter.added:
        lines.append(
            f"  (not needed: {', '.join(starter.dropped) or '-'}; listed now: {', '.join(starter.added) or '-'})"
        )
    lines.append(f"next: cd {dest}, then the two Quickstart commands in README.md")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", help=f"one of: {', '.join(known_recipes())}")
    parser.add_argument("dest", type=Path, help="the new project's directory (must not exist, or be empty)")
    args = parser.parse_args(argv)
    known = known_recipes()
    if args.recipe not in known:
        print(f"error: unknown recipe {args.recipe!r}: recipe must be one of: {', '.join(known)}", file=sys.stderr)
        return 2
    dest = args.dest.resolve()
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        print(f"error: {dest} exists and is not an empty directory; choose a new DEST", file=sys.stderr)
        return 2
    name = normalise_name(dest.name)
    if not name:
        print(f"error: no project name can be made from {dest.name!r}; choose another DEST", file=sys.stderr)
        return 2
    try:
        starter = plan(args.recipe, name)
    except StarterError as err:
        print(f"error: cannot clone {args.recipe}: {err}", file=sys.stderr)
        return 1
    write(starter, dest)
    print(summary(starter, dest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
