"""``PowerEMA`` and post-hoc EMA on an FSDP2-sharded model, 2 CPU processes over gloo
(``tests/workers/sharded_power_ema.py``): profiles equal bit for bit to the unsharded ones of the same run, 1/N of
them per rank, no collective and no allocation per update, each rank's snapshots in files of its own, synthesized
shard by shard with no collective into the shards of the unsharded reconstruction; full states loaded per rank, and a
state or snapshots spread otherwise refused. Control: the profiles gathered are whole, where a rank keeps its shard."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import run_rank_script

WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    ranks = run_rank_script("sharded_power_ema.py", tmp_path_factory.mktemp("sharded_power_ema"))
    assert len(ranks) == WORLD
    return ranks


def same(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> bool:
    return state.keys() == expected.keys() and all(torch.equal(state[k], v) for k, v in expected.items())


def test_the_sharded_profiles_equal_the_unsharded_ones_and_a_rank_keeps_its_shards(ranks: list[dict]) -> None:
    for rank in ranks:
        assert all(same(p, r) for p, r in zip(rank["profiles"], rank["reference"], strict=True))
    whole = ranks[0]["reference"][0]
    assert set(ranks[0]["local_shapes"]) == {k for k in whole if "running" not in k and "num_batches" not in k}
    for name, size in ((k, v.shape[0]) for k, v in whole.items() if k in ranks[0]["local_shapes"]):
        rows = [rank["local_shapes"][name][0] for rank in ranks]
        assert sum(rows) == size and max(rows) == (size + 1) // 2  # each rank keeps its rows, none the whole


def test_an_update_issues_no_collective_and_allocates_nothing(ranks: list[dict]) -> None:
    assert all(rank["update_collectives"] == 0 and rank["update_bytes"] == 0 for rank in ranks)


def test_each_rank_snapshots_its_shards_and_synthesizes_them_with_no_collective(ranks: list[dict]) -> None:
    expected = [f"power-ema-{t:09d}-rank{r}of2.pt" for t in (2, 4, 6) for r in range(WORLD)]
    assert ranks[0]["files"] == sorted(expected)
    for rank in ranks:
        assert rank["synthesis_collectives"] == 0
        assert same(rank["synthesized"], rank["expected"])  # the shards of the unsharded reconstruction


def test_a_full_state_is_loaded_per_rank_and_other_spreads_are_refused(ranks: list[dict]) -> None:
    for rank in ranks:
        assert all(same(p, r) for p, r in zip(rank["loaded"], rank["reference"], strict=True))
        assert "is Replicate() over a mesh of 2 ranks, the model's is Shard(dim=0) over a mesh of 2" in rank["refusal"]
        assert "synthesize(snapshot_paths(directory, rank=r), ...)" in rank["directory_refusal"]
        assert "different shards (rank 0 of 2, rank 1 of 2)" in rank["both_ranks_refusal"]
