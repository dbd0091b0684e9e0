"""No half-written average: a storage replaced in place through ``.data`` (which no module hook sees) with one of
another shape, dtype or device, on any tensor an update reads or writes, is refused in one line naming the tensor
before anything is written, by ``EMA``, ``PowerEMA``, ``soft_update`` and ``hard_update``: the average (or the target)
is bit for bit what it was. A storage swapped for one alike is followed, as ``copy_`` into it would be.

Control: with the data pointers not compared (the check before the writes gone), the same change makes the foreach
write the tensors before the changed one and raise torch's own error on it: the average half-written."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import copy_correct.averages.shadow as _shadow
import copy_correct.target as target_module
from copy_correct import EMA, PowerEMA, hard_update, make_target, soft_update
from tests.conftest import DEVICES

NAMES = ["0.weight", "2.bias", "4.weight"]  # the first tensor the update writes, one in the middle, the last


def net(device: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)).to(device)


def changed(tensor: torch.Tensor, change: str) -> torch.Tensor:
    """What the user's ``.data = ...`` puts in place of ``tensor``'s storage."""
    if change == "shape":
        return torch.randn(tuple(reversed(tensor.shape)) if tensor.dim() == 2 else (tensor.numel() + 1,))
    if change == "dtype":
        return torch.randn(tensor.shape, dtype=torch.float64, device=tensor.device)
    if change == "device":
        return torch.randn(tensor.shape)  # from CUDA to the CPU
    return torch.randn(tensor.shape, device=tensor.device)  # "alike"


class Averaged:
    """One of the four updates, with what it writes (``written``) and a step that changes the live network."""

    def __init__(self, kind: str, device: str) -> None:
        self.kind, self.live = kind, net(device)
        if kind == "EMA":
            self.average = EMA(self.live, decay=0.9)
            self.update = lambda: self.average.update(self.live)
            self.written = lambda: dict(self.average.shadow)
        elif kind == "PowerEMA":
            self.average = PowerEMA(self.live, sigma_rels=(0.05, 0.1))
            self.update = lambda: self.average.update(self.live)
            self.written = lambda: {f"{i}.{k}": v for i, p in enumerate(self.average._copies) for k, v in p.items()}
        else:
            self.target = make_target(self.live)
            step = soft_update if kind == "soft_update" else hard_update
            args = (0.1,) if kind == "soft_update" else ()
            self.update = lambda: step(self.target, self.live, *args)
            self.written = lambda: dict(self.target.state_dict())

    def perturb(self) -> None:
        """An optimizer step's change of the live weights: what the next update would write."""
        with torch.no_grad():
            for p in self.live.parameters():
                p.add_(torch.randn_like(p))

    def train(self) -> None:
        self.perturb()
        self.update()


KINDS = ["EMA", "PowerEMA", "soft_update", "hard_update"]
CHANGES = ["shape", "dtype", pytest.param("device", marks=[pytest.mark.gpu])]


def snapshot(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in tensors.items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The names whose tensors differ."""
    return [k for k in a if a[k].shape != b[k].shape or not torch.equal(a[k], b[k].to(a[k].device))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("change", CHANGES)
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("kind", KINDS)
def test_a_storage_replaced_through_data_is_refused_before_anything_is_written(
    kind: str, name: str, change: str, device: str
) -> None:
    if change == "device" and device == "cpu":
        pytest.skip("the change from CUDA to the CPU needs a CUDA network")
    averaged = Averaged(kind, device)
    averaged.train()
    averaged.train()
    averaged.perturb()
    side = averaged.live if kind in ("EMA", "PowerEMA") or name != "2.bias" else averaged.target  # the target's too
    tensor = side.get_parameter(name)
    tensor.data = changed(tensor, change)
    before = snapshot(averaged.written())
    with pytest.raises((RuntimeError, ValueError)) as refused:
        averaged.update()
    message = str(refused.value)
    assert repr(name) in message and "\n" not in message
    assert same(before, averaged.written()) == []  # bit for bit: nothing was written


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_a_storage_swapped_for_one_alike_is_followed(kind: str, device: str) -> None:
    averaged = Averaged(kind, device)
    averaged.train()
    averaged.perturb()
    swapped = averaged.live.get_parameter("2.bias")
    swapped.data = changed(swapped, "alike")
    averaged.update()
    reference = Averaged(kind, device)  # the same history, the new values copied in place instead
    reference.train()
    reference.perturb()
    with torch.no_grad():
        reference.live.get_parameter("2.bias").copy_(swapped)
    reference.update()
    assert same(snapshot(reference.written()), averaged.written()) == []


@pytest.mark.parametrize("kind", KINDS)
def test_control_without_the_check_the_update_is_half_written(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    blind: Callable[[torch.Tensor], int] = lambda tensor: 0  # noqa: E731 - every data pointer the same
    monkeypatch.setattr(_shadow, "DATA_PTR", blind)
    monkeypatch.setattr(target_module, "DATA_PTR", blind)
    averaged = Averaged(kind, "cpu")
    averaged.train()
    averaged.perturb()
    before = snapshot(averaged.written())
    tensor = averaged.live.get_parameter("2.bias")
    tensor.data = changed(tensor, "shape")
    with pytest.raises(RuntimeError) as raw:
        averaged.update()
    assert "2.bias" not in str(raw.value)  # torch's own error, naming no tensor
    differ = same(before, averaged.written())
    assert differ and all(not k.endswith(("2.bias", "4.weight", "4.bias")) for k in differ)  # the first ones only
