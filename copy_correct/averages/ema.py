"""``EMA``: exponential moving average ("shadow") weights, updated in place, outside autograd, grouped.

Copy contract (the shadows themselves, copies and model checks: ``copy_correct.averages.shadow``):

* ``shadow[name]`` is a tensor of its own per ``state_dict`` name, made once; the module is never deep-copied
  (``export`` copies it on request). Floating buffers (BatchNorm statistics) are averaged like parameters, integer
  ones copied. A float16/bfloat16 model gets a float32 shadow: at decay 0.9999 a bf16 shadow rounds small updates away.
* ``update`` writes in place under ``no_grad`` (whatever the caller's grad mode): one ``_foreach_lerp_`` per group of
  floating tensors, one ``_foreach_copy_`` for integer buffers. It allocates nothing and reads nothing back to the
  host; every write raises each shadow tensor's version by one (``copy_correct.core.foreach_writes``).
* ``average_weights(model)`` puts the average in the model for a block and the live values back on exit (an exception
  too), bit for bit, through one backup of the live values per group, freed on exit. The shadow is only read, so what
  the block writes into the model (BatchNorm statistics, an optimizer step) never reaches the average; a written
  parameter makes the block raise on exit, naming it (the version counters tell).
* ``module`` is the average as a module of the model's class whose tensors are the shadow's own storage (no copy);
  ``export()`` is a new module holding a copy of it. ``state_dict`` aliases the shadow; ``load_state_dict`` copies in
  place and refuses a state without counters or of another schedule (a silent reset would let the next warm-up update
  copy the live weights over the average).
* ``skip_nonfinite=True`` (opt-in: its price is in the manual): an update whose live values hold a NaN or an Inf
  leaves the shadow bit for bit; on the CPU decided on the host before anything is written, on a GPU on the device
  from a staging copy (``copy_correct.guards.device``). The warm-up counts applied updates only.
* ``traceable=True``: the counters and the decay are tensors on the shadow's device
  (``copy_correct.averages.device_clock``) and ``update`` traces into a ``torch.compile(..., fullgraph=True)`` step:
  one graph for every update, warm-up included, writing the shadows in place; reading ``step`` or ``num_updates`` is
  then a sync.
* Sharded (FSDP2): each rank's shadow is a copy of its shards, updated with no collective; ``full_state_dict()``
  gathers the average on request.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from copy import deepcopy
from typing import Any, ClassVar

import torch
from torch import nn

from copy_correct.averages.average_module import AverageAsModule
from copy_correct.averages.device_clock import clock_for, traced_values
from copy_correct.averages.peer_calls import EMA_NAMES, UpdateCount
from copy_correct.averages.selection import Exclude
from copy_correct.averages.settings import ema_settings
from copy_correct.averages.shadow import Group, Shadows, check_tensors, copy_into, gathered, write_into
from copy_correct.averages.weight_swap import Swap, swap_in, swap_out, written_error
from copy_correct.core.checks import integer, module
from copy_correct.core.foreach_writes import foreach_copy_, foreach_lerp_
from copy_correct.core.module_tensors import unwrap
from copy_correct.core.sharding import is_sharded, layout, reshard
from copy_correct.core.torch_internals import set_grad_enabled
from copy_correct.decay_schedule import schedule_differences
from copy_correct.guards.device import NonFiniteGuard

__all__ = ["EMA"]


class EMA(AverageAsModule, Shadows):
    """Exponential moving average of a model's parameters (and buffers), kept outside the model.

    Args:
        model: the module whose weights are averaged.
        decay: weight of the old average per update, in [0, 1).
        warmup: ramp the decay as ``min(decay, 1 - (1 + k) ** -warmup_power)`` over the first updates k (the
            default: the first update copies the weights, so the average never keeps the ones it was built from;
            ``False``: ``decay`` from the first update, see ``initial_share``); or a peer's warm-up by name
            (``schedule``: ``copy_correct.averages.peer_schedules``), with ``warmup_gamma``, ``warmup_offset``,
            ``min_decay``; ``"half_life"``: torchtitan's ``2 ** (-1 / (half_life * k))``, no first copy.
        half_life: the half-life of ``warmup="half_life"``, a fraction of the updates so far.
        warmup_power: exponent of the ramp (2/3 reaches 0.999 after about 31,000 updates).
        update_every: average on every n-th call of ``update`` (the others are free).
        start_step: before this many ``update`` calls, the shadow copies the weights instead of averaging.
        include_buffers: average floating buffers and copy integer ones; ``False``: parameters only.
        trainable_only: average only the parameters that require grad when the EMA is built, and the buffers of the
            modules that hold one (``copy_correct.averages.selection``): a LoRA adapter's average without a second
            copy of the frozen base.
        exclude: leave out the ``state_dict`` names starting with one of these prefixes (``("head.",)``), or those
            for which a function of (name, tensor) returns ``True``. A tensor left out holds no shadow;
            ``average_weights``, ``module`` and ``export`` give its live values, ``shadow`` and ``state_dict`` lack it.
        shadow_dtype: dtype of the shadow's floating tensors; ``None``: float32 for float16/bfloat16
            models, the model's dtype otherwise.
        device: where the shadow lives; ``None``: beside each model tensor. ``"cpu"`` keeps a GPU model's
            average in host memory (each update then waits for a device-to-host copy).
        skip_nonfinite: skip every update whose live values hold a NaN or an Inf, leaving the average bit for bit as
            it was and the warm-up where it was; ``skipped_updates(ema)`` counts them. Off by default: it costs a
            read of the weights per update on the CPU, a staging copy on a GPU (the manual's EMA page measures it).
        traceable: keep the counters and the decay as tensors on the shadow's device, so that ``update`` traces into a
            ``torch.compile``d step without recompiling (``copy_correct.averages.device_clock``); not with
            ``skip_nonfinite``, a sharded model or shadows on several devices.

    Every argument is checked here, in one line naming it and what it takes: a value of the wrong type (a string for
    a number, a bool for an int, ``model.parameters()`` for the model) is a ``TypeError``, one out of range a
    ``ValueError``, and so is a model with no floating parameter or buffer to average (``nn.ReLU()``).
    """

    _kind = "EMA"
    _peer_names = EMA_NAMES
    _moved_hint = ", or pass device='cpu' to keep the shadow on the CPU"
    _not_copied: ClassVar[dict[str, Any]] = {"_swap": None, "_module": None}

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
        half_life: float = 0.05,
        update_every: int = 1,
        start_step: int = 0,
        include_buffers: bool = True,
        trainable_only: bool = False,
        exclude: Exclude = (),
        shadow_dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
        skip_nonfinite: bool = False,
        traceable: bool = False,
    ) -> None:
        module("model", model)
        settings = ema_settings(locals())  # every argument by name: the signature above is where each is written
        self.schedule = settings.schedule
        self.decay = self.schedule.decay
        self.warmup = self.schedule.warmup
        self.update_every = settings.update_every
        self.start_step = settings.start_step
        self._step = 0  # calls of update(): ``step`` (without traceable)
        self._made = 0  # averaging updates made: ``num_updates`` (without traceable)
        self._swap: Swap | None = None  # set while average_weights holds the average in the model
        self._module: nn.Module | None = None  # the average as a module, made on the first read of ``module``
        self._share_checked = False  # initial_share is checked once, when the average is first used
        self._init_shadows(model, 1, settings)
        self._clock = clock_for(self._groups, self.sharded, self.skip_nonfinite) if settings.traceable else None

    @property
    def step(self) -> UpdateCount:
        """The number of ``update`` calls, an ``int`` (``copy_correct.averages.peer_calls.UpdateCount``: diffusers'
        ``ema.step(model.parameters())`` raises naming ``ema.update(model)``); with ``traceable``, read from the
        device."""
        return UpdateCount(self._step if self._clock is None else self._clock.counts()[0])

    @property
    def num_updates(self) -> int:
        """The averaging updates made (the warm-up's k; under ``skip_nonfinite``, skipped ones too); with
        ``traceable``, read from the device."""
        return self._made if self._clock is None else self._clock.counts()[1]

    def _set_counts(self, calls: int, made: int) -> None:
        self._step, self._made = calls, made
        if self._clock is not None:
            self._clock.set(calls, made)

    def _device_guard(self) -> NonFiniteGuard:
        """The guard of a shadow off the CPU: it stages, checks and averages (or selects) on the device."""
        return NonFiniteGuard([(group.shadows, group.average) for group in self._groups], self._skipped, self._applied)

    def _live_groups(self, model: nn.Module | None) -> list[tuple[Group, list[torch.Tensor]]]:
        self._tracked(model)
        return [(group, self._checked_lives(group)) for group in self._groups]

    # -- the update -----------------------------------------------------------------------------------

    def decay_at(self, k: int) -> float:
        """The decay of averaging update number ``k`` (0-based: ``num_updates``, or the updates applied under
        ``skip_nonfinite``), warm-up included."""
        return self.schedule.at(k)

    @property
    def initial_share(self) -> float:
        """The share of the average that is still the weights it started from: 0 after a warm-up's first update (its
        decay is 0), else the product of the decays so far (``decay ** num_updates`` without a warm-up)."""
        return self.schedule.share_after(self.num_updates)

    def _check_share(self, stacklevel: int) -> None:
        """Warn, once, when the average is first used while it is mostly the weights it started from."""
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
        """One step: average the model into the shadow (or copy it, before ``start_step``), in place, under
        ``no_grad``, with no allocation and no host sync. ``model`` defaults to the tracked one (wrapped in DDP or
        ``torch.compile`` is fine). Raises inside ``average_weights`` and when the model changed since the EMA was
        built. ``step`` (timm's ``update(model, step=n)``) must be this call's number, ``ema.step + 1``. Inside a
        ``torch.compile``d function it needs ``traceable=True`` (``_traced_update``)."""
        if torch.compiler.is_compiling():
            self._traced_update(model, step)
            return
        if self._swap is not None:
            raise RuntimeError(
                "EMA.update inside EMA.average_weights: the model holds a copy of the average there, which the live "
                "weights replace when the block ends, so this would average the average into itself; update after "
                "the block ends"
            )
        tracked = self._tracked(model)
        if self._watch.stale():
            self._check_model(tracked)
        if self._clock is not None:
            self._clocked(self._values, step)
            return
        if step is not None and step != self._step + 1:
            raise ValueError(
                f"EMA.update(step={step!r}): this is update call {self._step + 1} of this EMA, which counts its own "
                "calls (ema.step); restore a resumed count with load_state_dict or load_average(..., step=n), or drop "
                "step="
            )
        step, self._step = self._step, self._step + 1
        copy = step < self.start_step
        if not copy and (step - self.start_step) % self.update_every:
            return
        grad_was_enabled = torch.is_grad_enabled()
        set_grad_enabled(False)  # a `with torch.no_grad()` block costs more than a small model's update
        try:
            if isinstance(self._guard, NonFiniteGuard):
                self._stage()
                self._guard.update(copy, self.schedule)
            else:
                self._average(copy)
        finally:
            set_grad_enabled(grad_was_enabled)
        if not copy:
            self._made += 1

    def _traced_update(self, model: nn.Module | None, step: int | None) -> None:
        """``update`` as Dynamo traces it: the values looked up by name (``traced_values``), the counters and decay
        on the device (``DeviceClock``); without ``traceable`` refused in one line as it traces."""
        if self._clock is None:
            raise RuntimeError(
                "EMA.update inside torch.compile needs EMA(model, ..., traceable=True): its counters and decay are "
                "then tensors, where Python numbers would be graph constants and compile it again at every update"
            )
        if self._swap is not None:
            raise RuntimeError("EMA.update inside EMA.average_weights: update after the block ends")
        self._clocked(lambda: traced_values(self._tracked(model), self._groups, "EMA"), step)

    def _clocked(self, read: Callable[[], list[list[torch.Tensor]] | None], step: int | None) -> None:
        """The update of a ``traceable`` EMA, of the values ``read`` gives (per group), after refusing ``step=``."""
        if step is not None:
            raise ValueError("EMA.update(step=...) with traceable=True would read the device's count: drop step=")
        values = read()
        assert values is not None and self._clock is not None  # no FiniteCheck beside a clock
        with torch.no_grad():
            groups = [(group.shadows, lives, group.average) for group, lives in zip(self._groups, values, strict=True)]
            self._clock.update(groups, self.schedule, self.start_step, self.update_every)

    def _average(self, copy: bool) -> None:
        """The update without a guard, or under a ``FiniteCheck`` (a CPU shadow), which skips it whole, writing
        nothing, when a value averaged holds a NaN or an Inf (``_values``)."""
        values = self._values()
        if values is None:
            return
        k = self.num_updates
        if self._guard is not None:
            k = int(self._applied)
            if not copy:
                self._applied.add_(1.0)
        weight = 1.0 - self.schedule.at(k)
        for group, lives in zip(self._groups, values, strict=True):
            if group.average and not copy:
                foreach_lerp_(group.shadows, lives, weight)
            else:
                foreach_copy_(group.shadows, lives)

    # -- using the average ----------------------------------------------------------------------------

    @property
    def shadow(self) -> dict[str, torch.Tensor]:
        """The average by ``state_dict`` name: the shadow's own tensors, which hold it at all times."""
        return self._copies[0]

    @property
    def swapped(self) -> bool:
        """Whether an ``average_weights`` block holds the average in the model now."""
        return self._swap is not None

    def copy_to(self, model: nn.Module | None = None) -> None:
        """Overwrite a model's weights (and averaged buffers) with the shadow, in place: the averaged model (the
        default; refused inside ``average_weights``), or another with the same ``state_dict`` names and shapes."""
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
        write_into(unwrap(model), self.shadow, "EMA")

    def export(self) -> nn.Module:
        """A new module holding the average, in eval mode: a deep copy of the (unwrapped) model, the average copied
        into it. The model and the shadow are only read."""
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
        """The average as new, full, plain CPU tensors by name: an unsharded model's ``state_dict``. A sharded one is
        gathered tensor by tensor (a collective: every rank calls it)."""
        return gathered(self.shadow)

    @contextmanager
    def average_weights(self, model: nn.Module | None = None) -> Iterator[nn.Module]:
        """Run the block with the average in the model (``copy_correct.averages.weight_swap``): on exit, an exception
        too, the live values come back bit for bit and nothing written in the block reaches the average; a parameter
        written in the block (an optimizer step) is undone and named in a ``RuntimeError``. Nested, it changes
        nothing."""
        tracked = self._tracked(model)
        target = tracked if model is None else model
        if self._swap is not None:
            yield target
            return
        self._check_model(tracked)
        self._check_share(stacklevel=3)  # through contextlib's __enter__
        reshard(tracked)  # the sharded parameters registered, not gathered copies, before they are resolved
        swap = swap_in(self._live_groups(model))
        self._swap = swap
        try:
            yield target
        finally:
            written = swap_out(self._model, swap)
            self._swap = None
        if written:
            raise written_error(written)

    # -- checkpoints ----------------------------------------------------------------------------------

    def layout(self) -> dict[str, str]:
        """How each sharded tensor of the shadow is spread over the ranks (empty for an unsharded model)."""
        return {name: layout(t) for name, t in self.shadow.items() if is_sharded(t)}

    def state_dict(self) -> dict[str, Any]:
        """Counters, ``schedule`` and the average (``shadow``'s tensors, aliased like ``Module.state_dict``: save it
        before the next update); loads with ``weights_only=True``. Sharded: ``DTensor``s, and ``layout``. Under
        ``skip_nonfinite`` also ``skipped`` and ``applied_updates``, read from the device."""
        state = {
            "decay": self.decay,
            "schedule": self.schedule_state(),
            "step": int(self.step),
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
        """Raise ``ValueError``, naming the tensor and both sides, unless ``state`` fits this EMA: the same names and
        (full) shapes, each tensor whole or spread over the ranks as the model is (``check_tensors``: a state saved at
        another world size is resharded by ``torch.distributed.checkpoint`` into this EMA's ``state_dict()``)."""
        if not isinstance(state, Mapping):
            raise TypeError(f"EMA state must be a mapping (EMA.state_dict()), got {type(state).__name__}")
        saved = state.get("shadow")
        if not isinstance(saved, Mapping):
            if state and all(isinstance(v, torch.Tensor) for v in state.values()):
                raise ValueError(
                    "this is a model's state_dict (an average saved as weights: timm's state_dict_ema, an export), not "
                    "an EMA state, and it holds no counters: load it with ema.load_average(weights, step=n), n the "
                    "update calls it stands for (copy_correct.averages.peer_states reads diffusers' and ema-pytorch's "
                    "states)"
                )
            raise ValueError("EMA state must hold a 'shadow' mapping of tensor names to tensors (EMA.state_dict())")
        check_tensors("EMA", saved, self.shadow)

    def load_state_dict(self, state: Mapping[str, Any], *, new_schedule: bool = False) -> None:
        """Copy a saved average and counters in place, after ``check_state`` (a sharded EMA takes ``DTensor``s or
        full tensors; inside ``average_weights`` the model gets the loaded average too). A state without counters, or
        saved with another schedule unless ``new_schedule=True``, is refused in one line naming the difference."""
        self.check_state(state)
        absent = [key for key in ("step", "num_updates") if key not in state]
        if absent:
            raise ValueError(
                f"EMA state has no {' or '.join(map(repr, absent))}: without its counters the average would restart "
                "(the next warm-up update copies the live weights over it); load the average with "
                "ema.load_average(state['shadow'], step=n), n the update calls it stands for"
            )
        saved = state.get("schedule", {"decay": state["decay"]} if "decay" in state else {})
        differences = [] if new_schedule else schedule_differences(saved, self.schedule_state())
        if differences:
            raise ValueError(
                f"EMA state was saved with another schedule: {'; '.join(differences)}; build the EMA with the saved "
                "settings to continue it, or pass new_schedule=True to go on with this EMA's"
            )
        copy_into(self.shadow, state["shadow"])
        if self._swap is not None:  # the block goes on with the loaded average in the model
            self._swap.reload(self._model)
        self._set_counts(int(state["step"]), int(state["num_updates"]))
        if self.skip_nonfinite:  # a state saved without the guard: nothing skipped, every update applied
            self._skipped.fill_(int(state.get("skipped", 0)))
            self._applied.fill_(int(state.get("applied_updates", self.num_updates)))

    def load_average(self, weights: Mapping[str, torch.Tensor], *, step: int) -> None:
        """Load a plain average by ``state_dict`` name (timm's ``state_dict_ema``, an export, a peer's:
        ``copy_correct.averages.peer_states``) as the one this EMA would hold after ``step`` calls of ``update``."""
        step = integer("step", step, 0)
        made = 0 if step <= self.start_step else -(-(step - self.start_step) // self.update_every)
        self.load_state_dict({"shadow": weights, "step": step, "num_updates": made}, new_schedule=True)

    def __repr__(self) -> str:
        tensors = len({id(t) for t in self.shadow.values()})
        return (
            f"EMA(decay={self.decay}, warmup={self.warmup!r}, tensors={tensors}, groups={len(self._groups)}, "
            f"step={int(self.step)}, num_updates={self.num_updates})"
        )
