"""``trainer=ddp`` with 2 CPU processes (gloo), through ``train.py``: every rank ends with the same weights and
EMA shadows, metrics are synchronised, there is one Hydra output directory and one set of checkpoints, and a
run resumed from a checkpoint ends on every rank as the uninterrupted one, per-rank generators included."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from copy_correct.averages.posthoc import load_snapshot
from tests.conftest import ROOT, child_env, free_port

SHORT = {
    "metrics": ["trainer.max_epochs=2"],
    "ema": ["trainer.max_epochs=2"],
    "pinned": ["trainer.max_epochs=2", "data.num_workers=0"],
    "gan": ["trainer.max_epochs=2", "trainer.check_val_every_n_epoch=1", "model.judge_epochs=2",
            "model.eval_samples=200"],
}  # fmt: skip


def run_ddp(recipe: str, cwd: Path, *extra: str) -> tuple[subprocess.CompletedProcess[str], dict, dict]:
    """Train ``recipe`` on 2 gloo processes from ``cwd`` (so Hydra makes its own run directory there), once: the run
    must exit 0 with both ranks' process group ended (``end_process_group``: no gloo thread left to the interpreter's
    exit). ``extra`` overrides replace the short run's own settings of the same keys."""
    replaced = {override.split("=")[0] for override in extra}
    short = [override for override in SHORT[recipe] if override.split("=")[0] not in replaced]
    command = [
        sys.executable, str(ROOT / "train.py"), f"+recipe={recipe}", "trainer=ddp", *short, *extra,
        "trainer.accelerator=cpu",  # 2 gloo processes: CPU-only by nature (one GPU could not hold two ranks)
        "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", *rank_callbacks(cwd / "ranks"),
    ]  # fmt: skip
    env = child_env(PYTHONUNBUFFERED="1", MASTER_PORT=free_port())
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    load = lambda name: torch.load(cwd / "ranks" / f"{name}.pt", weights_only=True)  # noqa: E731
    assert [load("exit0"), load("exit1")] == [{"group": False, "threads": []}] * 2
    return result, load("rank0"), load("rank1")


def rank_callbacks(dirpath: Path) -> list[str]:
    """The overrides that add the tests' callbacks: what each rank ended with (``rank{R}.pt``) and what was left to
    its exit (``exit{R}.pt``), in ``dirpath``."""
    return [
        "+callbacks.rank_state._target_=tests.workers.rank_state.SaveRankState",
        f"+callbacks.rank_state.dirpath={dirpath}",
        "+callbacks.exit_census._target_=tests.workers.exit_census.ExitCensus",
        f"+callbacks.exit_census.dirpath={dirpath}",
    ]


# Per-step values logged without sync_dist stay each rank's own (rank 0's are written): a collective per step
# would cost a synchronisation. Everything else is a torchmetrics object or logged with sync_dist.
RANK_LOCAL = {"train/loss", "train/d_loss", "train/g_loss"}


def assert_same_tensors(left: dict, right: dict, skip: set[str] = frozenset()) -> None:
    assert left.keys() == right.keys()
    for name in left.keys() - skip:
        assert torch.equal(left[name], right[name]), name


def assert_one_run_directory(cwd: Path, recipe: str, *folders: str) -> Path:
    """One Hydra run directory for both ranks, holding one set of checkpoints (and ``folders`` beside them) and one
    summary."""
    assert sorted(p.name for p in cwd.iterdir()) == ["outputs", "ranks"]
    (run,) = (cwd / "outputs" / recipe).iterdir()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) in (
        sorted(["epoch001.ckpt", "last.ckpt", *folders]), sorted(["epoch000.ckpt", "last.ckpt", *folders])
    )  # fmt: skip
    assert (run / "summary.json").is_file() and (run / "train_ddp_process_1.log").is_file()
    return run


@pytest.mark.parametrize("recipe", ["metrics", pytest.param("ema", marks=pytest.mark.slow),
                                    pytest.param("pinned", marks=pytest.mark.slow)])  # fmt: skip
def test_classifiers_end_identical_on_both_ranks_with_synchronised_metrics(recipe: str, tmp_path: Path) -> None:
    _, rank0, rank1 = run_ddp(recipe, tmp_path)
    assert_one_run_directory(tmp_path, recipe)
    assert_same_tensors(rank0["model"], rank1["model"])
    if recipe == "ema":
        assert_same_tensors(rank0["ema"], rank1["ema"])
    assert_same_tensors(rank0["metrics"], rank1["metrics"], skip=RANK_LOCAL)
    assert not torch.equal(rank0["metrics"]["train/loss"], rank1["metrics"]["train/loss"])  # control: rank-local
    assert torch.equal(rank0["rng"], rank1["rng"])  # Lightning seeds every rank alike (what the gan recipe undoes)
    seen0, correct0, loss0 = rank0["local"].tolist()
    seen1, correct1, loss1 = rank1["local"].tolist()
    assert seen0 == seen1 == 180  # each rank validated its own half of the 360 validation digits
    # Control: the two halves really differ; unsynchronised, each rank would log its own figure.
    assert loss0 / seen0 != pytest.approx(loss1 / seen1, rel=1e-6)
    assert float(rank0["metrics"]["val/acc"]) == pytest.approx((correct0 + correct1) / 360, abs=1e-6)
    assert float(rank0["metrics"]["val/loss"]) == pytest.approx((loss0 + loss1) / 360, rel=1e-4)


@pytest.fixture(scope="module")
def gan_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, dict]:
    """The short gan run under DDP (2 epochs), shared by the tests of this module that need it whole."""
    cwd = tmp_path_factory.mktemp("gan")
    _, rank0, rank1 = run_ddp("gan", cwd)
    return cwd, rank0, rank1


@pytest.mark.long  # the gan recipe under DDP: the metrics recipe's DDP run stays in the default suite
def test_gan_trains_under_ddp_with_identical_networks_and_generator_ema(gan_run: tuple[Path, dict, dict]) -> None:
    cwd, rank0, rank1 = gan_run
    run = assert_one_run_directory(cwd, "gan", "power_ema")
    # The post-hoc EMA's final snapshot, of a run shorter than its schedule: one file, written by rank 0 alone.
    (snapshot,) = (run / "checkpoints" / "power_ema").iterdir()
    assert re.fullmatch(r"power-ema-\d{9}\.pt", snapshot.name) and load_snapshot(snapshot)["final"] is True
    assert_same_tensors(rank0["model"], rank1["model"])
    assert_same_tensors(rank0["ema"], rank1["ema"])
    assert_same_tensors(rank0["metrics"], rank1["metrics"], skip=RANK_LOCAL)
    assert any(name.startswith("generator.") for name in rank0["model"])
    assert not torch.equal(rank0["rng"], rank1["rng"])  # each rank draws its own noise and dropout masks


@pytest.mark.slow  # three two-process runs; single-process resume and DDP training run by default
def test_gan_resumed_under_ddp_ends_on_each_rank_as_the_uninterrupted_run(
    gan_run: tuple[Path, dict, dict], tmp_path: Path
) -> None:
    _, *uninterrupted = gan_run
    first = tmp_path / "first"
    first.mkdir()
    run_ddp("gan", first, "trainer.max_epochs=1")
    (first_run,) = (first / "outputs" / "gan").iterdir()
    checkpoint = first_run / "checkpoints" / "last.ckpt"
    saved = torch.load(checkpoint, weights_only=True)["callbacks"]["ResumeState"]["rng"]
    assert len(saved) == 2 and not torch.equal(saved[0]["torch"], saved[1]["torch"])  # each rank's own

    def resumed_from(path: Path, name: str) -> list[dict]:
        cwd = tmp_path / name
        cwd.mkdir()
        _, rank0, rank1 = run_ddp("gan", cwd, f"ckpt_path={path}")
        return [rank0, rank1]

    for rank, (expected, got) in enumerate(zip(uninterrupted, resumed_from(first_run, "resumed"), strict=True)):
        assert_same_tensors(expected["model"], got["model"])
        assert_same_tensors(expected["ema"], got["ema"])
        assert torch.equal(expected["rng"], got["rng"]), rank

    # Control: rank 0's states restored on both ranks (what a single saved entry gives) end elsewhere.
    state = torch.load(checkpoint, weights_only=True)
    state["callbacks"]["ResumeState"]["rng"][1] = state["callbacks"]["ResumeState"]["rng"][0]
    torch.save(state, tmp_path / "rank0_everywhere.ckpt")
    rank0, rank1 = resumed_from(tmp_path / "rank0_everywhere.ckpt", "control")
    assert not torch.equal(rank1["rng"], uninterrupted[1]["rng"])
    assert any(not torch.equal(weights, uninterrupted[0]["model"][name]) for name, weights in rank0["model"].items())
