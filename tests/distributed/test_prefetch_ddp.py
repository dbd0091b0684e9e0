"""``DeviceDataLoader`` under Lightning's DDP, 2 CPU processes over gloo (``tests/workers/ddp_prefetch.py``): it is
still a ``DataLoader``, so Lightning injects its distributed sampler and each rank sees its own half of the data."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, child_env, free_port

pytestmark = pytest.mark.long  # Lightning fits in 2 processes (DDP over gloo): CI runs them (pytest -m long)


def _ddp_indices(out: Path, *args: str) -> tuple[list[int], list[int]]:
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "workers" / "ddp_prefetch.py"), str(out), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=child_env(MASTER_PORT=free_port()),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return (
        torch.load(out / "rank0.pt", weights_only=True).tolist(),
        torch.load(out / "rank1.pt", weights_only=True).tolist(),
    )


def test_ddp_still_injects_its_sampler(tmp_path: Path) -> None:
    """2 CPU processes (gloo): each rank's DeviceDataLoader sees its own half of the data."""
    rank0, rank1 = _ddp_indices(tmp_path)
    assert len(rank0) == len(rank1) == 16
    assert not set(rank0) & set(rank1) and set(rank0) | set(rank1) == set(range(32))
    # Control: a bare DevicePrefetcher is no DataLoader, so Lightning cannot inject a sampler: both see all.
    (tmp_path / "control").mkdir()
    rank0, rank1 = _ddp_indices(tmp_path / "control", "control")
    assert sorted(rank0) == sorted(rank1) == list(range(32))
