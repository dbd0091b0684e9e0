"""``EMAWeights`` under Lightning's ``ModelParallelStrategy`` (FSDP2), 2 CPU processes over gloo
(``tests/workers/sharded_callback.py``): checkpoints hold the sharded average, in a distributed checkpoint directory
or a single file, hold the average as the weights and the live weights in the callback state, also when saved during
the EMA evaluation, and resume bit for bit. Controls: a resume without the EMA state (a fresh average), and saving
inside the EMA pass as before the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.conftest import run_rank_script

pytestmark = pytest.mark.long  # Lightning fits in 2 processes (FSDP2 over gloo): CI runs them (pytest -m long)

KEY = "EMAWeights{'decay': 0.9}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict], dict]:
    out = tmp_path_factory.mktemp("sharded_callback")
    ranks = run_rank_script("sharded_callback.py", out, timeout=600)
    return out, ranks, torch.load(out / "truth.pt", weights_only=True)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], v) for k, v in b.items())


def read(path: Path, tmp_path: Path) -> dict:
    """A checkpoint as one dict of full tensors: a file as it is, a distributed checkpoint converted (its shards
    joined by torch's own converter, in this one process) with its ``meta.pt`` merged in."""
    if path.is_file():
        return torch.load(path, weights_only=True)
    converted = tmp_path / f"{path.name}.pt"
    dcp_to_torch_save(path, converted)
    return {**torch.load(converted, weights_only=True), **torch.load(path / "meta.pt", weights_only=True)}


@pytest.mark.parametrize("kind", ["dcp", "file"])
def test_a_resumed_run_ends_with_the_shards_of_the_uninterrupted_one(
    runs: tuple[Path, list[dict], dict], kind: str
) -> None:
    _, ranks, _ = runs
    for rank in ranks:
        straight, resumed = rank[f"straight-{kind}"], rank[f"resumed-{kind}"]
        assert same(resumed["model"], straight["model"]) and same(resumed["ema"], straight["ema"])
        assert resumed["counters"] == straight["counters"] == (16, 16)
    # The control: the same resume with a fresh average ends with the same weights and another average.
    for rank in ranks:
        assert same(rank["control"]["model"], rank["straight-dcp"]["model"])
        assert not same(rank["control"]["ema"], rank["straight-dcp"]["ema"])


def test_each_rank_keeps_the_average_of_its_own_shards(runs: tuple[Path, list[dict], dict]) -> None:
    _, ranks, _ = runs
    for rank in ranks:
        shapes = {k: tuple(v.shape) for k, v in rank["straight-dcp"]["ema"].items()}
        assert shapes == {k: tuple(v.shape) for k, v in rank["straight-dcp"]["model"].items()}
        assert shapes["net.0.weight"] == (8, 8)  # half of (16, 8)


@pytest.mark.parametrize("kind", ["dcp", "file"])
def test_checkpoints_saved_during_the_ema_evaluation_hold_the_live_weights_and_the_average(
    runs: tuple[Path, list[dict], dict], kind: str, tmp_path: Path
) -> None:
    out, _, truth = runs
    paths = sorted((out / f"straight-{kind}").iterdir())
    assert [p.name for p in paths] == [f"epoch={e}.ckpt" for e in range(4)]
    for path in paths:
        assert path.is_dir() == (kind == "dcp")
        checkpoint = read(path, tmp_path)
        live, average = truth[kind][checkpoint["global_step"]]
        assert not same(live, average)
        state = checkpoint["callbacks"][KEY]["ema"]
        assert state["layout"]["net.0.weight"] == "Shard(dim=0) over a mesh of 2 ranks"
        # checkpoint_weights="ema": the weights are the average, the live weights are in the callback state
        assert same({k: checkpoint["state_dict"][k] for k in average}, average)
        if kind == "dcp":  # each tensor's key in the directory, where every rank wrote its shards
            assert state["shadow"]["net.0.weight"] == "net.0.weight"  # the weights' own entry: written once
            assert checkpoint["callbacks"][KEY]["live"]["net.0.weight"] == f"{KEY}/live/net.0.weight"
            saved = {name: checkpoint["state_dict"][key] for name, key in state["shadow"].items()}
            saved_live = {
                name: checkpoint["state_dict"][key] for name, key in checkpoint["callbacks"][KEY]["live"].items()
            }
        else:  # gathered into full tensors for the one file
            saved, saved_live = state["shadow"], checkpoint["callbacks"][KEY]["live"]
        assert same(saved, average) and same({k: saved_live[k] for k in live}, live)


def test_the_control_saving_inside_the_ema_pass_loses_the_live_weights(
    runs: tuple[Path, list[dict], dict], tmp_path: Path
) -> None:
    out, _, truth = runs
    checkpoint = read(out / "unfixed" / "epoch=1.ckpt", tmp_path)
    live, average = truth["unfixed"][checkpoint["global_step"]]
    keys = checkpoint["callbacks"][KEY]["live"]
    saved_live = {name: checkpoint["state_dict"][key] for name, key in keys.items()}
    assert same({k: saved_live[k] for k in average}, average)  # the average, saved as the live weights
    assert not same({k: saved_live[k] for k in live}, live)
