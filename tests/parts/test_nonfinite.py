"""``NonFiniteGuard`` (``copy_correct.guards.device``), the device guard's decision, on every device, the CPU included
(``EMA``, ``PowerEMA`` and the target networks build it only off the CPU: ``tests/parts/test_nonfinite_owners.py``
builds theirs on the CPU). Built here directly on groups of several tensors (three floating dtypes averaged, an
integer group copied): a NaN, an Inf or a -Inf in any tensor of any group (its first, a middle or its last) skips the
whole update, every average bit for bit as it was, each version raised by one and the skip counted; finite values
update exactly as the unguarded ``torch._foreach_lerp_``/``torch._foreach_copy_``. Each claim has its control: the
decision looking at each group's first tensor only lets a poison in any other tensor through; a guard that skipped
any group would not match the unguarded updates."""

from __future__ import annotations

import pytest
import torch

from copy_correct.decay_schedule import DecaySchedule
from copy_correct.guards.device import NonFiniteGuard
from tests.conftest import DEVICES

FLOATING = (torch.float32, torch.float64, torch.bfloat16)  # averaged groups; then one integer group, copied
SHAPES = ((3, 4), (5,), (2, 3, 2))  # each group's first, middle and last tensor
# The first update copies (weight 1), the next ones average with weight 0.25: exact in every floating dtype, so the
# guard's weight (computed on the device, rounded to the average's dtype) is the unguarded lerp_'s scalar, bit for bit.
SCHEDULE = DecaySchedule(0.75, warmup="copy")
POISONS = (float("nan"), float("inf"), -float("inf"))


def averages(device: str) -> list[tuple[list[torch.Tensor], bool]]:
    """The guard's groups: each floating dtype averaged, and int64 copied."""
    generator = torch.Generator().manual_seed(0)
    groups = [([torch.randn(s, generator=generator).to(device, dtype) for s in SHAPES], True) for dtype in FLOATING]
    groups.append(([torch.randint(-1000, 1000, s, generator=generator).to(device) for s in SHAPES], False))
    return groups


def live_values(groups: list[tuple[list[torch.Tensor], bool]], seed: int) -> list[list[torch.Tensor]]:
    """Finite live values for every group, unlike the averages and unlike another seed's."""
    generator = torch.Generator().manual_seed(seed)
    return [
        [torch.randn(t.shape, generator=generator).mul(100).to(t.device, t.dtype) for t in tensors]
        for tensors, _ in groups
    ]


def counters(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros((), dtype=torch.float64, device=device), torch.zeros((), dtype=torch.float64, device=device)


def update(guard: NonFiniteGuard, lives: list[list[torch.Tensor]], copy: bool) -> None:
    """What an owner does: stage the live values, then the guarded update."""
    for index, values in enumerate(lives):
        torch._foreach_copy_(guard.staging(index), values)
    guard.update(copy, SCHEDULE)


def check_first_tensor_only(guard: NonFiniteGuard) -> None:
    """The bug the tests catch: each group's decision reads its first tensor only (``_check`` reads ``flat``)."""
    for group in guard.groups:
        group.flat = group.views[0]


def all_bits(groups: list[tuple[list[torch.Tensor], bool]]) -> list[torch.Tensor]:
    return [t.view(torch.uint8).clone() for tensors, _ in groups for t in tensors]


def versions(groups: list[tuple[list[torch.Tensor], bool]]) -> list[int]:
    return [t._version for tensors, _ in groups for t in tensors]


def poisons_let_through(device: str, copy: bool, first_only: bool) -> list[str]:
    """Each poisoned update (a NaN, an Inf or a -Inf in the middle element of each tensor of each floating group, one at
    a time) that changed an average or was not counted as skipped; every version must rise by one either way."""
    let_through = []
    for index, dtype in enumerate(FLOATING):
        for position in range(len(SHAPES)):
            for poison in POISONS:
                groups = averages(device)
                guard = NonFiniteGuard(groups, *counters(device))
                if first_only:
                    check_first_tensor_only(guard)
                update(guard, live_values(groups, 1), copy)  # a clean update first: the counters move
                before, written, applied = all_bits(groups), versions(groups), int(guard.applied)
                lives = live_values(groups, 2)
                poisoned = lives[index][position]
                poisoned.view(-1)[poisoned.numel() // 2] = poison
                update(guard, lives, copy)
                assert versions(groups) == [v + 1 for v in written]
                skipped = all(map(torch.equal, all_bits(groups), before)) and int(guard.skipped) == 1
                if not skipped or int(guard.applied) != applied:
                    let_through.append(f"{dtype} tensor {position} {poison}")
    return let_through


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("copy", [False, True], ids=["average", "copy"])
def test_a_nan_or_an_inf_in_any_tensor_of_any_group_skips_the_whole_update(device: str, copy: bool) -> None:
    assert poisons_let_through(device, copy, first_only=False) == []
    # The control: a decision on each group's first tensor lets a poison in any other tensor through.
    expected = [f"{d} tensor {i} {p}" for d in FLOATING for i in (1, 2) for p in POISONS]
    assert sorted(poisons_let_through(device, copy, first_only=True)) == sorted(expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("copy", [False, True], ids=["average", "copy"])
def test_finite_updates_are_the_unguarded_lerp_and_copy_bit_for_bit(device: str, copy: bool) -> None:
    groups, expected = averages(device), averages(device)
    guard = NonFiniteGuard(groups, *counters(device))
    for step in range(4):
        lives = live_values(groups, step)
        before = all_bits(expected)
        update(guard, lives, copy)
        for (tensors, average), values in zip(expected, lives, strict=True):
            if average and not copy:
                torch._foreach_lerp_(tensors, values, 1.0 - SCHEDULE.at(step))
            else:
                torch._foreach_copy_(tensors, values)
        assert all(map(torch.equal, all_bits(groups), all_bits(expected))), step
        assert (int(guard.skipped), int(guard.applied)) == (0, 0 if copy else step + 1)
        # The control: every tensor changed, so a guard that skipped any group would not match.
        assert not any(map(torch.equal, all_bits(expected), before)), step
