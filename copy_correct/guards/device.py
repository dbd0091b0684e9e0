"""``NonFiniteGuard``: an average updated in place skips, on the device, every update whose live values hold a NaN or an
Inf, and leaves itself bit for bit as it was (``-0.0`` entries included).

Copy contract: new storage once, at construction: one flat staging tensor per group (the live values in the average's
dtype and device: one copy of the weights) and a few 0-dim tensors (flags, counters, the weight). An update then
allocates nothing, reads nothing back and decides nothing on the host: the decision is a 0-dim flag on the device,
and every kernel runs whatever it holds. The live tensors are only read (copied into the staging); each average
tensor's version rises by exactly one per update, skipped or not (``copy_correct.core.foreach_writes``), so autograd
sees every write. ``skipped`` and ``applied`` are device counters: reading one is a sync, the reader's. Groups on
several devices bring their checks to the first group's device. Not for a sharded average: each rank would decide alone.

Why it is exact, per group (``update``):

1. The caller copies the live values into ``staging``; ``torch.aminmax`` of it (one reduction, both ends propagate a
   NaN) gives the largest magnitude, finite exactly when every element is (a maximum cannot overflow, a sum could).
2. Averaging: ``lerp_(average, X, w)``, ``X`` the staging zeroed when bad (its bits times the flag, in integers of its
   width: a float product keeps ``0 * NaN = NaN``) and ``w`` the weight when good, ``-0.0`` when bad: a bad update
   computes ``a + (-0.0)`` = ``a`` for every finite ``a``, ``-0.0`` included, and a good one is the unguarded
   ``lerp_``, bit for bit (a float16/bfloat16 average's weight rounded to its dtype). ``torch._foreach_lerp_`` takes
   no 0-dim weight: the weight is expanded (CPU) or filled into one flat tensor (CUDA, for the fused path).
3. Copying (integer buffers, every tensor before ``start_step``): ``a += (x - a) * good`` in integers of the same
   width, exact for any bit pattern.
4. ``skipped += not good``, ``applied += good``: the warm-up counts applied updates only, so the update after a skip is
   made as if the skipped one had never been.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from copy_correct.core.checks import flag
from copy_correct.core.flat import flat_views
from copy_correct.core.module_tensors import unwrap
from copy_correct.core.torch_internals import increment_versions
from copy_correct.decay_schedule import DecaySchedule

__all__ = ["TARGET_GUARDS", "NonFiniteGuard", "ProfilesGuard", "guard_wanted", "refuse_nonfinite", "skipped_updates"]

# Each guarded target network of ``hard_update``/``soft_update`` (weakly held): the target tensors its guard was built
# on, their data pointers, and the guard, whose ``skipped`` is the count. ``copy_correct.target`` rebuilds the entry
# when those change (a new online network, buffers replaced or data swapped by ``model.to(...)``), the count kept.
TARGET_GUARDS: weakref.WeakKeyDictionary[nn.Module, tuple[list[torch.Tensor], list[int], Any]] = (
    weakref.WeakKeyDictionary()
)


def skipped_updates(averaged: Any) -> int:
    """How many ``skip_nonfinite`` updates of ``averaged`` were skipped (0 if none was guarded): an ``EMA``, a
    ``PowerEMA`` or a target network of ``hard_update``/``soft_update``. On the CPU a host count, elsewhere a read of a
    device counter, so a sync on a GPU: read it when you log, not every step."""
    count = getattr(type(averaged), "_skipped_count", None)
    if count is not None:
        return count(averaged)
    guarded = TARGET_GUARDS.get(unwrap(averaged, "averaged"))
    return 0 if guarded is None else int(guarded[2].skipped)


# the integer dtype of each element size: a float's bits, selected exactly (bool viewed as uint8: no bool subtraction)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def guard_wanted(requested: bool, owner: str, *, sharded: bool, tensors: Mapping[str, torch.Tensor]) -> bool:
    """Whether ``owner`` (``"EMA"``, ``"PowerEMA"``) runs with ``skip_nonfinite``: ``requested`` (``True`` or
    ``False``, else a ``TypeError``), ``True`` refused for a sharded model (each rank would decide on its own shards,
    and agreeing would need a collective per update) and for ``tensors`` holding a NaN or an Inf now
    (``refuse_nonfinite``: every update would be skipped)."""
    if not flag("skip_nonfinite", requested):
        return False
    if sharded:
        raise ValueError(
            f"skip_nonfinite=True is not supported for a sharded (FSDP2) model: each rank sees only its shards, so the "
            f"ranks could decide differently and leave the {owner} half updated"
        )
    refuse_nonfinite(tensors)
    return True


def refuse_nonfinite(tensors: Mapping[str, torch.Tensor]) -> None:
    """``ValueError`` naming the floating tensors that hold a NaN or an Inf: a guard built on them would skip every
    update. Read once, at construction (a sync per tensor there, none per update)."""
    nonfinite = [name for name, t in tensors.items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if nonfinite:
        raise ValueError(
            f"skip_nonfinite=True, but the model's {nonfinite[:5]} hold NaN or Inf now, so every update would be "
            "skipped (a floating buffer filled with -inf, say an attention mask: store it as bool, or leave it out of "
            "the state_dict with persistent=False)"
        )


class _Staged:
    """One group's scratch: the flat staging and its views shaped like the averages, integer views of both for the
    select, and, for an averaging group, the 0-dim weight in the average's dtype and the list ``lerp_`` takes."""

    def __init__(self, averages: list[torch.Tensor], average: bool) -> None:
        dtype = averages[0].dtype
        if dtype.itemsize not in _BITS:
            raise ValueError(f"skip_nonfinite cannot copy {dtype} tensors exactly: no integer dtype of their size")
        self.average = average
        self.averages = averages
        self.flat, self.views = flat_views(averages)
        device = self.flat.device
        bits = _BITS[dtype.itemsize]
        self.average_bits = [t.view(bits) for t in averages]
        self.view_bits = [t.view(bits) for t in self.views]
        self.flat_bits = self.flat.view(bits)
        self.keep = torch.ones((), dtype=bits, device=device)  # 1: a good update, 0: a bad one; in the bits' dtype
        self.extremes: tuple[torch.Tensor, torch.Tensor] | None = None  # None: nothing to check (integers; empty)
        self.weight = torch.zeros((), dtype=dtype, device=device)
        self.flat_weight: torch.Tensor | None = None  # CUDA: the weight in every element, refilled each update
        self.weights: list[torch.Tensor] = []
        if average:
            if self.flat.numel():
                self.extremes = (torch.zeros_like(self.weight), torch.zeros_like(self.weight))
            if device.type == "cpu":
                self.weights = [self.weight.expand_as(t) for t in averages]
            else:
                self.flat_weight, self.weights = flat_views(averages)


class NonFiniteGuard:
    """The scratch and flags that skip a non-finite update of ``groups`` (each: the average's tensors, of one dtype
    and device, and whether they are averaged or copied), counting into ``skipped`` and ``applied`` (0-dim float64
    tensors, exact counts below 2**53, on one of the groups' devices, which the owner keeps across guards).

    Every operand of every operation has the dtype of the others (the 0-dim flags are kept in each dtype they meet), so
    no kernel casts through a temporary: nothing is allocated, not even inside a kernel, where the probes cannot see."""

    def __init__(
        self, groups: Sequence[tuple[list[torch.Tensor], bool]], skipped: torch.Tensor, applied: torch.Tensor
    ) -> None:
        self.groups = [_Staged(averages, average) for averages, average in groups]
        self.skipped, self.applied = skipped, applied
        home = skipped.device
        self._good = torch.ones((), dtype=torch.bool, device=home)
        self._good64 = torch.ones((), dtype=torch.float64, device=home)
        self._bad64 = torch.zeros((), dtype=torch.float64, device=home)
        self._largest = torch.zeros((), dtype=torch.float64, device=home)  # the largest |x| of the update
        self._largest_here = torch.zeros((), dtype=torch.float64, device=home)  # one group's, brought home
        self._inf = torch.tensor(float("inf"), dtype=torch.float64, device=home)
        self._one = torch.ones((), dtype=torch.float64, device=home)
        self._minus_zero = torch.tensor(-0.0, dtype=torch.float64, device=home)
        self._weight = torch.zeros((), dtype=torch.float64, device=home)
        self._scratch = torch.zeros((), dtype=torch.float64, device=home)

    def staging(self, index: int) -> list[torch.Tensor]:
        """Where group ``index``'s live values go before ``update``: views of its flat staging."""
        return self.groups[index].views

    def update(self, copy: bool, schedule: DecaySchedule) -> None:
        """Average (``copy``: copy) the staged live values into the averages, unless any of them is NaN or Inf.

        The averaging weight is ``1 - schedule.at(applied)``, computed on the device from the count of applied
        updates (``DecaySchedule.write_weight``: the host's operations, in its order and precision)."""
        self._check()
        if not copy:
            schedule.write_weight(self.applied, self._weight, self._scratch, self._one)
            torch.where(self._good, self._weight, self._minus_zero, out=self._weight)
        for group in self.groups:
            if group.average and not copy:
                self._lerp(group)
            else:
                self._select(group)
        self.skipped.add_(self._bad64)
        if not copy:
            self.applied.add_(self._good64)

    def _check(self) -> None:
        self._largest.zero_()
        for group in self.groups:
            if group.extremes is not None:
                low, high = group.extremes
                torch.aminmax(group.flat, out=(low, high))
                torch.neg(low, out=low)
                torch.maximum(low, high, out=low)  # the largest magnitude; NaN wins
                self._largest_here.copy_(low, non_blocking=True)
                torch.maximum(self._largest, self._largest_here, out=self._largest)
        torch.lt(self._largest, self._inf, out=self._good)
        self._good64.copy_(self._good)
        torch.sub(self._one, self._good64, out=self._bad64)
        for group in self.groups:
            group.keep.copy_(self._good, non_blocking=True)

    def _lerp(self, group: _Staged) -> None:
        group.weight.copy_(self._weight, non_blocking=True)  # double to the average's dtype, as lerp_ rounds a scalar
        if group.flat_weight is not None:
            group.flat_weight.copy_(group.weight.expand_as(group.flat_weight))
        group.flat_bits.mul_(group.keep)  # bad: every bit 0, +0.0
        _bumped(torch._foreach_lerp_, group.averages, group.views, group.weights)

    def _select(self, group: _Staged) -> None:
        torch._foreach_sub_(group.view_bits, group.average_bits)  # x - a
        group.flat_bits.mul_(group.keep)  # (x - a) * good
        _bumped(torch._foreach_add_, group.average_bits, group.view_bits)  # a + (x - a) * good


def _bumped(op: Callable[..., Any], dst: list[torch.Tensor], *args: Any) -> None:
    """``op(dst, *args)``, an in-place foreach call, with every ``dst`` version raised by one on every device (a fused
    CUDA kernel may leave them as they were: ``copy_correct.core.foreach_writes``)."""
    first = dst[0]
    before = first._version
    op(dst, *args)
    if first._version == before:
        increment_versions(dst)


class ProfilesGuard(NonFiniteGuard):
    """``NonFiniteGuard`` for ``PowerEMA``: several profiles per group, one staging and one check per update shared by
    them all, and each profile's weight computed on the device from the step of the last applied update.

    ``groups``: per group, each profile's tensors (of one dtype and device) and whether they are averaged or copied.
    ``applied`` is the step of the last applied update (0: none; a 0-dim float64 tensor, exact below 2**53), so a
    skipped update is one that did not happen: the next good one, at step ``t``, weighs ``1 - (applied / t) **
    (gamma + 1)``, ``PowerEMA.betas``' operations in their order and precision (float64; bit for bit on CPU), and
    ``-0.0`` when bad. An averaged group's staging is zeroed once when bad and read by every profile's ``lerp_``; the
    0-dim weight (and on CUDA the flat weight) of the group is refilled per profile, stream-ordered, so the scratch
    is that of one average whatever the number of profiles. A copied (integer) group selects into the first profile
    as ``NonFiniteGuard`` does, then into each other profile from it: ``p += (first - p) * good``, exact for any bits
    (good: ``first`` is the live value; bad: nothing changes)."""

    def __init__(
        self,
        groups: Sequence[tuple[list[list[torch.Tensor]], bool]],
        gammas: Sequence[float],
        skipped: torch.Tensor,
        applied: torch.Tensor,
    ) -> None:
        super().__init__([(profiles[0], average) for profiles, average in groups], skipped, applied)
        self.profiles = [profiles for profiles, _ in groups]
        self.gammas = tuple(gammas)
        home = skipped.device
        self._step = torch.zeros((), dtype=torch.float64, device=home)
        self._ratio = torch.zeros((), dtype=torch.float64, device=home)
        self._weights = [torch.zeros((), dtype=torch.float64, device=home) for _ in self.gammas]
        self._profile_bits = [  # a copied group's profiles as integers, for the select
            [] if average else [[t.view(_BITS[t.element_size()]) for t in averages] for averages in profiles]
            for profiles, average in groups
        ]

    def update_profiles(self, step: int) -> None:
        """Average the staged live values into every profile at optimizer step ``step`` (copy the integer groups),
        unless any of them is NaN or Inf; then ``applied`` becomes ``step``, else ``skipped`` counts one."""
        self._check()
        self._step.fill_(step)
        torch.div(self.applied, self._step, out=self._ratio)  # previous / step
        for gamma, weight in zip(self.gammas, self._weights, strict=True):
            torch.pow(self._ratio, gamma + 1, out=weight)  # beta
            torch.sub(self._one, weight, out=weight)  # 1 - beta
            torch.where(self._good, weight, self._minus_zero, out=weight)
        for group, profiles, profile_bits in zip(self.groups, self.profiles, self._profile_bits, strict=True):
            if group.average:
                group.flat_bits.mul_(group.keep)  # bad: every bit 0, +0.0
                for averages, weight in zip(profiles, self._weights, strict=True):
                    group.weight.copy_(weight, non_blocking=True)
                    if group.flat_weight is not None:
                        group.flat_weight.copy_(group.weight.expand_as(group.flat_weight))
                    _bumped(torch._foreach_lerp_, averages, group.views, group.weights)
            else:
                self._select(group)  # into the first profile
                for bits in profile_bits[1:]:
                    torch._foreach_copy_(group.view_bits, group.average_bits)
                    torch._foreach_sub_(group.view_bits, bits)  # first - p
                    group.flat_bits.mul_(group.keep)
                    _bumped(torch._foreach_add_, bits, group.view_bits)
        self.skipped.add_(self._bad64)
        torch.where(self._good, self._step, self.applied, out=self.applied)
