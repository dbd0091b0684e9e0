"""``PostHocEMASnapshots`` under Lightning's ``ModelParallelStrategy`` (FSDP2), 2 CPU processes over gloo
(``tests/workers/sharded_posthoc_ema.py``): every rank snapshots its own shards; joined, the snapshots equal the power
EMA of the gathered weights bit for bit; checkpoints (a distributed checkpoint's directory, or one file) resume the
profiles bit for bit; ``copy-correct posthoc`` writes a checkpoint of full weights from the ranks' files. A fit ending
off its snapshot schedule leaves every rank's final snapshot of its last step, which the command synthesizes from; a
run stopped off schedule and resumed leaves the snapshot files of the run that was not stopped, bit for bit.
Controls: a resume that ignores the callback state ends with other profiles; one rank's files alone are not the
model; without the final snapshots the command's last step is the last scheduled one; the stopped run's final
snapshot was there before the resume removed it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from copy_correct import PowerEMA, synthesize
from copy_correct.averages.posthoc import load_snapshot, snapshot_paths
from copy_correct.averages.posthoc_command import join_shards, posthoc
from tests.conftest import ROOT, child_env, run_rank_script

pytestmark = pytest.mark.long  # Lightning fits in 2 processes (FSDP2 over gloo): CI runs them (pytest -m long)

STEPS = 16  # 4 epochs of 4 optimizer steps
FINAL_STEPS = 12  # the runs ending off their schedule: 3 epochs, a snapshot every 5 steps (5, 10; final 12)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict], dict]:
    out = tmp_path_factory.mktemp("sharded_posthoc")
    ranks = run_rank_script("sharded_posthoc_ema.py", out, timeout=600)
    return out, ranks, torch.load(out / "truth.pt", weights_only=True)


@pytest.fixture(scope="module")
def every_step(runs: tuple[Path, list[dict], dict]) -> dict[int, dict]:
    """An unsharded ``PowerEMA`` of the same network fed the gathered weights after each step: its snapshot after
    every step."""
    _, _, truth = runs
    net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
    ema = PowerEMA(net)
    snapshots = {}
    for step in range(1, STEPS + 1):
        net.load_state_dict({k.removeprefix("net."): v for k, v in truth[step].items()})
        ema.update()
        state = ema.snapshot()
        state["profiles"] = [{f"net.{k}": v for k, v in p.items()} for p in state["profiles"]]
        snapshots[step] = state
    return snapshots


@pytest.fixture(scope="module")
def reference(every_step: dict[int, dict]) -> dict[int, dict]:
    """The reference's snapshots on the straight runs' schedule (every 2 steps)."""
    return {step: state for step, state in every_step.items() if step % 2 == 0}


def rank_files(directory: Path) -> list[list[Path]]:
    return [snapshot_paths(directory / "power_ema", rank=r) for r in range(2)]


def test_every_rank_writes_its_own_shards_at_every_snapshot(runs: tuple[Path, list[dict], dict]) -> None:
    out, _, _ = runs
    for rank, paths in enumerate(rank_files(out / "straight-dcp")):
        assert [p.name for p in paths] == [f"power-ema-{s:09d}-rank{rank}of2.pt" for s in range(2, STEPS + 1, 2)]
        state = load_snapshot(paths[-1])
        assert (state["rank"], state["world_size"], state["module"]) == (rank, 2, "net")
        assert state["layout"]["net.0.weight"] == "Shard(dim=0) over a mesh of 2 ranks"
        assert state["layout"]["net.1.running_mean"] == "not sharded"
        assert tuple(state["profiles"][0]["net.0.weight"].shape) == (8, 8)  # half of (16, 8)
        assert tuple(state["profiles"][0]["net.3.weight"].shape) == ((1, 16) if rank == 0 else (0, 16))  # uneven


def test_the_ranks_snapshots_joined_are_the_power_ema_of_the_gathered_weights(
    runs: tuple[Path, list[dict], dict], reference: dict[int, dict]
) -> None:
    out, _, _ = runs
    files = rank_files(out / "straight-dcp")
    for i, step in enumerate(range(2, STEPS + 1, 2)):
        states = [load_snapshot(paths[i]) for paths in files]
        assert {int(s["step"]) for s in states} == {step}
        for k in range(2):
            joined = join_shards([s["profiles"][k] for s in states], states[0]["layout"])
            expected = reference[step]["profiles"][k]
            assert joined.keys() == expected.keys()
            assert all(torch.equal(joined[n], expected[n]) for n in expected), step  # rank 0's buffers
    # Every rank averaged rank 0's buffers (broadcast before each update): their profiles agree. The control: each
    # rank's own statistics, which it would have averaged without the broadcast, differ (each saw its own batches).
    last = [load_snapshot(paths[-1])["profiles"][0] for paths in files]
    assert all(torch.equal(last[0][n], last[1][n]) for n in ("net.1.running_mean", "net.1.running_var"))
    own = [rank["straight-dcp"]["own_running_mean"] for rank in runs[1]]
    assert not torch.equal(own[0], own[1])
    # The control: rank 0's files alone hold half of each sharded tensor.
    alone = load_snapshot(files[0][-1])["profiles"][0]["net.0.weight"]
    assert alone.shape != reference[STEPS]["profiles"][0]["net.0.weight"].shape


@pytest.mark.parametrize("kind", ["dcp", "file"])
def test_a_resumed_run_continues_the_profiles_and_snapshots_bit_for_bit(
    runs: tuple[Path, list[dict], dict], kind: str
) -> None:
    out, ranks, _ = runs
    for rank in ranks:
        straight, resumed = rank[f"straight-{kind}"], rank[f"resumed-{kind}"]
        assert resumed["step"] == straight["step"] == STEPS
        for a, b in zip(resumed["profiles"], straight["profiles"], strict=True):
            assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)  # buffers too: rank 0's
    for straight, resumed in zip(
        rank_files(out / f"straight-{kind}"), rank_files(out / f"resumed-{kind}"), strict=True
    ):
        # Every snapshot: the first 4 (up to the resume at step 8) carried over from the interrupted run's folder.
        assert [p.name for p in resumed] == [p.name for p in straight]
        for a, b in zip(resumed, straight, strict=True):
            sa, sb = load_snapshot(a), load_snapshot(b)
            for k in range(2):
                assert all(torch.equal(sa["profiles"][k][n], t) for n, t in sb["profiles"][k].items())
    # The control: the same resume with fresh profiles ends elsewhere.
    for rank in ranks:
        control, straight = rank["control"]["profiles"][0], rank["straight-dcp"]["profiles"][0]
        assert not torch.equal(control["0.weight"], straight["0.weight"])


@pytest.mark.parametrize("kind", ["dcp", "file"])
def test_the_command_writes_one_checkpoint_of_full_weights_from_the_ranks_files(
    runs: tuple[Path, list[dict], dict], reference: dict[int, dict], kind: str
) -> None:
    out, _, _ = runs
    result = subprocess.run(
        [sys.executable, "-m", "copy_correct", "posthoc", str(out / f"straight-{kind}"), "--sigma-rel", "0.08"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=child_env(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    path = Path(result.stdout.strip())
    assert path.name == f"posthoc-ema-sigma0.080-step{STEPS:09d}.ckpt" and path.is_file()
    checkpoint = torch.load(path, weights_only=False)
    expected = synthesize(list(reference.values()), 0.08)
    if kind == "dcp":  # the same training: its profiles are the reference's
        assert checkpoint["state_dict"].keys() == expected.keys()
        assert all(torch.equal(checkpoint["state_dict"][n], expected[n]) for n in expected)
    else:  # the file run trains the same; its weights equal the dcp run's
        dcp = torch.load(out / "straight-dcp" / path.name, weights_only=False)
        assert all(torch.equal(checkpoint["state_dict"][n], dcp["state_dict"][n]) for n in expected)
    assert checkpoint["posthoc_ema"]["module"] == "net" and checkpoint["global_step"] == STEPS


def test_a_fit_ending_off_its_schedule_leaves_every_ranks_final_snapshot_of_its_last_step(
    runs: tuple[Path, list[dict], dict], every_step: dict[int, dict]
) -> None:
    out, ranks, _ = runs
    files = rank_files(out / "final")
    for rank, paths in enumerate(files):
        assert ranks[rank]["final"]["step"] == FINAL_STEPS
        assert [p.name for p in paths] == [f"power-ema-{s:09d}-rank{rank}of2.pt" for s in (5, 10, FINAL_STEPS)]
        states = [load_snapshot(p) for p in paths]
        assert [bool(s.get("final", False)) for s in states] == [False, False, True]  # only the one fit's end took
        assert [(s["rank"], s["world_size"], s["module"]) for s in states] == [(rank, 2, "net")] * 3
    # Joined, each step's files are the reference's snapshot of that step: the final one holds steps 1..12.
    for i, step in enumerate((5, 10, FINAL_STEPS)):
        states = [load_snapshot(paths[i]) for paths in files]
        assert {int(s["step"]) for s in states} == {step}
        for k in range(2):
            joined = join_shards([s["profiles"][k] for s in states], states[0]["layout"])
            expected = every_step[step]["profiles"][k]
            assert joined.keys() == expected.keys()
            assert all(torch.equal(joined[n], expected[n]) for n in expected), step
    # A run shorter than snapshot_every: its one file, on every rank, is the final snapshot of its last step.
    for rank in range(2):
        assert ranks[rank]["stopped-files"] == {f"power-ema-{4:09d}-rank{rank}of2.pt": True}


def test_the_command_synthesizes_the_last_step_from_the_ranks_final_snapshots(
    runs: tuple[Path, list[dict], dict], every_step: dict[int, dict], tmp_path: Path
) -> None:
    out, _, _ = runs
    # The control first, on a copy of the run without its final snapshots: the last step is then the last scheduled.
    without = shutil.copytree(out / "final", tmp_path / "final")
    for path in sorted((without / "power_ema").glob("power-ema-*.pt")):
        if load_snapshot(path).get("final", False):
            path.unlink()
    assert len(list((without / "power_ema").iterdir())) == 4  # steps 5 and 10 on each of the 2 ranks
    (short,) = posthoc(without, [0.08])
    assert short.name == "posthoc-ema-sigma0.080-step000000010.ckpt"

    (path,) = posthoc(out / "final", [0.08])
    assert path.name == f"posthoc-ema-sigma0.080-step{FINAL_STEPS:09d}.ckpt" and path.parent == out / "final"
    checkpoint = torch.load(path, weights_only=False)
    expected = synthesize([every_step[s] for s in (5, 10, FINAL_STEPS)], 0.08)
    weights = {n: t for n, t in checkpoint["state_dict"].items() if n.startswith("net.")}
    assert weights.keys() == expected.keys()
    assert all(torch.equal(weights[n], expected[n]) for n in expected)
    assert checkpoint["posthoc_ema"]["module"] == "net" and checkpoint["global_step"] == FINAL_STEPS
    shorter = torch.load(short, weights_only=False)["state_dict"]
    assert torch.equal(shorter["net.0.weight"], synthesize([every_step[s] for s in (5, 10)], 0.08)["net.0.weight"])
    assert not torch.equal(shorter["net.0.weight"], weights["net.0.weight"])  # steps 11 and 12 left out


def test_a_run_stopped_off_its_schedule_and_resumed_leaves_the_uninterrupted_runs_snapshot_files(
    runs: tuple[Path, list[dict], dict],
) -> None:
    out, ranks, _ = runs
    stopped, straight = out / "stopped" / "power_ema", out / "final" / "power_ema"
    assert sorted(p.name for p in stopped.iterdir()) == sorted(p.name for p in straight.iterdir())  # no temporaries
    for a, b in zip(rank_files(out / "stopped"), rank_files(out / "final"), strict=True):
        assert [p.name for p in a] == [p.name for p in b] and len(a) == 3
        for pa, pb in zip(a, b, strict=True):
            sa, sb = load_snapshot(pa), load_snapshot(pb)
            assert (sa["step"], sa.get("final", False), sa["rank"]) == (sb["step"], sb.get("final", False), sb["rank"])
            assert len(sa["profiles"]) == len(sb["profiles"]) == 2
            for ka, kb in zip(sa["profiles"], sb["profiles"], strict=True):
                assert ka.keys() == kb.keys() and all(torch.equal(ka[n], kb[n]) for n in kb), pa.name
    for rank in ranks:
        resumed, straight_run = rank["stopped-resumed"], rank["final"]
        assert resumed["step"] == straight_run["step"] == FINAL_STEPS
        for a, b in zip(resumed["profiles"], straight_run["profiles"], strict=True):
            assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    # The control: the stopped run's final snapshot (step 4) was there, and the resume removed it on every rank.
    for r, rank in enumerate(ranks):
        (name,) = rank["stopped-files"]
        assert name == f"power-ema-{4:09d}-rank{r}of2.pt" and not (stopped / name).exists()
