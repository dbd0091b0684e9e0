"""A module docstring in ``copy_correct/`` states a copy contract (what is shared, what is new storage, what autograd
sees, and why) in about 25 lines: none is over ``MAX_LINES``. Measurements, peer comparisons and history belong in
the manual (``docs/``). The control writes a module with a long docstring and sees it named.

Issue 41 set this limit while the package's longest docstrings were being shortened: a failure lists each module over
it with its count, and the fix is in that module's docstring (moving figures to the manual), never here."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT

MAX_LINES = 30


def long_docstrings(package: Path, root: Path) -> list[str]:
    """``path: N lines`` for each module under ``package`` whose module docstring is longer than ``MAX_LINES``."""
    found = []
    for module in sorted(package.rglob("*.py")):
        docstring = ast.get_docstring(ast.parse(module.read_text()), clean=False) or ""
        lines = len(docstring.splitlines())
        if lines > MAX_LINES:
            found.append(f"{module.relative_to(root).as_posix()}: {lines} lines")
    return found


def test_no_module_docstring_in_the_package_is_over_the_limit() -> None:
    assert long_docstrings(ROOT / "copy_correct", ROOT) == []


def test_control_a_long_module_docstring_is_named(tmp_path: Path) -> None:
    package = tmp_path / "copy_correct"
    (package / "lightning").mkdir(parents=True)
    (package / "short.py").write_text('"""' + "a line\n" * MAX_LINES + '"""\n\nVALUE = 1\n')
    (package / "lightning" / "long.py").write_text('"""' + "a line\n" * (MAX_LINES + 1) + '"""\n\nVALUE = 1\n')
    assert long_docstrings(package, tmp_path) == [f"copy_correct/lightning/long.py: {MAX_LINES + 1} lines"]
