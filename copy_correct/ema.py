"""``EMA``: exponential moving average ("shadow") weights, updated in place, outside autograd, grouped.

Copy contract:

* The shadow is plain tensors of its own (``ema.shadow[name]``, keyed by the model's ``state_dict()``
  names), made once with ``detach().clone()`` at construction: ``requires_grad=False``, never an
  ``nn.Parameter``, never in ``model.parameters()``, an optimizer, DDP's reducer or autograd. The module
  itself is never deep-copied (``export()`` below makes a copy on request).
* ``update(model)`` writes into the shadow in place under ``torch.no_grad()`` (whatever the caller's grad
  mode): one ``torch._foreach_lerp_`` per (device, dtype) group of floating tensors, one
  ``torch._foreach_copy_`` for integer buffers (``num_batches_tracked``). It allocates nothing, reads
  no value back to the host, and raises each shadow tensor's version by one on every device (so does every
  other write below: ``copy_correct._foreach_writes``). Floating buffers (BatchNorm statistics) are averaged
  like parameters.
* A model in float16/bfloat16 gets a float32 shadow (``shadow_dtype=None``): at decay 0.9999 a bf16
  shadow rounds every small update away. A group whose shadow dtype or device differs from the model's
  keeps a staging copy of the live tensors in the shadow's dtype and device, allocated once.
* ``skip_nonfinite=True`` (off by default, see below): an update whose live parameters or floating buffers hold any
  NaN or Inf leaves the shadow bit for bit as it was (``-0.0`` entries, integer buffers and a copy before
  ``start_step`` included). For a shadow on the CPU the values the update averages (the live tensors, or their
  staging) are checked before anything is written, by one reduction per tensor into scratch made once
  (``copy_correct._finite_check``: exact, an overflowing sum included; one read of the weights, where the update
  moves three), and the host branches: a skipped update writes nothing (no version raised), a clean one is the
  unguarded update, bit for bit, and nothing is allocated. On a GPU the decision stays on the device
  (``copy_correct._nonfinite``: no value read back, every kernel run whatever the flag holds), at the price of a flat
  staging copy of the live values (one copy of the weights). The warm-up counts applied updates only: the next clean
  update is made as if the skipped ones had never been. ``update_every`` and ``start_step`` still count calls, skipped
  or not; ``num_updates`` counts updates made, skipped ones too. ``skipped`` reads the count (on a GPU a sync, the
  reader's); ``state_dict`` saves it and the warm-up's position. A model already non-finite at construction, and a
  sharded one (each rank would decide alone, and agreeing would take a collective per update), are refused. Not the
  default because it still costs more than the price the project set for one (1.35x the update on large models, 2x
  on small ones): measured on the models of ``benchmarks/ema.py`` (2 CPU threads, ``docs/recipes/ema.md`` section
  9), 1.43-1.44x on the large models, where one read of the weights alone takes 0.36-0.40 of the update on this
  machine, and 2.2x on the digits MLP, where each tensor's reduction is a call of its own; on an H200 the device
  path's staging made it 4.3x.
* ``average_weights(model)`` copies the average into the model for the block and the live values back on exit (an
  exception, ``KeyboardInterrupt`` included, too), bit for bit, through one backup of the live values per (device,
  dtype) group, allocated on entry and freed on exit (one copy of the model's weights: diffusers' ``store``/``restore``
  keeps the same). The shadow is only read, so nothing written into the model inside the block reaches the average: a
  forward in training mode (BatchNorm statistics, DCGAN's way of sampling) or an optimizer step writes into the
  model's copy, which is discarded; a written parameter also makes the block raise on exit, naming it (the version
  counters tell). The swap through one scratch buffer that this replaced kept no backup, and such writes became the
  average (``tests/parts/test_ema.py`` keeps it as the control). A nested ``average_weights`` of the same EMA changes
  nothing: the model already holds the average.
* The EMA knows when it is swapped (``swapped``). ``shadow`` maps each name to the shadow's tensor, which holds the
  average at all times; ``state_dict``, ``load_state_dict``, ``copy_to`` (another model) and ``export`` read and write
  it there, inside a block too. ``update`` and ``copy_to(model)`` raise inside a block: their result would be undone
  when the block ends.
* ``module`` is the average as a module of the model's class, in eval mode, made once: a deep copy of the model's
  structure whose parameters and averaged buffers are the shadow's own storage (no copy of the weights; a write into
  it is a write into the average), for ``module(x)``, ``module.state_dict()``, ``save_pretrained`` and timm's
  ``CheckpointSaver``/``load_checkpoint``. ``live_model`` is the model being averaged: the live weights.
* The schedule (``schedule``, a ``DecaySchedule``: ``warmup`` none, copy, power or ratio, ``warmup_gamma``,
  ``warmup_offset``, ``min_decay``) says every peer's (``copy_correct.peer_schedules``). ``state_dict`` holds it and
  the counters; ``load_state_dict`` refuses a state without counters or of another schedule (a silent reset would let
  the next warm-up update copy the live weights over the average); ``load_average(weights, step=n)`` loads a plain
  average with the step it stands for.
* A model changed under the EMA (a tensor replaced, added, removed, reshaped or moved: a new head) is refused, naming
  the tensor, at the next ``update`` and ``module`` (which compare one count of module registrations, and walk the
  model only when it changed) and at every ``average_weights``, ``copy_to`` and ``export`` (a walk over the names:
  ``benchmarks/model_changes.py`` times it). A peer's call shape (``ema(x)``, ``ema.eval()``, ``ema.ema_model``,
  ``ema.store``, ``update(model.parameters())``) fails in one line naming ours (``copy_correct._peer_calls``).
* The average is only as good as its start: ``initial_share`` is the share of it that is still the weights it began
  from. With the default warm-up (``warmup=True``) the first update's decay is 0 and the share is 0 from then on;
  with ``warmup=False`` it is ``decay ** updates`` (0.74 after 300 updates at 0.999). The first use of the average
  (``average_weights``, ``copy_to``, ``export``) warns once when it is above one half.
* ``export()`` returns a new module holding the average, in eval mode: a ``copy.deepcopy`` of the model (parameters
  and buffers cloned, gradients not), the average copied into it. The model and the shadow are only read.
* ``pickle`` and ``copy.deepcopy`` copy the EMA without its model: the settings, the counters and the shadow, in new
  storage (tied tensors stay one), so updating either never reaches the other. The model is not carried (the EMA
  refers to it, and weakly to its buffers' owners, which cannot travel): the copy tracks no model (``live_model`` is
  ``None``) until one is given, by ``update(model)``, ``average_weights(model)`` or ``track(model)``, which check
  that its names, shapes and ties are the shadow's; ``update()``, ``average_weights()``, ``copy_to()`` and
  ``export()`` without a model raise until then, saying so. ``shadow``, ``state_dict`` and ``copy_to(other_model)``
  work on a copy at once. An EMA of a sharded model refuses to be copied (save its ``state_dict`` instead).

Sharded models (FSDP2: every parameter a ``DTensor``, each rank holding its shard; ``ema.sharded`` is True):

* The shadow is per rank: each sharded parameter's shadow is a ``DTensor`` spread like it, whose local tensor
  (``shadow[name].to_local()``) is a copy of this rank's shard and has its shape, so a rank keeps 1/N of the
  shadow (buffers, which FSDP2 does not shard, are kept whole). Nothing is gathered to build it.
* ``update`` runs its foreach calls on the local shards (``DTensor.to_local()``, a view, taken on each call): the
  average of a shard is the shard of the average, so no collective is issued and nothing is allocated.
  ``average_weights``, ``copy_to`` and ``load_state_dict`` copy and write shards the same way, with every
  guarantee above (the backup of ``average_weights`` holds this rank's shards: 1/N of the weights). Before writing
  into the model they drop FSDP2's gathered parameters (``reshard()``, local), so the next forward gathers the shards
  as they are now instead of using a gathered copy of the values before.
* ``state_dict`` holds the shadow as ``DTensor``s (save it with ``torch.distributed.checkpoint``) and, under
  ``layout``, how each one is spread. Buffers stay plain tensors, each rank's own, and a distributed checkpoint
  keeps one copy of a plain tensor, as if every rank held the same: save them when they agree (``EMAWeights``
  makes them agree). ``load_state_dict`` takes ``DTensor``s or full plain tensors (each rank copies its own part;
  nothing is sent), and refuses, naming both, a state spread otherwise than the model (another world size, another
  placement, or unsharded): never resharded silently.
* ``full_state_dict()`` gathers the average once, on request, into full plain CPU tensors: a plain module's
  ``state_dict``. ``export()`` cannot deep-copy a sharded model (FSDP2 forbids it) and says so.
* Mixed precision (``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``): FSDP2 keeps the sharded parameters in
  float32 and casts only the gathered copies it computes with, so the shadow is a float32 average of the float32
  sharded parameters, the weights the optimizer steps.

Tensors are looked up once: parameters by object (stable across ``model.to(...)``), buffers by
(module, name), because ``model.to(...)`` replaces buffer objects. Replacing a Parameter object after
construction (``module.weight = nn.Parameter(...)``) needs a new ``EMA``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from copy import deepcopy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from copy_correct._average_module import average_module
from copy_correct._checks import device as checked_device
from copy_correct._checks import flag, floating_dtype, integer, module
from copy_correct._finite_check import FiniteCheck, checked_values
from copy_correct._flat import flat_views
from copy_correct._foreach_writes import foreach_copy_, foreach_lerp_
from copy_correct._model_changes import Entry, ModelWatch, changes
from copy_correct._module_tensors import TensorRefs, state_entries, unwrap
from copy_correct._nonfinite import NonFiniteGuard, guard_wanted
from copy_correct._peer_calls import EMA_NAMES, missing, not_callable
from copy_correct._sharding import from_local, is_sharded, layout, local, local_part, reshard
from copy_correct._torch_internals import set_grad_enabled
from copy_correct.decay_schedule import DecaySchedule

__all__ = ["EMA"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclass
class _Group:
    """Shadow/live pairs that one foreach call can update: same devices and dtypes on each side."""

    average: bool  # floating: lerp; integer: copy
    live_device: torch.device
    live_dtype: torch.dtype
    shadows: list[torch.Tensor] = field(default_factory=list)
    live: TensorRefs = field(default_factory=TensorRefs)
    staging: list[torch.Tensor] = field(default_factory=list)  # when shadow and live differ in dtype/device
    names: list[str] = field(default_factory=list)  # the state_dict name of each pair, for messages
    parameters: list[bool] = field(default_factory=list)  # whether each pair's live tensor is a parameter


@dataclass
class _Swap:
    """An ``average_weights`` block in progress: the live values to put back, and the model's versions to check."""

    pairs: list[tuple[_Group, list[torch.Tensor]]]
    backups: list[list[torch.Tensor]]  # per group: views of one flat tensor holding its live values
    versions: list[list[int]]  # per group: each live tensor's version once it holds the average


class EMA:
    """Exponential moving average of a model's parameters (and buffers), kept outside the model.

    Args:
        model: the module whose weights are averaged.
        decay: weight of the old average per update, in [0, 1).
        warmup: ramp the decay as ``min(decay, 1 - (1 + k) ** -warmup_power)`` over the first updates k (the
            default: the first update copies the weights, so the average never keeps the ones it was built from;
            ``False``: ``decay`` from the first update, see ``initial_share``).
        warmup_power: exponent of the ramp (2/3 reaches 0.999 after about 31,000 updates).
        update_every: average on every n-th call of ``update`` (the others are free).
        start_step: before this many ``update`` calls, the shadow copies the weights instead of averaging.
        include_buffers: average floating buffers and copy integer ones; ``False``: parameters only.
        shadow_dtype: dtype of the shadow's floating tensors; ``None``: float32 for float16/bfloat16
            models, the model's dtype otherwise.
        device: where the shadow lives; ``None``: beside each model tensor. ``"cpu"`` keeps a GPU model's
            average in host memory (each update then waits for a device-to-host copy).
        skip_nonfinite: skip every update whose live values hold a NaN or an Inf, leaving the average bit for bit as
            it was and the warm-up where it was; ``skipped`` counts them. Off by default: on the CPU it costs one read
            of the weights (about 1.4x the update on large models, 2.2x on a small MLP); on a GPU a staging copy of
            the weights and about 4x the update.

    Every argument is checked here, in one line naming it and what it takes: a value of the wrong type (a string for
    a number, a bool for an int, ``model.parameters()`` for the model) is a ``TypeError``, one out of range a
    ``ValueError``, and so is a model with no floating parameter or buffer to average (``nn.ReLU()``).
    """

    def __init__(
        self,
        model: nn.Module,
        decay: float = 0.999,
        *,
        warmup: bool | str = True,
        warmup_power: float = 2 / 3,
        warmup_gamma: float = 1.0,
        warmup_offset: float = 0.0,
        min_decay: float = 0.0,
        update_every: int = 1,
        start_step: int = 0,
        include_buffers: bool = True,
        shadow_dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
        skip_nonfinite: bool = False,
    ) -> None:
        module("model", model)
        self.schedule = DecaySchedule(decay, warmup, warmup_power, warmup_gamma, warmup_offset, min_decay)
        self.decay = self.schedule.decay
        self.warmup = self.schedule.warmup
        self.update_every = integer("update_every", update_every, 1)
        self.start_step = integer("start_step", start_step, 0)
        self.include_buffers = flag("include_buffers", include_buffers)
        self.shadow_dtype = floating_dtype("shadow_dtype", shadow_dtype)
        self.device = checked_device("device", device) if device is not None else None
        self.step = 0  # calls of update()
        self.num_updates = 0  # averaging updates made (the warm-up's k; under skip_nonfinite, skipped ones too)
        self._shadow: dict[str, torch.Tensor] = {}
        self._groups: list[_Group] = []
        tracked = unwrap(model)
        self._model: nn.Module | None = tracked  # None in a copy, until it is given a model (track)
        self.sharded = any(is_sharded(p) for p in tracked.parameters())
        if self.sharded and self.device is not None:
            raise ValueError(
                f"device={device!r} is not supported for a sharded (FSDP2) model: leave device=None, each rank's "
                "shadow then lives beside its shards"
            )
        self._swap: _Swap | None = None  # set while average_weights holds the average in the model
        self._module: nn.Module | None = None  # the average as a module, made on the first read of ``module``
        self._watch = ModelWatch()
        self._share_checked = False  # initial_share is checked once, when the average is first used
        self._shadow, self._groups = self._build(tracked)
        self._entries = self._entries_of(tracked)
        if not any(group.average for group in self._groups):
            buffers = "parameters or buffers" if include_buffers else "parameters (include_buffers=False)"
            raise ValueError(f"model ({type(tracked).__name__}) has no floating {buffers}: nothing to average")
        self.skip_nonfinite = guard_wanted(
            skip_nonfinite,
            "EMA",
            sharded=self.sharded,
            tensors={name: local(t) for name, t in self._shadow.items()},
        )
        self._guard: NonFiniteGuard | FiniteCheck | None = None
        if self.skip_nonfinite:
            home = self._groups[0].shadows[0].device
            self._skipped = torch.zeros((), dtype=torch.float64, device=home)  # updates skipped
            self._applied = torch.zeros((), dtype=torch.float64, device=home)  # averaging updates applied: the k
            self._arm()

    # -- construction -------------------------------------------------------------------------------

    def _build(
        self, model: nn.Module, given: Mapping[str, torch.Tensor] | None = None
    ) -> tuple[dict[str, torch.Tensor], list[_Group]]:
        """The shadow by name and the groups pairing it with the model's tensors. The shadow is new tensors, copies of
        the model's (at construction), or ``given``'s own (a copy of an EMA given a model: ``track``)."""
        shadows: dict[str, torch.Tensor] = {}
        first_name: dict[int, str] = {}
        claimed: set[int] = set()  # the given shadows paired with a tensor of the model so far
        groups: dict[tuple, _Group] = {}
        reshard(model)  # the sharded parameters registered, not gathered copies
        with torch.no_grad():
            for name, live, owner in state_entries(model, self.include_buffers):
                if id(live) in first_name:  # tied weights share one shadow
                    shadows[name] = shadows[first_name[id(live)]]
                    continue
                first_name[id(live)] = name
                average = live.is_floating_point()
                if given is None:
                    dtype = self._shadow_dtype_for(live.dtype) if average else live.dtype
                    shadow = local(live).to(device=self.device or live.device, dtype=dtype, copy=True)  # a shard's
                    shadows[name] = from_local(shadow, live) if is_sharded(live) else shadow
                else:
                    shadow = shadows[name] = _given_shadow(given, name, live, claimed)
                key = (shadow.device, shadow.dtype, live.device, live.dtype, average)
                if key not in groups:
                    groups[key] = _Group(average, live.device, live.dtype)
                group = groups[key]
                group.shadows.append(shadow)
                group.live.append(live, owner)
                group.names.append(name)
                group.parameters.append(owner is None)
                if shadow.dtype != live.dtype or shadow.device != live.device:
                    group.staging.append(torch.empty_like(shadow))
        if given is not None:
            untracked = sorted(set(given) - set(shadows))
            if untracked:
                raise ValueError(f"this EMA cannot track the model: the shadow has {untracked[:5]}, the model has not")
            tied = sorted(name for name in shadows if shadows[name] is not given[name])
            if tied:
                raise ValueError(
                    f"this EMA cannot track the model: the model ties {tied[:5]} to other tensors, the shadow does not"
                )
        return shadows, list(groups.values())

    def _entries_of(self, model: nn.Module) -> list[Entry]:
        """The model's tensors as the shadow pairs them now, for ``_check_model``."""
        return [
            Entry(name, tensor if owner is None else None, tensor.device, tensor.dtype, self._shadow[name].shape)
            for name, tensor, owner in state_entries(model, self.include_buffers)
        ]

    def _check_model(self, model: nn.Module) -> None:
        """``RuntimeError`` naming the tensor when ``model`` is no longer what the shadow pairs (a tensor replaced,
        added, removed, reshaped or moved): a walk over its ``state_dict`` names, no tensor read."""
        if self.sharded:
            reshard(model)  # the sharded parameters registered, not gathered copies
        change = changes(model, self.include_buffers, self._entries)
        if change is not None:
            raise RuntimeError(f"EMA: {change}")
        self._watch.seen()

    def _shadow_dtype_for(self, dtype: torch.dtype) -> torch.dtype:
        if self.shadow_dtype is not None:
            return self.shadow_dtype
        return torch.float32 if dtype in _LOW_PRECISION else dtype

    def _tracked(self, model: nn.Module | None) -> nn.Module:
        """The module this EMA tracks, after checking that ``model`` (when given) is it; a copy tracks ``model``."""
        tracked = self._model
        if tracked is None:
            if model is None:
                raise RuntimeError(
                    "this EMA is a copy (pickle or copy.deepcopy) and tracks no model yet: pass the model, as in "
                    "ema.update(model) or ema.average_weights(model), or call ema.track(model)"
                )
            self.track(model)
            return unwrap(model)
        if model is not None and model is not tracked and unwrap(model) is not tracked:
            raise ValueError(
                "this EMA was built for another model object; create a new EMA for this model "
                "(or pass the same module, wrapped in DDP, DataParallel or torch.compile)"
            )
        return tracked

    # -- copies ---------------------------------------------------------------------------------------

    @property
    def live_model(self) -> nn.Module | None:
        """The module whose weights are averaged (unwrapped): the live weights, not the average (that is ``module``);
        ``None`` in a copy until it is given one."""
        return self._model

    def __getattr__(self, name: str) -> Any:
        """Only for an attribute the EMA lacks: a peer's name (timm, diffusers, ema-pytorch) raises naming ours."""
        if name.startswith("__"):
            raise AttributeError(name)
        missing(self, name, EMA_NAMES)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """timm's and ema-pytorch's ``ema(x)`` runs their copy of the model; this EMA keeps none, and says so."""
        not_callable(self, EMA_NAMES)

    @property
    def module(self) -> nn.Module:
        """The average as a module of the model's class, in eval mode, for evaluation, ``state_dict``,
        ``save_pretrained`` and timm's ``load_checkpoint`` / ``CheckpointSaver``: its parameters and averaged buffers
        are the shadow's own storage (no copy; ``copy_correct._average_module``), so it holds the average at all times
        and a write into it is a write into the average. Its floating tensors have the shadow's dtype (float32 for a
        float16/bfloat16 model). Made on first use; a copy with no model and a sharded EMA have none. Its
        ``load_state_dict`` (timm's resume, ``load_checkpoint(ema.module, ...)``) is refused, naming ``load_average``:
        it would replace the average and leave the counters, so the next warm-up update would copy the live weights
        over it."""
        tracked = self._tracked(None)
        if self.sharded:
            raise RuntimeError(
                "EMA.module would deep-copy the model's structure, which FSDP2 forbids for a sharded one: load "
                "ema.full_state_dict() (gathered once) into an unsharded instance of the model instead"
            )
        if self._watch.stale():  # read per batch in an evaluation loop: the walk only after a registration
            self._check_model(tracked)
        if self._module is None:
            self._module = average_module(tracked, self._shadow, self.include_buffers)
            self._module.register_load_state_dict_pre_hook(_counterless_load)
        return self._module

    def track(self, model: nn.Module) -> None:
        """Give a copy (``pickle``, ``copy.deepcopy``) the model to average from now on; the model it tracks already
        is accepted too, any other refused. The model's ``state_dict`` names, shapes and ties must be the shadow's; the
        shadow keeps its own tensors, dtypes and devices (where they differ from the model's, each update stages the
        live values, as at construction). ``update(model)`` and ``average_weights(model)`` call it for a copy."""
        if self._model is not None:
            self._tracked(model)
            return
        tracked = unwrap(model)
        if any(is_sharded(p) for p in tracked.parameters()):
            raise ValueError(
                "a copy of an EMA cannot track a sharded (FSDP2) model: build EMA(model) on the sharded model and "
                "load_state_dict the copy's state_dict() into it"
            )
        self._shadow, self._groups = self._build(tracked, self._shadow)
        self._entries = self._entries_of(tracked)
        self._model = tracked
        self._arm()

    def _arm(self) -> None:
        """Under ``skip_nonfinite``, the guard for the groups (built with them; the counters are kept): on the CPU a
        ``FiniteCheck`` of the values each update averages (the shadows' shapes and dtypes), elsewhere a
        ``NonFiniteGuard``, which stages every group itself (the groups' own staging is freed)."""
        if not self.skip_nonfinite:
            return
        if all(t.device.type == "cpu" for group in self._groups for t in group.shadows):
            self._guard = FiniteCheck([group.shadows for group in self._groups if group.average])
            return
        for group in self._groups:
            group.staging = []
        groups = [(group.shadows, group.average) for group in self._groups]
        self._guard = NonFiniteGuard(groups, self._skipped, self._applied)

    def __getstate__(self) -> dict[str, Any]:
        """What ``pickle`` and ``copy.deepcopy`` copy: the settings, the counters and the shadow (new storage in the
        copy, tied tensors still one), not the model nor anything that refers to it: the copy tracks no model until it
        is given one (``track``). Inside ``average_weights`` too: the copy's shadow is the average, and nothing is
        swapped in it."""
        if self.sharded:
            raise TypeError(
                "an EMA of a sharded (FSDP2) model cannot be pickled or copied: save its state_dict() with "
                "torch.distributed.checkpoint and load it into EMA(model) of the sharded model"
            )
        return {**self.__dict__, "_model": None, "_groups": [], "_swap": None, "_guard": None, "_module": None}

    @staticmethod
    def _checked_lives(group: _Group) -> list[torch.Tensor]:
        lives = group.live.resolve()
        if lives[0].device != group.live_device or lives[0].dtype != group.live_dtype:
            raise RuntimeError(
                f"the model moved from {group.live_device}/{group.live_dtype} to "
                f"{lives[0].device}/{lives[0].dtype} after the EMA was created: create the EMA after "
                "model.to(...), or pass device='cpu' to keep the shadow on the CPU"
            )
        return lives

    def _live_groups(self, model: nn.Module | None) -> list[tuple[_Group, list[torch.Tensor]]]:
        self._tracked(model)
        return [(group, self._checked_lives(group)) for group in self._groups]

    # -- the update -----------------------------------------------------------------------------------

    def decay_at(self, k: int) -> float:
        """The decay used for averaging update number ``k`` (0-based), warm-up included (``schedule.at``). ``k`` is
        ``num_updates``; under ``skip_nonfinite`` it is the number of updates applied, counted and used on the
        device."""
        return self.schedule.at(k)

    @property
    def initial_share(self) -> float:
        """The share of the average that is still the weights it started from (at construction, or at its last
        copy before ``start_step``): the product of the decays applied so far. With the warm-up, the first update's
        decay is 0, so this is 0 from then on; without it, ``decay ** num_updates`` (0.999 over 300 updates: 0.74).
        Computed from the counters on the host: no tensor is read (so under ``skip_nonfinite`` skipped updates count as
        made)."""
        if self.num_updates == 0:
            return 1.0
        return 0.0 if self.warmup != "none" else self.decay**self.num_updates  # a warm-up's decay_at(0) is 0

    def _check_share(self, stacklevel: int) -> None:
        """Warn, once, when the average is first used while it is still mostly the weights it started from;
        ``stacklevel`` points the warning at the caller of the public method."""
        if self._share_checked:
            return
        self._share_checked = True
        share = self.initial_share
        if share > 0.5:
            warnings.warn(
                f"EMA: the average is still {share:.0%} the weights it started from after {self.num_updates} updates "
                f"(decay {self.decay}, warmup={self.warmup}): keep the default warmup=True, lower the decay, or use "
                "the average later",
                RuntimeWarning,
                stacklevel=stacklevel + 1,
            )

    def update(self, model: nn.Module | None = None, *, step: int | None = None) -> None:
        """One step: average the model into the shadow (or copy it, before ``start_step``).

        In place, under ``no_grad``, no allocation, no host synchronisation (shadow beside the model).
        ``model`` defaults to the one given at construction (passing it wrapped in DDP or
        ``torch.compile`` is fine). Inside ``average_weights`` it raises, and so it does when the model changed since
        the EMA was built (``_check_model``, run when any module registered a tensor since the last check). Under
        ``skip_nonfinite``, live values holding a NaN or an Inf leave the shadow as it was (decided on the host for a
        CPU shadow, before anything is written; on the device otherwise).
        ``step`` (timm's ``update(model, step=n)``) is accepted when it is this call's number, ``ema.step + 1``: the
        EMA counts its own calls, and the schedule (``peer_schedules.timm_schedule``) reads them.
        """
        if self._swap is not None:
            raise RuntimeError(
                "EMA.update inside EMA.average_weights: the model holds a copy of the average there, which the live "
                "weights replace when the block ends, so this would average the average into itself; update after "
                "the block ends"
            )
        tracked = self._tracked(model)
        if self._watch.stale():
            self._check_model(tracked)
        if step is not None and step != self.step + 1:
            raise ValueError(
                f"EMA.update(step={step!r}): this is update call {self.step + 1} of this EMA, which counts its own "
                "calls (ema.step); restore a resumed count with load_state_dict or load_average(..., step=n), or drop "
                "step="
            )
        step, self.step = self.step, self.step + 1
        copy = step < self.start_step
        if not copy and (step - self.start_step) % self.update_every:
            return
        grad_was_enabled = torch.is_grad_enabled()
        set_grad_enabled(False)  # a `with torch.no_grad()` block costs more than a small model's update
        try:
            if isinstance(self._guard, NonFiniteGuard):
                for index, group in enumerate(self._groups):
                    foreach_copy_(self._guard.staging(index), self._checked_lives(group))
                self._guard.update(copy, self.schedule)
            else:
                self._average(copy)
        finally:
            set_grad_enabled(grad_was_enabled)
        if not copy:
            self.num_updates += 1

    def _average(self, copy: bool) -> None:
        """The update without a guard, or under a ``FiniteCheck`` (a CPU shadow): the values averaged (staged into the
        shadow's dtype and device where they differ) are then checked on the host before anything is written, and a
        non-finite one skips the update whole, writing nothing (no version raised) and counting it in ``skipped``."""
        check = self._guard if isinstance(self._guard, FiniteCheck) else None  # a device guard does not come here
        values = checked_values(self._groups, self._checked_lives, check, self._skipped if check is not None else None)
        if values is None:
            return
        k = self.num_updates
        if check is not None:
            k = int(self._applied)
            if not copy:
                self._applied.add_(1.0)
        weight = 1.0 - self.decay_at(k)
        for group, lives in zip(self._groups, values, strict=True):
            if group.average and not copy:
                foreach_lerp_(group.shadows, lives, weight)
            else:
                foreach_copy_(group.shadows, lives)

    def _skipped_count(self) -> int:
        """How many updates ``skip_nonfinite`` skipped (0 without it). The count is kept beside the shadow: on a GPU
        reading it waits for the updates queued before (a sync, once per read, never in ``update``)."""
        return int(self._skipped) if self.skip_nonfinite else 0

    # -- using the average ----------------------------------------------------------------------------

    @property
    def shadow(self) -> dict[str, torch.Tensor]:
        """The average by ``state_dict`` name: the shadow's own tensors, which hold it at all times (inside
        ``average_weights`` too, where the model holds a copy of it)."""
        return self._shadow

    @property
    def swapped(self) -> bool:
        """Whether an ``average_weights`` block holds the average in the model now."""
        return self._swap is not None

    def copy_to(self, model: nn.Module | None = None) -> None:
        """Overwrite a model's weights (and averaged buffers) with the shadow, in place.

        ``model`` defaults to the averaged model; another model with the same state_dict names and shapes
        (a fresh instance for export, say) is written through its ``state_dict(keep_vars=True)`` tensors.
        Inside ``average_weights``, copying into the averaged model raises; into another model works.
        """
        target = unwrap(model) if model is not None else None  # a TypeError for anything but a module, first
        self._check_share(stacklevel=2)
        if target is None or target is self._model:
            tracked = self._tracked(model)
            self._check_model(tracked)
            if self._swap is not None:
                raise RuntimeError(
                    "EMA.copy_to(model) inside EMA.average_weights: the model holds the average already and gets its "
                    "live weights back when the block ends; call copy_to after the block to keep the average"
                )
            reshard(tracked)
            with torch.no_grad():
                for group, lives in self._live_groups(model):
                    foreach_copy_(lives, group.shadows)
            return
        reshard(model)
        targets = unwrap(model).state_dict(keep_vars=True)
        for name, shadow in self.shadow.items():
            if name not in targets or targets[name].shape != shadow.shape:
                found = tuple(targets[name].shape) if name in targets else "nothing"
                raise ValueError(f"cannot copy the EMA into this model: {name!r} {tuple(shadow.shape)} vs {found}")
            if layout(targets[name]) != layout(shadow):
                raise ValueError(
                    f"cannot copy the EMA into this model: {name!r} is {layout(shadow)} in the EMA, "
                    f"{layout(targets[name])} in the model (for an unsharded model, load full_state_dict())"
                )
        with torch.no_grad():
            for name, shadow in self.shadow.items():
                local(targets[name]).copy_(local(shadow))

    def export(self) -> nn.Module:
        """A new module holding the average, in eval mode, for inference or ``torch.save(exported.state_dict(), ...)``:
        a deep copy of the (unwrapped) model, the average copied into it (``.train()`` it to train it further). The
        model and the shadow are only read."""
        if self.sharded:
            raise RuntimeError(
                "EMA.export deep-copies the model, which FSDP2 forbids for a sharded one: load "
                "ema.full_state_dict() (gathered once) into an unsharded instance of the model instead"
            )
        tracked = self._tracked(None)
        self._check_model(tracked)
        self._check_share(stacklevel=2)
        exported = deepcopy(tracked)
        self.copy_to(exported)
        return exported.eval()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The average as new, full, plain CPU tensors by ``state_dict`` name: an unsharded model's ``state_dict``.

        A sharded average is gathered here, tensor by tensor (``DTensor.full_tensor()``: a collective, so every rank
        calls it), so a device holds one full tensor at a time beyond its shards. Tied weights stay one tensor.
        """
        out: dict[str, torch.Tensor] = {}
        made: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for name, tensor in self.shadow.items():
                if id(tensor) not in made:
                    made[id(tensor)] = tensor.full_tensor().cpu() if is_sharded(tensor) else tensor.to("cpu", copy=True)
                out[name] = made[id(tensor)]
        return out

    @contextmanager
    def average_weights(self, model: nn.Module | None = None) -> Iterator[nn.Module]:
        """Run the block with the average in the model; on exit the live values come back bit for bit, and nothing
        written into the model inside the block reaches the average.

        The live values are kept in one backup per group for the block (one copy of the model's weights, freed on
        exit) and the average is copied into the model; the shadow is only read. On exit (an exception or
        ``KeyboardInterrupt`` too) the backup is copied back. So a forward in training mode inside the block (BatchNorm
        statistics) writes into the model's copy of the average, which is discarded: the shadow and the live
        statistics are as before. A write into a parameter (an optimizer step) is undone the same way, and, because
        a training step silently lost is a bug, the block then raises ``RuntimeError`` naming the parameters: the
        model's version counters tell, at no cost. Nested in another ``average_weights`` of this EMA, the block
        changes nothing: the model holds the average.
        """
        tracked = self._tracked(model)
        target = tracked if model is None else model
        if self._swap is not None:
            yield target
            return
        self._check_model(tracked)
        self._check_share(stacklevel=3)  # through contextlib's __enter__
        swap = self._swap_in(model)
        self._swap = swap
        try:
            yield target
        finally:
            written = self._swap_out(swap)
            self._swap = None
        if written:
            more = f" and {len(written) - 3} more" if len(written) > 3 else ""
            raise RuntimeError(
                f"EMA.average_weights: {len(written)} parameter(s) of the model were written inside the block "
                f"({', '.join(map(repr, written[:3]))}{more}; an optimizer step?): undone, the live weights are back "
                "as they were before the block and the average is unchanged; step optimizers and write parameters "
                "outside the block"
            )

    def _swap_in(self, model: nn.Module | None) -> _Swap:
        reshard(self._tracked(model))
        with torch.no_grad():
            pairs = self._live_groups(model)
            backups = []
            for group, lives in pairs:
                _, views = flat_views(lives)
                foreach_copy_(views, lives)
                foreach_copy_(lives, group.shadows)
                backups.append(views)
        return _Swap(pairs, backups, _versions(pairs))

    def _swap_out(self, swap: _Swap) -> list[str]:
        """Put the live values back; the names of the parameters written since the swap (or the last load)."""
        written = [
            name
            for (group, lives), versions in zip(swap.pairs, swap.versions, strict=True)
            for name, is_parameter, live, version in zip(group.names, group.parameters, lives, versions, strict=True)
            if is_parameter and _version(live) != version
        ]
        reshard(self._model)
        with torch.no_grad():
            for (_, lives), backup in zip(swap.pairs, swap.backups, strict=True):
                foreach_copy_(lives, backup)
        return written

    # -- checkpoints ----------------------------------------------------------------------------------

    def layout(self) -> dict[str, str]:
        """How each sharded tensor of the shadow is spread over the ranks (empty for an unsharded model)."""
        return {name: layout(t) for name, t in self._shadow.items() if is_sharded(t)}

    def state_dict(self) -> dict[str, Any]:
        """Counters and the average (``shadow``'s tensors, aliased like ``Module.state_dict``: save it before the
        next update, or inside the ``average_weights`` block it was taken in); loads with ``weights_only=True``.
        Sharded: the tensors are ``DTensor``s, and ``layout`` says how each is spread. Under ``skip_nonfinite`` also
        ``skipped`` and ``applied_updates`` (the warm-up's position), read from the device. ``schedule`` holds every
        setting that decides when and how much the average moves (``schedule_state``), which ``load_state_dict``
        compares."""
        state = {
            "decay": self.decay,
            "schedule": self.schedule_state(),
            "step": self.step,
            "num_updates": self.num_updates,
            "shadow": dict(self.shadow),
        }
        if self.skip_nonfinite:  # read from the device: a sync per save
            state |= {"skipped": self._skipped_count(), "applied_updates": int(self._applied)}
        if self.sharded:
            state["layout"] = self.layout()
        return state

    def schedule_state(self) -> dict[str, Any]:
        """The decay schedule's settings and ``update_every`` and ``start_step``, as plain numbers and strings."""
        return self.schedule.state() | {"update_every": self.update_every, "start_step": self.start_step}

    def check_state(self, state: Mapping[str, Any]) -> None:
        """Raise ``ValueError``, naming the tensor and both sides, unless ``state`` fits this EMA: the same names,
        spread over the ranks as the model is (``layout``), and the same (full) shapes."""
        if not isinstance(state, Mapping):
            raise TypeError(f"EMA state must be a mapping (EMA.state_dict()), got {type(state).__name__}")
        saved = state.get("shadow")
        if not isinstance(saved, Mapping):
            if state and all(isinstance(v, torch.Tensor) for v in state.values()):
                raise ValueError(
                    "this is a model's state_dict (an average saved as weights: timm's state_dict_ema, an export), not "
                    "an EMA state, and it holds no counters: load it with ema.load_average(weights, step=n), n the "
                    "update calls it stands for (copy_correct.peer_states reads diffusers' and ema-pytorch's states)"
                )
            raise ValueError("EMA state must hold a 'shadow' mapping of tensor names to tensors (EMA.state_dict())")
        missing = sorted(set(self.shadow) - set(saved))
        unexpected = sorted(set(saved) - set(self.shadow))
        if missing or unexpected:
            raise ValueError(f"EMA state does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
        theirs, ours = state.get("layout") or {}, self.layout()
        for name, tensor in saved.items():
            recorded, mine = theirs.get(name, layout(tensor)), ours.get(name, "not sharded")
            for spread in (recorded, layout(tensor) if is_sharded(tensor) else recorded):
                if spread != mine:
                    raise ValueError(
                        f"EMA state for {name!r} is {spread}, the model's is {mine}: a sharded average is restored "
                        "only as it was saved (same world size and placements), never resharded"
                    )
            if tuple(tensor.shape) != tuple(self.shadow[name].shape):
                raise ValueError(
                    f"EMA state for {name!r} has shape {tuple(tensor.shape)}, the model's is "
                    f"{tuple(self.shadow[name].shape)}"
                )

    def load_state_dict(self, state: Mapping[str, Any], *, new_schedule: bool = False) -> None:
        """Copy a saved average and counters in place (into ``shadow``'s tensors), after ``check_state``. A sharded
        EMA takes ``DTensor``s or full tensors, of which each rank copies its own part (nothing is sent). Inside
        ``average_weights`` the model gets the loaded average too, for the rest of the block. A state without
        ``skipped`` and ``applied_updates`` (saved without ``skip_nonfinite``) counts none skipped.

        Never an average thrown away: a state without its counters (``step``, ``num_updates``: a reset would make the
        next warm-up update copy the live weights over the average) is refused, and so is one saved with another
        schedule (``schedule``; a state from before it was saved is compared on ``decay``), in one line naming the
        difference, unless ``new_schedule=True`` says to go on with this EMA's schedule (a new decay to fine-tune, say).
        A plain average with counters you state: ``load_average``."""
        self.check_state(state)
        absent = [key for key in ("step", "num_updates") if key not in state]
        if absent:
            raise ValueError(
                f"EMA state has no {' or '.join(map(repr, absent))}: without its counters the average would restart "
                "(the next warm-up update copies the live weights over it); load the average with "
                "ema.load_average(state['shadow'], step=n), n the update calls it stands for"
            )
        saved = state.get("schedule", {"decay": state["decay"]} if "decay" in state else {})
        differences = [] if new_schedule else _schedule_differences(saved, self.schedule_state())
        if differences:
            raise ValueError(
                f"EMA state was saved with another schedule: {'; '.join(differences)}; build the EMA with the saved "
                "settings to continue it, or pass new_schedule=True to go on with this EMA's"
            )
        with torch.no_grad():
            for name, tensor in state["shadow"].items():
                target = self.shadow[name]
                if is_sharded(target) and not is_sharded(tensor):
                    tensor = local_part(tensor, target)
                local(target).copy_(local(tensor))
            if self._swap is not None:  # the block goes on with the loaded average in the model
                reshard(self._model)  # its next forward must gather what is loaded
                for group, lives in self._swap.pairs:
                    foreach_copy_(lives, group.shadows)
                self._swap.versions = _versions(self._swap.pairs)
        self.step = int(state["step"])
        self.num_updates = int(state["num_updates"])
        if self.skip_nonfinite:  # a state saved without the guard: nothing skipped, every update applied
            self._skipped.fill_(int(state.get("skipped", 0)))
            self._applied.fill_(int(state.get("applied_updates", self.num_updates)))

    def load_average(self, weights: Mapping[str, torch.Tensor], *, step: int) -> None:
        """Load a plain average, by ``state_dict`` name (timm's ``state_dict_ema``, an exported average's
        ``state_dict()``, a peer's average: ``copy_correct.peer_states``), as the average this EMA would hold after
        ``step`` calls of ``update``: ``num_updates`` follows from ``step``, ``start_step`` and ``update_every``, so the
        next update continues the schedule where those calls left it. Copied in place, as ``load_state_dict``."""
        step = integer("step", step, 0)
        made = 0 if step <= self.start_step else -(-(step - self.start_step) // self.update_every)
        self.load_state_dict({"shadow": weights, "step": step, "num_updates": made}, new_schedule=True)

    def __repr__(self) -> str:
        tensors = len({id(t) for t in self.shadow.values()})
        return (
            f"EMA(decay={self.decay}, warmup={self.warmup!r}, tensors={tensors}, groups={len(self._groups)}, "
            f"step={self.step}, num_updates={self.num_updates})"
        )


def _given_shadow(given: Mapping[str, torch.Tensor], name: str, live: torch.Tensor, claimed: set[int]) -> torch.Tensor:
    """``given[name]``, the shadow of the model's tensor ``live``, once checked against it and against the shadows
    ``claimed`` by other tensors of the model (which it joins)."""
    if name not in given:
        raise ValueError(f"this EMA cannot track the model: the model has {name!r}, the shadow has not")
    shadow = given[name]
    if id(shadow) in claimed:
        raise ValueError(
            f"this EMA cannot track the model: {name!r} is tied to another tensor in the shadow, not in the model"
        )
    claimed.add(id(shadow))
    if shadow.shape != live.shape or shadow.is_floating_point() != live.is_floating_point():
        raise ValueError(
            f"this EMA cannot track the model: {name!r} is {tuple(shadow.shape)} {shadow.dtype} in the shadow, "
            f"{tuple(live.shape)} {live.dtype} in the model"
        )
    return shadow


def _counterless_load(module: nn.Module, *_: Any) -> None:
    """``EMA.module``'s ``load_state_dict`` pre-hook: refuse, naming the load that keeps the counters."""
    raise RuntimeError(
        "ema.module.load_state_dict would replace the average without its counters (the next warm-up update would "
        "copy the live weights over it): load an average with ema.load_average(state_dict, step=n), n the update "
        "calls it stands for, or an EMA state with ema.load_state_dict(state)"
    )


def _schedule_differences(saved: Any, ours: Mapping[str, Any]) -> list[str]:
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


def _versions(pairs: list[tuple[_Group, list[torch.Tensor]]]) -> list[list[int]]:
    return [[_version(t) for t in lives] for _, lives in pairs]


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # an inference tensor has no version counter (and cannot be written outside inference mode)
        return None
