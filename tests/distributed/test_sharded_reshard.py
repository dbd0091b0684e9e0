"""A sharded average saved at one world size and resumed at another (``tests/workers/sharded_reshard.py``): ``EMA``
and ``PowerEMA`` of an FSDP2 network with uneven shards saved by ``torch.distributed.checkpoint`` at 2 ranks and
loaded at 1 and 4, and saved at 1 and 4 and loaded at 2, each world size its own group of gloo processes. The average
loaded, gathered at the new world size, equals the one gathered at the old bit for bit, counters included, and each
rank holds only its own shards of it (resharded by the checkpoint's reader, not gathered onto one rank). The control:
the same averages before the load. Then the same through Lightning under ``ModelParallelStrategy``, a distributed
checkpoint saved at 2 ranks and the fit resumed from it at 1 and 4, and saved at 1 and 4 and resumed at 2:
``EMAWeights`` (``tests/workers/sharded_callback_reshard.py``) and ``PostHocEMASnapshots``, whose snapshot files
change world size at the resume and which ``copy-correct posthoc`` joins step by step
(``tests/workers/sharded_posthoc_reshard.py``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, child_env, free_port

FULL_SHADOW_PARAMETER_BYTES = 4 * (33 * 16 + 33 + 33 + 33 + 5 * 33 + 5 + 5 + 1)


def worker(script: str, out: Path, *args: str) -> None:
    """Run ``tests/workers/SCRIPT`` with ``out`` and ``args``, on a port of its own; it must succeed."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "workers" / script), str(out), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=child_env(TEST_PORT=free_port()),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]


def run(out: Path, *args: str) -> None:
    worker("sharded_reshard.py", out, *args)


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


@pytest.mark.long  # Lightning fits in 1, 2 and 4 gloo processes
@pytest.mark.parametrize(("source", "worlds"), [(2, (1, 4)), (1, (2,)), (4, (2,))])
def test_ema_weights_resumes_a_distributed_checkpoint_at_another_world_size(
    tmp_path: Path, source: int, worlds: tuple[int, ...]
) -> None:
    def callback_worker(*args: str) -> None:
        worker("sharded_callback_reshard.py", tmp_path, *args)

    callback_worker(str(source), "save")
    saved = torch.load(tmp_path / f"gathered-{source}.pt", weights_only=True)
    for world in worlds:
        callback_worker(str(world), "load", str(source))
        loaded = torch.load(tmp_path / f"loaded-{source}-to-{world}.pt", weights_only=True)
        assert same(loaded["ema"], saved["ema"]) and loaded["counters"] == saved["counters"], world


def posthoc_worker(out: Path, *args: str) -> None:
    worker("sharded_posthoc_reshard.py", out, *args)


def reference_snapshots(truth: dict[int, dict[str, torch.Tensor]], every: int) -> dict[int, dict]:
    """An unsharded ``PowerEMA`` of the same network fed the gathered live weights after each step: its snapshots
    every ``every`` steps, named as the LightningModule's ``state_dict``."""
    from torch import nn

    from copy_correct import PowerEMA

    net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
    power_ema = PowerEMA(net)
    snapshots = {}
    for step in sorted(truth):
        net.load_state_dict({k.removeprefix("net."): v for k, v in truth[step].items()})
        power_ema.update()
        if step % every == 0:
            state = power_ema.snapshot()
            state["profiles"] = [{f"net.{k}": v for k, v in p.items()} for p in state["profiles"]]
            snapshots[step] = state
    return snapshots


@pytest.fixture(scope="module")
def posthoc_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder for the post-hoc runs: each world size's saved run is made once, by the first pair that needs it."""
    return tmp_path_factory.mktemp("posthoc_reshard")


@pytest.mark.long  # Lightning fits in 1, 2 and 4 gloo processes
@pytest.mark.parametrize(("source", "world"), [(2, 1), (2, 4), (1, 2), (4, 2)])
def test_posthoc_snapshots_resume_at_another_world_size_and_the_command_joins_each_steps_files(
    posthoc_runs: Path, source: int, world: int
) -> None:
    """``PostHocEMASnapshots`` saved at one world size and resumed at another: the profiles restored equal the ones
    saved bit for bit; the resumed run's folder holds the earlier snapshots as rank files of the old size (carried
    over) and its own of the new; ``copy-correct posthoc`` joins each step's files at its own size, and its checkpoint
    is the post-hoc EMA of the live weights of both fits bit for bit. The control: one carried file removed, the
    command refuses naming the step."""
    from copy_correct import synthesize
    from copy_correct.averages.posthoc_command import posthoc

    def steps(ranks: int) -> int:  # optimizer steps an epoch: 8 batches shared by the ranks
        return 8 // ranks

    out = posthoc_runs
    if not (out / f"saved-{source}.pt").exists():
        posthoc_worker(out, str(source), "save")
    saved = torch.load(out / f"saved-{source}.pt", weights_only=True)
    first, last = 2 * steps(source), 2 * steps(source) + 2 * steps(world)  # 2 epochs, then 2 more
    assert saved["step"] == first
    posthoc_worker(out, str(world), "load", str(source))
    loaded = torch.load(out / f"loaded-{source}-to-{world}.pt", weights_only=True)
    assert loaded["step"] == saved["step"]
    assert all(same(mine, theirs) for mine, theirs in zip(loaded["profiles"], saved["profiles"], strict=True))
    folder = out / f"resumed-{source}-to-{world}" / "power_ema"
    earlier = [f"power-ema-{s:09d}-rank{r}of{source}.pt" for s in range(2, first + 1, 2) for r in range(source)]
    later = [f"power-ema-{s:09d}-rank{r}of{world}.pt" for s in range(first + 2, last + 1, 2) for r in range(world)]
    assert sorted(p.name for p in folder.iterdir()) == sorted(earlier + later)
    (path,) = posthoc(folder.parent, [0.08])
    truth = saved["truth"] | loaded["truth"]
    assert sorted(truth) == list(range(1, last + 1))
    expected = synthesize(list(reference_snapshots(truth, 2).values()), 0.08)
    weights = {n: t for n, t in torch.load(path, weights_only=False)["state_dict"].items() if n in expected}
    assert weights.keys() == expected.keys() and all(torch.equal(weights[n], expected[n]) for n in expected)
    (folder / f"power-ema-000000002-rank{source - 1}of{source}.pt").unlink()  # the control
    with pytest.raises(ValueError, match=r"the snapshot of step 2 of ranks|the snapshot of step 2, which"):
        posthoc(folder.parent, [0.08])
