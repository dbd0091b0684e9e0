"""Evaluation never moves training, in every recipe: a short run that evaluates after every epoch (``dqn``: after every
round) ends in the training state, bit for bit, of the same run evaluating once, at its end. Compared: everything the
checkpoint the run ends with holds but the records of its evaluations (weights, optimizer states, EMA shadows, the
target network, the replay buffer, the data order, the environment and the global generators' states), and every
training value the run logged on the way (``train/...``).

Each test has its control: the run that evaluates often, with one way evaluation used to reach training put back (the
isolation of validation switched off, the greedy episodes as they were, a validation left in train mode, a validation
that feeds a training metric). It must end elsewhere than the run that evaluates once: the comparison sees what it
guards against.
The evaluation data draw nothing from the global generators either: ``pinned``'s validation images, the image folder's
images for the ``gan`` judge (each against a control that does draw).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from recipes.build import build
from recipes.data.digits import load_digits_split
from recipes.data.image_folder import ImageFolderDataModule
from recipes.data.pinned_digits import AugmentedDigits
from recipes.dqn import DQN
from recipes.ema import NoisyClassifier
from recipes.metrics import DigitsClassifier
from tests.conftest import ON_CPU, QUIET, compose_config, write_images
from tests.state_differences import differences, present

# Short runs: 3 epochs of 3 batches, validation on one batch.
EPOCHS = ("trainer.max_epochs=3", "trainer.limit_train_batches=3", "trainer.limit_val_batches=1")
RUNS = {
    "gan": (*EPOCHS, "model.eval_samples=100", "model.judge_epochs=1"),
    "ema": EPOCHS,
    "metrics": EPOCHS,
    # 32x32 images made in this process (no workers): their augmentation draws from the global generator
    "pinned": (*EPOCHS, "data.num_workers=0", "data.size=32", "data.batch_size=32"),
    "dqn": (
        "model.total_env_steps=1024", "model.learning_starts=512", "model.eval_episodes=2", "model.gradient_steps=16",
        "model.target_update_every=16", "model.buffer_size=768",
    ),  # 4 rounds of 256 steps, 2 of them learning; the buffer wraps around
}  # fmt: skip
OFTEN, ONCE = ("trainer.check_val_every_n_epoch=1",), ("trainer.check_val_every_n_epoch=3",)
DQN_OFTEN, DQN_ONCE = ("model.eval_every=256",), ("model.eval_every=1024",)
# What each recipe's training state must hold, so that comparing it is not comparing nothing.
GAN_EMA = "callbacks/EMAWeights{'decay': 0.999, 'module': 'generator'}"  # the average, and the live weights it replaced
MUST_HOLD = {
    "gan": [
        f"{GAN_EMA}/ema/shadow/generator.net.0.weight",
        f"{GAN_EMA}/live/generator.net.0.weight",
        "optimizer_states/1/state",
    ],
    "ema": ["callbacks/EMAWeights{'decay': 0.995}/ema/shadow/net.body.2.running_mean", "optimizer_states/0/state"],
    "metrics": ["state_dict/net.0.weight", "optimizer_states/0/state"],
    "pinned": ["state_dict/net.0.weight", "optimizer_states/0/state", "PinnedDigitsDataModule/shuffle"],
    "dqn": ["state_dict/target.net.0.weight", "replay_buffer/obs", "dqn/rng", "dqn/sampler", "dqn/curve"],
}
ALWAYS = ["callbacks/ResumeState/rng/0/torch", "callbacks/ResumeState/rng/0/numpy"]
LOGGED = {
    "gan": {"train/d_loss", "train/g_loss"}, "ema": {"train/loss"}, "metrics": {"train/loss", "train/acc"},
    "pinned": {"train/loss", "train/acc"}, "dqn": {"train/td_loss", "train/episode_return"},
}  # fmt: skip


class TrainingLog(pl.Callback):
    """Every training value logged (``train/...``), as the trainer holds them after each batch and at the end."""

    def __init__(self) -> None:
        self.values: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.record(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.record(trainer)

    def record(self, trainer: pl.Trainer) -> None:
        self.values.append({k: v.clone() for k, v in trainer.callback_metrics.items() if k.startswith("train/")})


def training_state(recipe: str, tmp_path: Path, *overrides: str) -> dict[str, Any]:
    """Train as ``python train.py +recipe=RECIPE`` would (on the CPU); the checkpoint the run ends with, less the
    records of its evaluations (the loops' counters, ``ModelCheckpoint``'s scores, the schedule in the hyperparameters,
    ``dqn``'s returns), with the logged training values under ``logged``."""
    cfg = compose_config(f"+recipe={recipe}", ON_CPU, *QUIET, *RUNS[recipe], *overrides, output_dir=tmp_path)
    trainer, model, datamodule = build(cfg)
    log = TrainingLog()
    trainer.callbacks.append(log)
    trainer.fit(model, datamodule=datamodule)
    trainer.save_checkpoint(tmp_path / "end.ckpt")
    state = torch.load(tmp_path / "end.ckpt", weights_only=True)
    for key in ("loops", "hyper_parameters"):
        del state[key]
    state["callbacks"] = {k: v for k, v in state["callbacks"].items() if not k.startswith("ModelCheckpoint")}
    state.get("dqn", {}).pop("evals", None)
    state["logged"] = log.values
    return state


def assert_same_training(recipe: str, often: dict[str, Any], once: dict[str, Any]) -> None:
    for path in ALWAYS + MUST_HOLD[recipe]:
        assert present(once, path), path
    assert LOGGED[recipe] <= set(once["logged"][-1])
    assert differences(often, once) == []


def moved(often: dict[str, Any], once: dict[str, Any]) -> list[str]:
    """Where the control's training state differs from the run's that evaluates once: weights, and the rest."""
    found = differences(often, once)
    assert any(d.startswith(("/state_dict/", f"/{GAN_EMA}/live/", "/logged/")) for d in found), found
    return found


def test_gan_validating_every_epoch_trains_as_validating_once(tmp_path: Path) -> None:
    """The issue's report: ``train/d_loss`` and the weights moved with ``check_val_every_n_epoch``. The validation
    loader's iterator drew its base seed from the generator the latents and the discriminator's dropout come from."""
    once = training_state("gan", tmp_path / "once", *ONCE)
    assert_same_training("gan", training_state("gan", tmp_path / "often", *OFTEN), once)
    control = training_state("gan", tmp_path / "control", *OFTEN, "callbacks.isolated_evaluation=null")
    assert "/callbacks/ResumeState/rng/0/torch" in moved(control, once)


def test_pinned_validating_every_epoch_trains_as_validating_once(tmp_path: Path) -> None:
    """With the augmentation made in this process (``data.num_workers=0``) it draws from the global generator, which
    the validation loader's iterator drew from."""
    once = training_state("pinned", tmp_path / "once", *ONCE)
    assert_same_training("pinned", training_state("pinned", tmp_path / "often", *OFTEN), once)
    control = training_state("pinned", tmp_path / "control", *OFTEN, "callbacks.isolated_evaluation=null")
    assert "/callbacks/ResumeState/rng/0/torch" in moved(control, once)


def test_dqn_evaluating_every_round_trains_as_evaluating_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy episodes play on an environment and seeds of their own, draw nothing from the exploration generator and
    run the Q-network in eval mode. The control: the episodes as they were, each action the training loop's
    epsilon-greedy choice at epsilon 0, whose coin is still tossed on the exploration generator once per step."""
    once = training_state("dqn", tmp_path / "once", *DQN_ONCE)
    assert_same_training("dqn", training_state("dqn", tmp_path / "often", *DQN_OFTEN), once)

    def greedy_return_drawing_from_rng(self: DQN) -> float:
        returns = []
        for episode in range(self.hparams.eval_episodes):
            obs, _ = self.eval_env.reset(seed=self.hparams.seed + 10_000 + episode)
            total, done = 0.0, False
            while not done:
                coin = self.rng.random() < 0.0  # tossed, never heads: the draw alone moves rng
                action = int(self.rng.integers(self.env.action_space.n)) if coin else self.greedy_action(obs)
                obs, reward, terminated, truncated, _ = self.eval_env.step(action)
                total += float(reward)
                done = terminated or truncated
            returns.append(total)
        return float(np.mean(returns))

    monkeypatch.setattr(DQN, "greedy_return", greedy_return_drawing_from_rng)
    control = training_state("dqn", tmp_path / "control", *DQN_OFTEN)
    assert "/dqn/rng/state/state" in moved(control, once)


def test_ema_validating_every_epoch_trains_as_validating_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both of ``EMAWeights``'s passes (the average, then the live weights) run in eval mode and put the live weights
    back bit for bit. The control: a validation left in train mode, whose batches move the BatchNorm statistics of the
    weights being trained (and so the average of them)."""
    once = training_state("ema", tmp_path / "once", *ONCE)
    assert_same_training("ema", training_state("ema", tmp_path / "often", *OFTEN), once)
    monkeypatch.setattr(NoisyClassifier, "on_validation_model_eval", lambda self: None)
    control = training_state("ema", tmp_path / "control", *OFTEN)
    assert "/callbacks/EMAWeights{'decay': 0.995}/live/net.body.2.running_mean" in moved(control, once)


def test_metrics_validating_every_epoch_trains_as_validating_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Validation has metric objects of its own. The control: a validation step that also feeds the training
    accuracy, which then reports validation batches as training ones."""
    once = training_state("metrics", tmp_path / "once", *ONCE)
    assert_same_training("metrics", training_state("metrics", tmp_path / "often", *OFTEN), once)
    validation_step = DigitsClassifier.validation_step

    def validation_step_feeding_train_acc(self: DigitsClassifier, batch: Any, batch_idx: int) -> None:
        self.train_acc.update(self(batch[0]), batch[1])
        validation_step(self, batch, batch_idx)

    monkeypatch.setattr(DigitsClassifier, "validation_step", validation_step_feeding_train_acc)
    control = training_state("metrics", tmp_path / "control", *OFTEN)
    assert any(d.startswith("/logged/") and d.endswith("/train/acc") for d in moved(control, once))


def test_pinned_validation_images_are_the_same_every_time_and_draw_nothing() -> None:
    """3-channel validation images are tinted from generators of their own. The control: the training images'
    augmentation draws from the global generator (as it should: it is training's)."""
    train_set, val_set = load_digits_split()
    plain = AugmentedDigits(*val_set.tensors, size=16, max_shift=2, augment=False, channels=3)
    before = torch.get_rng_state()
    first = [plain[i][0] for i in range(4)]
    assert torch.equal(torch.get_rng_state(), before)
    assert all(torch.equal(image, plain[i][0]) for i, image in enumerate(first))
    AugmentedDigits(*train_set.tensors, size=16, max_shift=2, channels=3)[0]
    assert not torch.equal(torch.get_rng_state(), before)


def test_the_image_folder_evaluation_images_draw_nothing(tmp_path: Path) -> None:
    """``eval_images`` (the ``gan`` recipe's judge images and Frechet floor, read when the fit starts and when the first
    validation ends) goes through a loader with a generator of its own. The control: a plain loader over the same
    images draws its base seed from the global generator."""
    root = write_images(tmp_path / "images", 8, size=16, channels=3, classes=2)
    data = ImageFolderDataModule(str(root), image_size=16, channels=3, num_workers=0)
    before = torch.get_rng_state()
    data.eval_images("train", 4)
    data.eval_images("val", 4)
    assert torch.equal(torch.get_rng_state(), before)
    list(DataLoader(data.val_set))
    assert not torch.equal(torch.get_rng_state(), before)
