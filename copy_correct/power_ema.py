"""``PowerEMA``: power-function EMA profiles of a model (EDM2), updated in place per optimizer step, and snapshots of
them for post-hoc reconstruction (``copy_correct.posthoc_ema.synthesize``).

Copy contract:

* Each profile (one per ``sigma_rel``) is plain tensors of its own (``profiles[k][name]``, keyed by the model's
  ``state_dict()`` names), made once with a copy of the model's at construction: ``requires_grad=False``, never an
  ``nn.Parameter``, never in ``model.parameters()``, an optimizer or autograd. The module is never deep-copied.
  Tied weights share one tensor per profile.
* ``update()`` writes into the profiles in place under ``torch.no_grad()``: per (device, dtype) group, one
  ``torch._foreach_lerp_`` per profile for the floating tensors (parameters and floating buffers) and one
  ``torch._foreach_copy_`` per profile for integer buffers. It allocates nothing and reads nothing back from a
  device: ``beta`` is a Python float computed on the host from the host's step counters (under ``skip_nonfinite`` on
  the CPU, from the applied step, a CPU tensor's value). Each write raises the profile tensors' versions by one on
  every device (``copy_correct._foreach_writes``); an update skipped on the CPU writes nothing (``skip_nonfinite``).
* A float16/bfloat16 model gets float32 profiles (``shadow_dtype=None``); a group whose profile dtype differs from the
  model's keeps one staging copy of its live tensors in the profile dtype, allocated once and shared by the profiles.
* ``beta`` for an update at optimizer step ``t`` whose previous update was at step ``p`` is
  ``(p / t) ** (gamma + 1)``, the product of the per-step ``(1 - 1/s) ** (gamma + 1)`` over ``s = p+1..t``. With
  ``update_every=N`` the profile is therefore exactly the per-step power EMA of the weights sampled at every N-th step
  (each sample standing for the N steps it ends), as EDM2's ``power_function_beta(t_next=cur_nimg,
  t_delta=batch_size)``. The per-step ``beta`` applied on every N-th step only (ema-pytorch 0.8.3's ``KarrasEMA``
  with ``update_every=N``) averages over far more than asked: more than twice the relative width at N=5.
* ``snapshot()`` returns new CPU tensors (a copy of every profile, ties kept) with the metadata that reconstruction
  needs (``step``, ``sigma_rels``, ``gammas``); ``save_snapshot(directory)`` writes it to
  ``power-ema-STEP.pt`` atomically (``copy_correct._atomic_save``: a crash leaves no partial file under that name).
  ``snapshot_every`` does so from ``update()`` on a schedule: the only place where the update waits for a device.
* ``pickle`` and ``copy.deepcopy`` copy the settings, the counters and the profiles (new storage, ties kept), never
  the model: a copy tracks no model until ``track(model)`` or ``update(model)`` gives it one, whose names, shapes and
  ties must be the profiles'; the profiles keep their dtypes and devices. A sharded PowerEMA refuses to be copied.
* ``state_dict()`` holds the counters and the profiles' own tensors (aliased, like ``Module.state_dict``: save it
  before the next update); ``load_state_dict`` copies into them in place, so a resumed run continues the profiles and
  the snapshot schedule bit for bit. Both load with ``weights_only=True``.
* ``skip_nonfinite=True`` (off by default): an update whose live parameters or floating buffers hold any NaN or Inf
  leaves every profile bit for bit as it was (``-0.0`` entries and integer buffers included), decided once per update
  for all profiles. With every profile on the CPU the live values (staged into the profiles' dtype where they differ, as
  without the guard) are checked on the host before anything is written, one reduction per tensor into scratch made
  once, exact, a finite tensor whose sum overflows included (``copy_correct._finite_check``): nothing allocated per
  update, and a skipped update writes nothing, so the profiles' versions stay; a clean one is the unguarded update, bit
  for bit. That costs 1.22x the plain update with two profiles on the large models of ``benchmarks/posthoc_ema.py`` and
  1.67x on the digits MLP (2 CPU threads): within the price set for a default (1.35x on large models, 2x on small
  ones), but the guarded update then trails
  ema-pytorch's unguarded ``PostHocEMA.update`` (by 2% and 12%), so it stays opt-in, as ``EMA``'s does. On a GPU it is
  decided on the device as ``EMA`` does there (``copy_correct._nonfinite``: no value read back, nothing allocated per
  update, every kernel run whatever the flag holds, each version raised by one either way), with one flat staging copy
  of the live values in the profiles' dtype, shared by all profiles; that staging made the guarded update 4.3x the plain
  one on an H200. A skipped update is an update that did not happen: the step of the last *applied* update is kept (a
  0-dim float64 tensor beside the profiles), and the next good update at step ``t`` uses ``beta = (applied / t) **
  (gamma + 1)``: on the CPU ``betas(t, applied)`` itself, on CUDA computed on the device in float64 with ``betas``'
  operations. So each profile is exactly the power EMA of the weights of the applied updates, each standing for the
  steps since the one before: the weights of a skipped update's steps are replaced by those of the next applied update
  (at ``update_every=N``, a skipped sample merges into the next, as if ``update_every`` were ``2N`` there). ``step``,
  ``update_every`` and ``snapshot_every`` count calls, skipped or not; ``updated_step`` is the last update made, skipped
  or not; ``applied_step`` and ``skipped`` read the counters (on a GPU a sync, the reader's). A snapshot's ``step`` is
  the applied step (one taken with nothing applied since the last rewrites that file, the same profiles under the same
  name), so ``synthesize``'s power-function response stays exact: it reconstructs the post-hoc EMA of that trajectory,
  no approximation added; against a run with nothing skipped, a skipped update at step ``s`` after an applied one at
  ``p`` moves the share ``(s ** (g+1) - p ** (g+1)) / t ** (g+1)`` of a profile at step ``t`` from the weights of step
  ``s`` to those of the next applied update. The snapshot also records ``skipped`` (the count so far); ``state_dict``
  saves ``skipped`` and ``applied_step``. ``skip_nonfinite=True`` is refused for a model non-finite at construction and
  for a sharded one (each rank would decide alone, and agreeing would take a collective per update).

Sharded models (FSDP2: every parameter a ``DTensor``, each rank holding its shard; ``sharded`` is True):

* Each profile is per rank, as ``EMA``'s shadow: a sharded parameter's profile tensor is a ``DTensor`` spread like it,
  whose local tensor is a copy of this rank's shard (buffers, which FSDP2 does not shard, are kept whole). ``update``
  runs its foreach calls on the local shards (``to_local()`` views taken on each call): the average of a shard is the
  shard of the average, so no collective is issued and nothing is allocated.
* Each rank snapshots its own shards (plain CPU tensors) into ``power-ema-STEP-rankRofW.pt``, with ``rank``,
  ``world_size`` and each tensor's ``layout``; ``synthesize`` combines one rank's files into that rank's shards
  (``snapshot_paths(directory, rank=r)``), with no gather: the combination is linear.
* ``state_dict`` holds the profiles as ``DTensor``s (save it with ``torch.distributed.checkpoint``);
  ``load_state_dict`` takes ``DTensor``s spread as the model is, or full plain tensors, of which each rank copies its
  own part (nothing is sent); a state spread otherwise is refused, naming both.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from copy_correct._atomic_save import atomic_save
from copy_correct._checks import flag, floating_dtype, integer, module, real, shown
from copy_correct._finite_check import FiniteCheck, checked_values
from copy_correct._foreach_writes import foreach_copy_, foreach_lerp_
from copy_correct._model_changes import Entry, ModelWatch, changes
from copy_correct._module_tensors import TensorRefs, state_entries, unwrap
from copy_correct._nonfinite import ProfilesGuard, guard_wanted
from copy_correct._peer_calls import POWER_EMA_NAMES, missing, not_callable
from copy_correct._sharding import from_local, is_sharded, layout, local, local_part, reshard
from copy_correct._torch_internals import set_grad_enabled
from copy_correct.power_function import SIGMA_REL_MAX, sigma_rel_to_gamma

__all__ = ["SNAPSHOT_FORMAT", "PowerEMA", "snapshot_name"]

SNAPSHOT_FORMAT = "copy_correct.power_ema.snapshot/1"
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _check_match(entries: list[tuple[str, torch.Tensor, Any]], profile: Mapping[str, torch.Tensor]) -> None:
    """``ValueError`` unless a model's ``state_entries`` and a profile have the same names, shapes and ties."""
    names = [name for name, _, _ in entries]
    if set(names) != set(profile):
        missing, unexpected = sorted(set(names) - set(profile)), sorted(set(profile) - set(names))
        raise ValueError(f"the model is not the profiles': missing {missing[:5]}, unexpected {unexpected[:5]}")
    live_ties, profile_ties = {}, {}
    for name, live, _ in entries:
        if profile[name].shape != live.shape:
            raise ValueError(
                f"{name!r} is {tuple(live.shape)} in the model, {tuple(profile[name].shape)} in the profiles"
            )
        live_ties.setdefault(id(live), name)
        profile_ties.setdefault(id(profile[name]), name)
        if live_ties[id(live)] != profile_ties[id(profile[name])]:
            raise ValueError(f"{name!r} is tied to other tensors in the model than in the profiles")


def _sigma_rels(given: Any) -> tuple[float, ...]:
    """The ``sigma_rels`` argument as floats, checked: a sequence of distinct numbers (one number alone is a
    ``TypeError``: ``(0.05,)`` is one profile); ``sigma_rel_to_gamma`` refuses one outside ``(0, SIGMA_REL_MAX)``."""
    interval = f"(0, {SIGMA_REL_MAX:.4f})"
    if not isinstance(given, Iterable) or isinstance(given, (str, bytes)):
        raise TypeError(
            f"sigma_rels must be a sequence of numbers in {interval}, one per profile, such as (0.05, 0.10), got "
            f"{shown(given)}"
        )
    sigma_rels = tuple(real(f"sigma_rels[{i}]", s, f"a number in {interval}") for i, s in enumerate(given))
    if not sigma_rels or len(set(sigma_rels)) != len(sigma_rels):
        raise ValueError(f"sigma_rels must be one or more distinct values, got {sigma_rels}")
    return sigma_rels


def snapshot_name(step: int, rank: int | None = None, world_size: int | None = None) -> str:
    """The file name of the snapshot of step ``step``: ``power-ema-000001000.pt`` (sorts by step), or for a rank of
    a sharded model ``power-ema-000001000-rank0of2.pt``."""
    shard = "" if rank is None else f"-rank{rank}of{world_size}"
    return f"power-ema-{step:09d}{shard}.pt"


@dataclass
class _Group:
    """Live tensors that one foreach call per profile can update: same device and dtype on each side."""

    average: bool  # floating: lerp; integer: copy
    live_device: torch.device
    live_dtype: torch.dtype
    live: TensorRefs = field(default_factory=TensorRefs)
    profiles: list[list[torch.Tensor]] = field(default_factory=list)  # per profile, one tensor per live tensor
    staging: list[torch.Tensor] = field(default_factory=list)  # the live tensors in the profiles' dtype, if it differs


class PowerEMA:
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

    def __init__(
        self,
        model: nn.Module,
        sigma_rels: Sequence[float] = (0.05, 0.10),
        *,
        update_every: int = 1,
        snapshot_every: int | None = None,
        snapshot_dir: str | os.PathLike[str] | None = None,
        include_buffers: bool = True,
        shadow_dtype: torch.dtype | None = None,
        skip_nonfinite: bool = False,
    ) -> None:
        module("model", model)
        sigma_rels = _sigma_rels(sigma_rels)
        update_every = integer("update_every", update_every, 1)
        if snapshot_every is not None and (integer("snapshot_every", snapshot_every, 1) % update_every):
            raise ValueError(
                f"snapshot_every must be a positive multiple of update_every={update_every}, got {snapshot_every}"
            )
        if (snapshot_every is None) != (snapshot_dir is None):
            raise ValueError("snapshot_every and snapshot_dir go together: give both, or neither")
        if snapshot_dir is not None and not isinstance(snapshot_dir, (str, os.PathLike)):
            raise TypeError(f"snapshot_dir must be a path (str or os.PathLike) or None, got {shown(snapshot_dir)}")
        self.sigma_rels = sigma_rels
        self.gammas = tuple(sigma_rel_to_gamma(s) for s in sigma_rels)
        self.update_every = update_every
        self.snapshot_every = snapshot_every
        self.snapshot_dir = Path(snapshot_dir) if snapshot_dir is not None else None
        self.step = 0  # optimizer steps seen (update() calls)
        self.updated_step = 0  # the step of the last averaging update: the profiles hold weights of steps 1..this
        self.include_buffers = flag("include_buffers", include_buffers)
        self.shadow_dtype = floating_dtype("shadow_dtype", shadow_dtype)
        self._model: nn.Module | None = unwrap(model)
        self.sharded = any(is_sharded(p) for p in self._model.parameters())
        self.profiles: list[dict[str, torch.Tensor]] = [{} for _ in sigma_rels]
        self._groups = self._build()
        self._entries = self._entries_of(self._model)
        self._watch = ModelWatch()
        if not any(group.average for group in self._groups):
            buffers = "parameters or buffers" if include_buffers else "parameters (include_buffers=False)"
            raise ValueError(f"model ({type(self._model).__name__}) has no floating {buffers}: nothing to average")
        self.skip_nonfinite = guard_wanted(
            skip_nonfinite,
            "PowerEMA",
            sharded=self.sharded,
            tensors={name: local(t) for name, t in self.profiles[0].items()},
        )
        self._guard: ProfilesGuard | FiniteCheck | None = None
        if self.skip_nonfinite:
            home = self._groups[0].profiles[0][0].device
            self._skipped = torch.zeros((), dtype=torch.float64, device=home)  # updates skipped
            self._applied_step = torch.zeros((), dtype=torch.float64, device=home)  # the last applied update's step
            self._arm()

    def _arm(self) -> None:
        """Under ``skip_nonfinite``, the guard for the groups (built with them; the counters are kept): with every
        profile on the CPU a ``FiniteCheck`` of the values each update averages (the first profile's shapes and dtypes:
        one check shared by all profiles), elsewhere a ``ProfilesGuard``, which stages every group itself (the groups'
        own staging is freed)."""
        if not self.skip_nonfinite:
            return
        if all(t.device.type == "cpu" for group in self._groups for profile in group.profiles for t in profile):
            self._guard = FiniteCheck([group.profiles[0] for group in self._groups if group.average])
            return
        for group in self._groups:
            group.staging = []
        groups = [(group.profiles, group.average) for group in self._groups]
        self._guard = ProfilesGuard(groups, self.gammas, self._skipped, self._applied_step)

    def _build(self, existing: list[dict[str, torch.Tensor]] | None = None) -> list[_Group]:
        """The groups of the tracked model's tensors, each with its profiles' tensors: new copies of the live ones,
        or ``existing`` profiles (a copy's, given a model by ``track``), which keep their tensors, dtypes and devices
        (a group whose profiles' dtype or device differs from the model's stages the live values)."""
        assert self._model is not None
        entries = list(state_entries(self._model, self.include_buffers))
        if existing is not None:
            _check_match(entries, existing[0])
        groups: dict[tuple, _Group] = {}
        first_name: dict[int, str] = {}
        with torch.no_grad():
            for name, live, owner in entries:
                if id(live) in first_name:  # tied weights share one tensor per profile
                    for profile in self.profiles:
                        profile[name] = profile[first_name[id(live)]]
                    continue
                first_name[id(live)] = name
                average = live.is_floating_point()
                dtype, device = live.dtype, live.device
                if existing is not None:
                    dtype, device = existing[0][name].dtype, existing[0][name].device
                elif average and self.shadow_dtype is not None:
                    dtype = self.shadow_dtype
                elif average and live.dtype in _LOW_PRECISION:
                    dtype = torch.float32
                key = (live.device, live.dtype, device, dtype, average)
                if key not in groups:
                    groups[key] = _Group(average, live.device, live.dtype, profiles=[[] for _ in self.profiles])
                group = groups[key]
                group.live.append(live, owner)
                for k, (profile, tensors) in enumerate(zip(self.profiles, group.profiles, strict=True)):
                    # a copy's own tensor, or a new copy of the live one (this rank's shard when sharded)
                    shard = existing[k][name] if existing is not None else local(live).to(dtype=dtype, copy=True)
                    profile[name] = from_local(shard, live) if is_sharded(live) else shard
                    tensors.append(shard)
                if (dtype, device) != (live.dtype, live.device):  # freed by _arm for a ProfilesGuard (it stages)
                    group.staging.append(torch.empty(local(live).shape, dtype=dtype, device=device))
        return list(groups.values())

    # -- copies ---------------------------------------------------------------------------------------------

    @property
    def live_model(self) -> nn.Module | None:
        """The module whose weights are averaged (unwrapped): the live weights, not an average; ``None`` in a copy
        until it is given one."""
        return self._model

    def __getattr__(self, name: str) -> Any:
        """Only for an attribute the PowerEMA lacks: a peer's name (ema-pytorch's ``PostHocEMA``) raises naming
        ours."""
        if name.startswith("__"):
            raise AttributeError(name)
        missing(self, name, POWER_EMA_NAMES)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """ema-pytorch's ``ema(x)`` runs its first profile's model; the profiles here are tensors, and it says so."""
        not_callable(self, POWER_EMA_NAMES)

    def _check_model(self, model: nn.Module) -> None:
        """``RuntimeError`` naming the tensor when ``model`` is no longer what the profiles pair (replaced, added,
        removed, reshaped or moved: ``copy_correct._model_changes``)."""
        if self.sharded:
            reshard(model)
        change = changes(model, self.include_buffers, self._entries)
        if change is not None:
            raise RuntimeError(f"PowerEMA: {change}")
        self._watch.seen()

    def _entries_of(self, model: nn.Module) -> list[Entry]:
        return [
            Entry(name, tensor if owner is None else None, tensor.device, tensor.dtype, self.profiles[0][name].shape)
            for name, tensor, owner in state_entries(model, self.include_buffers)
        ]

    def track(self, model: nn.Module) -> None:
        """Give a copy (``pickle``, ``copy.deepcopy``) the model to average from now on; the model it tracks already
        is accepted too, any other refused (``ValueError``). The model's ``state_dict`` names, shapes and ties must be
        the profiles'; the profiles keep their own tensors, dtypes and devices. ``update(model)`` calls it for a
        copy."""
        if self._model is not None:
            if unwrap(model) is not self._model:
                raise ValueError("PowerEMA.track: this PowerEMA already tracks another model")
            return
        tracked = unwrap(model)
        if any(is_sharded(p) for p in tracked.parameters()):
            raise ValueError(
                "a copy of a PowerEMA cannot track a sharded (FSDP2) model: build PowerEMA(model) on the sharded model "
                "and load_state_dict the copy's state_dict() into it"
            )
        self._model = tracked
        existing = [dict(profile) for profile in self.profiles]
        try:
            self._groups = self._build(existing)
        except ValueError:
            self._model, self.profiles = None, existing
            raise
        self._entries = self._entries_of(tracked)
        self._arm()

    def __getstate__(self) -> dict[str, Any]:
        """What ``pickle`` and ``copy.deepcopy`` copy: the settings, the counters and the profiles (new storage in the
        copy, tied tensors still one), not the model nor anything that refers to it: the copy tracks no model until it
        is given one (``track``, or ``update(model)``)."""
        if self.sharded:
            raise TypeError(
                "a PowerEMA of a sharded (FSDP2) model cannot be pickled or copied: save its state_dict() with "
                "torch.distributed.checkpoint and load it into PowerEMA(model) of the sharded model"
            )
        return {**self.__dict__, "_model": None, "_groups": [], "_guard": None}

    def betas(self, step: int, previous: int) -> list[float]:
        """Each profile's ``beta`` for an update at optimizer step ``step`` whose previous update was at ``previous``
        (0: none, so ``beta`` is 0 and the update copies): ``(previous / step) ** (gamma + 1)``."""
        return [(previous / step) ** (gamma + 1) for gamma in self.gammas]

    def update(self, model: nn.Module | None = None) -> None:
        """Count one optimizer step; average the model into every profile on every ``update_every``-th, and save a
        snapshot on every ``snapshot_every``-th. In place, under ``no_grad``, no allocation, no host synchronisation
        (scheduled snapshots aside). ``model``, when given, must be the tracked one (wrapped or not)."""
        if self._model is None:
            if model is None:
                raise ValueError(
                    "this PowerEMA is a copy (pickle or copy.deepcopy) and tracks no model yet: pass the model, as in "
                    "update(model), or call track(model) first"
                )
            self.track(model)
        elif model is not None and unwrap(model) is not self._model:
            raise ValueError("PowerEMA.update: this is not the model the PowerEMA was built for")
        if self._watch.stale():
            self._check_model(self._model)
        self.step += 1
        if self.step % self.update_every:
            return
        grad_was_enabled = torch.is_grad_enabled()
        set_grad_enabled(False)
        try:
            if isinstance(self._guard, ProfilesGuard):
                for index, group in enumerate(self._groups):
                    foreach_copy_(self._guard.staging(index), self._checked_lives(group))
                self._guard.update_profiles(self.step)
            else:
                self._average()
        finally:
            set_grad_enabled(grad_was_enabled)
        self.updated_step = self.step
        if self.snapshot_every is not None and self.step % self.snapshot_every == 0:
            self.save_snapshot(self.snapshot_dir)

    @staticmethod
    def _checked_lives(group: _Group) -> list[torch.Tensor]:
        """The group's live tensors now (this rank's shards when sharded), refused if the model moved."""
        lives = group.live.resolve()
        if lives[0].device != group.live_device or lives[0].dtype != group.live_dtype:
            raise RuntimeError(
                f"the model moved from {group.live_device}/{group.live_dtype} to {lives[0].device}/"
                f"{lives[0].dtype} after the PowerEMA was created: create it after model.to(...)"
            )
        return lives

    def _average(self) -> None:
        """The update, unguarded or decided on the host under a ``FiniteCheck`` (every profile on the CPU): the values
        averaged (staged into the profiles' dtype and device where they differ) are checked once, for all profiles,
        before anything is written, and a non-finite one skips the update whole, writing nothing (no version raised)
        and counting it in ``skipped``. A good one is the unguarded update, ``beta`` spanning from the last applied
        step."""
        check = self._guard if isinstance(self._guard, FiniteCheck) else None  # a device guard does not come here
        values = checked_values(self._groups, self._checked_lives, check, self._skipped if check is not None else None)
        if values is None:
            return
        previous = int(self._applied_step) if check is not None else self.updated_step  # a CPU tensor's value: no sync
        weights = [1.0 - beta for beta in self.betas(self.step, previous)]
        for group, lives in zip(self._groups, values, strict=True):
            for profile, weight in zip(group.profiles, weights, strict=True):
                if group.average:
                    foreach_lerp_(profile, lives, weight)
                else:
                    foreach_copy_(profile, lives)
        if self._guard is not None:
            self._applied_step.fill_(self.step)

    def _skipped_count(self) -> int:
        """How many updates ``skip_nonfinite`` skipped (0 without it). Kept beside the profiles: on a GPU reading it
        waits for the updates queued before (a sync, the reader's, never ``update``'s)."""
        return int(self._skipped) if self.skip_nonfinite else 0

    @property
    def applied_step(self) -> int:
        """The step of the last applied update: the profiles hold the weights of steps ``1..applied_step``.
        ``updated_step`` without ``skip_nonfinite``; with it, read from beside the profiles (on a GPU a sync)."""
        return int(self._applied_step) if self.skip_nonfinite else self.updated_step

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
            state |= {"skipped": int(self._skipped), "applied_step": self.applied_step}
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Copy saved profiles and counters in (in place); ``ValueError`` naming the difference when the state is of
        other ``sigma_rels``, another model, or spread otherwise over the ranks. Sharded: ``DTensor``s spread as the
        model is, or full tensors, of which each rank copies its own part. A state without ``skipped`` and
        ``applied_step`` (saved without ``skip_nonfinite``) counts none skipped."""
        self.check_state(state)
        saved = state["profiles"]
        with torch.no_grad():
            for profile, loaded in zip(self.profiles, saved, strict=True):
                for name, tensor in loaded.items():
                    target = profile[name]
                    if is_sharded(target) and not is_sharded(tensor):
                        tensor = local_part(tensor, target)
                    local(target).copy_(local(tensor))
        self.step = int(state["step"])
        self.updated_step = int(state["updated_step"])
        if self.skip_nonfinite:  # a state saved without the guard: nothing skipped, every update applied
            self._skipped.fill_(int(state.get("skipped", 0)))
            self._applied_step.fill_(int(state.get("applied_step", self.updated_step)))

    def check_state(self, state: Mapping[str, Any]) -> None:
        """``load_state_dict``'s checks alone, reading nothing but names, shapes and spreads: ``ValueError`` naming
        the difference. A profile's entry may be ``None`` (a tensor not read yet), which only its name is checked
        for."""
        absent = [key for key in ("sigma_rels", "step", "updated_step", "profiles") if key not in state]
        if absent:
            raise ValueError(
                f"PowerEMA state has no {', '.join(map(repr, absent))}: a state of PowerEMA.state_dict() holds its "
                "counters and profiles (copy_correct.peer_states reads ema-pytorch's PostHocEMA states)"
            )
        if [float(s) for s in state["sigma_rels"]] != list(self.sigma_rels):
            raise ValueError(f"PowerEMA state has sigma_rels {list(state['sigma_rels'])}, this one {self.sigma_rels}")
        saved = state["profiles"]
        for profile, loaded in zip(self.profiles, saved, strict=True):
            if set(profile) != set(loaded):
                missing, unexpected = sorted(set(profile) - set(loaded)), sorted(set(loaded) - set(profile))
                raise ValueError(
                    f"PowerEMA state does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
                )
            for name, tensor in loaded.items():
                if tensor is None:
                    continue
                if tensor.shape != profile[name].shape:
                    raise ValueError(
                        f"PowerEMA state for {name!r} has shape {tuple(tensor.shape)}, the model's is "
                        f"{tuple(profile[name].shape)}"
                    )
                if is_sharded(tensor) and layout(tensor) != layout(profile[name]):
                    raise ValueError(
                        f"PowerEMA state for {name!r} is {layout(tensor)}, the model's is {layout(profile[name])}: "
                        "a sharded profile is restored only as it was saved, or from full tensors"
                    )

    def __repr__(self) -> str:
        return (
            f"PowerEMA(sigma_rels={self.sigma_rels}, gammas={tuple(round(g, 3) for g in self.gammas)}, "
            f"update_every={self.update_every}, step={self.step}, updated_step={self.updated_step})"
        )
