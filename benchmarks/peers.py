"""The peer libraries the benchmarks call, as installed: each found by import, named with its version, or a reason.

The ``bench`` extra pins them (``pip install -e ".[bench]"``), except timm: timm requires torchvision, and PyPI's
torchvision does not import beside a CPU build of torch, so it is installed on its own with ``pip install --no-deps
timm==1.0.31``. Without torchvision, ``import timm`` fails; its EMA classes live in ``timm/utils/model_ema.py``, which
imports only torch, and are then loaded from that file of the installed package (the same code, not a copy).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
from types import ModuleType

INSTALL = "pip install -e '.[bench]' && pip install --no-deps timm==1.0.31"


class Missing(str):
    """Why a peer cannot run here: its row in a table says this instead of a time."""


def version(distribution: str) -> str:
    return importlib.metadata.version(distribution)


def load(module: str, distribution: str) -> ModuleType | Missing:
    """``import module``, or why not (not installed, or failed to import: the error's first line)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name is not None and module.startswith(error.name.split(".")[0]):
            return Missing(f"{distribution} not installed ({INSTALL})")
        return Missing(f"{distribution} failed to import: {str(error).splitlines()[0]}")
    except Exception as error:  # a peer's import can fail any way (a missing C++ operator, say)
        return Missing(f"{distribution} failed to import: {type(error).__name__}: {str(error).splitlines()[0]}")


def timm_model_ema() -> ModuleType | Missing:
    """``timm.utils.model_ema`` imported as usual where timm imports, else loaded alone from the installed file."""
    module = load("timm.utils.model_ema", "timm")
    if not isinstance(module, Missing):
        return module
    spec = importlib.util.find_spec("timm")
    if spec is None or not spec.submodule_search_locations:
        return module
    path = f"{next(iter(spec.submodule_search_locations))}/utils/model_ema.py"
    alone = importlib.util.spec_from_file_location("_timm_model_ema", path)
    if alone is None or alone.loader is None:
        return module
    loaded = importlib.util.module_from_spec(alone)
    sys.modules[alone.name] = loaded
    alone.loader.exec_module(loaded)
    return loaded


def label(distribution: str, what: str) -> str:
    """A row's name: ``what`` with the package and the version installed (``timm 1.0.31 ModelEmaV3``)."""
    try:
        return f"{distribution} {version(distribution)} {what}"
    except importlib.metadata.PackageNotFoundError:
        return f"{distribution} {what}"
