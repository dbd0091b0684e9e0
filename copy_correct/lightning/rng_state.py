"""The global random number generators' states as checkpoint values: torch's CPU generator, the current CUDA
device's (when CUDA is initialised), NumPy's global generator and Python's ``random``.

``get_rng_state`` returns copies (nothing is shared with the generators) made of tensors, numbers and tuples only, so
a checkpoint that holds them loads with ``torch.load(..., weights_only=True)``; ``set_rng_state`` puts them back.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["get_rng_state", "set_rng_state"]


def get_rng_state(cuda: bool = True) -> dict[str, Any]:
    """The global generators' states: torch CPU, CUDA (current device, when initialised and ``cuda``), NumPy,
    Python."""
    _, key, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"key": torch.from_numpy(key.astype(np.int64)), "pos": pos, "gauss": (has_gauss, cached_gaussian)},
        "python": random.getstate(),
    }
    if cuda and torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what ``get_rng_state`` returned (the CUDA state only where it holds one and CUDA is available)."""
    torch.set_rng_state(state["torch"])
    numpy = state["numpy"]
    np.random.set_state(("MT19937", numpy["key"].numpy().astype(np.uint32), numpy["pos"], *numpy["gauss"]))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
