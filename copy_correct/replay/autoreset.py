"""How a vector env resets, as the replay buffers read it: gymnasium's ``envs.metadata["autoreset_mode"]``.

* ``"next_step"`` (gymnasium 1.x's default): the step after an episode ends is the env's reset step, whose row (the
  last observation to the first of the next episode, the action ignored) is no transition.
* ``"same_step"``: an env that ends resets in the same step; ``next_obs`` holds the next episode's first observation
  and the real last one is in ``infos["final_obs"]`` (``infos["_final_obs"]``: which envs ended).
* ``"disabled"``: the caller resets ended envs by hand (``envs.reset(options={"reset_mask": done})``); every row is a
  transition. A single env, reset by hand, is this mode.

Names only: nothing here holds a tensor.
"""

from __future__ import annotations

from typing import Any

__all__ = ["AUTORESET_MODES", "parse_mode"]

AUTORESET_MODES = ("next_step", "same_step", "disabled")
_MODE_NAMES = {"nextstep": "next_step", "samestep": "same_step", "disabled": "disabled"}


def parse_mode(value: Any, num_envs: int | None) -> str:
    """The autoreset mode from its name in any spelling or gymnasium's ``AutoresetMode`` (by its value). A single env
    (``num_envs=None``) is reset by hand, so only ``None`` or ``"disabled"`` fit it; with ``num_envs`` the mode must be
    given (a vector env resets itself, and a buffer told nothing would store its reset steps as transitions)."""
    if value is None:
        if num_envs is not None:
            raise ValueError(
                "autoreset_mode is needed with num_envs: pass envs.metadata['autoreset_mode'] "
                f"(one of {', '.join(AUTORESET_MODES)}; disabled for envs you reset by hand), so that no reset step is "
                "stored as a transition"
            )
        return "disabled"
    name = str(getattr(value, "value", value)).replace("_", "").replace("-", "").lower()
    if name not in _MODE_NAMES:
        raise ValueError(f"autoreset_mode must be one of {', '.join(AUTORESET_MODES)} (or gymnasium's AutoresetMode)")
    mode = _MODE_NAMES[name]
    if num_envs is None and mode != "disabled":
        raise ValueError("a single env (num_envs=None) is reset by hand: autoreset_mode must be None or disabled")
    return mode
