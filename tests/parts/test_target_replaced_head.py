"""A target update after the online network's head was replaced (a new submodule, as timm's ``reset_classifier``
does) pairs the networks anew: ``hard_update`` copies the new head, ``soft_update`` averages it, in a plain loop and
called from a ``torch.compile``d function (where the update traces, looking the tensors up by name).
A replaced head keeps every data pointer the pair holds (it holds the old Parameter objects), so the pointer check
alone misses it: the registration count (``ModelWatch``) tells. The control: that count ignored, the update writes
from the old head's parameters, with no error."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from copy_correct import hard_update, make_target, soft_update
from copy_correct.averages.model_changes import ModelWatch


def networks() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    online = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    return online, make_target(online)


def counting_backend(graph: Any, inputs: Any) -> Callable[..., Any]:
    return graph.forward


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_hard_update_after_a_new_head_copies_the_new_head(compiled: bool) -> None:
    online, target = networks()
    update = lambda: hard_update(target, online)  # noqa: E731
    call = torch.compile(update, backend=counting_backend) if compiled else update
    call()
    online[2] = nn.Linear(16, 4)  # new Parameter objects; the old ones live on in the pair until it is rebuilt
    call()
    pairs = zip(target.state_dict().values(), online.state_dict().values(), strict=True)
    assert all(torch.equal(t, o) for t, o in pairs)


def test_soft_update_after_a_new_head_averages_the_new_head() -> None:
    online, target = networks()
    soft_update(target, online, 0.5)
    previous = [p.clone() for p in target[2].parameters()]
    online[2] = nn.Linear(16, 4)
    soft_update(target, online, 0.5)
    for written, start, new in zip(target[2].parameters(), previous, online[2].parameters(), strict=True):
        assert torch.equal(written, start.lerp(new.detach(), 0.5))


def test_the_control_without_the_registration_count_the_old_head_is_copied(monkeypatch: pytest.MonkeyPatch) -> None:
    online, target = networks()
    hard_update(target, online)
    old = [p.detach().clone() for p in online[2].parameters()]
    monkeypatch.setattr(ModelWatch, "stale", lambda self: False)
    online[2] = nn.Linear(16, 4)
    hard_update(target, online)
    assert all(torch.equal(t, o) for t, o in zip(target[2].parameters(), old, strict=True))
    assert not torch.equal(target[2].weight, online[2].weight)
