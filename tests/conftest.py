"""Shared test helpers: device parametrisation (CUDA cases marked ``gpu`` and skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, CUDA]),
]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    """Each test using it runs on CPU, and on CUDA when a GPU is present."""
    return torch.device(request.param)
