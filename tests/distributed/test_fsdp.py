"""``trainer=fsdp`` (Lightning's ``ModelParallelStrategy``, FSDP2) with 2 CPU processes (gloo), through ``train.py``:
the recipes that shard their network run with one run directory, synchronised metrics and distributed checkpoints;
the ``ema`` recipe's average is per rank, the shards of one average; a checkpoint of another world size is refused
with one line; the recipes that cannot run sharded say so; and (slow) a killed sharded run resumes bit for bit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from copy_correct.lightning import AtomicCheckpointIO, AtomicModelParallelStrategy, atomic_sharded_checkpoint
from recipes.build import build
from recipes.launch import checkpoint_to_resume
from tests.conftest import QUIET, ROOT, child_env, compose_config, free_port, warning_lines
from tests.distributed.test_ddp import RANK_LOCAL, SHORT, assert_same_tensors, rank_callbacks
from tests.recipes.test_resume import differences

FSDP = ["trainer=fsdp", "trainer.accelerator=cpu"]  # 2 gloo processes: CPU-only by nature, like trainer=ddp's tests
DCP_FILES = [".metadata", "__0_0.distcp", "__1_0.distcp", "digests.json", "meta.pt"]
KEY = "EMAWeights{'decay': 0.995}"
FIRST = "net.body.1.weight"  # the first Linear of the ema recipe's MLP (body.0 is its Flatten)


def command(recipe: str, cwd: Path, *extra: str) -> list[str]:
    replaced = {override.split("=")[0] for override in extra}
    short = [override for override in SHORT[recipe] if override.split("=")[0] not in replaced]
    return [
        sys.executable, str(ROOT / "train.py"), f"+recipe={recipe}", *FSDP, *short, *QUIET, *extra,
        *rank_callbacks(cwd / "ranks"),
    ]  # fmt: skip


def run_fsdp(recipe: str, cwd: Path, *extra: str) -> tuple[subprocess.CompletedProcess[str], dict, dict]:
    """Train ``recipe`` sharded over 2 gloo processes from ``cwd``, once: the run must exit 0 with both ranks' process
    group ended (``end_process_group``); what each rank ended with. (The group's threads may outlive it, idle: a
    ``DTensor`` keeps its backend from C++, out of Python's reach.)"""
    env = child_env(PYTHONUNBUFFERED="1", MASTER_PORT=free_port())
    result = subprocess.run(command(recipe, cwd, *extra), cwd=cwd, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    load = lambda name: torch.load(cwd / "ranks" / f"{name}.pt", weights_only=True)  # noqa: E731
    assert not load("exit0")["group"] and not load("exit1")["group"]
    return result, load("rank0"), load("rank1")


def one_run_directory(cwd: Path, recipe: str) -> Path:
    """One Hydra run directory for both ranks, with one summary and checkpoints that are distributed checkpoints."""
    assert sorted(p.name for p in cwd.iterdir()) == ["outputs", "ranks"]
    (run,) = (cwd / "outputs" / recipe).iterdir()
    checkpoints = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert checkpoints in (["epoch001.ckpt", "last.ckpt"], ["epoch000.ckpt", "last.ckpt"])
    for name in checkpoints:
        assert sorted(p.name for p in (run / "checkpoints" / name).iterdir()) == DCP_FILES  # each rank's shards
    assert (run / "summary.json").is_file() and (run / "train_ddp_process_1.log").is_file()
    return run


def assert_synchronised(rank0: dict, rank1: dict) -> None:
    """Gathered weights alike on both ranks, metrics over the whole validation set (each rank validated half)."""
    assert_same_tensors(rank0["model"], rank1["model"])
    assert_same_tensors(rank0["metrics"], rank1["metrics"], skip=RANK_LOCAL)
    seen0, correct0, _ = rank0["local"].tolist()
    seen1, correct1, _ = rank1["local"].tolist()
    assert seen0 == seen1 == 180
    assert float(rank0["metrics"]["val/acc"]) == pytest.approx((correct0 + correct1) / 360, abs=1e-6)


@pytest.fixture(scope="module")
def ema_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str], dict, dict]:
    cwd = tmp_path_factory.mktemp("ema")
    return cwd, *run_fsdp("ema", cwd)


def test_the_ema_recipe_keeps_the_shards_of_one_average_per_rank(
    ema_run: tuple[Path, subprocess.CompletedProcess[str], dict, dict], tmp_path: Path
) -> None:
    cwd, result, rank0, rank1 = ema_run
    run = one_run_directory(cwd, "ema")
    assert_synchronised(rank0, rank1)
    assert_same_tensors(rank0["ema"], rank1["ema"])  # gathered: one average
    halves = {k: (-(-v.shape[0] // 2), *v.shape[1:]) for k, v in rank0["ema"].items() if k.endswith("weight")}
    assert len(halves) == 5  # the recipe's two Linear, two BatchNorm and one head weights
    for rank in (rank0, rank1):  # each rank holds half of every averaged weight
        assert {k: tuple(v.shape) for k, v in rank["ema_local"].items() if k.endswith("weight")} == halves
    assert not torch.equal(rank0["ema_local"][FIRST], rank1["ema_local"][FIRST])
    dcp_to_torch_save(run / "checkpoints" / "last.ckpt", tmp_path / "last.pt")  # the shards, joined
    saved = torch.load(tmp_path / "last.pt", weights_only=True)["state_dict"]
    assert torch.equal(saved[FIRST], rank0["ema"][FIRST])  # the weights are the average
    assert f"{KEY}/live/{FIRST}" in saved and f"{KEY}/ema/shadow/{FIRST}" not in saved  # written once
    assert warning_lines(result.stderr) == []


@pytest.mark.parametrize("recipe", ["metrics", pytest.param("pinned", marks=pytest.mark.slow)])
def test_the_other_classifiers_run_sharded(recipe: str, tmp_path: Path) -> None:
    _, rank0, rank1 = run_fsdp(recipe, tmp_path)
    one_run_directory(tmp_path, recipe)
    assert_synchronised(rank0, rank1)


@pytest.mark.slow  # two processes each; the refusals themselves are checked in-process in the recipes' tests
@pytest.mark.parametrize(("recipe", "message"), [
    ("dqn", "recipe dqn runs in one process: use trainer=default, cpu or gpu, not ddp or fsdp"),
    ("gan", "recipe gan does not run sharded: it alternates two networks"),
])  # fmt: skip
def test_recipes_that_cannot_run_sharded_say_so(recipe: str, message: str, tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), f"+recipe={recipe}", *FSDP, *QUIET, f"hydra.run.dir={tmp_path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=child_env(MASTER_PORT=free_port()),
    )  # fmt: skip
    assert result.returncode != 0
    assert message in result.stderr


def test_a_checkpoint_of_another_world_size_resumes_its_shards_read_at_the_new_spread(
    ema_run: tuple[Path, subprocess.CompletedProcess[str], dict, dict], tmp_path: Path
) -> None:
    """The run's distributed checkpoint (2 ranks) resumed by one process: ``torch.distributed.checkpoint`` reads the
    weights, the optimizer state and the average's shards at the new spread, and the run trains its third epoch
    (``tests/distributed/test_sharded_reshard.py`` compares the averages bit for bit)."""
    cwd = ema_run[0]
    (run,) = (cwd / "outputs" / "ema").iterdir()
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "+recipe=ema", *FSDP, *QUIET, "trainer.devices=1",
         "trainer.max_epochs=3", f"ckpt_path={run}", f"hydra.run.dir={tmp_path / 'one'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=child_env(MASTER_PORT=free_port()),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Restored all states from the checkpoint" in result.stderr + result.stdout
    summary = json.loads((tmp_path / "one" / "summary.json").read_text())
    assert summary["epochs"] == 3 and summary["metrics"]["val/acc_ema"] > 0.5, summary


def test_a_distributed_checkpoint_is_refused_under_another_trainer(
    ema_run: tuple[Path, subprocess.CompletedProcess[str], dict, dict], tmp_path: Path
) -> None:
    (run,) = (ema_run[0] / "outputs" / "ema").iterdir()
    for trainer in ("trainer=default", "trainer=ddp"):
        cfg = compose_config("+recipe=ema", trainer, f"ckpt_path={run}", output_dir=tmp_path)
        with pytest.raises(ValueError, match=r"is a distributed checkpoint \(a directory of shards\): resume it with"):
            checkpoint_to_resume(cfg)
    for path in (run, run / "checkpoints" / "last.ckpt"):  # the control: a run directory, a checkpoint directory
        cfg = compose_config("+recipe=ema", "trainer=fsdp", f"ckpt_path={path}", output_dir=tmp_path)
        assert checkpoint_to_resume(cfg) == str(run / "checkpoints" / "last.ckpt")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized")  # one process here
def test_one_file_checkpoints_go_through_atomic_checkpoint_io_and_directories_are_swapped_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What trainer=fsdp's strategy does with the trainer's CheckpointIO plugin, in this process (rank 0, no group):
    a file goes through the plugin; a directory is written beside its target and put in its place
    (``tests/lightning/test_atomic_sharded_checkpoint.py`` kills it midway)."""
    written: list[Path] = []
    monkeypatch.setattr(
        AtomicCheckpointIO, "save_checkpoint", lambda self, checkpoint, path, **kwargs: written.append(path)
    )
    swapped: list[tuple[str, str]] = []
    put_in_place = atomic_sharded_checkpoint.put_in_place
    monkeypatch.setattr(
        atomic_sharded_checkpoint, "put_in_place", lambda new, target: (swapped.append((new.name, target.name)),
                                                                        put_in_place(new, target)),
    )  # fmt: skip
    for one_file in (True, False):
        overrides = ("+recipe=ema", *FSDP, f"trainer.strategy.save_distributed_checkpoint={str(not one_file).lower()}")
        trainer, _, _ = build(compose_config(*overrides, output_dir=tmp_path))
        assert isinstance(trainer.strategy, AtomicModelParallelStrategy)
        assert isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO)
        path = tmp_path / f"{'file' if one_file else 'directory'}.ckpt"
        trainer.strategy.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "epoch": 0}, path)
        if one_file:
            assert written == [path] and swapped == []
        else:  # torch.distributed.checkpoint's files and torch.save's meta.pt, not the plugin
            assert written == [tmp_path / "file.ckpt"]
            assert swapped == [(f".directory.ckpt.tmp-{os.getpid()}", "directory.ckpt")]
            assert sorted(p.name for p in path.iterdir()) == [".metadata", "__0_0.distcp", "digests.json", "meta.pt"]


def read(path: Path, scratch: Path) -> dict:
    """A distributed checkpoint as one dict of full tensors (its shards joined) with its ``meta.pt``, less
    ModelCheckpoint's bookkeeping, which names the run directory."""
    dcp_to_torch_save(path, scratch)
    checkpoint = {**torch.load(scratch, weights_only=True), **torch.load(path / "meta.pt", weights_only=True)}
    checkpoint["callbacks"] = {k: v for k, v in checkpoint["callbacks"].items() if not k.startswith("ModelCheckpoint")}
    return checkpoint


@pytest.mark.slow
def test_a_killed_sharded_run_resumed_from_its_directory_ends_bit_for_bit_as_the_uninterrupted_one(
    tmp_path: Path,
) -> None:
    """As ``tests/recipes/test_resume.py`` for the ``ema`` recipe, sharded: SIGKILL to both processes once
    ``last.ckpt`` is whole (its ``meta.pt``, written last), resume from the run directory. The control resumes without
    the EMA state. (The data module's shuffle state, withheld in the unsharded test, plays no part here: under a
    multi-process strategy Lightning's DistributedSampler orders each epoch by seed and epoch.)"""
    args = ["+recipe=ema", "seed=0", *FSDP, *QUIET, "trainer.max_epochs=4"]

    def run(name: str, *extra: str) -> Path:
        result = subprocess.run(
            [sys.executable, str(ROOT / "train.py"), *args, f"hydra.run.dir={tmp_path / name}", *extra],
            cwd=ROOT, capture_output=True, text=True, timeout=600, env=child_env(MASTER_PORT=free_port()),
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        return tmp_path / name / "checkpoints" / "last.ckpt"

    killed = tmp_path / "killed"
    with open(tmp_path / "killed.log", "w") as log:
        process = subprocess.Popen(
            [sys.executable, str(ROOT / "train.py"), *args, f"hydra.run.dir={killed}"], cwd=ROOT, stdout=log,
            stderr=log, env=child_env(MASTER_PORT=free_port()), start_new_session=True,
        )  # fmt: skip
        while process.poll() is None and not (killed / "checkpoints" / "last.ckpt" / "meta.pt").exists():
            time.sleep(0.005)
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)  # both ranks: rank 1 is rank 0's child, in its session
        process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL, (tmp_path / "killed.log").read_text()[-3000:]
    at_kill = torch.load(killed / "checkpoints" / "last.ckpt" / "meta.pt", weights_only=True)
    assert not (killed / "summary.json").exists()

    final = read(run("full"), tmp_path / "full.pt")
    resumed = read(run("resumed", f"ckpt_path={killed}"), tmp_path / "resumed.pt")
    assert final["global_step"] == 4 * 45 and 0 < at_kill["global_step"] < final["global_step"]
    assert f"{KEY}/live/{FIRST}" in final["state_dict"]
    assert differences(final, resumed) == []

    without_ema_state = "callbacks.ema._target_=tests.workers.without_state.EMAWeightsWithoutState"
    control = read(run("control", f"ckpt_path={killed}", without_ema_state), tmp_path / "control.pt")
    assert sorted(differences(final["state_dict"], control["state_dict"])) == sorted(
        f"/{name}" for name in final["callbacks"][KEY]["ema"]["shadow"] if "num_batches" not in name
    )  # the same weights, another average (only the counter of BatchNorm batches, copied, is the same)
