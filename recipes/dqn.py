"""Recipe ``dqn``: deep Q-learning on a gymnasium environment with a target network kept current by in-place copies.

    python train.py +recipe=dqn                      # CartPole-v1; hard target update every target_update_every steps
    python train.py +recipe=dqn model.tau=0.005 model.target_update_every=1     # soft (Polyak) updates
    python train.py +recipe=dqn env.id=Acrobot-v1    # any environment with Discrete actions and Box observations
    python train.py +recipe=dqn +dqn=atari trainer=gpu   # Breakout as CleanRL's dqn_atari.py plays it (atari extra)

What it shows:
  * The target network is ``make_target(q)``: a frozen copy with storage of its own, no gradients, never in
    the optimizer, and kept in eval mode even when Lightning switches the module to training mode.
  * ``hard_update`` / ``soft_update`` write into the target's storage in place: one foreach call per
    dtype group, no allocation, never ``load_state_dict`` in the loop, never ``.data``.
  * The bootstrap target ``r + gamma * max Q_target(s')`` is computed under ``no_grad``: no graph through
    the target network, so no gradient can reach it and no activations of it are kept.
  * Experience lives in a preallocated ``ReplayBuffer`` built from the spaces; samples are independent tensors.
    Stacks of frames (Atari: 4 frames of 84x84) go into a ``FrameReplayBuffer``, which keeps each frame once and
    rebuilds the stacks when it samples: an eighth of the memory (``model.replay``).
  * Truncation (a time limit: CartPole's 500 steps) is not termination: those transitions still bootstrap.
  * ``model.compress=zstd`` (Atari): each frame compressed once as it is stored (Pong: 208 bytes a transition, not
    7,193), ``FrameReplayBuffer``'s ``compress`` (the compress extra); the batches are the same, bit for bit.
  * ``model.n_steps`` (1 by default): n-step returns, read by the buffer from its one-step rows at sample time; the
    target bootstraps by the batch's ``discounts`` (``gamma**m`` for the ``m`` rewards summed), not by ``gamma``.

One Lightning "batch" is one round: ``train_freq`` environment steps, then ``gradient_steps`` updates.
Greedy evaluation (``eval_episodes`` episodes) every ``eval_every`` environment steps, after the updates of the
round that reaches the mark (so the checkpoint taken then holds the evaluated policy), is logged as
``eval/return``; the first evaluation to reach the environment's ``spec.reward_threshold`` (CartPole-v1: 475,
Acrobot-v1: -100; some environments have none) is logged as ``eval/solved_at_step``; the run directory gets
``return_curve.png``. DQN runs in one process (``trainer=ddp`` and ``trainer=fsdp`` are refused): environment
steps are sequential, and averaging gradients of ranks that explore differently would change the algorithm.

Checkpoints (after any round) resume bit for bit: besides the networks and Adam's state they hold the
replay buffer, the counters, both generators' states, the curves, and the current episode as the
environment generator's state at its reset plus its actions so far; resuming replays that episode, which
lands on the checkpoint's observation exactly (checked) because gymnasium environments are deterministic
given their generator. Where an episode is one life of a game (Atari), the replay starts at the game's reset and
repeats the lives lost since. A checkpoint of a run on another environment is refused.

The environment comes from ``make_env`` (``recipes/dqn_env.py``), the run's ``return_curve.png`` from
``plot_returns`` (``recipes/dqn_plot.py``); this file is the algorithm, its methods in the order Lightning calls them.

Callbacks (``conf/callbacks/default.yaml``'s, which every recipe has; ``conf/recipe/dqn.yaml`` sets the checkpoints
to every round):
  * ``ResumeState`` (``copy_correct/lightning/resume.py``): copies of torch's, NumPy's and Python's global generators'
    states in every checkpoint, put back when a fit resumes. DQN draws from generators of its own (``rng``,
    ``sampler``, the environment's), which ``on_save_checkpoint`` here keeps; its loader is a clock
    (``batch_size=None``), with no order for ``resume_data_order.py`` to record.
  * ``IsolatedEvaluation`` (``copy_correct/lightning/isolated_evaluation.py``) would undo a validation's draws; this
    recipe runs none (``limit_val_batches: 0``): its greedy evaluation plays inside ``training_step``, on an
    environment and seeds of its own, and draws nothing from ``rng``.
  * ``ModelCheckpoint`` and ``LastCheckpoint`` (``copy_correct/lightning/last_checkpoint.py``), after every round,
    through ``AtomicCheckpointIO`` (``atomic_checkpoint.py``): each storage, the replay buffer's too, streamed once
    into a file beside the target and renamed over it; no copy of the buffer in memory.
  * ``NonFiniteStop`` (``copy_correct/lightning/nonfinite_stop.py``): the step returns no loss, so it reads the
    weights (never copies them) every 50 rounds and before each save. ``RunSummary``, ``StaleTemporaries``, the
    progress bar: read only.

Change first: ``QNetwork`` and the environment (``env.id``); the defaults follow well-known CartPole settings, and
``conf/dqn/atari.yaml`` CleanRL's ``dqn_atari.py`` (with the Nature network, ``recipes/atari.py``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from copy_correct import CheckpointMismatch, FrameReplayBuffer, ReplayBuffer, hard_update, make_target, soft_update
from recipes.allocation import allocated
from recipes.atari import NatureQNetwork, game_goes_on, start_a_game_at_the_next_reset
from recipes.dqn_env import is_frame_stack, make_env
from recipes.dqn_plot import plot_returns
from recipes.model_setup import at_least_one, check_args

__all__ = ["DQN", "QNetwork"]

NETWORKS = ("auto", "mlp", "nature_cnn")
REPLAYS = ("auto", "whole", "frames")
RESET = -1  # in a checkpoint's episode actions: the env was reset there (a life lost, the game going on)


class QNetwork(nn.Module):
    """An MLP from observations (of any shape, flattened; cast to float32) to one value per action."""

    def __init__(self, obs_dim: int, n_actions: int, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(obs_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, n_actions)
        )

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs.reshape(len(obs), -1).float())  # views and no-ops for float32 vectors: no copy


class DQN(pl.LightningModule):
    """DQN with a replay buffer and a target network; manual optimisation, several updates per round."""

    # Lightning warnings this recipe causes on purpose (``train.py`` silences them for its run, nothing at import):
    # the training "data" is a clock (round numbers the step never reads) and the rest of the state is in the
    # checkpoint, so a plain loader starting its epoch over when resumed mid-epoch is moot; the target network is
    # in eval mode on purpose; checkpoints are taken after a round's updates on purpose (they hold the policy that
    # was just evaluated): the alternative Lightning 2.6 suggests, a clone of the whole state_dict per training step
    # kept in a dict keyed by batch index, keeps one copy of the weights per step for the whole run
    # (tests/recipes/test_dqn.py measures it).
    expected_warnings = (
        r"You're resuming from a checkpoint that ended before the epoch ended",
        r"train loader 0 \(batch_size=None\): the rest of the interrupted epoch",  # a clock: any order is its order
        r"Found \d+ module\(s\) in eval mode at the start of training",
        r"Using ModelCheckpoint with manual optimization and every_n_train_steps",
    )

    def __init__(
        self,
        env_id: str = "CartPole-v1",
        hidden: int = 256,
        lr: float = 2.3e-3,
        gamma: float = 0.99,
        n_steps: int = 1,
        batch_size: int = 64,
        buffer_size: int = 100_000,
        learning_starts: int = 1_000,
        train_freq: int = 256,
        gradient_steps: int = 128,
        target_update_every: int = 128,
        tau: float = 1.0,
        exploration_fraction: float = 0.16,
        exploration_final_eps: float = 0.04,
        total_env_steps: int = 50_000,
        eval_every: int = 5_000,
        eval_episodes: int = 10,
        max_grad_norm: float | None = 10.0,
        network: str = "auto",
        replay: str = "auto",
        compress: str | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        check_args([
            ("gamma", gamma, 0.0 <= gamma <= 1.0, "in [0, 1]"),
            ("tau", tau, 0.0 < tau <= 1.0, "in (0, 1]"),
            ("lr", lr, lr > 0.0, "> 0"),
            ("exploration_fraction", exploration_fraction, 0.0 < exploration_fraction <= 1.0, "in (0, 1]"),
            ("exploration_final_eps", exploration_final_eps, 0.0 <= exploration_final_eps <= 1.0, "in [0, 1]"),
        ])  # fmt: skip
        at_least_one(
            hidden=hidden, n_steps=n_steps, batch_size=batch_size, buffer_size=buffer_size, train_freq=train_freq,
            gradient_steps=gradient_steps, target_update_every=target_update_every, total_env_steps=total_env_steps,
            eval_every=eval_every, eval_episodes=eval_episodes,
        )  # fmt: skip
        clip = max_grad_norm is None or max_grad_norm > 0
        check_args([
            ("max_grad_norm", max_grad_norm, clip, "> 0 or null (no clipping)"),
            ("network", repr(network), network in NETWORKS, f"one of {', '.join(NETWORKS)}"),
            ("replay", repr(replay), replay in REPLAYS, f"one of {', '.join(REPLAYS)}"),
        ])  # fmt: skip
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.env, self.eval_env = make_env(env_id), make_env(env_id)
        self.reward_threshold: float | None = self.env.spec.reward_threshold  # None: no solved_at_step
        observations, actions = self.env.observation_space, self.env.action_space
        frames = is_frame_stack(observations)
        if network == "nature_cnn" or (network == "auto" and frames):
            if observations.shape[1:] != (84, 84):
                raise ValueError(f"model.network=nature_cnn takes stacks of 84x84 frames, not {observations.shape}")
            self.q: nn.Module = NatureQNetwork(actions.n, observations.shape[0])
        else:
            self.q = QNetwork(math.prod(observations.shape), actions.n, hidden)
        # Copy decision: one deep copy, once. From here on the target is only written in place.
        self.target = make_target(self.q)
        kind = FrameReplayBuffer if replay == "frames" or (replay == "auto" and frames) else ReplayBuffer
        if compress is not None and kind is not FrameReplayBuffer:
            raise ValueError(
                f"model.compress={compress} compresses frames: it needs a FrameReplayBuffer (stacks of frames, "
                f"model.replay=frames), and {env_id}'s observations go into a ReplayBuffer"
            )
        codec = {} if compress is None else {"compress": compress}
        # Copy decision: each frame once (FrameReplayBuffer); the stacks are rebuilt by the sample, not stored 8 times
        # over. A buffer this machine cannot hold is refused naming model.buffer_size and the bytes.
        what = f"model.buffer_size={buffer_size} (a {kind.__name__} of {env_id})"
        self.buffer: ReplayBuffer | FrameReplayBuffer = allocated(
            # n-step windows are read from the one-step rows at sample time: nothing more is stored
            lambda: kind(buffer_size, observations, actions, n_steps=n_steps, gamma=gamma, **codec),
            what,
            "model.buffer_size",
        )
        self.rng = np.random.default_rng(seed)
        self.sampler = torch.Generator().manual_seed(seed)
        self.env_steps = 0
        self.updates = 0
        self.obs, _ = self.env.reset(seed=seed)
        self.episode_return = 0.0
        self.episode_start: dict[str, Any] | None = None  # env generator state before this episode's reset
        self.episode_actions: list[int] = []  # replayed from episode_start on resume
        self.curve: list[tuple[int, float]] = []  # (env step, training episode return)
        self.evals: list[tuple[int, float]] = []  # (env step, mean greedy return)

    def train(self, mode: bool = True) -> DQN:
        super().train(mode)
        self.target.eval()  # Copy decision: the target is a frozen snapshot, in eval mode whatever the parent's
        return self

    def setup(self, stage: str) -> None:
        if self.trainer.world_size > 1:
            raise ValueError("recipe dqn runs in one process: use trainer=default, cpu or gpu, not ddp or fsdp")

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint["dqn"]
        saved_env = state.get("env_id", "CartPole-v1")  # checkpoints written before env.id existed are CartPole's
        if saved_env != self.hparams.env_id:
            raise CheckpointMismatch(
                f"it is a run on {saved_env} and this run's env.id (model.env_id) is {self.hparams.env_id}"
            )
        self.buffer.load_state_dict(checkpoint["replay_buffer"])
        self.env_steps, self.updates = state["env_steps"], state["updates"]
        self.episode_return = state["episode_return"]
        self.rng.bit_generator.state = state["rng"]
        self.sampler.set_state(state["sampler"])
        self.curve, self.evals = list(state["curve"]), list(state["evals"])
        self.replay_episode(state["episode_start"], state["episode_actions"].tolist(), state["obs"].numpy())

    def replay_episode(self, start: dict[str, Any] | None, actions: list[int], obs: np.ndarray) -> None:
        """Put the training environment where a checkpoint left it, mid-episode: reset it from the generator
        state recorded before the episode's reset (``None``: the run's first, seeded reset) and repeat the
        episode's actions (``RESET``: the resets of lives lost since the game's). Raises ``RuntimeError`` if that does
        not reproduce the recorded observation."""
        self.obs, _ = self.env.reset(seed=self.hparams.seed)
        if start is not None:
            self.env.np_random.bit_generator.state = start
            start_a_game_at_the_next_reset(self.env)  # as after the game over it was recorded at
            self.obs, _ = self.env.reset()
        for action in actions:
            self.obs = self.env.reset()[0] if action == RESET else self.env.step(action)[0]
        if not np.array_equal(self.obs, obs):
            raise RuntimeError(
                f"replaying the current episode of {self.hparams.env_id} did not reach the checkpoint's observation: "
                "the environment is not deterministic given its generator, so this run cannot resume exactly"
            )
        self.episode_start, self.episode_actions = start, actions

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.q.parameters(), lr=self.hparams.lr, fused=True)  # in place, no temporaries

    def train_dataloader(self) -> DataLoader:
        rounds = math.ceil(self.hparams.total_env_steps / self.hparams.train_freq)
        return DataLoader(range(rounds), batch_size=None)  # a clock: one item per collect-then-train round

    def training_step(self, batch: Any, batch_idx: int) -> None:
        h = self.hparams
        evaluations_due = self.env_steps // h.eval_every
        for _ in range(h.train_freq):
            self.collect_one_step()
        if len(self.buffer) >= h.learning_starts:
            self.learn()
        # Evaluated after this round's updates: the checkpoint written at this step's end holds the very policy
        # that earned the score (mid-round, the saved weights would be a round of updates past it).
        if self.env_steps // h.eval_every > evaluations_due:
            self.evaluate()

    def collect_one_step(self) -> None:
        action = self.act(self.obs, self.epsilon())
        next_obs, reward, terminated, truncated, _ = self.env.step(action)
        self.episode_actions.append(action)
        # Copy decision: the buffer copies the arrays into its own storage; we keep no reference to them.
        self.buffer.add(self.obs, action, reward, next_obs, terminated, truncated)
        self.env_steps += 1
        self.episode_return += float(reward)
        self.obs = next_obs
        if terminated or truncated:
            self.curve.append((self.env_steps, self.episode_return))
            self.log("train/episode_return", self.episode_return)
            self.episode_return = 0.0
            if game_goes_on(self.env):  # a life lost: the game, and what a resume replays of it, go on
                self.episode_actions.append(RESET)
            else:
                self.episode_start = self.env.np_random.bit_generator.state
                self.episode_actions.clear()
            self.obs, _ = self.env.reset()

    def epsilon(self) -> float:
        h = self.hparams
        progress = min(1.0, self.env_steps / max(1.0, h.exploration_fraction * h.total_env_steps))
        return 1.0 + progress * (h.exploration_final_eps - 1.0)

    def act(self, obs: np.ndarray, epsilon: float) -> int:
        """Epsilon-greedy, for training: the coin and the random action come from the training generator ``rng``."""
        if self.rng.random() < epsilon:
            return int(self.rng.integers(self.env.action_space.n))
        return self.greedy_action(obs)

    def greedy_action(self, obs: np.ndarray) -> int:
        """The action of the largest Q-value; draws nothing."""
        with torch.no_grad():
            values = self.q(torch.from_numpy(obs).to(self.device).unsqueeze(0))
        return int(values.argmax(dim=1).item())  # the environment runs on the CPU: one sync per step

    def learn(self) -> None:
        h = self.hparams
        optimizer = self.optimizers()
        for _ in range(h.gradient_steps):
            loss = self.td_loss(self.buffer.sample(h.batch_size, generator=self.sampler))
            optimizer.zero_grad(set_to_none=True)
            self.manual_backward(loss)
            if h.max_grad_norm is not None:
                nn.utils.clip_grad_norm_(self.q.parameters(), h.max_grad_norm)
            optimizer.step()
            self.updates += 1
            if self.updates % h.target_update_every == 0:
                if h.tau < 1.0:
                    soft_update(self.target, self.q, h.tau)
                else:
                    hard_update(self.target, self.q)
        self.log("train/td_loss", loss.detach(), prog_bar=True)
        self.log("train/epsilon", self.epsilon())

    def td_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        with torch.no_grad():  # Copy decision: no graph through the target, so nothing of it is kept
            next_value = self.target(batch["next_obs"]).max(dim=1).values
            # truncation is not termination: a truncated transition still bootstraps, by gamma**m for its m rewards
            target = batch["reward"] + batch["discounts"] * (~batch["terminated"]).float() * next_value
        value = self.q(batch["obs"]).gather(1, batch["action"].unsqueeze(1)).squeeze(1)
        return F.smooth_l1_loss(value, target)

    def evaluate(self) -> None:
        mean = self.greedy_return()
        self.evals.append((self.env_steps, mean))
        best = max(value for _, value in self.evals)
        self.log("eval/return", mean, prog_bar=True)
        self.log("eval/best_return", best)
        self.log("env_steps", float(self.env_steps))
        threshold = self.reward_threshold
        solved = [step for step, value in self.evals if threshold is not None and value >= threshold]
        if solved:
            self.log("eval/solved_at_step", float(solved[0]))

    def greedy_return(self) -> float:
        """Mean return of ``eval_episodes`` greedy episodes, on the evaluation environment's fixed seeds.

        Evaluation never moves training: the episodes play on an environment of their own, reset from seeds of their
        own; the actions draw nothing from the training generator ``rng`` (an ``act(obs, epsilon=0.0)`` would still
        toss its coin there, and every later exploration would change with how often the run evaluates); and the
        Q-network plays in eval mode, so a network with BatchNorm or dropout neither updates its statistics nor draws
        masks here. It goes back to the mode it was in."""
        returns, training = [], self.q.training
        self.q.eval()
        try:
            for episode in range(self.hparams.eval_episodes):
                obs, _ = self.eval_env.reset(seed=self.hparams.seed + 10_000 + episode)
                total, done = 0.0, False
                while not done:
                    obs, reward, terminated, truncated, _ = self.eval_env.step(self.greedy_action(obs))
                    total += float(reward)
                    done = terminated or truncated
                returns.append(total)
        finally:
            self.q.train(training)
        return float(np.mean(returns))

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["replay_buffer"] = self.buffer.state_dict()
        checkpoint["dqn"] = {
            "env_steps": self.env_steps, "updates": self.updates, "episode_return": self.episode_return,
            "rng": self.rng.bit_generator.state, "sampler": self.sampler.get_state(), "obs": torch.tensor(self.obs),
            "episode_start": self.episode_start, "episode_actions": torch.tensor(self.episode_actions).long(),
            "curve": self.curve, "evals": self.evals, "env_id": self.hparams.env_id,
        }  # fmt: skip

    def on_train_end(self) -> None:
        if self.trainer.is_global_zero:
            path = Path(self.trainer.default_root_dir) / "return_curve.png"
            plot_returns(self.curve, self.evals, path, self.hparams.env_id, self.reward_threshold)
