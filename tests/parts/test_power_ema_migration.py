"""What a user of ema-pytorch's ``PostHocEMA`` meets in ``PowerEMA``: its names answered in one line naming ours, a
state without counters refused, and a model changed under the profiles refused naming the tensor (with controls)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from copy_correct import PowerEMA


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def test_post_hoc_ema_names_fail_in_one_line_naming_ours() -> None:
    model = net()
    power = PowerEMA(model)
    cases = [
        (lambda: power(torch.randn(2, 8)), TypeError, r"^PowerEMA is not a module and runs nothing: synthesize"),
        (lambda: power.ema_models, AttributeError, r"^PowerEMA has no 'ema_models' .*power_ema.profiles"),
        (lambda: power.synthesize_ema_model(sigma_rel=0.1), AttributeError, r"copy_correct.synthesize\(snapshot_dir"),
        (lambda: power.checkpoint(), AttributeError, r"power_ema.save_snapshot\(directory\)"),
        (lambda: power.model, AttributeError, r"^PowerEMA has no 'model' .*power_ema.live_model"),
        (lambda: power.nothing, AttributeError, r"^'PowerEMA' object has no attribute 'nothing'$"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()
    assert power.live_model is model


def test_a_state_without_counters_is_refused_in_one_line() -> None:
    model = net()
    power = PowerEMA(model)
    power.update(model)
    state = power.state_dict()
    for key in ("step", "updated_step"):
        partial = {k: v for k, v in state.items() if k != key}
        with pytest.raises(ValueError, match=rf"^PowerEMA state has no '{key}'"):
            power.load_state_dict(partial)
    power.load_state_dict(state)  # the control: the whole state loads


def test_a_model_changed_under_the_profiles_is_refused_at_the_next_update() -> None:
    model = net()
    power = PowerEMA(model)
    power.update(model)
    old_head = model[2].weight
    model[2] = nn.Linear(16, 5)
    with pytest.raises(RuntimeError, match=r"^PowerEMA: the model changed under its average: '2.weight' was replaced"):
        power.update(model)
    power._watch.stale = lambda: False  # the control: without the check, the old head is averaged in silence
    power.update(model)
    assert power.profiles[0]["2.weight"].shape == old_head.shape != model[2].weight.shape
