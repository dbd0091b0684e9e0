"""Target networks: a frozen copy of an online network, kept current in place.

Copy contract:

* New storage, once: ``make_target(online)`` deep-copies; every parameter and buffer gets storage of its own,
  ``requires_grad=False`` (no optimizer built with a ``requires_grad`` filter, and no backward, can touch it), eval
  mode. ``make_target(online, into=net)`` gives ``net`` the same: written in place by ``hard_update``, then frozen.
* Written in place, nothing allocated: ``hard_update`` (bit for bit, NaN and Inf included) and ``soft_update``
  (``lerp_`` by ``tau``) write into the target's storage under ``no_grad``, one ``torch._foreach_copy_`` /
  ``torch._foreach_lerp_`` per (device, dtype) group over lists built once per (target, online) pair, with no host
  read. Buffers come along: floating ones copied or averaged, integer ones copied. A storage replaced in place on
  either side (``.data = ...``, ``.to(...)``: a data pointer changed), or a module of either replaced (a new head:
  ``copy_correct.averages.model_changes.ModelWatch`` sees every registration), has the pair checked again before
  anything is written: one that no longer matches is refused naming the tensor, the target bit for bit as it was.
* What autograd sees: each target tensor's ``_version`` rises by exactly one per update on every device
  (``copy_correct.core.foreach_writes``), so a backward through a target tensor saved before the update raises. Why not
  ``load_state_dict`` or ``target.data.copy_(tau * q + (1 - tau) * t)``: a ``state_dict()`` walk per call, or three
  temporaries per tensor and a write that ``.data`` hides from autograd.
* ``skip_nonfinite=True`` (opt-in) leaves the target bit for bit when an online floating value is NaN or Inf. A CPU
  target is checked on the host before writing (``copy_correct.guards.host``: one read of the online weights, no
  staging copy), so a skip writes nothing and raises no version; on CUDA the device decides
  (``copy_correct.guards.device``: a staging copy, no sync). ``skipped_updates`` counts the skips; the cost is on the
  dqn recipe's page. Not for sharded networks: each rank would decide on its own shards.
* ``torch.compile``, ``DataParallel`` and DDP wrappers are looked through; the pair's lists hold the target's modules
  weakly, so a dropped target is freed. A parent's ``.train()`` also switches the target: ``recipes/dqn.py`` keeps it
  in eval mode.
* Sharded (FSDP2): make the target before sharding and shard both alike, or give ``make_target(online, into=second)``
  a second network sharded alike. Each rank updates its own shards (``to_local()``), no collective, after dropping the
  target's gathered parameters so that its next forward gathers the new values; a pair spread unlike is refused.
"""

from __future__ import annotations

import copy
import functools
import operator
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from copy_correct.averages.model_changes import ModelWatch
from copy_correct.core.checks import flag, module, number
from copy_correct.core.foreach_writes import foreach_copy_, foreach_lerp_
from copy_correct.core.module_tensors import DATA_PTR, TensorRefs, state_entries, unwrap
from copy_correct.core.sharding import fsdp_modules, is_sharded, layout, reshard
from copy_correct.core.torch_internals import set_grad_enabled
from copy_correct.decay_schedule import DecaySchedule
from copy_correct.guards.choice import choose
from copy_correct.guards.device import TARGET_GUARDS, NonFiniteGuard
from copy_correct.guards.host import FiniteCheck

__all__ = ["hard_update", "make_target", "soft_update"]


def make_target(online: nn.Module, into: nn.Module | None = None) -> nn.Module:
    """A frozen copy of ``online``: own storage, ``requires_grad=False`` everywhere, eval mode.

    Without ``into``, a deep copy. With ``into`` (a network built like ``online``, sharded alike when ``online`` is
    sharded), ``online``'s parameters and buffers are copied into it in place (``hard_update``: on this rank's shards,
    no collective) and ``into`` is frozen and returned: the way to a target of a network that is already sharded,
    which FSDP2 cannot deep-copy.
    """
    online = unwrap(module("online", online), "online")
    if into is not None:
        _update(module("into", into), online, 1.0, caller=None)  # the order is named: nothing looks reversed
        into.requires_grad_(False)
        return into.eval()
    if any(is_sharded(p) for p in online.parameters()):
        raise ValueError(
            "make_target: online is sharded (FSDP2 forbids deep copies of sharded modules): make the target before "
            "fully_shard and shard both networks alike, or build a second network, shard it alike and pass it: "
            "make_target(online, into=it)"
        )
    target = copy.deepcopy(online)
    target.requires_grad_(False)
    return target.eval()


def hard_update(target: nn.Module, online: nn.Module, *, skip_nonfinite: bool = False) -> None:
    """Copy every parameter and buffer of ``online`` into ``target``, in place and bit for bit; with
    ``skip_nonfinite``, not at all when an online floating value is NaN or Inf: on the CPU decided on the host before
    writing (one more read of the online weights, 1.5x the copy on a large network; a skip writes nothing),
    elsewhere on the device (a staging copy, no sync).

    Refused before anything is written (one line, naming the argument): anything but a module for either network
    (``.parameters()`` included: pass the modules), networks that differ or hold no floating tensor, and the
    arguments reversed, as stable-baselines3's ``polyak_update(params, target_params)`` orders them: a ``target``
    that requires grad with an ``online`` frozen everywhere (as ``make_target`` leaves a target). Two trainable
    networks (CleanRL's target) are taken. Checked once per (target, online) pair, when its lists are built."""
    if type(skip_nonfinite) is not bool:
        flag("skip_nonfinite", skip_nonfinite)
    _update(target, online, 1.0, skip_nonfinite, "hard_update")


def soft_update(target: nn.Module, online: nn.Module, tau: float, *, skip_nonfinite: bool = False) -> None:
    """``target = (1 - tau) * target + tau * online`` for floating tensors, in place; integer buffers copied. With
    ``skip_nonfinite``, not at all when an online floating value is NaN or Inf: on the CPU decided on the host before
    writing (one more read of the online weights, 1.5x the update on a large network; a skip writes nothing),
    elsewhere on the device (a staging copy, no sync).

    ``tau`` must be a number in (0, 1] (a string or a bool is a ``TypeError``); ``tau == 1`` is a hard update. The
    networks are checked, and refused, as ``hard_update`` checks them, the reversed order included.
    """
    if type(tau) is not float or not 0.0 < tau <= 1.0:
        number("tau", tau, "(0, 1]")
    if type(skip_nonfinite) is not bool:
        flag("skip_nonfinite", skip_nonfinite)
    _update(target, online, tau, skip_nonfinite, "soft_update")


def _update(
    target: nn.Module, online: nn.Module, tau: float, skip_nonfinite: bool = False, caller: str | None = None
) -> None:
    """One foreach call per group: ``lerp_`` by ``tau`` for floating groups when ``tau < 1``, else ``copy_``.

    Guarded, a target on the CPU has the online floating values checked first, on the host (its ``FiniteCheck``): not
    finite, nothing is written and the skip is counted; finite, the same calls as unguarded. Guarded elsewhere, the
    online values are staged, checked and averaged (or selected) on the device by the target's ``NonFiniteGuard``.
    ``caller``: the public function whose argument order a new pair is checked for (``None``: not checked)."""
    if torch.compiler.is_compiling():
        _traced(unwrap(target, "target"), unwrap(online, "online"), tau, skip_nonfinite, caller)
        return
    groups, targets, onlines = _checked(_pairs(target, online, caller), target, online)
    grad_was_enabled = torch.is_grad_enabled()
    set_grad_enabled(False)  # what `with torch.no_grad()` does, at a fraction of a small network's update
    try:
        if skip_nonfinite:
            guard = _guard(unwrap(target), groups)
            if isinstance(guard, NonFiniteGuard):
                for index, values in enumerate(onlines):
                    foreach_copy_(guard.staging(index), values)
                guard.update(tau >= 1.0, _constant(1.0 - tau if tau < 1.0 else 0.0))
                return
            if not guard.check.finite([v for g, v in zip(groups, onlines, strict=True) if g.average]):
                guard.skipped += 1
                return
        for group, written, values in zip(groups, targets, onlines, strict=True):
            if group.average and tau < 1.0:
                foreach_lerp_(written, values, tau)
            else:
                foreach_copy_(written, values)
    finally:
        set_grad_enabled(grad_was_enabled)


def _traced(target: nn.Module, online: nn.Module, tau: float, skip_nonfinite: bool, caller: str | None) -> None:
    """The update inside a ``torch.compile``d function: the same writes (``lerp_`` by ``tau`` of the floating tensors,
    or ``copy_``; integer buffers copied), one op per tensor, the tensors looked up by name on both sides as Dynamo
    traces (the pair's cache reads data pointers, which do not trace): a module replaced by one alike is followed at
    the next call, as the compiled step's forward follows it. No graph break, one compile for every call with the same
    ``tau`` (a Python float is a constant of the graph). Refused in one line as it traces: ``skip_nonfinite`` (decided
    on the host), networks whose names, shapes or dtypes differ, a sharded network."""
    if caller is not None:
        _refuse_reversed(caller, target, online)
    if skip_nonfinite:
        raise ValueError(f"{caller}(..., skip_nonfinite=True) inside torch.compile: the skip is decided on the host")
    written, values = _named_tensors(target), _named_tensors(online)
    if list(written) != list(values) or any(
        is_sharded(t) or (t.shape, t.dtype) != (values[name].shape, values[name].dtype) for name, t in written.items()
    ):
        raise ValueError(f"{caller} inside torch.compile takes two unsharded networks of the same tensors")
    with torch.no_grad():
        for name, t in written.items():
            if t.is_floating_point() and tau < 1.0:
                t.lerp_(values[name], tau)
            else:
                t.copy_(values[name])


def _named_tensors(network: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters (each once) and persistent buffers by name, as ``state_dict`` has them, in a form Dynamo
    traces."""
    named = dict(network.named_parameters())
    for prefix, owner in network.named_modules():
        for name, buffer in owner._buffers.items():
            if buffer is not None and name not in owner._non_persistent_buffers_set:
                named[f"{prefix}.{name}" if prefix else name] = buffer
    return named


def _checked(
    groups: list[_PairGroup], target: nn.Module, online: nn.Module
) -> tuple[list[_PairGroup], list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """The pair's groups and each group's target and online tensors now, once every data pointer on both sides is
    the one they were built or last checked with; otherwise (a storage replaced in place) the pair is checked again
    as ``_build`` checks a new one, and refused naming the tensor, or its groups rebuilt, before anything is
    written."""
    targets, onlines = [], []
    for group in groups:
        written, values = group.target.resolve(), group.online.resolve()
        if list(map(DATA_PTR, written)) != group.target_pointers or (
            list(map(DATA_PTR, values)) != group.online_pointers
        ):
            target, online = unwrap(target, "target"), unwrap(online, "online")
            pair = _CACHE[target]
            pair.groups = _build(target, online)
            return _checked(pair.groups, target, online)
        targets.append(written)
        onlines.append(values)
    return groups, targets, onlines


class _HostGuard:
    """A CPU target's guard: the ``FiniteCheck`` of the online floating values (scratch allocated once, the values
    checked on the host before anything is written) and the count of skipped updates (a host int: no tensor written)."""

    __slots__ = ("check", "skipped")

    def __init__(self, check: FiniteCheck, skipped: int) -> None:
        self.check = check
        self.skipped = skipped


def _guard(target: nn.Module, groups: list[_PairGroup]) -> NonFiniteGuard | _HostGuard:
    """The target's guard, built on the first guarded update and when its tensors change, as
    ``copy_correct.guards.choice`` chooses: a ``_HostGuard`` when every target tensor is on the CPU, else a
    ``NonFiniteGuard``; the count of skips goes over to the new one."""
    tensors = [t for group in groups for t in group.target.resolve()]
    addresses = list(map(DATA_PTR, tensors))
    guarded = TARGET_GUARDS.get(target)
    if guarded is not None and guarded[1] == addresses and all(map(operator.is_, guarded[0], tensors)):
        return guarded[2]
    if any(is_sharded(t) for t in tensors):
        raise ValueError(
            "skip_nonfinite=True is not supported for a sharded (FSDP2) target: each rank sees only its shards, so the "
            "ranks could decide differently and leave the target half updated"
        )
    before = None if guarded is None else guarded[2]
    host = functools.partial(_host_guard, groups, before)
    guard = choose(tensors, host, functools.partial(_device_guard, groups, before, tensors[0].device))
    TARGET_GUARDS[target] = (tensors, addresses, guard)
    return guard


def _host_guard(groups: list[_PairGroup], before: NonFiniteGuard | _HostGuard | None) -> _HostGuard:
    count = 0 if before is None else int(before.skipped)  # from a device guard: a sync, once, at the rebuild
    return _HostGuard(FiniteCheck([group.online.resolve() for group in groups if group.average]), count)


def _device_guard(
    groups: list[_PairGroup], before: NonFiniteGuard | _HostGuard | None, device: torch.device
) -> NonFiniteGuard:
    if isinstance(before, NonFiniteGuard):
        skipped = before.skipped  # the device counter itself: no sync
    else:
        count = 0 if before is None else before.skipped
        skipped = torch.full((), count, dtype=torch.float64, device=device)
    applied = torch.zeros((), dtype=torch.float64, device=skipped.device)  # no warm-up here: never read
    return NonFiniteGuard([(group.target.resolve(), group.average) for group in groups], skipped, applied)


@dataclass
class _PairGroup:
    average: bool
    target: TensorRefs = field(default_factory=TensorRefs)
    online: TensorRefs = field(default_factory=TensorRefs)
    target_pointers: list[int] = field(default_factory=list)  # each side's data pointers when built
    online_pointers: list[int] = field(default_factory=list)


@dataclass
class _Pair:
    """A (target, online) pair's groups, built on its first update and again when a data pointer changed or a
    parameter, buffer or submodule was registered anywhere since (``watch``: a new head assigned), and the target's
    FSDP2 modules (weakly), found once: the updates run every step."""

    online: weakref.ref
    groups: list[_PairGroup]
    sharded: list[weakref.ref]
    watch: ModelWatch = field(default_factory=ModelWatch)


# Keyed by the target; every value refers to modules weakly (the target's buffer owners and FSDP2 modules, the online
# network), so a target dropped by its user is freed, cache entry and all.
_CACHE: weakref.WeakKeyDictionary[nn.Module, _Pair] = weakref.WeakKeyDictionary()
# The same pairs by the ids of the objects an update is passed (wrapped or not), checked by identity and dropped with
# either: one dict lookup, where unwrapping both and the weak dictionary cost a small network's update a tenth.
_PASSED: dict[tuple[int, int], tuple[weakref.ref, weakref.ref, _Pair]] = {}


def _pairs(target: nn.Module, online: nn.Module, caller: str | None) -> list[_PairGroup]:
    """The pair's groups, built on the first call (after ``_refuse_reversed``); the target's FSDP2 modules resharded
    (local), ready to write.

    Both networks are unwrapped first (``torch.compile``, ``DataParallel``, DDP): the pair is the modules inside."""
    key = (id(target), id(online))
    passed = _PASSED.get(key)
    if passed is not None and passed[0]() is target and passed[1]() is online:
        pair = passed[2]
    else:
        pair = _pair(unwrap(target, "target"), unwrap(online, "online"), caller)
        forget = lambda _: _PASSED.pop(key, None)  # noqa: E731 - a weakref callback
        _PASSED[key] = (weakref.ref(target, forget), weakref.ref(online, forget), pair)
    if pair.sharded:
        reshard([m for m in (ref() for ref in pair.sharded) if m is not None])
    if pair.watch.stale():  # a registration since the last update (one integer compare): pair the networks anew
        pair.groups = _build(unwrap(target, "target"), unwrap(online, "online"))
        pair.watch.seen()
    return pair.groups


def _pair(target: nn.Module, online: nn.Module, caller: str | None) -> _Pair:
    """The unwrapped pair's cache entry, made when the target has none for this online network."""
    pair = _CACHE.get(target)
    if pair is None or pair.online() is not online:
        if caller is not None:
            _refuse_reversed(caller, target, online)
        sharded = fsdp_modules(target)
        reshard(sharded)  # its sharded parameters registered, to build the lists from
        pair = _Pair(weakref.ref(online), _build(target, online), [weakref.ref(m) for m in sharded])
        _CACHE[target] = pair
    return pair


def _refuse_reversed(caller: str, target: nn.Module, online: nn.Module) -> None:
    """Refuse a trainable ``target`` with an ``online`` whose parameters are all frozen: the networks passed in
    stable-baselines3's ``polyak_update(params, target_params)`` order, which would overwrite the trained network."""
    sources = [p.requires_grad for p in online.parameters()]
    if sources and not any(sources) and any(p.requires_grad for p in target.parameters()):
        raise ValueError(
            f"{caller}(target, online): target requires grad and online is frozen (requires_grad=False everywhere, "
            "as make_target leaves a target): the arguments look reversed; pass the network you train second "
            "(stable-baselines3's polyak_update takes them the other way round: (params, target_params))"
        )


def _build(target: nn.Module, online: nn.Module) -> list[_PairGroup]:
    if target is online:
        raise ValueError("target and online are the same module; make the target with make_target(online)")
    targets = list(state_entries(target))
    onlines = list(state_entries(online))
    for (t_name, t, _), (o_name, o, _) in zip(targets, onlines, strict=False):
        if t_name != o_name or t.shape != o.shape or t.dtype != o.dtype or t.device != o.device:
            raise ValueError(
                f"target and online differ at {t_name!r} / {o_name!r}: target {tuple(t.shape)} {t.dtype} "
                f"on {t.device}, online {tuple(o.shape)} {o.dtype} on {o.device}"
            )
        if layout(t) != layout(o):
            raise ValueError(
                f"target and online are sharded differently at {t_name!r}: target {layout(t)}, online {layout(o)}; "
                "shard both networks alike"
            )
    if len(targets) != len(onlines):
        longer, name = ("target", targets[len(onlines)][0]) if len(targets) > len(onlines) else (
            "online", onlines[len(targets)][0])  # fmt: skip
        raise ValueError(f"target and online differ: only the {longer} has {name!r}")
    groups: dict[tuple, _PairGroup] = {}
    seen: set[int] = set()
    for (_, t, t_owner), (_, o, o_owner) in zip(targets, onlines, strict=True):
        if id(t) in seen:  # tied weights: once
            continue
        seen.add(id(t))
        if any(t is x for _, x, _ in onlines):
            raise ValueError("target and online share tensors; make the target with make_target(online)")
        group = groups.setdefault((t.device, t.dtype), _PairGroup(average=t.is_floating_point()))
        group.target.append(t, t_owner)
        group.online.append(o, o_owner)
    if not any(group.average for group in groups.values()):
        raise ValueError(
            f"target and online ({type(online).__name__}) have no floating parameters or buffers: nothing to update"
        )
    for group in groups.values():
        group.target_pointers = list(map(DATA_PTR, group.target.resolve()))
        group.online_pointers = list(map(DATA_PTR, group.online.resolve()))
    return list(groups.values())


@functools.lru_cache(maxsize=8)
def _constant(decay: float) -> DecaySchedule:
    """The guard's schedule of a soft update by ``tau = 1 - decay``: that decay at every update (made once per tau)."""
    return DecaySchedule(decay, warmup=False)
