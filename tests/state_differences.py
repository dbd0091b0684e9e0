"""Comparing two training states (checkpoints, or what a test collected) bit for bit: the resume and the
evaluation-isolation tests both ask where two runs ended apart."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Paths at which ``a`` and ``b`` differ: tensors and arrays by dtype, shape and value bit for bit, two NaN floats
    alike, anything else by type and ``==``."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(map(str, set(a) ^ set(b)))}"]
        return [d for k in a for d in differences(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and type(a) is type(b):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{path}/{i}")]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return [] if a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) else [path]
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return [] if a.dtype == b.dtype and np.array_equal(a, b) else [path]
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return []
    return [] if type(a) is type(b) and a == b else [path]


def present(state: Mapping[str, Any], path: str) -> bool:
    """Whether ``state`` holds something non-empty at ``path`` (``a/b/0``: keys and list indices)."""
    node: Any = state
    for part in path.split("/"):
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, (list, tuple)) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return False
    return not isinstance(node, (Mapping, list, tuple, torch.Tensor)) or len(node) > 0
