"""The package is a few rooms by concern, and stays one: at most 12 modules directly in ``copy_correct/`` (a concern
of one module may stay a module there; more go into a room of their own), no module over 450 lines, and imports
between rooms (its subpackages and those modules) in one direction only, no circle. A room is what a change opens:
a sampler, a checksum or a guard should mean one room, not six files across the listing.

The imports are read with ``ast`` anywhere in a module (a function's body too), as the layers' test reads them. The
controls build small trees that break each rule, and the same checks must name what breaks it."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts.new_project import ROOMS, ROOT, SourceTree

PACKAGE = "copy_correct"
TOP_MODULES = 12
MODULE_LINES = 450


def room(module: str) -> str | None:
    """The room a module of the package is in: its subpackage, or itself for a module directly in the package; None
    for the package's own ``__init__`` (the facade, which may import every room)."""
    parts = module.split(".")
    return None if parts == [PACKAGE] else parts[1]


def top_modules(root: Path) -> list[str]:
    return sorted(p.name for p in (root / PACKAGE).glob("*.py") if p.name != "__init__.py")


def long_modules(root: Path) -> list[str]:
    found = ((p, len(p.read_text().splitlines())) for p in sorted((root / PACKAGE).rglob("*.py")))
    return [f"{p.relative_to(root).as_posix()}: {n} lines" for p, n in found if n > MODULE_LINES]


def room_imports(tree: SourceTree) -> dict[str, set[str]]:
    """Room -> the other rooms its modules import (a package ``__init__`` counts as its room's)."""
    edges: dict[str, set[str]] = {}
    for module in tree.paths:
        here = room(module) if module.split(".")[0] == PACKAGE else None
        if here is None:
            continue
        targets = {room(m) for m in tree.needs(module).modules if m.split(".")[0] == PACKAGE}
        edges.setdefault(here, set()).update(t for t in targets if t is not None and t != here)
    return edges


def circle(edges: dict[str, set[str]]) -> list[str]:
    """A circle of rooms that import each other (each importing the next, the last the first), or [] for none."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for after in sorted(edges.get(node, ())):
            if state.get(after) == 1:
                return path[path.index(after) :]
            if after not in state and (found := visit(after)):
                return found
        state[node] = 2
        path.pop()
        return []

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_at_most_twelve_modules_directly_in_the_package() -> None:
    assert len(top_modules(ROOT)) <= TOP_MODULES, top_modules(ROOT)


def test_no_module_of_the_package_is_over_450_lines() -> None:
    assert long_modules(ROOT) == []


def test_the_rooms_import_each_other_in_one_direction() -> None:
    edges = room_imports(SourceTree(ROOT))
    assert set(ROOMS) <= set(edges)  # every room read
    assert circle(edges) == []
    assert not edges["core"]  # below every room


def test_each_room_states_its_contract_and_exports_little() -> None:
    for name in ROOMS:
        package = __import__(f"{PACKAGE}.{name}", fromlist=["__all__"])
        assert "Copy contract" in (package.__doc__ or ""), name
        assert len(package.__all__) <= 8, name


# Controls: a small tree that breaks each rule.
def write(root: Path, files: dict[str, str]) -> None:
    for relative, text in files.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(text)


BASE = {
    "copy_correct/__init__.py": "from copy_correct.a.x import X\n",
    "copy_correct/a/__init__.py": "",
    "copy_correct/a/x.py": "from copy_correct.b.y import Y\nX = Y\n",
    "copy_correct/b/__init__.py": "",
    "copy_correct/b/y.py": "Y = 1\n",
    "conf/recipe/r.yaml": "",
}


def test_control_a_circle_of_two_rooms_is_found_and_one_direction_is_not(tmp_path: Path) -> None:
    write(tmp_path, BASE)
    assert circle(room_imports(SourceTree(tmp_path))) == []
    write(tmp_path, {"copy_correct/b/y.py": "def f():\n    from copy_correct.a.x import X\nY = 1\n"})
    assert circle(room_imports(SourceTree(tmp_path))) == ["a", "b"]


def test_control_a_thirteenth_top_module_and_a_long_one_are_found(tmp_path: Path) -> None:
    write(tmp_path, BASE | {f"copy_correct/m{i}.py": "" for i in range(TOP_MODULES + 1)})
    assert len(top_modules(tmp_path)) == TOP_MODULES + 1
    write(tmp_path, {"copy_correct/b/y.py": "Y = 1\n" * (MODULE_LINES + 1)})
    assert long_modules(tmp_path) == [f"copy_correct/b/y.py: {MODULE_LINES + 1} lines"]


@pytest.mark.parametrize("name", ["averages", "replay"])
def test_control_a_room_without_its_contract_is_found(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    package = __import__(f"{PACKAGE}.{name}", fromlist=["__all__"])
    monkeypatch.setattr(package, "__doc__", "Some modules.")
    with pytest.raises(AssertionError):
        test_each_room_states_its_contract_and_exports_little()
