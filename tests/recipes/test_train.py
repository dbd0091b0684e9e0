"""The entry point: recipe selection, config groups, run outputs, seeding, multirun (bad input: test_bad_input.py)."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import warnings
from datetime import datetime, timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from recipes.build import build, ignore_expected_warnings
from recipes.launch import available_recipes, recipe_argument_error
from tests.conftest import ON_CPU, child_env, compose_config, run_train, warning_lines

ROOT = Path(__file__).resolve().parents[2]
QUICK = ["trainer.max_epochs=2", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]


def test_recipe_list_comes_from_conf() -> None:
    assert available_recipes() == sorted(p.stem for p in (ROOT / "conf" / "recipe").glob("*.yaml"))
    assert recipe_argument_error(["+recipe=metrics"]) is None
    assert recipe_argument_error(["--help"]) is None


@pytest.mark.parametrize("recipe", available_recipes())
@pytest.mark.parametrize("trainer", ["default", "cpu", "gpu", "ddp"])
@pytest.mark.parametrize("logger", ["csv", "tensorboard"])
def test_every_recipe_composes_with_every_group(recipe: str, trainer: str, logger: str, tmp_path: Path) -> None:
    cfg = compose_config(f"+recipe={recipe}", f"trainer={trainer}", f"logger={logger}", output_dir=tmp_path)
    assert cfg.recipe.name == recipe
    assert cfg.trainer._target_ == "lightning.pytorch.Trainer"
    assert "csv" in cfg.logger  # summary.json and the tests read the CSV metrics under every logger choice
    assert {"model_checkpoint", "run_summary"} <= set(cfg.callbacks)
    assert cfg.callbacks.run_summary.recipe == recipe
    if trainer == "ddp":
        assert cfg.trainer.strategy == "ddp" and cfg.trainer.devices == 2


def test_recipe_objects_instantiate_from_config(tmp_path: Path) -> None:
    cfg = compose_config("+recipe=metrics", "trainer=cpu", output_dir=tmp_path)
    trainer, model, datamodule = build(cfg)
    assert type(model).__name__ == "DigitsClassifier" and datamodule is not None
    names = {type(c).__name__ for c in trainer.callbacks}
    assert {"ModelCheckpoint", "RunSummary", "GraphRetentionCheck"} <= names
    assert Path(instantiate(cfg.logger.csv).log_dir) == tmp_path


def test_run_writes_metrics_checkpoints_and_summary(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = run_train("+recipe=metrics", "seed=3", *QUICK, f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert warning_lines(result.stderr) == []
    assert f"outputs: {run_dir}" in result.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["recipe"] == "metrics" and summary["seed"] == 3
    assert summary["epochs"] == 2 and summary["global_step"] == 2 * 23
    assert {"train/loss", "train/acc", "val/loss", "val/acc", "val/auroc"} <= set(summary["metrics"])
    assert all(isinstance(v, float) for v in summary["metrics"].values())
    assert Path(summary["checkpoints"]["last"]).is_file() and Path(summary["checkpoints"]["best"]).is_file()
    with open(run_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    last_val_acc = [float(r["val/acc"]) for r in rows if r["val/acc"]][-1]
    assert last_val_acc == pytest.approx(summary["metrics"]["val/acc"])
    assert (run_dir / ".hydra" / "config.yaml").is_file()


def test_seed_makes_cpu_runs_repeatable(tmp_path: Path) -> None:
    def metrics(seed: int, name: str) -> dict[str, float]:
        result = run_train("+recipe=metrics", f"seed={seed}", ON_CPU, *QUICK, f"hydra.run.dir={tmp_path / name}")
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads((tmp_path / name / "summary.json").read_text())["metrics"]

    first, again, other = metrics(1, "a"), metrics(1, "b"), metrics(2, "c")
    assert first == again
    assert first != other


def test_multirun_sweeps_into_one_directory_per_job(tmp_path: Path) -> None:
    result = run_train(
        "-m", "+recipe=metrics", "seed=0,1", "trainer.max_steps=3", *QUICK[1:], f"hydra.sweep.dir={tmp_path}"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    seeds = sorted(json.loads((tmp_path / job / "summary.json").read_text())["seed"] for job in ("0", "1"))
    assert seeds == [0, 1]


def test_runs_started_in_the_same_second_get_their_own_directories() -> None:
    hydra_conf = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "config.yaml").hydra, resolve=False)
    patterns = [re.fullmatch(r".*\$\{now:([^}]*)\}", hydra_conf[mode]["dir"])[1] for mode in ("run", "sweep")]
    started = datetime(2026, 1, 31, 12, 0, 0, 481516)
    for pattern in patterns:
        assert started.strftime(pattern) != (started + timedelta(microseconds=1)).strftime(pattern)
    # Control: named to the second, they would share one directory (and the second run's CSV logger would
    # delete the first one's metrics.csv).
    assert started.strftime("%Y-%m-%d_%H-%M-%S") == (started + timedelta(microseconds=1)).strftime("%Y-%m-%d_%H-%M-%S")


def test_default_run_reaches_95_percent_validation_accuracy(tmp_path: Path) -> None:
    """The recipe exactly as shipped (20 epochs, guard on), only without the progress bar."""
    result = run_train("+recipe=metrics", "trainer.enable_progress_bar=false", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    print(f"default metrics run: val/acc {summary['metrics']['val/acc']:.4f} in {summary['wall_s']} s")
    assert summary["metrics"]["val/acc"] >= 0.95


def test_lightnings_advice_for_more_workers_is_silenced_on_a_many_core_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a machine with more than three cores (the GPU machine has 16) Lightning advises more workers for every
    recipe's loader; this machine has 2, so the test gives Lightning 16. Control: without the recipes' filter, the
    warning is there."""
    from lightning.pytorch.trainer.connectors.data_connector import _worker_check
    from torch.utils.data import DataLoader

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    trainer = SimpleNamespace(num_devices=1)
    for filtered in (False, True):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if filtered:
                ignore_expected_warnings()
            _worker_check(trainer, DataLoader(range(8)), "train_dataloader")  # type: ignore[arg-type]
        advice = [w for w in caught if "does not have many workers" in str(w.message)]
        assert len(advice) == (0 if filtered else 1)


def test_float32_matmul_precision_comes_from_the_config(tmp_path: Path) -> None:
    before = torch.get_float32_matmul_precision()
    try:
        cfg = compose_config("+recipe=metrics", output_dir=tmp_path)
        assert cfg.float32_matmul_precision == "high"
        torch.set_float32_matmul_precision("highest")
        build(cfg)
        assert torch.get_float32_matmul_precision() == "high"
        build(compose_config("+recipe=metrics", "float32_matmul_precision=highest", output_dir=tmp_path))
        assert torch.get_float32_matmul_precision() == "highest"
        a, b = torch.randn(256, 256, generator=torch.Generator().manual_seed(0)).chunk(2)
        full = a @ b.T
        torch.set_float32_matmul_precision("high")
        assert torch.equal(a @ b.T, full)  # "high" leaves CPU matmuls in full float32, as the config says
        assert not torch.equal((a.double() @ b.T.double()).float(), full)  # the control: rounding shows
    finally:
        torch.set_float32_matmul_precision(before)


def test_child_processes_keep_the_machines_own_python_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU machine without registry access provides hydra-core on PYTHONPATH; the processes the tests start (DDP
    ranks, killed writers, starters' suites) must keep it. Control: ``PYTHONPATH=ROOT`` alone, as the tests set it
    before, loses it."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "machine_package.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", str(site))
    probe = [sys.executable, "-c", "import machine_package, recipes"]  # recipes: found only in this checkout
    assert subprocess.run(probe, cwd=tmp_path, env=child_env()).returncode == 0
    old = {**os.environ, "PYTHONPATH": str(ROOT)}
    assert subprocess.run(probe, cwd=tmp_path, env=old, capture_output=True).returncode != 0
