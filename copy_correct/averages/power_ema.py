"""``PowerEMA``: power-function EMA profiles of a model (EDM2), updated in place per optimizer step, and snapshots of
them for post-hoc reconstruction (``copy_correct.averages.posthoc.synthesize``).

Copy contract (the shadows themselves, copies and model checks: ``copy_correct.averages.shadow``):

* Each profile (one per ``sigma_rel``) is tensors of its own per ``state_dict`` name, made once; the module is never
  deep-copied. A float16/bfloat16 model gets float32 profiles.
* ``update()`` writes in place under ``no_grad``: per group, one ``_foreach_lerp_`` per profile for floating tensors,
  one ``_foreach_copy_`` per profile for integer buffers. It allocates nothing and reads nothing back from a device:
  ``beta`` is a Python float from the host's step counters. An update at step ``t`` after one at ``p`` uses
  ``beta = (p / t) ** (gamma + 1)``, the product of the per-step betas over the steps between, so ``update_every=N``
  gives exactly the per-step power EMA of the weights sampled every N steps (EDM2's ``power_function_beta``).
* ``snapshot()`` is new CPU tensors (ties kept) with what reconstruction reads (``step``, ``sigma_rels``, ``gammas``);
  ``save_snapshot`` writes it atomically, and ``snapshot_every`` does so from ``update``: the only place the update
  waits for a device. ``state_dict`` aliases the profiles; ``load_state_dict`` copies in place, so a resume continues
  profiles and snapshot schedule bit for bit.
* ``skip_nonfinite=True`` (opt-in: its price is in the manual): an update whose live values hold a NaN or an Inf
  leaves every profile bit for bit, one decision for all profiles; the next good update's ``beta`` spans from the last
  applied step, and a snapshot's ``step`` is the applied step, so ``synthesize`` stays exact for that trajectory.
* Sharded (FSDP2): each rank's profiles are copies of its shards, updated with no collective; each rank snapshots its
  own shards (``power-ema-STEP-rankRofW.pt``), which ``synthesize`` combines rank by rank with no gather.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from copy_correct.averages.peer_calls import POWER_EMA_NAMES
from copy_correct.averages.selection import Exclude
from copy_correct.averages.settings import power_ema_settings
from copy_correct.averages.shadow import Shadows, check_tensors, copy_into
from copy_correct.core.checks import module
from copy_correct.core.foreach_writes import foreach_copy_, foreach_lerp_
from copy_correct.core.sharding import layout, local
from copy_correct.core.torch_internals import set_grad_enabled
from copy_correct.files.atomic_save import atomic_save
from copy_correct.guards.device import ProfilesGuard

__all__ = ["SNAPSHOT_FORMAT", "PowerEMA", "snapshot_name"]

SNAPSHOT_FORMAT = "copy_correct.averages.power_ema.snapshot/1"


def snapshot_name(step: int, rank: int | None = None, world_size: int | None = None) -> str:
    """The file name of the snapshot of step ``step``: ``power-ema-000001000.pt`` (sorts by step), or for a rank of
    a sharded model ``power-ema-000001000-rank0of2.pt``."""
    shard = "" if rank is None else f"-rank{rank}of{world_size}"
    return f"power-ema-{step:09d}{shard}.pt"


class PowerEMA(Shadows):
    """Power-function EMA profiles of a model's ``state_dict`` tensors, one per ``sigma_rel``, updated per optimizer
    step, with snapshots for post-hoc reconstruction at any other ``sigma_rel``.

    Args:
        model: the module whose weights are averaged (DDP, ``DataParallel`` and ``torch.compile`` wrappers looked
            through).
        sigma_rels: the profiles' relative standard deviations, each in ``(0, 1/sqrt(12))``; EDM2 tracks 0.05 and 0.10.
        update_every: average on every n-th optimizer step (``update()`` call); ``beta`` accounts for the n steps.
        snapshot_every: save a snapshot into ``snapshot_dir`` every this many steps (a multiple of ``update_every``);
            ``None``: only when ``save_snapshot`` is called.
        snapshot_dir: where scheduled snapshots go.
        include_buffers: average floating buffers and copy integer ones; ``False``: parameters only.
        trainable_only: average only the parameters that require grad when the PowerEMA is built, and the buffers of the
            modules that hold one (``copy_correct.averages.selection``): a LoRA adapter's average without a second
            copy of the frozen base.
        exclude: leave out the ``state_dict`` names starting with one of these prefixes (``("head.",)``), or those
            for which a function of (name, tensor) returns ``True``. A tensor left out holds no shadow;
            the profiles, snapshots and ``state_dict`` lack it.
        shadow_dtype: dtype of the profiles' floating tensors; ``None``: float32 for float16/bfloat16 models, the
            model's dtype otherwise.
        skip_nonfinite: skip every update whose live values hold a NaN or an Inf, leaving every profile bit for bit
            as it was; the next good update is made as if the skipped one had never been. ``skipped`` counts them.
            Off by default: on the CPU it costs one read of the weights (checked on the host, exact, nothing
            allocated; a skipped update writes nothing), about 1.2x the update with two profiles; on a GPU it
            decides on the device from a staging copy of the weights (4.3x the update on an H200). Refused for a
            sharded model and for one holding a NaN or an Inf now.

    Every argument is checked here, in one line naming it and what it takes: a value of the wrong type (a string for
    a number, one number for ``sigma_rels``, a bool for an int, ``model.parameters()`` for the model) is a
    ``TypeError``, one out of range a ``ValueError``, and so is a model with no floating parameter or buffer to
    average (``nn.ReLU()``).
    """

    _kind = "PowerEMA"
    _peer_names = POWER_EMA_NAMES

    def __init__(
        self,
        model: nn.Module,
        sigma_rels: Sequence[float] = (0.05, 0.10),
        *,
        update_every: int = 1,
        snapshot_every: int | None = None,
        snapshot_dir: str | os.PathLike[str] | None = None,
        include_buffers: bool = True,
        trainable_only: bool = False,
        exclude: Exclude = (),
        shadow_dtype: torch.dtype | None = None,
        skip_nonfinite: bool = False,
    ) -> None:
        module("model", model)
        settings = power_ema_settings(locals())  # every argument by name, as written in the signature above
        self.sigma_rels = settings.sigma_rels
        self.gammas = settings.gammas
        self.update_every = settings.update_every
        self.snapshot_every = settings.snapshot_every
        self.snapshot_dir = settings.snapshot_dir
        self.step = 0  # optimizer steps seen (update() calls)
        self.updated_step = 0  # the step of the last averaging update: the profiles hold weights of steps 1..this
        self._init_shadows(model, len(self.sigma_rels), settings)  # skip_nonfinite: ``_applied``, the last applied step

    @property
    def profiles(self) -> list[dict[str, torch.Tensor]]:
        """Each profile by ``state_dict`` name: its own tensors, which hold it at all times."""
        return self._copies

    def _device_guard(self) -> ProfilesGuard:
        """The guard of profiles off the CPU: it stages, checks and averages (or selects) on the device."""
        groups = [(group.copies, group.average) for group in self._groups]
        return ProfilesGuard(groups, self.gammas, self._skipped, self._applied)

    def betas(self, step: int, previous: int) -> list[float]:
        """Each profile's ``beta`` for an update at optimizer step ``step`` whose previous update was at ``previous``
        (0: none, so ``beta`` is 0 and the update copies): ``(previous / step) ** (gamma + 1)``."""
        return [(previous / step) ** (gamma + 1) for gamma in self.gammas]

    def update(self, model: nn.Module | None = None) -> None:
        """Count one optimizer step; average the model into every profile on every ``update_every``-th, and save a
        snapshot on every ``snapshot_every``-th. In place, under ``no_grad``, no allocation, no host synchronisation
        (scheduled snapshots aside). ``model``, when given, must be the tracked one (wrapped or not)."""
        tracked = self._tracked(model)
        if self._watch.stale():
            self._check_model(tracked)
        self.step += 1
        if self.step % self.update_every:
            return
        grad_was_enabled = torch.is_grad_enabled()
        set_grad_enabled(False)
        try:
            if isinstance(self._guard, ProfilesGuard):
                self._stage()
                self._guard.update_profiles(self.step)
            else:
                self._average()
        finally:
            set_grad_enabled(grad_was_enabled)
        self.updated_step = self.step
        if self.snapshot_every is not None and self.step % self.snapshot_every == 0:
            self.save_snapshot(self.snapshot_dir)

    def _average(self) -> None:
        """The update without a guard, or under a ``FiniteCheck`` (every profile on the CPU), which skips it whole,
        writing nothing, when a value averaged holds a NaN or an Inf (``_values``); a good one's ``beta`` spans from
        the last applied step."""
        values = self._values()
        if values is None:
            return
        previous = int(self._applied) if self._guard is not None else self.updated_step  # a CPU tensor: no sync
        weights = [1.0 - beta for beta in self.betas(self.step, previous)]
        for group, lives in zip(self._groups, values, strict=True):
            for profile, weight in zip(group.copies, weights, strict=True):
                if group.average:
                    foreach_lerp_(profile, lives, weight)
                else:
                    foreach_copy_(profile, lives)
        if self._guard is not None:
            self._applied.fill_(self.step)

    @property
    def applied_step(self) -> int:
        """The step of the last applied update: the profiles hold the weights of steps ``1..applied_step``.
        ``updated_step`` without ``skip_nonfinite``; with it, read from beside the profiles (on a GPU a sync)."""
        return int(self._applied) if self.skip_nonfinite else self.updated_step

    # -- snapshots ----------------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The profiles as they are now, in new CPU tensors (ties kept; this rank's shards when sharded), with
        ``step`` (the last averaged step: the profiles hold the weights of steps ``1..step``), ``sigma_rels`` and
        ``gammas``: what ``synthesize`` reads. Sharded: also ``rank``, ``world_size`` and each tensor's ``layout``.
        Under ``skip_nonfinite``, ``step`` is ``applied_step`` and ``skipped`` the count so far."""
        step = self.applied_step
        if step == 0:
            raise RuntimeError("PowerEMA.snapshot before the first update: the profiles hold no training step yet")
        profiles = []
        with torch.no_grad():
            for profile in self.profiles:
                copies: dict[int, torch.Tensor] = {}
                for t in profile.values():
                    if id(t) not in copies:
                        copies[id(t)] = local(t).to("cpu", copy=True)
                profiles.append({name: copies[id(t)] for name, t in profile.items()})
        state = {
            "format": SNAPSHOT_FORMAT,
            "step": step,
            "sigma_rels": list(self.sigma_rels),
            "gammas": list(self.gammas),
            "profiles": profiles,
        }
        if self.skip_nonfinite:
            state["skipped"] = int(self._skipped)
        if self.sharded:
            import torch.distributed as dist

            state.update(
                rank=dist.get_rank(),
                world_size=dist.get_world_size(),
                layout={name: layout(t) for name, t in self.profiles[0].items()},
            )
        return state

    def save_snapshot(self, directory: str | os.PathLike[str] | None = None) -> Path:
        """Write ``snapshot()`` to ``directory / snapshot_name(step)`` atomically (temporary file, ``fsync``,
        ``os.replace``); the path. ``directory`` defaults to ``snapshot_dir``. Sharded: every rank calls it, and
        writes its own file."""
        directory = directory if directory is not None else self.snapshot_dir
        if directory is None:
            raise ValueError("PowerEMA.save_snapshot: give a directory (or snapshot_dir at construction)")
        state = self.snapshot()
        name = snapshot_name(state["step"], state.get("rank"), state.get("world_size"))
        return atomic_save(state, Path(directory) / name)

    # -- checkpoints ----------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Counters, settings and the profiles' own tensors (aliased: save before the next update; ``DTensor``s for a
        sharded model). Under ``skip_nonfinite`` also ``skipped`` and ``applied_step``, read from the device."""
        state = {
            "sigma_rels": list(self.sigma_rels),
            "step": self.step,
            "updated_step": self.updated_step,
            "profiles": [dict(profile) for profile in self.profiles],
        }
        if self.skip_nonfinite:  # read from the device: a sync per save
            state |= {"skipped": self._skipped_count(), "applied_step": self.applied_step}
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Copy saved profiles and counters in (in place); ``ValueError`` naming the difference when the state is of
        other ``sigma_rels``, another model, or spread otherwise over the ranks. Sharded: ``DTensor``s spread as the
        model is, or full tensors, of which each rank copies its own part. A state without ``skipped`` and
        ``applied_step`` (saved without ``skip_nonfinite``) counts none skipped."""
        self.check_state(state)
        for profile, loaded in zip(self.profiles, state["profiles"], strict=True):
            copy_into(profile, loaded)
        self.step = int(state["step"])
        self.updated_step = int(state["updated_step"])
        if self.skip_nonfinite:  # a state saved without the guard: nothing skipped, every update applied
            self._skipped.fill_(int(state.get("skipped", 0)))
            self._applied.fill_(int(state.get("applied_step", self.updated_step)))

    def check_state(self, state: Mapping[str, Any]) -> None:
        """``load_state_dict``'s checks alone, reading nothing but names, shapes and spreads: ``ValueError`` naming
        the difference. A profile's entry may be ``None`` (a tensor not read yet), which only its name is checked
        for."""
        absent = [key for key in ("sigma_rels", "step", "updated_step", "profiles") if key not in state]
        if absent:
            raise ValueError(
                f"PowerEMA state has no {', '.join(map(repr, absent))}: a state of PowerEMA.state_dict() holds its "
                "counters and profiles (copy_correct.averages.peer_states reads ema-pytorch's PostHocEMA states)"
            )
        if [float(s) for s in state["sigma_rels"]] != list(self.sigma_rels):
            raise ValueError(f"PowerEMA state has sigma_rels {list(state['sigma_rels'])}, this one {self.sigma_rels}")
        for profile, loaded in zip(self.profiles, state["profiles"], strict=True):
            check_tensors("PowerEMA", loaded, profile)

    def __repr__(self) -> str:
        return (
            f"PowerEMA(sigma_rels={self.sigma_rels}, gammas={tuple(round(g, 3) for g in self.gammas)}, "
            f"update_every={self.update_every}, step={self.step}, updated_step={self.updated_step})"
        )
