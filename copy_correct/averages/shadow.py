"""``Shadows``: what ``EMA`` and ``PowerEMA`` share. Both keep copies of a model's ``state_dict`` tensors ("shadows":
``EMA`` one, ``PowerEMA`` one per profile) and update them in place from the live tensors.

Copy contract:

* Every shadow is a new tensor made once, by ``.to(copy=True)`` under ``no_grad`` at construction:
  ``requires_grad=False``, never an ``nn.Parameter``, never in ``model.parameters()``, an optimizer or autograd. Tied
  tensors share one shadow per copy. A sharded (FSDP2) tensor's shadow is a ``DTensor`` spread like it whose local
  tensor is a copy of this rank's shard; buffers, which FSDP2 does not shard, are kept whole.
* The shadows are grouped once by (shadow device and dtype, live device and dtype, floating or not), so an update is
  one foreach call per group and copy. A group whose shadows differ from the live tensors in dtype or device keeps one
  staging tensor per live tensor, allocated once. Parameters are looked up by object, buffers by (module, name):
  ``model.to(...)`` replaces buffer objects.
* A model changed under the shadows (a tensor replaced, added, removed, reshaped or moved) is refused by name
  (``copy_correct.averages.model_changes``) before anything is written, the shadows bit for bit as they were. Each group
  keeps its live tensors' data pointers: a storage replaced in place (``param.data = ...``, ``model.to(...)``), which no
  hook sees, changes one, and the update then checks every live tensor's shape, dtype and device first; a storage
  swapped for one alike is followed.
* ``pickle`` and ``copy.deepcopy`` copy the settings, counters and shadows (new storage, ties kept), never the model: a
  copy tracks no model until ``track(model)`` gives it one whose names, shapes and ties are the shadows'; the shadows
  keep their dtypes and devices. A sharded average refuses to be copied (save its ``state_dict``).
* Under ``skip_nonfinite`` shadows on the CPU get a ``FiniteCheck`` of the values each update averages (checked on the
  host before anything is written); elsewhere the subclass's device guard (``copy_correct.guards.device``), which stages
  the live values itself, so the groups' staging is freed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from copy_correct.averages.model_changes import Entry, ModelWatch, changes
from copy_correct.averages.peer_calls import missing, not_callable
from copy_correct.averages.selection import Chosen
from copy_correct.averages.settings import EMASettings, PowerEMASettings
from copy_correct.core.foreach_writes import foreach_copy_
from copy_correct.core.module_tensors import DATA_PTR, TensorRefs, unwrap
from copy_correct.core.sharding import from_local, is_sharded, layout, local, local_part, reshard
from copy_correct.guards.choice import choose
from copy_correct.guards.device import guard_wanted
from copy_correct.guards.host import FiniteCheck

__all__ = ["Group", "Shadows", "check_tensors", "copy_into", "gathered", "misfit", "write_into"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclass
class Group:
    """Live tensors and their shadows that one foreach call per copy can update: same devices and dtypes on each
    side."""

    average: bool  # floating: lerp; integer: copy
    live_device: torch.device
    live_dtype: torch.dtype
    copies: list[list[torch.Tensor]]  # per copy, the local shadow of each live tensor
    live: TensorRefs = field(default_factory=TensorRefs)
    staging: list[torch.Tensor] = field(default_factory=list)  # when shadow and live differ in dtype or device
    names: list[str] = field(default_factory=list)  # the state_dict name of each live tensor, for messages
    parameters: list[bool] = field(default_factory=list)  # whether each live tensor is a parameter
    pointers: list[int] = field(default_factory=list)  # the live tensors' data pointers, when last checked
    shadows: list[torch.Tensor] = field(init=False)  # copies[0] (EMA's only copy), the same list

    def __post_init__(self) -> None:
        self.shadows = self.copies[0]


class Shadows:
    """The base of ``EMA`` and ``PowerEMA``: the shadows (``_copies``), their groups, the tracked model, copies, the
    non-finite guard's counters. A subclass sets ``_kind``, ``_peer_names`` and ``_device_guard``."""

    _kind: ClassVar[str]
    _peer_names: ClassVar[dict[str, tuple[str, str]]]
    _moved_hint: ClassVar[str] = ""  # how to avoid a model moved after construction, for the message
    _not_copied: ClassVar[dict[str, Any]] = {}  # attributes a pickled copy leaves out, beyond the model's

    def _init_shadows(self, model: nn.Module, copies: int, settings: EMASettings | PowerEMASettings) -> None:
        """Build ``copies`` shadows of ``model`` (already checked to be a module) as ``settings`` say and, under
        ``skip_nonfinite``, the guard."""
        selection = settings.selection
        self.include_buffers, self.trainable_only, self.exclude = (
            selection.include_buffers,
            selection.trainable_only,
            selection.exclude,
        )
        self.shadow_dtype = settings.shadow_dtype
        self.device = settings.device
        tracked = unwrap(model)
        self._model: nn.Module | None = tracked  # None in a copy, until it is given a model (track)
        self.sharded = any(is_sharded(p) for p in tracked.parameters())
        if self.sharded and self.device is not None:
            raise ValueError(
                f"device={str(self.device)!r} is not supported for a sharded (FSDP2) model: leave device=None, each "
                "rank's shadow then lives beside its shards"
            )
        self._watch = ModelWatch()
        self._chosen: Chosen = selection.choose(tracked)  # the tensors averaged, by name, from now on
        self._copies, self._groups = self._build(tracked, [{} for _ in range(copies)], given=False)
        self._entries = self._entries_of(tracked)
        if not any(group.average for group in self._groups):
            raise ValueError(
                f"model ({type(tracked).__name__}) has no floating {self._chosen.describe()}: nothing to average"
            )
        self.skip_nonfinite = guard_wanted(
            settings.skip_nonfinite,
            self._kind,
            sharded=self.sharded,
            tensors={name: local(t) for name, t in self._copies[0].items()},
        )
        self._guard: Any = None
        if self.skip_nonfinite:
            home = self._groups[0].copies[0][0].device
            self._skipped = torch.zeros((), dtype=torch.float64, device=home)  # updates skipped
            self._applied = torch.zeros((), dtype=torch.float64, device=home)  # the subclass's applied counter
            self._arm()

    def _build(
        self, model: nn.Module, copies: list[dict[str, torch.Tensor]], *, given: bool
    ) -> tuple[list[dict[str, torch.Tensor]], list[Group]]:
        """New shadows by name, per copy, and the groups pairing them with the model's tensors. The shadows are new
        copies of the model's (``given=False``: ``copies`` are empty dicts to fill), or ``copies``' own tensors (a
        copy of an average given a model: ``track``), checked against the model's names, shapes and ties."""
        made: list[dict[str, torch.Tensor]] = [{} for _ in copies]
        first_name: dict[int, str] = {}
        claimed: set[int] = set()  # the given shadows paired with a tensor of the model so far
        groups: dict[tuple, Group] = {}
        reshard(model)  # the sharded parameters registered, not gathered copies
        with torch.no_grad():
            for name, live, owner in self._chosen.entries(model):
                if id(live) in first_name:  # tied weights share one shadow per copy
                    for shadows in made:
                        shadows[name] = shadows[first_name[id(live)]]
                    continue
                first_name[id(live)] = name
                average = live.is_floating_point()
                if given:
                    locals_ = [self._given(shadows, name, live, claimed) for shadows in copies]
                    for shadows, shadow in zip(made, locals_, strict=True):
                        shadows[name] = shadow
                else:
                    dtype = self._dtype_for(live.dtype) if average else live.dtype
                    device = self.device or live.device
                    locals_ = [local(live).to(device=device, dtype=dtype, copy=True) for _ in copies]  # a shard's
                    for shadows, shadow in zip(made, locals_, strict=True):
                        shadows[name] = from_local(shadow, live) if is_sharded(live) else shadow
                first = locals_[0]
                key = (first.device, first.dtype, live.device, live.dtype, average)
                if key not in groups:
                    groups[key] = Group(average, live.device, live.dtype, [[] for _ in copies])
                group = groups[key]
                for tensors, shadow in zip(group.copies, locals_, strict=True):
                    tensors.append(shadow)
                group.live.append(live, owner)
                group.names.append(name)
                group.parameters.append(owner is None)
                if first.dtype != live.dtype or first.device != live.device:
                    group.staging.append(torch.empty_like(first))
        if given:
            self._check_given(copies, made)
        for group in groups.values():
            group.pointers = list(map(DATA_PTR, group.live.resolve()))
        return made, list(groups.values())

    def _given(
        self, given: Mapping[str, torch.Tensor], name: str, live: torch.Tensor, claimed: set[int]
    ) -> torch.Tensor:
        """``given[name]``, the shadow of the model's tensor ``live``, once checked against it and against the shadows
        ``claimed`` by other tensors of the model (which it joins)."""
        cannot = f"this {self._kind} cannot track the model"
        if name not in given:
            raise ValueError(f"{cannot}: the model has {name!r}, the shadow has not")
        shadow = given[name]
        if id(shadow) in claimed:
            raise ValueError(f"{cannot}: {name!r} is tied to another tensor in the shadow, not in the model")
        claimed.add(id(shadow))
        if shadow.shape != live.shape or shadow.is_floating_point() != live.is_floating_point():
            raise ValueError(
                f"{cannot}: {name!r} is {tuple(shadow.shape)} {shadow.dtype} in the shadow, "
                f"{tuple(live.shape)} {live.dtype} in the model"
            )
        return shadow

    def _check_given(self, given: list[dict[str, torch.Tensor]], made: list[dict[str, torch.Tensor]]) -> None:
        """Refuse shadows the model leaves over, and ties the model makes that the shadows do not."""
        cannot = f"this {self._kind} cannot track the model"
        for before, after in zip(given, made, strict=True):
            untracked = sorted(set(before) - set(after))
            if untracked:
                raise ValueError(f"{cannot}: the shadow has {untracked[:5]}, the model has not")
            tied = sorted(name for name in after if after[name] is not before[name])
            if tied:
                raise ValueError(f"{cannot}: the model ties {tied[:5]} to other tensors, the shadow does not")

    def _dtype_for(self, dtype: torch.dtype) -> torch.dtype:
        """A floating shadow's dtype: ``shadow_dtype``, else float32 for a float16/bfloat16 model, else the model's."""
        if self.shadow_dtype is not None:
            return self.shadow_dtype
        return torch.float32 if dtype in _LOW_PRECISION else dtype

    def _entries_of(self, model: nn.Module) -> list[Entry]:
        """The model's tensors as the shadows pair them now, for ``_check_model``."""
        shadows = self._copies[0]
        return [
            Entry(name, tensor if owner is None else None, tensor.device, tensor.dtype, shadows[name].shape)
            for name, tensor, owner in self._chosen.entries(model)
        ]

    def _check_model(self, model: nn.Module) -> None:
        """``RuntimeError`` naming the tensor when ``model`` is no longer what the shadows pair (a tensor replaced,
        added, removed, reshaped or moved): a walk over its ``state_dict`` names, no tensor read."""
        if self.sharded:
            reshard(model)  # the sharded parameters registered, not gathered copies
        change = changes(self._chosen.now(model), self._entries)
        if change is not None:
            raise RuntimeError(f"{self._kind}: {change}")
        self._watch.seen()

    def _tracked(self, model: nn.Module | None) -> nn.Module:
        """The module tracked, after checking that ``model`` (when given) is it; a copy tracks ``model`` from now on."""
        tracked = self._model
        if tracked is None:
            if model is None:
                raise RuntimeError(
                    f"this {self._kind} is a copy (pickle or copy.deepcopy) and tracks no model yet: pass the model, "
                    f"as in update(model), or call track(model)"
                )
            self.track(model)
            return unwrap(model)
        if model is not None and model is not tracked and unwrap(model) is not tracked:
            raise ValueError(
                f"this {self._kind} was built for another model object; create a new {self._kind} for this model "
                "(or pass the same module, wrapped in DDP, DataParallel or torch.compile)"
            )
        return tracked

    @property
    def live_model(self) -> nn.Module | None:
        """The module whose weights are averaged (unwrapped): the live weights, not the average; ``None`` in a copy
        until it is given one."""
        return self._model

    def __getattr__(self, name: str) -> Any:
        """Only for an attribute the average lacks: a peer's name (timm, diffusers, ema-pytorch) raises naming
        ours."""
        if name.startswith("__"):
            raise AttributeError(name)
        missing(self, name, self._peer_names)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """timm's and ema-pytorch's ``ema(x)`` runs their copy of the model; this average keeps none, and says so."""
        not_callable(self, self._peer_names)

    def track(self, model: nn.Module) -> None:
        """Give a copy (``pickle``, ``copy.deepcopy``) the model to average from now on; the model it tracks already
        is accepted too, any other refused. The model's ``state_dict`` names, shapes and ties must be the shadows'; the
        shadows keep their own tensors, dtypes and devices (where they differ from the model's, each update stages the
        live values, as at construction)."""
        if self._model is not None:
            self._tracked(model)
            return
        tracked = unwrap(model)
        if any(is_sharded(p) for p in tracked.parameters()):
            raise ValueError(
                f"a copy of a {self._kind} cannot track a sharded (FSDP2) model: build {self._kind}(model) on the "
                "sharded model and load_state_dict the copy's state_dict() into it"
            )
        self._copies, self._groups = self._build(tracked, self._copies, given=True)
        self._entries = self._entries_of(tracked)
        self._model = tracked
        self._arm()

    def __getstate__(self) -> dict[str, Any]:
        """What ``pickle`` and ``copy.deepcopy`` copy: the settings, the counters and the shadows (new storage in the
        copy, tied tensors still one), not the model nor anything that refers to it: the copy tracks no model until it
        is given one (``track``)."""
        if self.sharded:
            raise TypeError(
                f"a {self._kind} of a sharded (FSDP2) model cannot be pickled or copied: save its state_dict() with "
                f"torch.distributed.checkpoint and load it into {self._kind}(model) of the sharded model"
            )
        return {**self.__dict__, "_model": None, "_groups": [], "_guard": None, **self._not_copied}

    # -- the non-finite guard ----------------------------------------------------------------------------

    def _arm(self) -> None:
        """Under ``skip_nonfinite``, the guard for the groups (built with them; the counters are kept), as
        ``copy_correct.guards.choice`` chooses: with every shadow on the CPU a ``FiniteCheck`` of the values each update
        averages (the first copy's shapes and dtypes: one check for every copy), elsewhere the subclass's device guard,
        which stages every group itself (the groups' own staging is freed)."""
        if not self.skip_nonfinite:
            return
        written = (t for group in self._groups for copy in group.copies for t in copy)
        self._guard = choose(written, self._host_check, self._staging_device_guard)

    def _host_check(self) -> FiniteCheck:
        return FiniteCheck([group.copies[0] for group in self._groups if group.average])

    def _staging_device_guard(self) -> Any:
        for group in self._groups:
            group.staging = []  # freed before the guard allocates its own
        return self._device_guard()

    def _device_guard(self) -> Any:
        raise NotImplementedError

    def _checked_lives(self, group: Group) -> list[torch.Tensor]:
        """The group's live tensors now (this rank's shards when sharded), checked (``_recheck``) when a data pointer
        changed since the last check."""
        lives = group.live.resolve()
        if list(map(DATA_PTR, lives)) != group.pointers:
            self._recheck(group, lives)
        return lives

    def _recheck(self, group: Group, lives: list[torch.Tensor]) -> None:
        """A data pointer of ``lives`` changed (a storage replaced in place: ``.data = ...``, ``model.to``): every
        tensor of the model is checked, and one moved, reshaped or replaced refused by name, before anything is
        written; the pointers are kept for the next update when all still fit."""
        for name, live in zip(group.names, lives, strict=True):
            if live.device != group.live_device or live.dtype != group.live_dtype:
                raise RuntimeError(
                    f"the model moved from {group.live_device}/{group.live_dtype} to {live.device}/{live.dtype} "
                    f"({name!r}) after the {self._kind} was created: nothing was averaged; create the "
                    f"{self._kind} after model.to(...){self._moved_hint}"
                )
        self._check_model(self._tracked(None))
        group.pointers = list(map(DATA_PTR, lives))

    def _stage(self) -> None:
        """Copy the live values into the device guard's staging, group by group, once every group is checked."""
        lives = [self._checked_lives(group) for group in self._groups]
        for index, values in enumerate(lives):
            foreach_copy_(self._guard.staging(index), values)

    def _values(self) -> list[list[torch.Tensor]] | None:
        """The values an update averages, per group: its live tensors (checked: ``_checked_lives``), copied into its
        staging where it has one (the shadows' dtype or device differs). Under a ``FiniteCheck``, ``None`` when an
        averaged value is NaN or Inf: the skip is counted, nothing is written."""
        values = []
        for group in self._groups:
            lives = group.live.resolve()
            if list(map(DATA_PTR, lives)) != group.pointers:  # _checked_lives, in line: the update's hot path
                self._recheck(group, lives)
            if group.staging:
                foreach_copy_(group.staging, lives)
                lives = group.staging
            values.append(lives)
        guard = self._guard  # a FiniteCheck or none: a device guard does not come here
        if guard is not None and not guard.finite([v for g, v in zip(self._groups, values, strict=True) if g.average]):
            self._skipped.add_(1.0)  # a float: an int is wrapped as an int64 tensor, then cast (a new one)
            return None
        return values

    def _skipped_count(self) -> int:
        """How many updates ``skip_nonfinite`` skipped (0 without it), for ``skipped_updates``: on a GPU a sync."""
        return int(self._skipped) if self.skip_nonfinite else 0


def check_tensors(kind: str, saved: Mapping[str, torch.Tensor | None], ours: Mapping[str, torch.Tensor]) -> None:
    """``ValueError`` naming the tensor and both sides unless ``saved`` has ``ours``' names and (full) shapes, each
    tensor whole (a plain tensor: ``copy_into`` cuts this rank's part of it) or a ``DTensor`` spread as ours is (what
    ``torch.distributed.checkpoint`` loads into our own ``state_dict()``, resharding a state saved at another world
    size). A ``DTensor`` spread otherwise cannot be cut here and is refused. An entry ``None`` (not read yet) is
    checked by name only."""
    absent, unexpected = sorted(set(ours) - set(saved)), sorted(set(saved) - set(ours))
    if absent or unexpected:
        raise ValueError(f"{kind} state does not match the model: missing {absent[:5]}, unexpected {unexpected[:5]}")
    for name, tensor in saved.items():
        if tensor is None:
            continue
        mine = layout(ours[name])
        if is_sharded(tensor) and layout(tensor) != mine:
            raise ValueError(
                f"{kind} state for {name!r} is {layout(tensor)}, the model's is {mine}: load a sharded state into "
                f"this {kind}'s own state_dict() with torch.distributed.checkpoint (dcp.load), which reshards it, or "
                "give it whole (full_state_dict())"
            )
        if tuple(tensor.shape) != tuple(ours[name].shape):
            raise ValueError(
                f"{kind} state for {name!r} has shape {tuple(tensor.shape)}, the model's is {tuple(ours[name].shape)}"
            )


def copy_into(ours: Mapping[str, torch.Tensor], saved: Mapping[str, torch.Tensor]) -> None:
    """Copy ``saved`` into ``ours``' tensors in place (checked by ``check_tensors``); a sharded tensor of ours takes
    this rank's part of a full one, so nothing is sent."""
    with torch.no_grad():
        for name, tensor in saved.items():
            target = ours[name]
            if is_sharded(target) and not is_sharded(tensor):
                tensor = local_part(tensor, target)
            local(target).copy_(local(tensor))


def write_into(model: nn.Module, shadows: Mapping[str, torch.Tensor], kind: str) -> None:
    """Copy ``shadows`` into another model's tensors of the same names, shapes and spread, in place, through its
    ``state_dict(keep_vars=True)``; ``ValueError`` naming the first that differs, before anything is written."""
    reshard(model)
    targets = model.state_dict(keep_vars=True)
    for name, shadow in shadows.items():
        wrong = misfit(targets, name, shadow)
        if wrong is not None:
            raise ValueError(f"cannot copy the {kind} into this model: {wrong}")
        if layout(targets[name]) != layout(shadow):
            raise ValueError(
                f"cannot copy the {kind} into this model: {name!r} is {layout(shadow)} in the {kind}, "
                f"{layout(targets[name])} in the model (for an unsharded model, load full_state_dict())"
            )
    copy_into(targets, shadows)  # spread alike: each tensor's local part into the other's


def misfit(targets: Mapping[str, torch.Tensor], name: str, value: torch.Tensor) -> str | None:
    """``'name' (shape) vs (shape)`` when ``targets`` (a module's ``state_dict(keep_vars=True)``) holds ``name`` in
    another shape than ``value``'s, ``vs nothing`` when it lacks it: what a copy by name refuses; ``None`` when it
    fits."""
    if name in targets and targets[name].shape == value.shape:
        return None
    found = tuple(targets[name].shape) if name in targets else "nothing"
    return f"{name!r} {tuple(value.shape)} vs {found}"


def gathered(shadows: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``shadows`` as new, full, plain CPU tensors by name, tied ones still one; a sharded one is gathered here
    (``DTensor.full_tensor()``: a collective, so every rank calls it), one full tensor at a time, and copied (on a
    mesh of one rank ``full_tensor()`` is the local tensor itself, which the next update writes)."""
    out: dict[str, torch.Tensor] = {}
    made: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for name, tensor in shadows.items():
            if id(tensor) not in made:
                whole = tensor.full_tensor() if is_sharded(tensor) else tensor
                made[id(tensor)] = whole.to("cpu", copy=True)
            out[name] = made[id(tensor)]
    return out
