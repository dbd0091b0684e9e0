"""What a user coming from timm, diffusers or ema-pytorch meets in ``EMA`` (issue 44), each with a control: the
schedules they know, ``ema.module`` (the average as a module, sharing the shadow's storage), loads that never throw
an average away, a model changed under the EMA refused, and their call shapes answered in one line naming ours."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from copy_correct import EMA
from copy_correct.decay_schedule import DecaySchedule
from copy_correct.probes import shares_storage
from tests.conftest import DEVICES


def net(device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3)).to(device)


def train(model: nn.Module, ema: EMA, steps: int, seed: int = 1) -> None:
    """``steps`` random steps of the live weights (and BatchNorm statistics), the EMA updated after each."""
    generator = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    for _ in range(steps):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=generator).to(device), alpha=0.1)
        model.train()
        model(torch.randn(32, 8, generator=generator).to(device))
        ema.update(model)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def cloned(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in state.items()}


# -- schedules ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        (DecaySchedule(0.99, False), [0.99, 0.99, 0.99]),
        (DecaySchedule(0.99, "copy"), [0.0, 0.99, 0.99]),
        (DecaySchedule(0.9999, "ratio"), [0.0, 2 / 11, 3 / 12]),
        (DecaySchedule(0.9999, "ratio", min_decay=0.2), [0.0, 0.2, 3 / 12]),
        (DecaySchedule(0.1, "ratio"), [0.0, 0.1, 0.1]),
        (DecaySchedule(0.999, True), [0.0, 1 - 2 ** (-2 / 3), 1 - 3 ** (-2 / 3)]),
        (DecaySchedule(0.999, "power", 0.75, 2.0, 0.5), [0.0, 1 - 1.75**-0.75, 1 - 2.25**-0.75]),
        (DecaySchedule(0.9999, "half_life", half_life=0.05), [2.0**-20, 2.0**-20, 2.0**-10]),
        (DecaySchedule(0.9999, "half_life", warmup_offset=1.0, half_life=0.5), [0.25, 0.5, 2 ** (-2 / 3)]),
        (DecaySchedule(0.4, "half_life", half_life=0.5), [0.25, 0.25, 0.4]),
    ],
    ids=[
        "none", "copy", "ratio", "ratio-min_decay", "ratio-capped", "power", "power-gamma-offset", "half_life",
        "half_life-offset", "half_life-capped",
    ],
)  # fmt: skip
def test_each_schedule_is_its_formula(schedule: DecaySchedule, expected: list[float]) -> None:
    assert [schedule.at(k) for k in range(3)] == pytest.approx(expected, rel=1e-15, abs=0)


def test_the_default_schedule_is_todays_ramp_bit_for_bit() -> None:
    ema = EMA(net(), decay=0.9999)
    assert all(ema.decay_at(k) == min(0.9999, 1.0 - (1.0 + k) ** (-2 / 3)) for k in range(0, 10**6, 997))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"warmup": "ratio", "decay": 0.99, "min_decay": 0.3},
        {"warmup": "copy", "decay": 0.9},
        {"warmup": "power", "decay": 0.999, "warmup_gamma": 3.0, "warmup_offset": 0.5, "min_decay": 0.1},
        {"warmup": "half_life", "decay": 0.9999, "half_life": 0.5, "warmup_offset": 1.0},
    ],
    ids=["ratio", "copy", "power", "half_life"],
)
@pytest.mark.parametrize("device", DEVICES)
def test_the_guarded_update_computes_each_schedule_as_the_host_does(device: str, kwargs: dict) -> None:
    model = net(device)
    plain, guarded = EMA(model, **kwargs), EMA(model, skip_nonfinite=True, **kwargs)
    for step in range(12):
        train(model, plain, 1, seed=step)
        guarded.update(model)
        assert same(guarded.shadow, plain.shadow), step
    control = EMA(model, decay=kwargs["decay"], skip_nonfinite=True)  # the old ramp: another average
    control.load_state_dict(guarded.state_dict(), new_schedule=True)
    train(model, plain, 1, seed=99)
    control.update(model)
    assert not same(control.shadow, plain.shadow)


@pytest.mark.parametrize(
    "schedule",
    [
        DecaySchedule(0.99, False),
        DecaySchedule(0.99, "copy"),
        DecaySchedule(0.9999, "ratio", min_decay=0.2),
        DecaySchedule(0.999, "power", 0.75, 2.0, 0.5, min_decay=0.1),
        DecaySchedule(0.9999, "half_life", warmup_offset=1.0, half_life=0.5),
    ],
    ids=["none", "copy", "ratio", "power", "half_life"],
)
@pytest.mark.parametrize("device", DEVICES)
def test_the_devices_weight_is_one_minus_the_hosts_decay_bit_for_bit_on_the_cpu(
    device: str, schedule: DecaySchedule
) -> None:
    """``write_weight`` (the device guard's ``1 - decay`` from a 0-dim counter, nothing read back) against ``at``;
    a CUDA ``pow`` may differ in a double's last bit. The control: the first update's weight is not the second's."""
    one, scratch, out = (torch.ones((), dtype=torch.float64, device=device) for _ in range(3))
    tolerance = 0.0 if device == "cpu" else 2.0**-52
    for k in range(40):
        schedule.write_weight(torch.tensor(float(k), dtype=torch.float64, device=device), out, scratch, one)
        assert abs(out.item() - (1.0 - schedule.at(k))) <= tolerance, k
    schedule.write_weight(torch.zeros((), dtype=torch.float64, device=device), out, scratch, one)
    assert out.item() != 1.0 - schedule.at(1) or schedule.warmup == "none"


# -- ema.module: the average as a module ------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_module_is_the_average_in_the_shadows_own_storage_and_never_the_live_weights(device: str) -> None:
    model = net(device)
    ema = EMA(model, decay=0.9)
    train(model, ema, 5)
    view = ema.module
    assert ema.module is view and not view.training
    assert all(not p.requires_grad for p in view.parameters())
    for name, tensor in view.state_dict(keep_vars=True).items():
        assert shares_storage(tensor, ema.shadow[name]), name  # no copy: the shadow's storage
    x = torch.randn(4, 8, device=device)
    with ema.average_weights(model):
        expected = model.eval()(x)
    assert torch.equal(view(x), expected)
    assert not torch.equal(model.eval()(x), expected)  # the control: the live model is not the average
    train(model, ema, 3)  # later updates are in it at once
    with ema.average_weights(model):
        assert torch.equal(view(x), model.eval()(x))
    with pytest.raises(AttributeError, match=r"EMA has no 'model' .*ema.live_model.*ema.module"):
        _ = ema.model


def test_module_refuses_a_load_that_would_leave_the_counters_behind() -> None:
    model = net()
    ema = EMA(model, decay=0.9)
    train(model, ema, 3)
    saved = cloned(ema.module.state_dict())
    train(model, ema, 3)
    before = cloned(ema.shadow)
    with pytest.raises(RuntimeError, match=r"^ema.module.load_state_dict would replace the average .*load_average"):
        ema.module.load_state_dict(saved)  # timm's load_checkpoint(ema.module, ...) does this
    assert same(cloned(ema.shadow), before)
    ema.module._load_state_dict_pre_hooks.clear()  # the control: let through, it writes the average, counters kept
    ema.module.load_state_dict(saved)
    assert same(cloned(ema.shadow), saved) and ema.step == 6


def test_module_shares_the_live_buffers_an_ema_of_parameters_leaves_out() -> None:
    model = net()
    ema = EMA(model, decay=0.9, include_buffers=False)
    view = ema.module
    assert view[1].running_mean is model[1].running_mean
    assert view[0].weight is not model[0].weight and shares_storage(view[0].weight, ema.shadow["0.weight"])


def test_a_copy_without_a_model_has_no_module_until_it_tracks_one() -> None:
    ema = EMA(net(), decay=0.9)
    twin = copy.deepcopy(ema)
    with pytest.raises(RuntimeError, match="tracks no model yet"):
        _ = twin.module


# -- loads that never throw an average away -------------------------------------------------------------


def test_a_state_without_counters_is_refused_and_a_reset_would_have_thrown_the_average_away() -> None:
    model = net()
    ema = EMA(model, decay=0.99)
    train(model, ema, 20)
    weights = cloned(ema.shadow)
    fresh = EMA(model, decay=0.99)
    with pytest.raises(ValueError, match=r"has no 'step' or 'num_updates'.*load_average"):
        fresh.load_state_dict({"shadow": weights})
    with pytest.raises(ValueError, match=r"a model's state_dict .* holds no counters: .*load_average"):
        fresh.load_state_dict(weights)
    fresh.load_state_dict({"shadow": weights, "step": 0, "num_updates": 0})  # the control: counters reset
    fresh.update(model)
    assert same(cloned(fresh.shadow), cloned(model.state_dict()))  # the warm-up copied the live weights: average lost


@pytest.mark.parametrize(
    "kwargs", [{}, {"start_step": 5, "update_every": 3}, {"warmup": "ratio"}, {"warmup": False}], ids=str
)
def test_load_average_with_its_step_continues_exactly_as_the_ema_that_made_it(kwargs: dict) -> None:
    model = net()
    ema = EMA(model, decay=0.99, **kwargs)
    train(model, ema, 17)
    twin_model, reset_model = copy.deepcopy(model), copy.deepcopy(model)
    twin, reset = EMA(twin_model, decay=0.99, **kwargs), EMA(reset_model, decay=0.99, **kwargs)
    twin.load_average(cloned(ema.shadow), step=17)
    assert (twin.step, twin.num_updates) == (ema.step, ema.num_updates)
    reset.load_average(cloned(ema.shadow), step=0)  # the control: the same average, its counters lost
    for m, e in ((model, ema), (twin_model, twin), (reset_model, reset)):
        train(m, e, 9, seed=5)
    assert same(twin.shadow, ema.shadow)
    assert same(reset.shadow, ema.shadow) == (kwargs.get("warmup") is False)  # no warm-up: the counters do not matter


def test_a_state_of_another_schedule_is_refused_unless_the_caller_says_so() -> None:
    model = net()
    saved = EMA(model, decay=0.999, warmup="ratio").state_dict()
    ema = EMA(model, decay=0.999)
    with pytest.raises(ValueError, match=r"another schedule: warmup 'ratio' \(saved\) vs 'power' \(this EMA\)"):
        ema.load_state_dict(saved)
    ema.load_state_dict(saved, new_schedule=True)
    old = {k: v for k, v in saved.items() if k != "schedule"}  # saved before the schedule was: decay compared
    EMA(model, decay=0.999).load_state_dict(old)
    with pytest.raises(ValueError, match=r"decay 0.999 \(saved\) vs 0.9 \(this EMA\)"):
        EMA(model, decay=0.9).load_state_dict(old)


def test_a_state_with_its_schedule_loads_with_weights_only(tmp_path) -> None:
    model = net()
    ema = EMA(model, decay=0.99, warmup="ratio", min_decay=0.1)
    train(model, ema, 4)
    torch.save(ema.state_dict(), tmp_path / "ema.pt")
    other = EMA(model, decay=0.99, warmup="ratio", min_decay=0.1)
    other.load_state_dict(torch.load(tmp_path / "ema.pt", weights_only=True))
    assert same(other.shadow, ema.shadow) and other.schedule == ema.schedule


# -- a model changed under the EMA ----------------------------------------------------------------------


def new_head(model: nn.Module, outputs: int) -> None:
    """timm's ``reset_classifier``: the head replaced by a new module."""
    model[3] = nn.Linear(16, outputs)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda m: new_head(m, 3), r"'3.weight' was replaced by another Parameter"),
        (lambda m: new_head(m, 5), r"'3.weight' was replaced by another Parameter"),
        (lambda m: m.add_module("extra", nn.Linear(2, 2)), r"'extra.weight' added, 'extra.bias' added"),
        (lambda m: setattr(m[0], "weight", nn.Parameter(torch.zeros(16, 8))), r"'0.weight' was replaced"),
        (lambda m: m[1].register_buffer("running_mean", torch.zeros(4)), r"'1.running_mean' is \(4,\) now"),
    ],
    ids=["same-shape head", "new head", "added", "parameter assigned", "buffer reshaped"],
)
def test_a_model_changed_under_the_ema_is_refused_at_the_next_update_naming_the_tensor(change, message: str) -> None:
    model = net()
    ema = EMA(model, decay=0.9)
    train(model, ema, 2)
    change(model)
    before = cloned(ema.shadow)
    with pytest.raises(RuntimeError, match=rf"^EMA: the model changed under its average: {message}"):
        ema.update(model)
    assert same(cloned(ema.shadow), before)
    for use in (lambda: ema.average_weights(model).__enter__(), ema.export, lambda: ema.module, ema.copy_to):
        with pytest.raises(RuntimeError, match=message):
            use()


def test_without_the_check_a_new_head_is_averaged_stale_in_silence() -> None:
    model = net()
    ema = EMA(model, decay=0.9)
    old_head = model[3].weight
    new_head(model, 3)
    ema._watch.stale = lambda: False  # the control: the check switched off
    ema.update(model)  # no error: the old head, no longer in the model, is what gets averaged
    assert torch.equal(ema.shadow["3.weight"], old_head.detach())  # the warm-up's first update copied the old head
    assert not torch.equal(ema.shadow["3.weight"], model[3].weight.detach())


def test_what_no_hook_sees_is_found_where_the_average_is_used() -> None:
    model = net()
    ema = EMA(model, decay=0.9)
    model[3].weight.data = torch.zeros(5, 16)  # .data assigned: no registration hook runs
    with (
        pytest.raises(RuntimeError, match=r"'3.weight' is \(5, 16\) now, its average \(3, 16\)"),
        ema.average_weights(),
    ):
        pass
    del model[3]  # a removed head
    with pytest.raises(RuntimeError, match=r"'3.weight' removed, '3.bias' removed"):
        ema.export()


def test_a_registration_elsewhere_costs_one_walk_and_changes_nothing() -> None:
    model = net()
    ema = EMA(model, decay=0.9)
    nn.Linear(3, 3)  # another module built anywhere: the next update walks the model once, finds it unchanged
    assert ema._watch.stale()
    ema.update(model)
    assert not ema._watch.stale()


# -- peers' call shapes -----------------------------------------------------------------------------------


def test_peer_call_shapes_fail_in_one_line_naming_ours() -> None:
    model = net()
    ema = EMA(model, decay=0.9)
    x = torch.randn(2, 8)
    cases = [
        (lambda: ema.update(model.parameters()), TypeError, r"^model must be an nn.Module, got generator: pass the"),
        (lambda: ema.copy_to(model.parameters()), TypeError, r"^model must be an nn.Module, got generator"),
        (lambda: ema(x), TypeError, r"^EMA is not a module and runs nothing: ema.module\(x\)"),
        (lambda: ema.eval(), AttributeError, r"^EMA has no 'eval' \(a module's eval\(\)\): ema.module is the average"),
        (lambda: ema.ema_model, AttributeError, r"^EMA has no 'ema_model' \(ema-pytorch's average\): ema.module"),
        (lambda: ema.store(model.parameters()), AttributeError, r"^EMA has no 'store' .*average_weights"),
        (lambda: ema.update(model, step=5), ValueError, r"^EMA.update\(step=5\): this is update call 1 of this EMA"),
        (lambda: ema.nothing, AttributeError, r"^'EMA' object has no attribute 'nothing'$"),
    ]
    for call, error, message in cases:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no unrelated warning first (the initial share's, say)
            with pytest.raises(error, match=message) as raised:
                call()
        assert "\n" not in str(raised.value)


def test_timms_update_with_its_step_works_while_the_steps_agree() -> None:
    model = net()
    ema, control = EMA(model, decay=0.9, warmup="copy"), EMA(model, decay=0.9, warmup="copy")
    for step in range(1, 6):
        ema.update(model, step=step)  # timm's train.py: update(model, step=num_updates)
        control.update(model)
    assert same(ema.shadow, control.shadow) and ema.step == 5 and isinstance(ema.step, int)


def test_a_buffer_reassigned_alike_each_step_costs_no_walk() -> None:
    from torch.optim.swa_utils import AveragedModel

    model = net()
    ema = EMA(model, decay=0.9)
    averaged = AveragedModel(model)  # its update does self.n_averaged += 1: a buffer assigned anew
    ema.update(model)
    averaged.update_parameters(model)
    model[1].running_mean = model[1].running_mean + 1  # the same shape, dtype and device
    assert not ema._watch.stale()
    model[1].running_mean = torch.zeros(4)  # the control: reshaped, so the next update walks (and refuses)
    assert ema._watch.stale()
    with pytest.raises(RuntimeError, match=r"'1.running_mean' is \(4,\) now"):
        ema.update(model)
