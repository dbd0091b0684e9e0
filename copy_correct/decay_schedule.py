"""``DecaySchedule``: the decay an ``EMA`` applies at each of its averaging updates, in one place, for the host and the
device alike.

Copy contract: none; a schedule holds numbers and computes floats (``at``) or writes one 0-dim device tensor
(``write_weight``, for ``skip_nonfinite``), nothing else.

The update ``k`` (0-based, counting averaging updates) uses ``decay_at(k)``:

* ``warmup=False``: ``decay`` from the first update (the average starts from the weights it was built with);
* every warm-up but ``"half_life"`` copies at ``k = 0`` (decay 0: the average starts from the weights of its first
  update), then: ``"copy"``: ``decay``; ``"power"`` (``True``): ``1 - (1 + (k + warmup_offset) / warmup_gamma) **
  -warmup_power``; ``"ratio"``: ``(1 + k) / (10 + k)``;
* ``"half_life"`` (torchtitan's): ``2 ** (-1 / (half_life * max(k + warmup_offset, 1)))`` from ``k = 0``, a half-life of
  ``half_life`` times the updates so far (0.05: the last twentieth of them weigh half the average);
* each ramp clipped to ``[min_decay, decay]``.

Each peer's schedule is one of these (``copy_correct.averages.peer_schedules`` maps their arguments; ``tests/peers``
compares the sequences with the peers' own code): timm's ``ModelEmaV3`` given ``step=`` (``"copy"``, or ``"power"`` with
``use_warmup``), diffusers' ``EMAModel`` (``"ratio"``, or ``"power"`` with ``use_ema_warmup``), ema-pytorch's ``EMA``
(``"power"``; ``warmup_offset`` places its ramp, counted from ``update_after_step``, on our grid of updates), torch's
``AveragedModel`` with ``get_ema_multi_avg_fn`` and Lightning's ``EMAWeightAveraging`` (``"copy"``), torchtitan's
``EMAOptimizersContainer`` (``"half_life"``, or ``"none"`` given a ``decay``). The arithmetic is
float64 in a fixed order; with ``warmup_gamma=1`` and ``warmup_offset=0`` the power ramp is the one ``EMA`` has always
used, bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

from copy_correct.core.checks import number, real, shown

__all__ = ["WARMUPS", "DecaySchedule", "schedule_differences", "warmup_name"]

# the warm-ups by name; True is "power", False "none"
WARMUPS = ("none", "copy", "power", "ratio", "half_life")


def warmup_name(warmup: Any) -> str:
    """``warmup`` as one of ``WARMUPS``: ``True`` is ``"power"``, ``False`` ``"none"``; else a one-line error."""
    if isinstance(warmup, bool):
        return "power" if warmup else "none"
    if not isinstance(warmup, str):
        raise TypeError(f"warmup must be True, False or one of {WARMUPS}, got {shown(warmup)}")
    if warmup not in WARMUPS:
        raise ValueError(f"warmup must be True, False or one of {WARMUPS}, got {warmup!r}")
    return warmup


@dataclass(frozen=True)
class DecaySchedule:
    """The decay of each averaging update (see the module's docstring); every field checked in one line naming it."""

    decay: float = 0.999
    warmup: str = "power"
    warmup_power: float = 2 / 3
    warmup_gamma: float = 1.0
    warmup_offset: float = 0.0
    min_decay: float = 0.0
    half_life: float = 0.05

    def __post_init__(self) -> None:
        set_field = object.__setattr__  # frozen: the checked values replace the given ones once, here
        set_field(self, "decay", number("decay", self.decay, "[0, 1)"))
        set_field(self, "warmup", warmup_name(self.warmup))
        set_field(self, "warmup_power", number("warmup_power", self.warmup_power, "(0, inf)"))
        set_field(self, "warmup_gamma", number("warmup_gamma", self.warmup_gamma, "(0, inf)"))
        offset = real("warmup_offset", self.warmup_offset, "a number > -1")
        if not offset > -1.0 or offset == float("inf"):
            raise ValueError(f"warmup_offset must be a finite number > -1, got {self.warmup_offset!r}")
        set_field(self, "warmup_offset", offset)
        set_field(self, "min_decay", number("min_decay", self.min_decay, "[0, 1)"))
        set_field(self, "half_life", number("half_life", self.half_life, "(0, inf)"))
        if self.min_decay > self.decay:
            raise ValueError(f"min_decay ({self.min_decay}) must not exceed decay ({self.decay})")

    def at(self, k: int) -> float:
        """The decay of averaging update ``k`` (0-based)."""
        if self.warmup == "none":
            return self.decay
        if self.warmup == "half_life":
            ramp = 2.0 ** (-1.0 / (self.half_life * max(k + self.warmup_offset, 1.0)))
        elif k == 0:
            return 0.0
        elif self.warmup == "copy":
            return self.decay
        elif self.warmup == "power":
            ramp = 1.0 - (1.0 + (k + self.warmup_offset) / self.warmup_gamma) ** -self.warmup_power
        else:
            ramp = (1.0 + k) / (10.0 + k)
        return max(self.min_decay, min(self.decay, ramp))

    def share_after(self, n: int) -> float:
        """The share of an average that is still the weights it started from after ``n`` averaging updates: the
        product of the decays so far (0 once a warm-up's first update has copied)."""
        if n == 0:
            return 1.0
        if self.warmup == "none":
            return self.decay**n
        if self.warmup != "half_life":
            return 0.0  # the first update copies
        share = 1.0
        for k in range(n):
            share *= self.at(k)
            if share < 1e-12:
                break
        return share

    def write_weight(self, k: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor, one: torch.Tensor) -> None:
        """``out = 1 - at(k)`` for ``k`` a 0-dim float64 device tensor, with ``at``'s operations in its order and
        precision (bit for bit on CPU; a CUDA ``pow`` may differ from the host's in a double's last bit). ``scratch``
        is a 0-dim float64 tensor it may write, ``one`` a 0-dim float64 1, both on ``k``'s device. Nothing is
        allocated and nothing is read back."""
        if self.warmup in ("none", "copy"):
            out.fill_(1.0 - self.decay)
        else:
            if self.warmup == "power":
                torch.add(k, self.warmup_offset, out=scratch)  # k + offset (+ 0.0 is exact)
                torch.div(scratch, self.warmup_gamma, out=scratch)
                torch.add(scratch, 1.0, out=scratch)
                torch.pow(scratch, -self.warmup_power, out=scratch)
                torch.sub(one, scratch, out=out)  # the ramp
            elif self.warmup == "half_life":
                torch.add(k, self.warmup_offset, out=scratch)
                scratch.clamp_min_(1.0)
                torch.mul(scratch, self.half_life, out=scratch)
                torch.reciprocal(scratch, out=scratch)
                scratch.neg_()  # -1 / (half_life * max(k + offset, 1)): a negation is exact
                torch.pow(2.0, scratch, out=out)  # the ramp
            else:
                torch.add(k, 1.0, out=scratch)
                torch.add(k, 10.0, out=out)
                torch.div(scratch, out, out=out)  # the ramp
            out.clamp_max_(self.decay)
            out.clamp_min_(self.min_decay)
            torch.sub(one, out, out=out)  # 1 - decay
        if self.warmup not in ("none", "half_life"):
            torch.eq(k, 0.0, out=scratch)  # 1.0 at update 0, else 0.0
            torch.maximum(out, scratch, out=out)  # update 0 copies (weight 1); others keep 1 - decay, which is > 0

    def state(self) -> dict[str, Any]:
        """The schedule as plain numbers and strings (loads with ``weights_only=True``)."""
        return asdict(self)


def schedule_differences(saved: Any, ours: Mapping[str, Any]) -> list[str]:
    """Each setting of ``saved`` (a state's ``schedule``) that is not ``ours``, as ``name saved (saved) vs ours``; a
    setting the state lacks (saved before it existed) is not compared. A warm-up saved as a bool reads as its name."""
    if not isinstance(saved, Mapping):
        return [f"schedule {saved!r} is not a mapping"]
    aliases = {True: "power", False: "none"}
    out = []
    for name, value in saved.items():
        value = aliases.get(value, value) if name == "warmup" and isinstance(value, bool) else value
        if name in ours and value != ours[name]:
            out.append(f"{name} {value!r} (saved) vs {ours[name]!r} (this EMA)")
        elif name not in ours:
            out.append(f"{name} {value!r} (saved) is not a setting of this EMA")
    return out
