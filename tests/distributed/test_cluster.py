"""The cluster path: Hydra's submitit launcher. SLURM cannot run here, so its config is composed, the launcher
instantiated and the sbatch script it would submit rendered; the same launcher's local executor really runs."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from tests.conftest import CONF_DIR, ROOT, env_without_checkout

submitit = pytest.importorskip("submitit", reason="the cluster extra: pip install -e '.[cluster]'")

MULTI_NODE = ("trainer=ddp", "trainer.accelerator=gpu", "trainer.num_nodes=2", "trainer.devices=8")


def slurm_launcher_params(*overrides: str) -> dict:
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["+recipe=gan", "hydra/launcher=slurm", *overrides], return_hydra_config=True)
    launcher = instantiate(cfg.hydra.launcher)
    assert type(launcher).__name__ == "SlurmLauncher"
    return dict(launcher.params)


def test_slurm_allocation_follows_the_trainer_group() -> None:
    params = slurm_launcher_params(*MULTI_NODE, "hydra.launcher.partition=gpu")
    assert (params["nodes"], params["tasks_per_node"], params["gpus_per_node"]) == (2, 8, 8)
    assert params["partition"] == "gpu"
    # Control: the allocation is read from the trainer group, not fixed in the launcher config.
    single = slurm_launcher_params("trainer=ddp", "trainer.devices=4")
    assert (single["nodes"], single["tasks_per_node"]) == (1, 4)


def test_the_sbatch_script_asks_for_what_the_trainer_uses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher's parameters, passed to submitit's SLURM executor as the launcher passes them."""
    srun = tmp_path / "bin" / "srun"  # submitit refuses to build a SLURM executor where srun is missing
    srun.parent.mkdir()
    srun.write_text("#!/bin/sh\n")
    srun.chmod(srun.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{srun.parent}{os.pathsep}{os.environ['PATH']}")
    params = slurm_launcher_params(*MULTI_NODE, "hydra.launcher.partition=gpu")
    executor = submitit.AutoExecutor(cluster="slurm", folder=tmp_path / "submitit")
    base = {"timeout_min", "cpus_per_task", "gpus_per_node", "tasks_per_node", "mem_gb", "nodes", "name",
            "stderr_to_stdout"}  # fmt: skip
    skip = {"submitit_folder", "max_num_timeout"}
    executor.update_parameters(
        **{k if k in base else f"slurm_{k}": v for k, v in params.items() if k not in skip}
    )  # unknown names would raise here
    script = executor._executor._make_submission_file_text("python train.py", "uid")
    for line in ("--nodes=2", "--ntasks-per-node=8", "--gpus-per-node=8", "--partition=gpu", "--time=240"):
        assert f"#SBATCH {line}" in script, line


def test_the_local_submitit_executor_runs_a_recipe(tmp_path: Path) -> None:
    """As the guide runs it: from the clone's root, with nothing of the checkout on ``PYTHONPATH``. The job is a
    fresh process that unpickles the task: it finds the installed ``copy_correct`` and the clone's ``recipes``."""
    result = subprocess.run(
        [sys.executable, "train.py", "-m", "+recipe=metrics", "hydra/launcher=submitit_local",
         "trainer.max_epochs=1", "trainer.enable_progress_bar=false", f"hydra.sweep.dir={tmp_path / 'metrics'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env_without_checkout(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    (summary,) = (tmp_path / "metrics").glob("0/summary.json")
    assert json.loads(summary.read_text())["metrics"]["val/acc"] > 0.5
    assert list(summary.parent.parent.glob(".submitit/*/*_result.pkl"))  # it went through submitit
    (job_log,) = summary.parent.parent.glob(".submitit/*/*_log.err")
    log = job_log.read_text()
    assert "GPU available" in log  # the control: the log holds what Lightning printed in the job
    for expected in ("exists and is not empty", "isinstance(treespec, LeafSpec)"):  # train.py's ignored warnings
        assert expected not in log, expected
    assert OmegaConf.load(summary.parent / ".hydra" / "hydra.yaml").hydra.launcher._target_.endswith("LocalLauncher")
