"""Shared test helpers: device parametrisation (CUDA cases marked ``gpu`` and skipped without a GPU)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, CUDA]),
]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    """Each test using it runs on CPU, and on CUDA when a GPU is present."""
    return torch.device(request.param)


@pytest.fixture(autouse=True)
def _no_dispatch_mode_outlives_a_test() -> Iterator[None]:
    """CopyAudit and MemoryProbe push dispatch modes; one left active would skew every later test."""
    yield
    assert not _get_current_dispatch_mode_stack(), "a TorchDispatchMode was left active"
