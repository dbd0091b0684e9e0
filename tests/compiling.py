"""What the tests of updates traced into ``torch.compile``d functions share: a backend that counts compiles, and
whether inductor can build a CPU kernel here."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping
from typing import Any

import torch


class Counting:
    """A ``torch.compile`` backend that runs the traced graph as it is (torch's kernels) and counts compiles."""

    def __init__(self) -> None:
        self.compiles = 0

    def __call__(self, graph: Any, inputs: Any) -> Callable[..., Any]:
        self.compiles += 1
        return graph.forward


def inductor_builds() -> bool:
    """Whether inductor can build a kernel for the CPU here (a C++ compiler and the headers it needs)."""
    if shutil.which("g++") is None:
        return False
    try:
        torch.compile(lambda x: x + 1, fullgraph=True)(torch.ones(2))
    except Exception:  # any failure to build means: not on this machine
        return False
    return True


# Bit for bit from torch 2.13 on (measured on 2.13.0 and 2.14.1); torch 2.10's Dynamo traces a lerp into a graph whose
# result differs from the eager kernel's within float32 rounding (the versions leg, 2026-12-07).
EXACT = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)


def close(ours: Mapping[str, torch.Tensor], theirs: Mapping[str, torch.Tensor]) -> None:
    """Equal to float32 rounding, name by name: floating tensors within 2**-22 of their scale, integer ones equal."""
    assert list(ours) == list(theirs)
    for name, theirs_tensor in theirs.items():
        if theirs_tensor.is_floating_point():
            scale = theirs_tensor.abs().max().item()
            torch.testing.assert_close(ours[name], theirs_tensor, rtol=2**-22, atol=2**-22 * scale)
        else:
            assert torch.equal(ours[name], theirs_tensor), name


def same_or_close(ours: Mapping[str, torch.Tensor], theirs: Mapping[str, torch.Tensor]) -> bool:
    """Bit for bit where torch's own kernels in a traced graph give the eager result (``EXACT``), else ``close``."""
    if not EXACT:
        close(ours, theirs)
        return True
    return list(ours) == list(theirs) and all(torch.equal(ours[name], t) for name, t in theirs.items())
