"""The ``dqn`` recipe's ``return_curve.png``: training and greedy evaluation returns against environment steps.

Copy contract: none; it reads the run's lists of ``(step, return)`` pairs once, when training ends.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["plot_returns"]


def plot_returns(
    curve: list[tuple[int, float]],
    evals: list[tuple[int, float]],
    path: Path,
    env_id: str,
    threshold: float | None = None,
) -> None:
    """Training episode returns and greedy evaluation returns against environment steps, as a PNG titled with
    ``env_id``; ``threshold`` (the environment's reward threshold), when given, is a dashed line."""
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
