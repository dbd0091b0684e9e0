"""``EMA(skip_nonfinite=True)``: a NaN or an Inf in the live weights or floating buffers leaves the average bit for
bit as it was, the next clean updates end where they would have without the poisoned ones, decided on the device
with nothing allocated per update. Each claim has its control: without the guard, one such update poisons the
average for good (ultralytics issues #24615, #24871)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from copy_correct import EMA, skipped_updates
from copy_correct.guards.host import FiniteCheck
from copy_correct.probes import CopyAudit, MemoryProbe
from tests.conftest import DEVICES
from tests.cuda_sync import no_host_sync

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# The ops that make a tensor: the profiler records them inside other ops' kernels too (a dtype cast's temporary, say),
# where CopyAudit and MemoryProbe, which see the ops a caller dispatches, do not look.
MAKERS = {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::_to_copy", "aten::clone", "aten::zeros"}
POISONS = [
    pytest.param(float("nan"), id="nan"),
    pytest.param(float("inf"), id="inf"),
    pytest.param(-float("inf"), id="-inf"),
]


def net(device: str = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    return model.to(device=device, dtype=dtype)


def train_step(model: nn.Module, seed: int) -> None:
    """What a training step does to the weights and BatchNorm statistics, the same for the same seed."""
    generator = torch.Generator().manual_seed(seed)
    device, dtype = model[0].weight.device, model[0].weight.dtype
    model.train()
    with torch.no_grad():
        model(torch.randn(8, 16, generator=generator).to(device, dtype) + 1)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator).to(device, dtype), alpha=0.1)


def bits(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors' bit patterns: ``torch.equal`` takes -0.0 for +0.0, the bits do not."""
    return {k: v.detach().view(_BITS[v.element_size()]).clone() for k, v in state.items()}


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def update_poisoned(ema: EMA, model: nn.Module, where: str, value: float) -> None:
    """One update with one live element NaN or Inf, in a weight or in BatchNorm's ``running_var`` (a floating
    buffer); the element is put back after it (as a step that recovers)."""
    tensor = model[0].weight if where == "parameter" else model[1].running_var
    with torch.no_grad():
        flat = tensor.view(-1)
        kept = flat[3].clone()
        flat[3] = value
        ema.update(model)
        flat[3] = kept


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("where", ["parameter", "buffer"])
@pytest.mark.parametrize("value", POISONS)
def test_poisoned_updates_leave_the_average_and_the_next_ones_as_if_they_never_happened(
    device: str, where: str, value: float
) -> None:
    runs = {}
    for name, poison, guard in (("guarded", True, True), ("never poisoned", False, True), ("control", True, False)):
        model = net(device)
        ema = EMA(model, decay=0.9, skip_nonfinite=guard)  # the default warm-up: its position must skip too
        for step in range(12):
            train_step(model, step)
            if poison and step in (4, 5, 9):
                before = bits(ema.shadow)
                update_poisoned(ema, model, where, value)
                if guard:
                    assert same_bits(bits(ema.shadow), before), f"a poisoned update at step {step} changed the average"
            ema.update(model)
        runs[name] = ema
    guarded, clean, control = runs["guarded"], runs["never poisoned"], runs["control"]
    assert same_bits(bits(guarded.shadow), bits(clean.shadow))
    assert (skipped_updates(guarded), skipped_updates(clean), guarded.num_updates, clean.num_updates) == (3, 0, 15, 12)
    name = "0.weight" if where == "parameter" else "1.running_var"
    assert not torch.isfinite(control.shadow[name]).all()  # the control: one poisoned update, poisoned for good
    assert skipped_updates(control) == 0


@pytest.mark.parametrize("device", DEVICES)
def test_minus_zero_entries_survive_a_skipped_update_where_a_zero_weight_would_not(device: str) -> None:
    model = net(device)
    ema = EMA(model, decay=0.9, skip_nonfinite=True)
    ema.update(model)
    with torch.no_grad():
        ema.shadow["0.weight"][:2] = -0.0
    before = bits(ema.shadow)
    for value in (float("nan"), float("inf")):
        update_poisoned(ema, model, "parameter", value)
    assert same_bits(bits(ema.shadow), before)
    assert torch.signbit(ema.shadow["0.weight"][:2]).all()

    # Controls: a skip by a zero weight is no skip: 0 * NaN is NaN, and -0.0 + (+0.0) is +0.0.
    shadow = torch.full((4,), -0.0, device=device)
    torch._foreach_lerp_([shadow], [torch.ones(4, device=device)], 0.0)
    assert not torch.signbit(shadow).any()
    torch._foreach_lerp_([shadow], [torch.full((4,), float("nan"), device=device)], 0.0)
    assert shadow.isnan().all()


@pytest.mark.parametrize("device", DEVICES)
def test_clean_guarded_updates_are_the_plain_ones(device: str) -> None:
    """Without a poisoned step the guard changes nothing: the same lerp, with the warm-up weight computed on the device
    (bit for bit on CPU; CUDA's pow may differ from the host's in a double's last bit)."""
    plain_model, guarded_model = net(device), net(device)
    plain = EMA(plain_model, decay=0.99, skip_nonfinite=False)
    guarded = EMA(guarded_model, decay=0.99, skip_nonfinite=True)
    for step in range(30):
        for model, ema in ((plain_model, plain), (guarded_model, guarded)):
            train_step(model, step)
            ema.update(model)
    if device == "cpu":
        assert same_bits(bits(guarded.shadow), bits(plain.shadow))
    else:
        for name, tensor in plain.shadow.items():
            torch.testing.assert_close(guarded.shadow[name], tensor)


def test_a_low_precision_model_is_staged_checked_and_averaged_in_float32() -> None:
    runs = {}
    for name, poison in (("guarded", True), ("never poisoned", False)):
        model = net(dtype=torch.bfloat16)
        ema = EMA(model, decay=0.9, skip_nonfinite=True)
        for step in range(6):
            train_step(model, step)
            if poison and step == 3:
                update_poisoned(ema, model, "parameter", float("inf"))
            ema.update(model)
        runs[name] = ema
    assert runs["guarded"].shadow["0.weight"].dtype == torch.float32
    assert same_bits(bits(runs["guarded"].shadow), bits(runs["never poisoned"].shadow))
    plain_model = net(dtype=torch.bfloat16)
    plain = EMA(plain_model, decay=0.9, skip_nonfinite=False)
    for step in range(6):
        train_step(plain_model, step)
        plain.update(plain_model)
    assert same_bits(bits(runs["never poisoned"].shadow), bits(plain.shadow))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_each_width_is_copied_and_skipped_bit_for_bit(dtype: torch.dtype) -> None:
    """The copies select in the integers of each element's width: a bool buffer as uint8, a float16 shadow as int16,
    a float64 one as int64 (``-0.0`` entries in the weights copied as they are)."""
    model = net(dtype=dtype)
    model.register_buffer("flags", torch.tensor([True, False, True]))
    ema = EMA(model, decay=0.5, start_step=2, shadow_dtype=dtype, skip_nonfinite=True)
    train_step(model, 0)
    with torch.no_grad():
        model.flags.logical_not_()
        model[0].bias[:4] = -0.0
    before = bits(ema.shadow)
    update_poisoned(ema, model, "parameter", float("nan"))  # a copy, skipped
    assert same_bits(bits(ema.shadow), before)
    ema.update(model)  # a copy
    copied = bits(model.state_dict())
    assert same_bits(bits(ema.shadow), copied) and ema.shadow["0.bias"].dtype == dtype
    train_step(model, 1)
    update_poisoned(ema, model, "buffer", -float("inf"))  # an average, skipped
    assert same_bits(bits(ema.shadow), copied) and skipped_updates(ema) == 2


def test_start_step_copies_and_update_every_hold_and_the_warmup_restarts_where_it_stood() -> None:
    model = net()
    ema = EMA(model, decay=0.999, start_step=2, update_every=3, skip_nonfinite=True)
    copy_before = bits(ema.shadow)
    update_poisoned(ema, model, "buffer", float("nan"))  # call 0: a copy, skipped
    assert same_bits(bits(ema.shadow), copy_before) and skipped_updates(ema) == 1
    train_step(model, 0)
    ema.update(model)  # call 1: a copy, bit for bit, the step counter included
    assert same_bits(bits(ema.shadow), bits(model.state_dict()))
    average_before = bits(ema.shadow)
    train_step(model, 1)
    update_poisoned(ema, model, "parameter", float("nan"))  # call 2: the first averaging update, skipped
    assert same_bits(bits(ema.shadow), average_before) and skipped_updates(ema) == 2
    for _ in range(2):  # calls 3 and 4: not averaging calls (every 3rd from start_step), poisoned or not
        update_poisoned(ema, model, "parameter", float("inf"))
    assert same_bits(bits(ema.shadow), average_before) and skipped_updates(ema) == 2
    train_step(model, 2)
    ema.update(model)  # call 5: the first applied averaging update, decay_at(0) == 0: the average becomes the weights
    live = model.state_dict()
    assert all(torch.equal(ema.shadow[k], live[k]) for k in live)
    assert (ema.step, ema.num_updates, skipped_updates(ema)) == (6, 2, 2)

    control = EMA(net(), decay=0.999, start_step=2, update_every=3, skip_nonfinite=False)
    update_poisoned(control, control.live_model, "buffer", float("nan"))
    assert control.shadow["1.running_var"].isnan().any()  # the control: the copy copies the NaN


@pytest.mark.parametrize("device", DEVICES)
def test_a_guarded_update_allocates_nothing_and_writes_only_when_it_averages(device: str) -> None:
    """Zero bytes allocated by a clean update and by a skipped one, and no tensor made even inside a kernel (a
    reduction to one element of a large tensor allocates its per-thread buffer: ``copy_correct.guards.host``). A
    clean update raises each shadow tensor's version by one; a skipped one writes nothing on the CPU (decided on the
    host), and on CUDA runs every kernel with the flag (each version +1)."""
    model = net(device)
    model.register_parameter("large", nn.Parameter(torch.randn(300, 300, device=device)))  # 90,000 elements
    ema = EMA(model, decay=0.99, skip_nonfinite=True)
    ema.update(model)
    for value, written in ((0.5, 1), (float("nan"), 0 if device == "cpu" else 1)):  # a clean update, a skipped one
        versions = {k: v._version for k, v in ema.shadow.items()}
        with torch.no_grad():
            model[0].weight[0, 0] = value
        with CopyAudit() as audit, MemoryProbe(device) as memory:
            ema.update(model)
        assert audit.bytes_allocated == 0, audit.summary()
        assert memory.peak_bytes == 0, memory.report()
        assert all(v._version == versions[k] + written for k, v in ema.shadow.items())
        with torch.autograd.profiler.profile() as profile:
            ema.update(model)
        assert not {event.name for event in profile.function_events} & MAKERS
    assert skipped_updates(ema) == 2  # the profiled update was bad too

    # The control: PR #24307's check, `isfinite().all()` per tensor, allocates (and syncs once per tensor on CUDA).
    with MemoryProbe(device) as control, torch.autograd.profiler.profile() as profile:
        assert not all(bool(torch.isfinite(t).all()) for t in model.state_dict().values() if t.is_floating_point())
    assert control.peak_bytes > 0 and {event.name for event in profile.function_events} & MAKERS


def test_the_cpu_guard_keeps_no_copy_of_the_weights() -> None:
    """The CPU guard's resident bytes are its check's scratch (one element per small tensor, one per row of a large
    one, and a vector of ones as wide as the widest row): under 1% of these weights. The control: a staging copy, as
    a float64 shadow of a float32 model keeps, is seen by the same probe at the size of the weights."""
    model = net()
    model.register_parameter("large", nn.Parameter(torch.randn(300, 300)))
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values() if t.is_floating_point())
    kept = []  # the averages stay alive: the probe counts what they hold
    with MemoryProbe("cpu") as plain:
        kept.append(EMA(model, skip_nonfinite=False))
    with MemoryProbe("cpu") as guarded:
        kept.append(EMA(model, skip_nonfinite=True))
    assert plain.net_bytes >= weights and 0 < guarded.net_bytes - plain.net_bytes < weights / 100
    with MemoryProbe("cpu") as staged:  # the control: float64 shadow (2x the weights) and a staging of that size
        kept.append(EMA(model, shadow_dtype=torch.float64))
    assert staged.net_bytes >= 4 * weights  # the float64 shadow, 2x the weights, and its staging, 2x more


def test_the_decision_is_what_guards(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mutation control: with the check's answer forced to "finite", the same poisoned update poisons the average,
    so the tests above fail without the decision."""
    monkeypatch.setattr(FiniteCheck, "finite", lambda self, groups: True)
    model = net()
    ema = EMA(model, decay=0.9, skip_nonfinite=True)
    update_poisoned(ema, model, "parameter", float("nan"))
    assert ema.shadow["0.weight"].isnan().any() and skipped_updates(ema) == 0


def test_the_guard_of_a_cpu_average_decides_on_the_host() -> None:
    model = net()
    assert not EMA(model, decay=0.9).skip_nonfinite  # opt-in
    ema = EMA(model, decay=0.9, skip_nonfinite=True)
    assert isinstance(ema._guard, FiniteCheck)
    before = bits(ema.shadow)
    update_poisoned(ema, model, "buffer", -float("inf"))
    assert same_bits(bits(ema.shadow), before) and skipped_updates(ema) == 1
    with pytest.raises(TypeError, match=r"skip_nonfinite must be True or False, got str 'yes'"):
        EMA(model, skip_nonfinite="yes")  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cuda_shadow_decides_on_the_device_and_a_cpu_shadow_of_a_cuda_model_on_the_host() -> None:
    """On CUDA the guard stages a copy of the weights on the device; a CPU shadow of a CUDA model is checked on the
    host after the device-to-host copy the update makes anyway."""
    model = net("cuda")
    assert not isinstance(EMA(model, skip_nonfinite=True)._guard, FiniteCheck)
    on_host = EMA(model, device="cpu", skip_nonfinite=True)
    assert isinstance(on_host._guard, FiniteCheck)
    before = bits(on_host.shadow)
    update_poisoned(on_host, model, "parameter", float("nan"))
    assert same_bits(bits(on_host.shadow), before) and skipped_updates(on_host) == 1


@pytest.mark.parametrize("device", DEVICES)
def test_skipped_and_the_warmup_position_round_trip_through_state_dict(device: str, tmp_path) -> None:
    model = net(device)
    ema = EMA(model, decay=0.99, skip_nonfinite=True)
    for step in range(6):
        train_step(model, step)
        if step in (2, 3):
            update_poisoned(ema, model, "buffer", float("inf"))
        ema.update(model)
    state = ema.state_dict()
    assert (state["skipped"], state["applied_updates"], state["num_updates"]) == (2, 6, 8)
    torch.save(state, tmp_path / "ema.pt")
    restored = EMA(model, decay=0.99, skip_nonfinite=True)
    restored.load_state_dict(torch.load(tmp_path / "ema.pt", weights_only=True))
    assert skipped_updates(restored) == 2
    for ema_ in (ema, restored):  # the same next update: the same warm-up position
        ema_.update(model)
    assert same_bits(bits(restored.shadow), bits(ema.shadow))

    old = {k: v for k, v in state.items() if k not in ("skipped", "applied_updates")}  # saved without the guard
    restored.load_state_dict(old)
    assert skipped_updates(restored) == 0 and int(restored._applied) == 8
    unguarded = EMA(net(device), decay=0.99, skip_nonfinite=False)
    unguarded.load_state_dict(state)
    assert skipped_updates(unguarded) == 0 and "skipped" not in unguarded.state_dict()


def test_a_copy_keeps_the_count_and_skips_once_given_the_model() -> None:
    model = net()
    ema = EMA(model, decay=0.9, skip_nonfinite=True)
    update_poisoned(ema, model, "parameter", float("nan"))
    for clone in (pickle.loads(pickle.dumps(ema)), copy.deepcopy(ema)):
        assert skipped_updates(clone) == 1
        before = bits(clone.shadow)
        update_poisoned(clone, model, "parameter", float("nan"))  # tracks the model from here on
        assert same_bits(bits(clone.shadow), before) and skipped_updates(clone) == 2
    assert skipped_updates(ema) == 1


def test_a_model_that_is_not_finite_at_construction_is_refused() -> None:
    model = net()
    model.register_buffer("mask", torch.full((4,), -float("inf")))
    with pytest.raises(ValueError, match=r"skip_nonfinite=True, but the model's \['mask'\] hold NaN or Inf"):
        EMA(model, skip_nonfinite=True)
    ema = EMA(model)
    assert not ema.skip_nonfinite and skipped_updates(ema) == 0
    ema.update(model)  # without the guard nothing is checked, nothing counted
    assert skipped_updates(ema) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_guarded_update_has_no_host_sync() -> None:
    model = net("cuda")
    ema = EMA(model, decay=0.99, start_step=1, skip_nonfinite=True)
    low = net("cuda", torch.bfloat16)
    staged = EMA(low, decay=0.99, skip_nonfinite=True)  # a float32 shadow of a bf16 model: staged in float32
    for step in range(6):
        for m, e in ((model, ema), (low, staged)):
            flat = m[0].weight.detach().view(-1)
            kept = flat[3].clone()
            if step in (0, 3):
                flat[3] = float("nan")
            with no_host_sync():
                e.update(m)
            flat[3] = kept
    assert (skipped_updates(ema), skipped_updates(staged)) == (2, 2)
    assert all(torch.isfinite(t).all() for e in (ema, staged) for t in e.shadow.values() if t.is_floating_point())
