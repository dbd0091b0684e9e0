"""Lazy re-exports: a package ``__init__`` whose names are imported from their submodules on first use.

The package lists its exports as imports under ``if TYPE_CHECKING:`` (which type checkers, IDEs, the manual's API
pages and ``scripts/new_project.py`` read) and takes ``__getattr__`` and ``__dir__`` from ``lazy_exports``, which
reads the same imports from the package's source. So ``from components import EMA`` imports ``components.ema`` and
what that needs, and nothing else: not Lightning, which only the Lightning callbacks import.

Copy contract: none; no tensor is touched.
"""

from __future__ import annotations

import ast
import importlib
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["lazy_exports", "type_checking_imports"]


def type_checking_imports(tree: ast.Module) -> list[ast.ImportFrom]:
    """The ``from ... import ...`` statements under a module's top-level ``if TYPE_CHECKING:``."""
    return [
        node
        for block in tree.body
        if isinstance(block, ast.If) and ast.unparse(block.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        for node in block.body
        if isinstance(node, ast.ImportFrom)
    ]


def lazy_exports(package: str) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``, which must be importing (call this from its ``__init__``)."""
    module = sys.modules[package]
    source = module.__spec__.loader.get_source(package)  # a source file or a zip archive alike
    sources = {
        alias.asname or alias.name: node.module
        for node in type_checking_imports(ast.parse(source))
        for alias in node.names
    }

    def __getattr__(name: str) -> Any:
        if name not in sources:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(sources[name]), name)
        setattr(module, name, value)  # found once: later lookups do not come here
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(module), *sources})

    return __getattr__, __dir__
