"""The gather-based EMA of a sharded model: the peers' way, and the control of ``tests/test_sharded.py``.

``GatheredEMA`` keeps a full shadow on every rank, and every update gathers the full parameters
(``DTensor.full_tensor()``, an all-gather each) and averages them into it: the proposal in Lightning issue 21414,
and Composer's EMA, which summons full parameters on every update.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from components._sharding import is_sharded  # noqa: E402


class GatheredEMA:
    """The control: a full shadow of every parameter on every rank; each update all-gathers every full parameter
    (``DTensor.full_tensor()``) and averages it into the shadow. Parameters only."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        self.decay = decay
        self.params = list(model.parameters())
        with torch.no_grad():
            self.shadow = [_full(p) for p in self.params]

    def update(self) -> None:
        with torch.no_grad():
            torch._foreach_lerp_(self.shadow, [_full(p) for p in self.params], 1.0 - self.decay)


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if is_sharded(p) else p.detach().clone()
