"""A sharded average saved at one world size and resumed at another (``tests/workers/sharded_reshard.py``): ``EMA``
and ``PowerEMA`` of an FSDP2 network with uneven shards saved by ``torch.distributed.checkpoint`` at 2 ranks and
loaded at 1 and 4, and saved at 1 and 4 and loaded at 2, each world size its own group of gloo processes. The average
loaded, gathered at the new world size, equals the one gathered at the old bit for bit, counters included, and each
rank holds only its own shards of it (resharded by the checkpoint's reader, not gathered onto one rank). The control:
the same averages before the load. Then the same through Lightning: ``EMAWeights`` under ``ModelParallelStrategy``,
its distributed checkpoint saved at 2 ranks and the fit resumed from it at 1 and 4
(``tests/workers/sharded_callback_reshard.py``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, child_env, free_port

FULL_SHADOW_PARAMETER_BYTES = 4 * (33 * 16 + 33 + 33 + 33 + 5 * 33 + 5 + 5 + 1)


def run(out: Path, *args: str) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "workers" / "sharded_reshard.py"), str(out), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=child_env(TEST_PORT=free_port()),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.long  # 12 process groups' worth of gloo processes on 2 cores
@pytest.mark.parametrize(("source", "target"), [(2, 1), (2, 4), (1, 2), (4, 2)])
def test_an_average_saved_at_one_world_size_loads_at_another_equal_to_the_gathered_one(
    source: int, target: int, tmp_path: Path
) -> None:
    run(tmp_path, str(source), "save")
    run(tmp_path, str(target), "load", str(source))
    saved = torch.load(tmp_path / f"gathered-{source}.pt", weights_only=True)
    loaded = torch.load(tmp_path / f"loaded-{source}-to-{target}.pt", weights_only=True)
    assert same(loaded["ema"], saved["ema"])
    assert all(same(mine, theirs) for mine, theirs in zip(loaded["power"], saved["power"], strict=True))
    assert loaded["counters"] == saved["counters"] == (5, 5, 5, 5)
    assert not same(loaded["untouched"]["ema"], saved["ema"])  # the control: before the load, another average
    # full_state_dict() is new memory at every world size (on a mesh of one rank full_tensor() is the shard itself)
    assert loaded["gathered_kept"] and loaded["average_moved"]
    # each rank holds its own shards of the parameters' shadow, together one shadow: nothing gathered onto one rank
    assert sum(loaded["held"]) == FULL_SHADOW_PARAMETER_BYTES
    assert max(loaded["held"]) < FULL_SHADOW_PARAMETER_BYTES or target == 1


@pytest.mark.long  # Lightning fits in 2, 1 and 4 gloo processes
def test_ema_weights_resumes_a_distributed_checkpoint_at_another_world_size(tmp_path: Path) -> None:
    def worker(*args: str) -> None:
        result = subprocess.run(
            [sys.executable, str(ROOT / "tests" / "workers" / "sharded_callback_reshard.py"), str(tmp_path), *args],
            cwd=ROOT, capture_output=True, text=True, timeout=600, env=child_env(TEST_PORT=free_port()),
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]

    worker("2", "save")
    saved = torch.load(tmp_path / "gathered-2.pt", weights_only=True)
    for world in (1, 4):
        worker(str(world), "load", "2")
        loaded = torch.load(tmp_path / f"loaded-2-to-{world}.pt", weights_only=True)
        assert same(loaded["ema"], saved["ema"]) and loaded["counters"] == saved["counters"] == (8, 8), world
