"""The device guards of ``EMA``, ``PowerEMA`` and the target networks (``copy_correct.guards.device``'s
``NonFiniteGuard`` and ``ProfilesGuard``) on every device, the CPU included: each owner chooses its guard in one place,
``copy_correct.guards.choice`` (on the CPU the host check, ``copy_correct.guards.host``), so here that choice is made to
say "device" and each owner builds its device guard from its own groups, as a CUDA average's is built. The guard must
skip an update with a NaN in a middle tensor of the floating group or an Inf in its last, bit for bit and counted, the
next updates made as if it had not been. The control: the decision looking at each group's first tensor only lets
both through."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from copy_correct import EMA, PowerEMA, hard_update, make_target, skipped_updates, soft_update
from copy_correct.guards import choice
from copy_correct.guards.device import NonFiniteGuard
from copy_correct.target import _guard, _pairs
from tests.conftest import DEVICES
from tests.parts.test_ema_nonfinite import bits, net, same_bits, train_step
from tests.parts.test_nonfinite import check_first_tensor_only

SIGMAS = (0.05, 0.10)
OWNERS = ["EMA", "PowerEMA", "soft_update", "hard_update"]


class Owner:
    """An average of ``model`` (an ``EMA``, a ``PowerEMA`` or a target network) with ``skip_nonfinite=True`` and the
    guard it chose; ``on_device``: the choice made to say "device" whatever the device (on the CPU too)."""

    def __init__(self, kind: str, model: nn.Module, on_device: bool = True) -> None:
        self.kind, self.model = kind, model
        with pytest.MonkeyPatch.context() as patch:
            if on_device:
                patch.setattr(choice, "on_host", lambda written: False)
            if kind == "EMA":
                self.averaged: Any = EMA(model, decay=0.9, skip_nonfinite=True)
            elif kind == "PowerEMA":
                self.averaged = PowerEMA(model, SIGMAS, skip_nonfinite=True)
            else:
                self.averaged = make_target(model)
            if kind in ("EMA", "PowerEMA"):
                self.guard = self.averaged._guard
            else:  # built at the first guarded update: here, now, the update then finds it built
                self.guard = _guard(self.averaged, _pairs(self.averaged, model, None))

    def update(self) -> None:
        if self.kind == "EMA":
            self.averaged.update(self.model)
        elif self.kind == "PowerEMA":
            self.averaged.update()
        elif self.kind == "soft_update":
            soft_update(self.averaged, self.model, 0.05, skip_nonfinite=True)
        else:
            hard_update(self.averaged, self.model, skip_nonfinite=True)

    def state(self) -> dict[str, torch.Tensor]:
        if self.kind == "EMA":
            return bits(self.averaged.shadow)
        if self.kind == "PowerEMA":
            return {f"{i}.{k}": v for i, p in enumerate(self.averaged.profiles) for k, v in bits(p).items()}
        return bits(self.averaged.state_dict())


def run_with_poisons(kind: str, device: str, poison: bool, first_only: bool = False) -> tuple[Owner, list[int]]:
    """Eight training steps, each followed by an update; after steps 3 and 5, one more update with a NaN in a middle
    tensor of the floating group (BatchNorm's ``running_var``) or an Inf in its last (the last layer's bias), which
    must be skipped, bit for bit, and the next updates made as if it had not been (``PowerEMA``: a step counted). The
    owner, and the steps whose poisoned update changed the average."""
    model = net(device)
    owner = Owner(kind, model)
    assert isinstance(owner.guard, NonFiniteGuard)
    if first_only:
        check_first_tensor_only(owner.guard)
    let_through = []
    for step in range(8):
        train_step(model, step)
        owner.update()
        if step in (3, 5):
            if not poison:
                if kind == "PowerEMA":
                    owner.averaged.step += 1
                continue
            tensor, value = (model[1].running_var, float("nan")) if step == 3 else (model[3].bias, float("inf"))
            before = owner.state()
            with torch.no_grad():
                kept = tensor[2].clone()
                tensor[2] = value
                owner.update()
                tensor[2] = kept
            if not same_bits(owner.state(), before):
                let_through.append(step)
    return owner, let_through


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", OWNERS)
def test_the_owners_device_guards_skip_a_poison_past_each_groups_first_tensor(kind: str, device: str) -> None:
    (guarded, let_through), (clean, _) = run_with_poisons(kind, device, True), run_with_poisons(kind, device, False)
    assert let_through == []
    assert (skipped_updates(guarded.averaged), skipped_updates(clean.averaged)) == (2, 0)
    assert same_bits(guarded.state(), clean.state())
    # The control: the decision on each group's first tensor (the first layer's weight) lets both through.
    control, let_through = run_with_poisons(kind, device, True, first_only=True)
    assert let_through == [3, 5] and skipped_updates(control.averaged) == 0


@pytest.mark.parametrize("kind", OWNERS)
def test_every_owner_chooses_its_guard_in_the_one_place(kind: str) -> None:
    """The choice made to say "device" in ``copy_correct.guards.choice`` gives every owner its device guard on the
    CPU: none chooses anywhere else. The control: the same owners as they choose on the CPU, the host check."""
    assert isinstance(Owner(kind, net("cpu")).guard, NonFiniteGuard)
    assert not isinstance(Owner(kind, net("cpu"), on_device=False).guard, NonFiniteGuard)
