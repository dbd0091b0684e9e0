"""Recipe `dqn`: the target network stays frozen and current through real training; a short run writes
its outputs; another environment is one override (``env.id=``) and one that a DQN cannot act in is refused in one
line; the Atari configuration plays Breakout into a frame replay with the Nature network (a short run: slow); the
default run solves CartPole and the stated Acrobot settings solve Acrobot (slow)."""

from __future__ import annotations

import importlib.util
import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from copy_correct import CheckpointMismatch, FrameReplayBuffer, make_target
from copy_correct.probes import MemoryProbe, storage_key
from recipes.atari import NatureQNetwork
from recipes.build import build
from recipes.dqn import DQN, QNetwork, plot_returns
from tests.conftest import QUIET, compose_config, run_train, warning_lines

SHORT = [
    "model.total_env_steps=1536", "model.learning_starts=512", "model.eval_every=768", "model.eval_episodes=2",
    "model.gradient_steps=16", "model.target_update_every=16", "model.buffer_size=2048",
]  # fmt: skip
# Acrobot-v1's settings, as docs/recipes/dqn.md states them (rl-baselines3-zoo's, with updates in rounds of 256 steps)
ACROBOT = [
    "env.id=Acrobot-v1", "model.total_env_steps=60000", "model.lr=6.3e-4", "model.batch_size=128",
    "model.buffer_size=50000", "model.learning_starts=1000", "model.train_freq=256", "model.gradient_steps=128",
    "model.target_update_every=64", "model.exploration_fraction=0.12", "model.exploration_final_eps=0.1",
]  # fmt: skip


def test_target_stays_frozen_current_and_in_its_own_storage_through_training(tmp_path: Path) -> None:
    trainer, model, _ = build(compose_config("+recipe=dqn", *QUIET, *SHORT, output_dir=tmp_path))
    target_storage = {name: storage_key(t) for name, t in model.target.state_dict().items()}
    trainer.fit(model)
    assert model.updates == 5 * 16  # rounds 2..6 of 256 steps trained: learning starts at 512 steps
    assert not model.target.training and model.q.training  # Lightning's .train() did not thaw the target
    for p in model.target.parameters():
        assert not p.requires_grad and p.grad is None and p.grad_fn is None
    optimized = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
    assert optimized == {id(p) for p in model.q.parameters()}
    assert {name: storage_key(t) for name, t in model.target.state_dict().items()} == target_storage  # in place
    for name, value in model.q.state_dict().items():  # the last of the 48 updates ended with a hard update
        assert torch.equal(model.target.state_dict()[name], value), name


# One round of 512 steps, then a single update of 256 transitions (no target update before it), then one episode of
# greedy evaluation: the TD target the recipe's loop computes, caught on its way into the loss.
ONE_UPDATE = [
    "model.total_env_steps=512", "model.train_freq=512", "model.learning_starts=512", "model.gradient_steps=1",
    "model.batch_size=256", "model.eval_every=512", "model.eval_episodes=1",
]  # fmt: skip


def fit_one_update(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *overrides: str, target_requires_grad: bool = False
) -> tuple[DQN, dict, dict]:
    """A run of ``ONE_UPDATE``: the model, the batch its update sampled, and what its loss was given (``value``,
    ``td_target``), as ``training_step`` passed them. ``target_requires_grad``: the target's weights made to require
    gradients first, as a plain copy's would."""
    trainer, model, _ = build(compose_config("+recipe=dqn", *QUIET, *ONE_UPDATE, *overrides, output_dir=tmp_path))
    model.target.requires_grad_(target_requires_grad)
    sampled, given = {}, {}
    sample, loss = model.buffer.sample, F.smooth_l1_loss

    def sample_spy(*args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        sampled.update(sample(*args, **kwargs))
        return sampled

    def loss_spy(value: torch.Tensor, td_target: torch.Tensor, **options: Any) -> torch.Tensor:
        given.update(value=value, td_target=td_target, **options)
        return loss(value, td_target, **options)

    monkeypatch.setattr(model.buffer, "sample", sample_spy)
    monkeypatch.setattr(F, "smooth_l1_loss", loss_spy)
    trainer.fit(model)
    assert model.updates == 1 and given  # one update, before the first target update (every 128)
    return model, sampled, given


def test_no_gradient_reaches_the_target_and_the_naive_copy_is_the_control(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The TD target is computed under ``no_grad``: even a target whose weights require gradients (a plain copy's)
    gets none and leaves no graph; ``make_target``'s weights require none in the first place."""
    model, batch, given = fit_one_update(tmp_path, monkeypatch, target_requires_grad=True)
    assert given["value"].grad_fn is not None  # the online network's values carry the graph the update needs
    assert given["td_target"].grad_fn is None and not given["td_target"].requires_grad  # the target's carry none
    assert all(p.grad is None for p in model.target.parameters())
    assert all(p.grad is not None for p in model.q.parameters())

    naive = make_target(model.q).requires_grad_(True)  # the control: a plain copy, bootstrap without no_grad
    next_value = naive(batch["next_obs"]).max(dim=1).values
    value = model.q(batch["obs"]).gather(1, batch["action"].unsqueeze(1)).squeeze(1)
    (value - (batch["reward"] + 0.99 * next_value)).square().mean().backward()
    assert all(p.grad is not None for p in naive.parameters())  # the target would be trained too


def test_n_step_returns_bootstrap_by_the_batchs_discounts_not_by_gamma(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, batch, given = fit_one_update(tmp_path, monkeypatch, "model.n_steps=3")
    assert (model.buffer.n_steps, model.buffer.gamma) == (3, 0.99)
    discounts = sorted(set(batch["discounts"].tolist()))  # 0.99**3, and less where an episode's end cut the window
    assert np.allclose(discounts, [0.99**3, 0.99**2, 0.99], rtol=1e-6)
    next_value = model.target(batch["next_obs"]).max(dim=1).values  # the target the update used: no update since
    alive = (~batch["terminated"]).float()
    assert torch.equal(given["td_target"], batch["reward"] + batch["discounts"] * alive * next_value)
    control = batch["reward"] + 0.99 * alive * next_value  # one step's bootstrap
    assert not torch.allclose(given["td_target"], control)


def test_prioritized_replay_weights_the_loss_and_gives_the_drawn_rows_their_td_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, batch, given = fit_one_update(tmp_path, monkeypatch, "model.prioritized=true", "model.priority_eps=0.001")
    tree = model.buffer._priorities
    assert given["reduction"] == "none" and batch["weights"].shape == (256,)  # each transition's loss, then weighted
    errors = (given["value"] - given["td_target"]).detach().abs() + 0.001
    last = dict(zip(batch["indices"].tolist(), errors.tolist(), strict=True))  # a row drawn twice keeps its last
    assert np.allclose([tree._leaves[row] for row in last], [error**0.6 for error in last.values()])
    untouched = np.setdiff1d(np.arange(512), list(last))
    assert np.all(tree._leaves[untouched] == 1.0)  # the rows not drawn keep a new row's priority
    plain, uniform, plain_given = fit_one_update(tmp_path / "uniform", monkeypatch)  # the control: the default
    assert plain.buffer._priorities is None and "weights" not in uniform and "reduction" not in plain_given


def collect(model: DQN, rounds: int) -> None:
    """``rounds`` of ``training_step`` before learning starts, with no trainer: ``train_freq`` environment steps each,
    played and stored as a run plays and stores them (what it logs goes nowhere)."""
    assert len(model.buffer) + rounds * model.hparams.train_freq < model.hparams.learning_starts
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"You are trying to `self.log\(\)` but the `self.trainer`")
        for round_number in range(rounds):
            model.training_step(round_number, round_number)


def test_checkpoint_resumes_the_episode_in_progress_and_refuses_one_it_cannot_replay(tmp_path: Path) -> None:
    model = DQN(seed=0, train_freq=100)
    collect(model, 1)  # several random-policy episodes and one in progress
    assert model.env.start is not None and model.env.actions
    checkpoint = {"state_dict": model.state_dict()}  # as Lightning writes it, less what DQN does not read
    model.on_save_checkpoint(checkpoint)
    torch.save(checkpoint, tmp_path / "dqn.ckpt")
    checkpoint = torch.load(tmp_path / "dqn.ckpt", weights_only=True)
    resumed, fresh = DQN(seed=0, train_freq=100), DQN(seed=0, train_freq=100)  # fresh, the control: no DQN state
    for dqn in (resumed, fresh):
        dqn.load_state_dict(checkpoint["state_dict"])
    resumed.on_load_checkpoint(checkpoint)
    for dqn in (model, resumed, fresh):
        collect(dqn, 3)
    assert np.array_equal(resumed.obs, model.obs) and not np.array_equal(fresh.obs, model.obs)
    assert resumed.curve == model.curve and resumed.env_steps == model.env_steps == 400
    assert torch.equal(resumed.buffer.next_obs[:400], model.buffer.next_obs[:400])

    checkpoint["dqn"]["obs"][0] += 1e-3
    with pytest.raises(RuntimeError, match="did not reach the checkpoint's observation"):
        DQN(seed=0).on_load_checkpoint(checkpoint)


def test_short_run_writes_summary_curve_and_a_weights_only_checkpoint(tmp_path: Path) -> None:
    result = run_train("+recipe=dqn", "trainer.enable_progress_bar=false", *SHORT, f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert warning_lines(result.stderr) == []  # eval-mode target and post-update checkpoints are intended
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["recipe"] == "dqn"
    assert {"eval/return", "eval/best_return", "train/episode_return"} <= set(summary["metrics"])
    assert (tmp_path / "return_curve.png").stat().st_size > 10_000
    checkpoint = torch.load(summary["checkpoints"]["last"], weights_only=True)
    assert checkpoint["dqn"]["env_steps"] == 1536
    assert checkpoint["replay_buffer"]["size"] == 1536
    assert any(key.startswith("target.") for key in checkpoint["state_dict"])


def test_the_pre_optimization_snapshot_lightnings_warning_suggests_keeps_a_copy_per_step() -> None:
    """Why the recipe silences that warning: its example keeps ``{k: v.detach().clone()}`` of the whole
    ``state_dict`` per batch index in a dict nothing empties, so a run holds one copy of the weights per step.
    Checkpointing after the round, as the recipe does, keeps none (the control)."""
    q = QNetwork(4, 2, 256)
    optimizer = torch.optim.Adam(q.parameters())
    weights = sum(t.numel() * t.element_size() for t in q.state_dict().values())

    def step(batch_idx: int, saved_models: dict[int, dict[str, torch.Tensor]] | None) -> None:
        loss = q(torch.randn(32, 4)).pow(2).mean()
        if saved_models is not None:
            saved_models[batch_idx] = {k: v.detach().clone() for k, v in q.state_dict().items()}
        optimizer.zero_grad(set_to_none=False)  # gradients kept in place: a step leaves no new storage
        loss.backward()
        optimizer.step()

    step(0, None)  # gradients and Adam's state exist from here on
    with MemoryProbe("cpu") as recipe_way:
        for batch_idx in range(20):
            step(batch_idx, None)
    suggested: dict[int, dict[str, torch.Tensor]] = {}
    with MemoryProbe("cpu") as lightning_way:
        for batch_idx in range(20):
            step(batch_idx, suggested)
    assert recipe_way.net_bytes == 0
    assert lightning_way.net_bytes == 20 * weights


def test_the_best_checkpoint_holds_the_policy_that_earned_its_score(tmp_path: Path) -> None:
    trainer, model, _ = build(compose_config("+recipe=dqn", *QUIET, *SHORT, output_dir=tmp_path))
    trainer.fit(model)
    best = torch.load(trainer.checkpoint_callback.best_model_path, weights_only=True)
    score = float(trainer.checkpoint_callback.best_model_score)
    assert (best["dqn"]["env_steps"], score) in best["dqn"]["evals"]  # written in the round it was evaluated
    restored = DQN(**{k: v for k, v in best["hyper_parameters"].items() if not k.startswith("_")})
    restored.load_state_dict(best["state_dict"])
    assert restored.greedy_return() == score


class _TwoProcessTrainer:
    world_size = 2


def test_more_than_one_process_is_refused_in_setup() -> None:
    """What Lightning calls on each rank before training; the subprocess test below (slow) runs it under DDP."""
    model, trainer = DQN(), _TwoProcessTrainer()
    model.trainer = trainer  # type: ignore[assignment]
    with pytest.raises(ValueError, match="recipe dqn runs in one process: use trainer=default, cpu or gpu"):
        model.setup("fit")


@pytest.mark.slow  # two processes, each importing Lightning
def test_ddp_is_refused_with_a_clear_message(tmp_path: Path) -> None:
    result = run_train("+recipe=dqn", "trainer=ddp", *SHORT, f"hydra.run.dir={tmp_path}")
    assert result.returncode != 0
    assert "recipe dqn runs in one process" in result.stderr


def test_bad_hyperparameters_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"model\.tau must be in \(0, 1\], got 0\.0"):
        DQN(tau=0.0)
    with pytest.raises(ValueError, match=r"model\.batch_size must be >= 1"):
        DQN(batch_size=0)


def test_env_id_and_model_env_id_both_choose_the_environment(tmp_path: Path) -> None:
    assert compose_config("+recipe=dqn", output_dir=tmp_path).model.env_id == "CartPole-v1"
    assert compose_config("+recipe=dqn", "env.id=Acrobot-v1", output_dir=tmp_path).model.env_id == "Acrobot-v1"
    assert compose_config("+recipe=dqn", "model.env_id=Acrobot-v1", output_dir=tmp_path).model.env_id == "Acrobot-v1"


def test_a_short_run_on_acrobot_sizes_everything_from_its_spaces(tmp_path: Path) -> None:
    cfg = compose_config("+recipe=dqn", "env.id=Acrobot-v1", *QUIET, *SHORT, output_dir=tmp_path)
    trainer, model, _ = build(cfg)
    trainer.fit(model)
    assert model.hparams.env_id == "Acrobot-v1" and model.reward_threshold == -100.0  # Acrobot-v1's spec
    assert (model.q.net[0].in_features, model.q.net[-1].out_features) == (6, 3)  # 6 observations, 3 actions
    assert model.buffer.obs.shape == (2048, 6) and model.buffer.obs.dtype == torch.float32
    assert model.updates == 5 * 16 and [step for step, _ in model.evals] == [768, 1536]
    assert all(-500.0 <= value <= 0.0 for _, value in model.evals)  # -1 per step, 500 steps at most
    assert (tmp_path / "return_curve.png").is_file()


@pytest.mark.parametrize(
    ("env_id", "said"),
    [
        ("Pendulum-v1", "has a continuous action space (Box(-2.0, 2.0, (1,), float32)); recipe dqn needs a Discrete"),
        ("FrozenLake-v1", "has Discrete(16) observations; recipe dqn needs a Box"),
        ("NoSuchEnv-v0", "cannot be made: Environment `NoSuchEnv` doesn't exist; try"),
    ],
)
def test_environments_a_dqn_cannot_act_in_are_refused_in_one_line(env_id: str, said: str) -> None:
    with pytest.raises(ValueError) as refused:
        DQN(env_id=env_id)
    message = str(refused.value)
    assert message.startswith(f"model.env_id={env_id} (env.id) {said}"), message
    assert "CartPole-v1, Acrobot-v1, MountainCar-v0" in message and "\n" not in message


def test_a_continuous_environment_stops_train_py_with_one_error_line(tmp_path: Path) -> None:
    result = run_train("+recipe=dqn", "env.id=Pendulum-v1", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2
    assert result.stderr.startswith("error: model.env_id=Pendulum-v1 (env.id) has a continuous action space (Box(")
    assert len(result.stderr.splitlines()) == 1  # nothing else: no traceback, no warning
    assert not (tmp_path / "checkpoints").exists()


def test_a_checkpoint_of_another_environment_is_refused() -> None:
    checkpoint = {"state_dict": DQN(seed=0).state_dict()}
    DQN(seed=0).on_save_checkpoint(checkpoint)
    with pytest.raises(CheckpointMismatch, match=r"it is a run on CartPole-v1 and this run's env\.id .* is Acrobot-v1"):
        DQN(env_id="Acrobot-v1", seed=0).on_load_checkpoint(checkpoint)
    del checkpoint["dqn"]["env_id"]  # as checkpoints written before env.id existed: CartPole runs
    with pytest.raises(CheckpointMismatch, match="it is a run on CartPole-v1"):
        DQN(env_id="Acrobot-v1", seed=0).on_load_checkpoint(checkpoint)


def test_the_plot_is_written_with_or_without_a_reward_threshold(tmp_path: Path) -> None:
    curve, evals = [(200, -200.0), (400, -150.0)], [(400, -120.0)]
    plot_returns(curve, evals, tmp_path / "with.png", "Acrobot-v1", -100.0)
    plot_returns(curve, evals, tmp_path / "without.png", "NoThreshold-v0", None)
    assert (tmp_path / "with.png").is_file() and (tmp_path / "without.png").is_file()


@pytest.mark.slow
def test_default_run_solves_cartpole_within_50k_steps(tmp_path: Path) -> None:
    result = run_train("+recipe=dqn", "seed=0", "trainer.enable_progress_bar=false", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((tmp_path / "summary.json").read_text())["metrics"]
    print(f"dqn seed 0: best eval return {metrics['eval/best_return']}, solved at {metrics.get('eval/solved_at_step')}")
    assert metrics["eval/best_return"] >= 475
    assert metrics["eval/solved_at_step"] <= 50_000


@pytest.mark.slow
def test_the_stated_acrobot_settings_solve_it_within_60k_steps(tmp_path: Path) -> None:
    """A greedy mean return of at least -100, Acrobot-v1's reward threshold, by the run's end (60,000 steps)."""
    result = run_train(
        "+recipe=dqn", *ACROBOT, "seed=0", "trainer.enable_progress_bar=false", f"hydra.run.dir={tmp_path}"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((tmp_path / "summary.json").read_text())["metrics"]
    print(f"Acrobot seed 0: best eval return {metrics['eval/best_return']}, solved at {metrics['eval/solved_at_step']}")
    assert metrics["eval/best_return"] >= -100
    assert metrics["eval/solved_at_step"] <= 60_000


NEEDS_ALE = pytest.mark.skipif(importlib.util.find_spec("ale_py") is None, reason="the atari extra (ale-py)")
# The Atari configuration, small: a short run that learns, evaluates and checkpoints (its replay included).
ATARI = [
    "+dqn=atari", "model.total_env_steps=400", "model.learning_starts=100", "model.buffer_size=1000",
    "model.eval_every=400", "model.eval_episodes=1", "callbacks.model_checkpoint.every_n_train_steps=25",
    "callbacks.last_checkpoint.every_n_train_steps=25", "trainer.log_every_n_steps=1",
]  # fmt: skip


@NEEDS_ALE
def test_the_atari_configuration_plays_breakout_into_a_frame_replay_with_the_nature_network(tmp_path: Path) -> None:
    """CleanRL's dqn_atari.py settings: uint8 stacks of 4 84x84 frames, each frame kept once; a million transitions
    would take 7.2 GB, where the whole-stack buffer of the other environments takes 56.5 GB (docs/recipes/dqn.md)."""
    model = build(compose_config("+recipe=dqn", "+dqn=atari", "model.buffer_size=20000", output_dir=tmp_path))[1]
    assert model.env.observation_space.shape == (4, 84, 84) and model.env.observation_space.dtype == np.uint8
    assert isinstance(model.q, NatureQNetwork) and isinstance(model.buffer, FrameReplayBuffer)
    assert (model.hparams.lr, model.hparams.batch_size, model.hparams.train_freq) == (1e-4, 32, 4)
    assert model.hparams.max_grad_norm is None and model.hparams.target_update_every * 4 == 1000
    collect(model, 500)  # 2,000 steps
    assert model.buffer.nbytes / model.buffer.capacity < 7_100  # a frame and 23 bytes a transition
    batch = model.buffer.sample(32)
    assert batch["obs"].shape == (32, 4, 84, 84) and batch["obs"].dtype == torch.uint8
    values = model.q(batch["obs"])  # the Nature network takes the uint8 stacks as they are
    assert values.shape == (32, model.env.action_space.n) and values.grad_fn is not None


@NEEDS_ALE
def test_model_compress_stores_atari_frames_compressed_and_refuses_a_whole_observation_buffer(tmp_path: Path) -> None:
    pytest.importorskip("zstandard", reason='the compress extra: pip install "copy-correct[compress]"')
    overrides = ("+dqn=atari", "model.buffer_size=20000", "model.n_steps=3")
    plain, packed = (
        build(compose_config("+recipe=dqn", *overrides, *more, output_dir=tmp_path / str(i)))[1]
        for i, more in enumerate(((), ("model.compress=zstd",)))
    )
    for model in (plain, packed):
        collect(model, 75)  # 300 steps
    batches = [m.buffer.sample(32, generator=torch.Generator().manual_seed(0)) for m in (plain, packed)]
    assert all(torch.equal(batches[0][name], batches[1][name]) for name in batches[0])
    assert packed.buffer.nbytes < plain.buffer.nbytes / 10
    with pytest.raises(ValueError, match=r"model\.compress=zstd compresses frames: it needs a FrameReplayBuffer"):
        build(compose_config("+recipe=dqn", "model.compress=zstd", output_dir=tmp_path / "cartpole"))


@NEEDS_ALE
def test_the_atari_configuration_draws_compressed_n_step_frames_by_priority(tmp_path: Path) -> None:
    """``+dqn=atari model.prioritized=true``: a slot of the frame replay holds a priority exactly when a transition
    can be drawn from it, and a batch carries its weights."""
    pytest.importorskip("zstandard", reason='the compress extra: pip install "copy-correct[compress]"')
    overrides = ("+dqn=atari", "model.buffer_size=20000", "model.n_steps=3", "model.compress=zstd")
    model = build(compose_config("+recipe=dqn", *overrides, "model.prioritized=true", output_dir=tmp_path))[1]
    collect(model, 75)  # 300 steps
    tree, rows = model.buffer._priorities, np.arange(model.buffer._priorities.rows)
    assert np.array_equal(tree.drawable(rows), model.buffer._drawable(rows)) and tree.drawable(rows).sum() > 250
    batch = model.buffer.sample(32, generator=torch.Generator().manual_seed(0), beta=0.4)
    assert batch["obs"].shape == (32, 4, 84, 84) and batch["weights"].shape == (32,)


@NEEDS_ALE
@pytest.mark.slow
def test_a_short_atari_run_learns_evaluates_and_checkpoints(tmp_path: Path) -> None:
    result = run_train("+recipe=dqn", *QUIET, *ATARI, f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert warning_lines(result.stderr) == []
    metrics = json.loads((tmp_path / "summary.json").read_text())["metrics"]
    assert metrics["env_steps"] == 400 and "eval/return" in metrics and metrics["train/td_loss"] >= 0
    checkpoint = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["replay_buffer"]["frames"].shape[-2:] == (84, 84)
