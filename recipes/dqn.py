"""Recipe ``dqn``: deep Q-learning on a gymnasium environment with a target network kept current by in-place copies.

    python train.py +recipe=dqn                          # CartPole-v1, a hard target update every 128 updates
    python train.py +recipe=dqn model.tau=0.005 model.target_update_every=1     # soft (Polyak) updates
    python train.py +recipe=dqn env.id=Acrobot-v1        # any environment with Discrete actions and Box observations
    python train.py +recipe=dqn model.prioritized=true   # transitions drawn by |TD error|, the loss weighted
    python train.py +recipe=dqn +dqn=atari trainer=gpu   # Breakout as CleanRL's dqn_atari.py plays it (atari extra)

Copy contract, each marked ``# Copy decision:`` where the code makes it:
  * The target is ``make_target(q)``, the run's one deep copy: storage of its own, no gradients, never in the
    optimizer, in eval mode whatever its parent's mode. ``hard_update``/``soft_update`` then write it in place, one
    foreach call per dtype group and no allocation: never ``load_state_dict`` in the loop, never ``.data``.
  * ``buffer.add`` copies each transition into storage allocated once (stacks of frames: a ``FrameReplayBuffer``,
    each frame kept once); ``buffer.sample`` gathers a batch into new memory that aliases no row.
  * The TD target ``r + discounts * max Q_target(s')`` is computed under ``no_grad``: no graph through the target.

``training_step`` is the algorithm in one block: a Lightning batch is one round of ``train_freq`` environment steps,
then ``gradient_steps`` updates, then a greedy evaluation when the round passed a multiple of ``eval_every``. The
section at the end makes checkpoints resume bit for bit. DQN runs in one process (``trainer=ddp`` is refused). The
walk-through, the measurements and the tests that prove each decision: docs/recipes/dqn.md.

Change first: ``QNetwork`` and the environment (``env.id``); the defaults follow well-known CartPole settings, and
``conf/dqn/atari.yaml`` CleanRL's ``dqn_atari.py`` (with the Nature network, ``recipes/atari.py``).
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any, SupportsFloat

import gymnasium as gym
import lightning.pytorch as pl
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from copy_correct import CheckpointMismatch, FrameReplayBuffer, ReplayBuffer, hard_update, make_target, soft_update
from recipes.allocation import allocated
from recipes.atari import NatureQNetwork, game_goes_on, is_atari, make_atari_env, start_a_game_at_the_next_reset
from recipes.model_setup import at_least_one, check_args

__all__ = ["DQN", "QNetwork", "is_frame_stack", "make_env", "plot_returns"]

NETWORKS = ("auto", "mlp", "nature_cnn")
REPLAYS = ("auto", "whole", "frames")
# Environments with Discrete actions and Box observations that gymnasium registers, named in refusals.
SUGGESTED_ENVS = "CartPole-v1, Acrobot-v1, MountainCar-v0 or LunarLander-v3 (needs gymnasium[box2d])"
LISTING = "python -c 'import gymnasium; gymnasium.pprint_registry()' lists every id"


def make_env(env_id: str) -> gym.Env:
    """``gym.make(env_id)`` for DQN (an ``ALE/`` game wrapped as CleanRL wraps it, ``recipes/atari.py``): a
    ``ValueError`` of one line naming ``model.env_id`` (the config's ``env.id``) when gymnasium cannot make it, its
    action space is not ``Discrete`` from 0 (a DQN picks the action of the largest Q-value, by index) or its
    observation space is not a ``Box``."""
    where = f"model.env_id={env_id} (env.id)"
    if is_atari(env_id) and importlib.util.find_spec("ale_py") is None:
        raise ValueError(f"{where} needs ale-py, which plays the Atari games: pip install -e '.[atari]'")
    try:
        env = make_atari_env(env_id) if is_atari(env_id) else gym.make(env_id)
    except (gym.error.Error, ModuleNotFoundError) as err:
        said = " ".join(str(err).split())
        raise ValueError(f"{where} cannot be made: {said.rstrip('.')}; try {SUGGESTED_ENVS} ({LISTING})") from err
    actions, observations = env.action_space, env.observation_space
    if not isinstance(actions, gym.spaces.Discrete):
        kind = "a continuous" if isinstance(actions, gym.spaces.Box) else "a non-Discrete"
        problem = f"has {kind} action space ({actions}); recipe dqn needs a Discrete one"
        problem += " (a DQN picks the action of the largest Q-value)"
    elif actions.start != 0:
        problem = f"numbers its actions from {actions.start} ({actions}); recipe dqn takes the Q-network's index"
        problem += " as the action, so they must start at 0"
    elif not isinstance(observations, gym.spaces.Box):
        problem = f"has {observations} observations; recipe dqn needs a Box (an array the Q-network flattens)"
    else:
        return env
    env.close()
    raise ValueError(" ".join(f"{where} {problem}: try {SUGGESTED_ENVS}".split()))


def is_frame_stack(space: gym.Space) -> bool:
    """Whether observations are stacks of uint8 frames (``(stack, height, width)``), as Atari's are."""
    return isinstance(space, gym.spaces.Box) and space.dtype == np.uint8 and len(space.shape) == 3


class QNetwork(nn.Module):
    """An MLP from observations (of any shape, flattened; cast to float32) to one value per action."""

    def __init__(self, obs_dim: int, n_actions: int, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(obs_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, n_actions)
        )

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs.reshape(len(obs), -1).float())  # views and no-ops for float32 vectors: no copy


def plot_returns(
    curve: list[tuple[int, float]],
    evals: list[tuple[int, float]],
    path: Path,
    env_id: str,
    threshold: float | None = None,
) -> None:
    """The run's ``return_curve.png``: training episode returns and greedy evaluation returns against environment
    steps, titled with ``env_id``; ``threshold`` (the environment's reward threshold), when given, a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    if curve:
        steps, returns = zip(*curve, strict=True)
        ax.plot(steps, returns, lw=0.8, alpha=0.6, label="training episodes (epsilon-greedy)")
    if evals:
        steps, returns = zip(*evals, strict=True)
        ax.plot(steps, returns, "o-", label="greedy evaluation (mean of episodes)")
    if threshold is not None:
        ax.axhline(threshold, color="grey", ls="--", lw=0.8, label=f"reward threshold {threshold:g}")
    ax.set_xlabel("environment steps")
    ax.set_ylabel("episode return")
    ax.set_title(f"DQN on {env_id}")
    ax.legend(loc="best", framealpha=0.9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


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
        prioritized: bool = False,
        alpha: float = 0.6,
        beta: float = 0.4,
        priority_eps: float = 1e-6,
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
            ("alpha", alpha, 0.0 <= alpha < math.inf, ">= 0"),
            ("beta", beta, 0.0 <= beta <= 1.0, "in [0, 1]"),
            ("priority_eps", priority_eps, 0.0 < priority_eps < math.inf, "> 0"),
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
        # The training environment records its episode in progress for the checkpoints (EpisodeRecord, at the end).
        self.env, self.eval_env = EpisodeRecord(make_env(env_id)), make_env(env_id)
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
        priorities = {"prioritized": True, "alpha": alpha} if prioritized else {}
        # Copy decision: each frame once (FrameReplayBuffer); the stacks are rebuilt by the sample, not stored 8 times
        # over. A buffer this machine cannot hold is refused naming model.buffer_size and the bytes.
        what = f"model.buffer_size={buffer_size} (a {kind.__name__} of {env_id})"
        self.buffer: ReplayBuffer | FrameReplayBuffer = allocated(
            # n-step windows are read from the one-step rows at sample time: nothing more is stored
            lambda: kind(buffer_size, observations, actions, n_steps=n_steps, gamma=gamma, **codec, **priorities),
            what,
            "model.buffer_size",
        )
        self.rng = np.random.default_rng(seed)  # exploration: the epsilon coin and the random actions
        self.sampler = torch.Generator().manual_seed(seed)  # the replay's batches
        self.env_steps = 0
        self.updates = 0
        self.obs, _ = self.env.reset(seed=seed)
        self.episode_return = 0.0
        self.curve: list[tuple[int, float]] = []  # (env step, training episode return)
        self.evals: list[tuple[int, float]] = []  # (env step, mean greedy return)

    def setup(self, stage: str) -> None:
        if self.trainer.world_size > 1:
            raise ValueError("recipe dqn runs in one process: use trainer=default, cpu or gpu, not ddp or fsdp")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.q.parameters(), lr=self.hparams.lr, fused=True)  # in place, no temporaries

    def train_dataloader(self) -> DataLoader:
        rounds = math.ceil(self.hparams.total_env_steps / self.hparams.train_freq)
        return DataLoader(range(rounds), batch_size=None)  # a clock: one item per collect-then-train round

    def train(self, mode: bool = True) -> DQN:
        super().train(mode)
        self.target.eval()  # Copy decision: the target is a frozen snapshot, in eval mode whatever the parent's
        return self

    def training_step(self, round_number: int, batch_idx: int) -> None:
        """One round: ``train_freq`` epsilon-greedy environment steps into the replay; once it holds
        ``learning_starts`` transitions, ``gradient_steps`` updates, the target written every ``target_update_every``;
        then a greedy evaluation if the round passed a multiple of ``eval_every``."""
        h = self.hparams
        evaluations_due = self.env_steps // h.eval_every
        for _ in range(h.train_freq):
            # Epsilon-greedy: the coin and the random action come from the training generator rng.
            if self.rng.random() < self.epsilon():
                action = int(self.rng.integers(self.env.action_space.n))
            else:
                action = self.greedy_action(self.obs)
            next_obs, reward, terminated, truncated, _ = self.env.step(action)
            # Copy decision: the buffer copies the arrays into its own storage; we keep no reference to them.
            self.buffer.add(self.obs, action, reward, next_obs, terminated, truncated)
            self.env_steps += 1
            self.episode_return += float(reward)
            self.obs = next_obs
            if terminated or truncated:
                self.curve.append((self.env_steps, self.episode_return))
                self.log("train/episode_return", self.episode_return)
                self.episode_return = 0.0
                self.obs, _ = self.env.reset()

        if len(self.buffer) >= h.learning_starts:
            optimizer = self.optimizers()
            for _ in range(h.gradient_steps):
                # Copy decision: sample gathers the batch into new memory; later adds cannot change it.
                batch = self.buffer.sample(h.batch_size, generator=self.sampler, **self.beta())
                batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
                with torch.no_grad():  # Copy decision: no graph through the target, so nothing of it is kept
                    next_value = self.target(batch["next_obs"]).max(dim=1).values
                    # truncation is not termination: a truncated transition still bootstraps, by gamma**m for its m
                    # rewards (discounts: gamma with n_steps=1)
                    td_target = batch["reward"] + batch["discounts"] * (~batch["terminated"]).float() * next_value
                value = self.q(batch["obs"]).gather(1, batch["action"].unsqueeze(1)).squeeze(1)
                if h.prioritized:  # each transition's loss weighted, and its priority its |TD error|
                    loss = (batch["weights"] * F.smooth_l1_loss(value, td_target, reduction="none")).mean()
                    # Copy decision: detached, so the buffer's copy of the priorities holds no graph
                    self.buffer.update_priorities(batch["indices"], (value - td_target).detach().abs() + h.priority_eps)
                else:
                    loss = F.smooth_l1_loss(value, td_target)
                optimizer.zero_grad(set_to_none=True)
                self.manual_backward(loss)
                if h.max_grad_norm is not None:
                    nn.utils.clip_grad_norm_(self.q.parameters(), h.max_grad_norm)
                optimizer.step()
                self.updates += 1
                if self.updates % h.target_update_every == 0:
                    # Copy decision: written in place, one foreach call per dtype group; never load_state_dict.
                    if h.tau < 1.0:
                        soft_update(self.target, self.q, h.tau)
                    else:
                        hard_update(self.target, self.q)
            self.log("train/td_loss", loss.detach(), prog_bar=True)
            self.log("train/epsilon", self.epsilon())

        # Evaluated after this round's updates: the checkpoint written at this step's end holds the very policy
        # that earned the score (mid-round, the saved weights would be a round of updates past it).
        if self.env_steps // h.eval_every > evaluations_due:
            self.evaluate()

    def epsilon(self) -> float:
        """The exploration rate: from 1 down to ``exploration_final_eps`` over the run's first
        ``exploration_fraction`` of ``total_env_steps``, then flat."""
        h = self.hparams
        progress = min(1.0, self.env_steps / max(1.0, h.exploration_fraction * h.total_env_steps))
        return 1.0 + progress * (h.exploration_final_eps - 1.0)

    def beta(self) -> dict[str, float]:
        """``sample``'s ``beta`` for a prioritized buffer (none for a uniform one): from ``model.beta`` up to 1,
        linearly over ``total_env_steps``, as the paper anneals it."""
        h = self.hparams
        if not h.prioritized:
            return {}
        return {"beta": h.beta + (1.0 - h.beta) * min(1.0, self.env_steps / h.total_env_steps)}

    def greedy_action(self, obs: np.ndarray) -> int:
        """The action of the largest Q-value; draws nothing."""
        with torch.no_grad():
            values = self.q(torch.from_numpy(obs).to(self.device).unsqueeze(0))
        return int(values.argmax(dim=1).item())  # the environment runs on the CPU: one sync per step

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
        own; the actions draw nothing from the training generator ``rng``; and the Q-network plays in eval mode, so a
        network with BatchNorm or dropout neither updates its statistics nor draws masks here. It goes back to the
        mode it was in."""
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

    def on_train_end(self) -> None:
        if self.trainer.is_global_zero:
            path = Path(self.trainer.default_root_dir) / "return_curve.png"
            plot_returns(self.curve, self.evals, path, self.hparams.env_id, self.reward_threshold)

    # --- Resume: what a checkpoint holds besides the networks and Adam's state, and how a run goes on from it -------
    # The replay buffer, the counters, both generators' states, the curves, and the episode in progress: the
    # environment generator's state at its game's reset and the actions since (EpisodeRecord). Resuming replays that
    # episode, which lands on the checkpoint's observation exactly (checked): gymnasium environments are deterministic
    # given their generator. Everything else (the global generators, the loops) is Lightning's and ResumeState's.

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["replay_buffer"] = self.buffer.state_dict()
        checkpoint["dqn"] = {
            "env_steps": self.env_steps, "updates": self.updates, "episode_return": self.episode_return,
            "rng": self.rng.bit_generator.state, "sampler": self.sampler.get_state(), "obs": torch.tensor(self.obs),
            "episode_start": self.env.start, "episode_actions": torch.tensor(self.env.actions).long(),
            "curve": self.curve, "evals": self.evals, "env_id": self.hparams.env_id,
        }  # fmt: skip

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
        self.env.start, self.env.actions = start, actions


RESET = -1  # in EpisodeRecord.actions (a checkpoint's episode_actions): the env was reset there, the game going on


class EpisodeRecord(gym.Wrapper):
    """What a resume needs to replay the episode in progress: ``start``, the environment generator's state before its
    game's reset (``None``: the run's first, seeded reset), and ``actions``, every action since, with ``RESET`` where
    a reset went on with the game (a life lost: ``recipes/atari.py``'s ``EpisodicLife``)."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        self.start: dict[str, Any] | None = None
        self.actions: list[int] = []

    def step(self, action: int) -> tuple[Any, SupportsFloat, bool, bool, dict[str, Any]]:
        self.actions.append(action)
        return self.env.step(action)

    def reset(self, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        if kwargs.get("seed") is not None:
            self.start, self.actions = None, []
        elif game_goes_on(self.env):
            self.actions.append(RESET)
        else:
            self.start, self.actions = self.env.np_random.bit_generator.state, []
        return self.env.reset(**kwargs)
