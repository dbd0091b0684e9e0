"""Resume after a crash: a run killed with SIGKILL once it has written a checkpoint, resumed with
``ckpt_path=<its run directory>``, ends bit for bit in the state of an uninterrupted run of the same length
and seed (CPU): weights, EMA shadows, target network, replay buffer, optimiser state, generator states.

The control resumes from the same checkpoint with one piece of the saved state withheld (the data order,
the global generators, the environment's episode): the same comparison then finds the weights different,
so each piece is needed and an equality here is not an empty one.

The ``ema`` run is killed at its first resume point by time (``train_time_interval=0``: after its first optimizer
step), long before its first epoch ends, where the old configuration had none; the resumed run's ``summary.json``
names the uninterrupted run's best, with its score. With a step interval, ``last.ckpt`` holds the step fit ended on
(the control, the old configuration, the last multiple of the interval)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from copy_correct.lightning import ResumeState
from copy_correct.lightning.resume_data_order import TrainDataOrder
from recipes.build import build
from recipes.data.digits import DigitsDataModule
from recipes.dqn import DQN
from tests.conftest import ON_CPU, QUIET, ROOT, compose_config, run_train
from tests.state_differences import differences, present

RUNS = {
    "ema": ["trainer.max_epochs=4"],
    "dqn": [
        "model.total_env_steps=2048", "model.learning_starts=512", "model.eval_every=768", "model.eval_episodes=2",
        "model.gradient_steps=16", "model.target_update_every=16", "model.buffer_size=1500",
    ],  # 8 rounds, last.ckpt after each round that trained (every gradient_steps); the buffer wraps around
    "gan": ["trainer.max_epochs=4", "trainer.check_val_every_n_epoch=1", "model.judge_epochs=2"],
    # Breakout as CleanRL trains it, small: lives lost (each an episode) before the checkpoint, the game going on
    "atari": [
        "+dqn=atari", "model.total_env_steps=600", "model.learning_starts=100", "model.buffer_size=1000",
        "model.eval_every=600", "model.eval_episodes=1", "model.target_update_every=10",
        "callbacks.model_checkpoint.every_n_train_steps=40", "callbacks.last_checkpoint.every_n_train_steps=40",
        "trainer.log_every_n_steps=1",
    ],
}  # fmt: skip
RECIPE = {"atari": "dqn"}  # a configuration of another recipe
POSTHOC_EMA = "callbacks/PostHocEMASnapshots{'sigma_rels': (0.05, 0.1), 'module': 'generator'}"
# What each recipe's checkpoint must hold, so that comparing it is not comparing nothing.
MUST_HOLD = {
    "ema": ["callbacks/EMAWeights{'decay': 0.995}/ema/shadow/net.body.1.weight", "DigitsDataModule/shuffle"],
    "dqn": ["state_dict/target.net.0.weight", "replay_buffer/obs", "dqn/rng", "dqn/episode_actions"],
    "gan": [
        "callbacks/EMAWeights{'decay': 0.999, 'module': 'generator'}/ema/shadow/generator.net.0.weight",
        "state_dict/judge.net.head.weight",
        "DigitsDataModule/shuffle",
        POSTHOC_EMA + "/power_ema/profiles/1/net.0.weight",  # the generator's post-hoc EMA profiles
    ],
    "atari": ["state_dict/target.net.0.weight", "replay_buffer/frames", "dqn/rng", "dqn/episode_actions"],
}
ALWAYS = ["state_dict", "optimizer_states/0/state", "callbacks/ResumeState/rng/0/torch", "loops"]
KILLED = {"ema": ["callbacks.last_checkpoint.train_time_interval=0"]}  # overrides of the killed run alone
# Optimizer steps in last.ckpt, written at fit's end (atari: one per round of 4 environment steps, from the 25th of
# the 150, when the replay holds learning_starts=100 transitions).
STEPS = {"ema": 4 * 90, "dqn": 7 * 16, "gan": 4 * 23 * 2, "atari": 150 - 24}
WITHHELD = {  # the control: resuming without these leaves the run elsewhere
    # the shuffle generator, kept by the data module and by ResumeState: epochs would repeat the first orders
    "ema": [(DigitsDataModule, "load_state_dict"), (TrainDataOrder, "on_train_start")],
    "dqn": [(DQN, "replay_episode")],  # the episode in progress: the environment would start a new one
    "gan": [(ResumeState, "on_train_start")],  # the global generators: other latents, other dropout masks
    "atari": [(DQN, "replay_episode")],  # the game in progress, lives lost and all
}


def train_command(recipe: str, run_dir: Path, *extra: str) -> list[str]:
    return [
        f"+recipe={RECIPE.get(recipe, recipe)}", "seed=0", ON_CPU, *QUIET, *RUNS[recipe], f"hydra.run.dir={run_dir}",
        *extra,
    ]  # fmt: skip


def resume_in_process(recipe: str, checkpoint: Path, output_dir: Path) -> Path:
    """What ``train.py ... ckpt_path=...`` does, in this process (so that a test can patch it)."""
    cfg = compose_config(
        f"+recipe={RECIPE.get(recipe, recipe)}", "seed=0", ON_CPU, *QUIET, *RUNS[recipe], output_dir=output_dir
    )
    trainer, model, datamodule = build(cfg)
    trainer.fit(model, datamodule=datamodule, ckpt_path=checkpoint, weights_only=True)
    return output_dir / "checkpoints" / "last.ckpt"


def run_until_killed(args: list[str], run_dir: Path) -> None:
    """Start ``train.py`` and SIGKILL it the moment ``checkpoints/last.ckpt`` exists: ``AtomicCheckpointIO``
    renames a whole file into place, so it is whole once it exists."""
    last = run_dir / "checkpoints" / "last.ckpt"
    with open(run_dir.parent / f"{run_dir.name}.log", "w") as log:
        process = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, stdout=log, stderr=log)
        while process.poll() is None and not last.exists():
            time.sleep(0.005)
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL, (run_dir.parent / f"{run_dir.name}.log").read_text()[-3000:]
    assert last.is_file() and not (run_dir / "summary.json").exists()  # killed mid-run, after a checkpoint


def load(path: Path) -> dict[str, Any]:
    """A checkpoint as written (weights_only: tensors and plain containers only), less ModelCheckpoint's own
    bookkeeping, which names the run directory and so differs between any two runs."""
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    checkpoint["callbacks"] = {k: v for k, v in checkpoint["callbacks"].items() if not k.startswith("ModelCheckpoint")}
    return checkpoint


NEEDS_ALE = pytest.mark.skipif(importlib.util.find_spec("ale_py") is None, reason="the atari extra (ale-py)")


# dqn's in the default suite (three runs of two Lightning processes at once, 15-20 s each on 2 cores); ema's (killed by
# time) and gan's in CI's long runs; atari's with the slow ones.
MARKS = {"dqn": (), "atari": [pytest.mark.slow, NEEDS_ALE]}


@pytest.mark.parametrize("recipe", [pytest.param(r, marks=MARKS.get(r, pytest.mark.long)) for r in RUNS])
def test_killed_run_resumed_from_its_directory_ends_bit_for_bit_as_the_uninterrupted_one(
    recipe: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    full, killed, resumed = tmp_path / "full", tmp_path / "killed", tmp_path / "resumed"
    with open(tmp_path / "full.log", "w") as log:
        uninterrupted = subprocess.Popen(
            [sys.executable, str(ROOT / "train.py"), *train_command(recipe, full)], cwd=ROOT, stdout=log, stderr=log
        )
        run_until_killed(train_command(recipe, killed, *KILLED.get(recipe, [])), killed)
        assert uninterrupted.wait(timeout=600) == 0, (tmp_path / "full.log").read_text()[-3000:]
    at_kill = load(killed / "checkpoints" / "last.ckpt")
    result = run_train(*train_command(recipe, resumed, f"ckpt_path={killed}"))
    assert result.returncode == 0, result.stderr[-3000:]

    if recipe == "atari":  # the game in progress had lost lives before the checkpoint: its replay repeats them
        assert (at_kill["dqn"]["episode_actions"] == -1).any()
    final, final_resumed = load(full / "checkpoints" / "last.ckpt"), load(resumed / "checkpoints" / "last.ckpt")
    assert final["global_step"] == STEPS[recipe] and 0 < at_kill["global_step"] < STEPS[recipe]
    for path in ALWAYS + MUST_HOLD[recipe]:
        assert present(final, path), path
    assert differences(final, final_resumed) == []
    if recipe == "ema":  # killed at a resume point by time, before the first epoch's 90 steps ended
        assert at_kill["global_step"] < 90
    summaries = [json.loads((run / "summary.json").read_text())["checkpoints"] for run in (full, resumed)]
    assert summaries[1]["best_score"] == summaries[0]["best_score"]
    assert (Path(summaries[1]["best"]).name if summaries[1]["best"] else None) == (
        Path(summaries[0]["best"]).name if summaries[0]["best"] else None
    )

    for owner, name in WITHHELD[recipe]:
        monkeypatch.setattr(owner, name, lambda *args: None)
    if recipe == "atari":  # a new game's frames do not continue the stream the replay holds: the buffer refuses them
        with pytest.raises(ValueError, match="does not continue its stream"):
            resume_in_process(recipe, killed / "checkpoints" / "last.ckpt", tmp_path / "control")
        return
    control = load(resume_in_process(recipe, killed / "checkpoints" / "last.ckpt", tmp_path / "control"))
    assert control["global_step"] == STEPS[recipe]
    assert any(d.startswith("/state_dict/") for d in differences(final, control))


OLD_LAST_CHECKPOINT = [  # conf/callbacks/default.yaml's last_checkpoint before LastCheckpoint: a ModelCheckpoint
    "callbacks.last_checkpoint._target_=lightning.pytorch.callbacks.ModelCheckpoint",
    "~callbacks.last_checkpoint.train_time_interval", "+callbacks.last_checkpoint.monitor=null",
    "+callbacks.last_checkpoint.save_top_k=1", "+callbacks.last_checkpoint.save_on_train_epoch_end=true",
    "+callbacks.last_checkpoint.enable_version_counter=false",
]  # fmt: skip


@pytest.mark.parametrize("control", [False, True])
def test_with_a_step_interval_last_holds_the_step_fit_ended_on(control: bool, tmp_path: Path) -> None:
    """Issue 39's run: ``every_n_train_steps=7`` and 20 steps. ``LastCheckpoint`` saves at the epoch's end as well;
    the old ``ModelCheckpoint`` stops at step 14."""
    cfg = compose_config(
        "+recipe=metrics", ON_CPU, *QUIET, "trainer.max_epochs=1", "trainer.limit_train_batches=20",
        "callbacks.last_checkpoint.every_n_train_steps=7", *(OLD_LAST_CHECKPOINT if control else []),
        output_dir=tmp_path,
    )  # fmt: skip
    trainer, model, datamodule = build(cfg)
    trainer.fit(model, datamodule=datamodule)
    assert trainer.global_step == 20
    assert torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == (
        14 if control else 20
    )
