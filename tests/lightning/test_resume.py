"""ResumeState: the global generators' states round-trip through a weights_only checkpoint, are restored
only at ``on_train_start``, each rank from its own entry, and, given a recipe, a checkpoint of another recipe or
seed (or none of ours) is refused; without one (a user's own Trainer) any is taken.

The data order of a user's own module resumed in a real Trainer is in ``test_resume_any_module.py``; the recipes'
end-to-end resume (killed runs) in ``tests/recipes/test_resume.py``; under DDP, where the ranks' states are gathered
into the checkpoint, in ``tests/distributed/test_ddp.py``."""

from __future__ import annotations

import random
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from copy_correct.lightning import ResumeState, check_checkpoint
from copy_correct.lightning.resume import get_rng_state, set_rng_state
from tests.conftest import CUDA


def draws() -> tuple[torch.Tensor, float, float]:
    return torch.rand(3), float(np.random.randn()), random.random()  # randn: NumPy's cached Gaussian too


def same(a: tuple[torch.Tensor, float, float], b: tuple[torch.Tensor, float, float]) -> list[bool]:
    return [torch.equal(a[0], b[0]), a[1] == b[1], a[2] == b[2]]


def test_generator_states_round_trip_through_a_weights_only_file(tmp_path: Path) -> None:
    torch.manual_seed(1)
    np.random.seed(1)
    random.seed(1)
    np.random.randn()  # leaves the second Gaussian of a pair cached in NumPy's state
    torch.save({"callbacks": {"ResumeState": ResumeState("alpha", 1).state_dict()}}, tmp_path / "a.ckpt")
    expected = draws()
    saved = torch.load(tmp_path / "a.ckpt", weights_only=True)["callbacks"]["ResumeState"]
    assert same(draws(), expected) == [False, False, False]  # the control: the generators moved on
    set_rng_state(saved["rng"][0])  # one process: one entry
    assert same(draws(), expected) == [True, True, True]


@pytest.mark.gpu
@CUDA
def test_cuda_generator_state_round_trips() -> None:
    torch.cuda.init()
    state = get_rng_state()
    expected = torch.rand(3, device="cuda")
    assert not torch.equal(torch.rand(3, device="cuda"), expected)  # the control
    set_rng_state(state)
    assert torch.equal(torch.rand(3, device="cuda"), expected)


def trainer(rank: int, world_size: int) -> SimpleNamespace:
    return SimpleNamespace(global_rank=rank, world_size=world_size, train_dataloader=None)  # no loaders to order


def test_states_are_restored_at_train_start_not_when_loaded() -> None:
    state = ResumeState("alpha", 0).state_dict()
    expected = draws()
    callback = ResumeState("alpha", 0)
    callback.load_state_dict(state)
    moved = draws()  # building the run, a sanity check: draws that the uninterrupted run did not make
    callback.on_train_start(trainer(0, 1), None)  # type: ignore[arg-type]
    assert torch.equal(draws()[0], expected[0]) and not torch.equal(moved[0], expected[0])
    callback.on_train_start(trainer(0, 1), None)  # type: ignore[arg-type]  # once only
    assert not torch.equal(draws()[0], expected[0])


def test_a_state_loaded_before_this_fits_setup_is_not_restored() -> None:
    """``trainer.validate(ckpt_path=...)`` loads the callback states too, and never starts training: a later ``fit``
    (whose ``setup`` comes before any checkpoint of its own is loaded) must not restore them."""
    state = ResumeState().state_dict()
    expected = draws()
    callback = ResumeState()
    callback.load_state_dict(state)
    callback.setup(trainer(0, 1), None, "fit")  # type: ignore[arg-type]
    callback.on_train_start(trainer(0, 1), None)  # type: ignore[arg-type]
    assert not torch.equal(draws()[0], expected[0])


def stamp_of_ranks(*seeds: int) -> tuple[dict, list[torch.Tensor]]:
    """A checkpoint stamp whose rank r's torch generator was seeded with ``seeds[r]``, and each one's next draw."""
    states, nexts = [], []
    for seed in seeds:
        torch.manual_seed(seed)
        states.append(get_rng_state())
        nexts.append(torch.rand(3))
    return {"recipe": "alpha", "seed": 0, "rng": states}, nexts


def test_each_rank_restores_its_own_entry() -> None:
    stamp, (next0, next1) = stamp_of_ranks(10, 11)
    assert not torch.equal(next0, next1)  # the control: rank 0's state on rank 1 would draw other numbers
    for rank, expected in enumerate([next0, next1]):
        callback = ResumeState("alpha", 0)
        callback.load_state_dict(stamp)
        callback.on_train_start(trainer(rank, 2), None)  # type: ignore[arg-type]
        assert torch.equal(torch.rand(3), expected), rank


def test_a_rank_the_checkpoint_has_no_entry_for_keeps_its_states_with_a_warning() -> None:
    stamp, (next0,) = stamp_of_ranks(10)
    for rank in (0, 1):
        callback = ResumeState("alpha", 0)
        callback.load_state_dict(stamp)
        torch.manual_seed(99)
        fresh = torch.rand(3)
        torch.manual_seed(99)
        with pytest.warns(UserWarning, match="states for 1 process\\(es\\), this run has 2.*not bit-exact"):
            callback.on_train_start(trainer(rank, 2), None)  # type: ignore[arg-type]
        assert torch.equal(torch.rand(3), [next0, fresh][rank]), rank


@pytest.mark.parametrize(
    ("recipe", "seed", "message"),
    [
        ("beta", 0, "it holds a run of recipe 'alpha', not 'beta': resume it with +recipe=alpha"),
        ("alpha", 3, "seed=0, not seed=3"),
    ],
)
def test_another_runs_checkpoint_is_refused(recipe: str, seed: int, message: str, tmp_path: Path) -> None:
    state = ResumeState("alpha", 0).state_dict()
    torch.save({"callbacks": {"ResumeState": state}}, tmp_path / "alpha.ckpt")
    with pytest.raises(ValueError, match=re.escape(message)):
        ResumeState(recipe, seed).load_state_dict(state)
    with pytest.raises(ValueError, match=re.escape(message)):
        check_checkpoint(tmp_path / "alpha.ckpt", recipe, seed)
    check_checkpoint(tmp_path / "alpha.ckpt", "alpha", 0)  # the control: its own run's
    ResumeState("alpha", 0).load_state_dict(state)


def test_without_a_recipe_any_runs_checkpoint_resumes_and_a_recipe_refuses_one_of_no_recipe(tmp_path: Path) -> None:
    """A user's own Trainer: ``ResumeState()`` stamps no recipe and checks none; ``train.py``'s, given a recipe,
    refuses such a checkpoint with one line (the control: the same stamp with the recipe's name is taken)."""
    ResumeState().load_state_dict(ResumeState("alpha", 0).state_dict())
    theirs = ResumeState().state_dict()
    assert (theirs["recipe"], theirs["seed"]) == (None, None)
    torch.save({"callbacks": {"ResumeState": theirs}}, tmp_path / "user.ckpt")
    message = "it holds a run of no recipe (a ResumeState without one), not of 'alpha'"
    with pytest.raises(ValueError, match=re.escape(message)):
        ResumeState("alpha", None).load_state_dict(theirs)
    with pytest.raises(ValueError, match=re.escape(message)):
        check_checkpoint(tmp_path / "user.ckpt", "alpha", None)
    ResumeState("alpha", None).load_state_dict({**theirs, "recipe": "alpha"})


def test_a_distributed_checkpoint_is_checked_by_its_meta_pt(tmp_path: Path) -> None:
    """Lightning's ModelParallelStrategy writes a directory: the shards (torch.distributed.checkpoint's files and
    ``.metadata``) and everything else, our stamp included, in ``meta.pt``; ``AtomicModelParallelStrategy`` adds
    ``digests.json``, without which the shards cannot be verified."""
    import torch.distributed.checkpoint as dcp

    from copy_correct.files.shard_digest import write_digests

    directory = tmp_path / "last.ckpt"
    directory.mkdir()
    torch.save({"callbacks": {"ResumeState": ResumeState("alpha", 0).state_dict()}}, directory / "meta.pt")
    with pytest.raises(ValueError, match=r"a directory without meta\.pt and \.metadata, not a distributed checkpoint"):
        check_checkpoint(directory, "alpha", 0)  # no .metadata: not written by torch.distributed.checkpoint
    dcp.save({"w": torch.ones(3)}, checkpoint_id=directory, no_dist=True)
    with pytest.raises(ValueError, match=r"has no digests\.json .*its shards cannot be verified"):
        check_checkpoint(directory, "alpha", 0)  # Lightning's own strategy's directory: nothing to verify against
    write_digests(directory)
    check_checkpoint(directory, "alpha", 0)
    with pytest.raises(ValueError, match="seed=0, not seed=3"):
        check_checkpoint(directory, "alpha", 3)
    with pytest.raises(ValueError, match=r"a directory without meta\.pt"):
        check_checkpoint(tmp_path, "alpha", 0)  # the control: any other directory


def test_files_that_are_not_our_checkpoints_are_refused(tmp_path: Path) -> None:
    (tmp_path / "text.ckpt").write_text("not a checkpoint")
    torch.save({"state_dict": {}}, tmp_path / "plain.ckpt")
    torch.save(
        {"callbacks": {"ResumeState": {"recipe": "alpha", "seed": 0}}, "x": Path("/")}, tmp_path / "pickled.ckpt"
    )
    truncated = (tmp_path / "plain.ckpt").read_bytes()
    (tmp_path / "truncated.ckpt").write_bytes(truncated[: len(truncated) // 2])
    for name, message in [
        ("text", "is not the zip archive torch.save writes"),
        ("truncated", "is not the zip archive torch.save writes"),
        ("plain", "no ResumeState stamp"),
        ("pickled", r"names pathlib\.PosixPath in its pickle, which a weights_only load refuses"),
    ]:
        with pytest.raises(ValueError, match=message):
            check_checkpoint(tmp_path / f"{name}.ckpt", "alpha", 0)
