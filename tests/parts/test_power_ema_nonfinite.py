"""``PowerEMA(skip_nonfinite=True)``, and the default (on for CPU profiles): a NaN or an Inf in the live weights or
floating buffers leaves every profile bit for bit as it was, decided once per update (on the host for CPU profiles,
writing nothing; on the device on CUDA) with nothing allocated per update, and the next good update is made as if the
skipped one had never been: ``beta`` spans from the last *applied* step, so the profiles are exactly those of an
unguarded ``PowerEMA`` that was not updated at the skipped steps, and a snapshot records the applied step. Each claim
has its control: without the guard (``skip_nonfinite=False``), one such update poisons every profile for good."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from copy_correct import PowerEMA, skipped_updates, synthesize
from copy_correct.averages.posthoc import snapshot_paths
from copy_correct.guards.host import FiniteCheck
from copy_correct.probes import CopyAudit, MemoryProbe
from tests.conftest import DEVICES
from tests.cuda_sync import no_host_sync
from tests.parts.test_ema_nonfinite import MAKERS, POISONS, bits, same_bits

SIGMAS = (0.05, 0.10)


def net(device: str = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    return model.to(device=device, dtype=dtype)


def train_step(model: nn.Module, step: int) -> None:
    """What a training step does to the weights and the BatchNorm statistics (and its step counter, an integer
    buffer), the same for the same ``step`` on every device and in every run."""
    generator = torch.Generator().manual_seed(step)
    device, dtype = model[0].weight.device, model[0].weight.dtype
    model.train()
    with torch.no_grad():
        model(torch.randn(8, 8, generator=generator).to(device, dtype) + 1)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator).to(device, dtype), alpha=0.05)


def poisoned(ema: PowerEMA, model: nn.Module, where: str, value: float) -> None:
    """One update with one live element NaN or Inf, in a weight or in BatchNorm's ``running_var``; put back after."""
    tensor = model[0].weight if where == "parameter" else model[1].running_var
    with torch.no_grad():
        flat = tensor.view(-1)
        kept = flat[3].clone()
        flat[3] = value
        ema.update()
        flat[3] = kept


def profile_bits(ema: PowerEMA) -> list[dict[str, torch.Tensor]]:
    return [bits(profile) for profile in ema.profiles]


def same_profiles(a: PowerEMA, b: PowerEMA) -> bool:
    return all(same_bits(x, y) for x, y in zip(profile_bits(a), profile_bits(b), strict=True))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("where", ["parameter", "buffer"])
@pytest.mark.parametrize("value", POISONS)
@pytest.mark.parametrize("every", [1, 3])
def test_a_skipped_update_is_one_that_did_not_happen(device: str, where: str, value: float, every: int) -> None:
    """Poisoned updates leave every profile bit for bit; the run then equals an unguarded ``PowerEMA`` that simply
    was not updated at those steps (its ``beta`` spanning from the last update it made)."""
    bad = {3 * every, 4 * every, 9 * every}  # two in a row, and one more
    guarded_model, reference_model, control_model = net(device), net(device), net(device)
    guarded = PowerEMA(guarded_model, SIGMAS, update_every=every, skip_nonfinite=True)
    reference = PowerEMA(reference_model, SIGMAS, update_every=every, skip_nonfinite=False)
    control = PowerEMA(control_model, SIGMAS, update_every=every, skip_nonfinite=False)
    for step in range(1, 12 * every + 1):
        for model in (guarded_model, reference_model, control_model):
            train_step(model, step)
        if step in bad:
            before = profile_bits(guarded)
            poisoned(guarded, guarded_model, where, value)
            assert all(same_bits(a, b) for a, b in zip(profile_bits(guarded), before, strict=True)), step
            poisoned(control, control_model, where, value)
            reference.step += 1  # the reference: a step counted, no update made
        else:
            guarded.update()
            control.update()
            reference.update()
    assert (skipped_updates(guarded), guarded.applied_step, guarded.updated_step) == (3, 12 * every, 12 * every)
    if device == "cpu":  # the host's beta from the applied step: the reference's, bit for bit
        assert same_profiles(guarded, reference)
    else:
        for ours, expected in zip(guarded.profiles, reference.profiles, strict=True):
            for name, tensor in expected.items():
                torch.testing.assert_close(ours[name], tensor)
    name = "0.weight" if where == "parameter" else "1.running_var"
    assert all(not torch.isfinite(profile[name]).all() for profile in control.profiles)  # poisoned for good
    assert skipped_updates(control) == 0

    # The control of the semantics: the per-step beta applied after a skip (the host's updated_step, which counts
    # the skipped update) weighs the next applied update as if it stood for every_ steps only: not the reference.
    naive = PowerEMA(net(device), SIGMAS, update_every=every, skip_nonfinite=False)
    model = naive._model
    for step in range(1, 12 * every + 1):
        train_step(model, step)
        if step in bad:
            naive.step += 1
            naive.updated_step = naive.step
        else:
            naive.update()
    assert not same_profiles(naive, reference)


@pytest.mark.parametrize("device", DEVICES)
def test_clean_guarded_updates_are_the_plain_ones_and_minus_zero_survives_a_skip(device: str) -> None:
    plain_model, guarded_model = net(device), net(device)
    plain = PowerEMA(plain_model, SIGMAS, skip_nonfinite=False)
    guarded = PowerEMA(guarded_model, SIGMAS, skip_nonfinite=True)
    for step in range(1, 21):
        for model, ema in ((plain_model, plain), (guarded_model, guarded)):
            train_step(model, step)
            ema.update()
    if device == "cpu":
        assert same_profiles(guarded, plain)
    else:
        for ours, expected in zip(guarded.profiles, plain.profiles, strict=True):
            for name, tensor in expected.items():
                torch.testing.assert_close(ours[name], tensor)
    with torch.no_grad():
        for profile in guarded.profiles:
            profile["0.weight"][:2] = -0.0
    before = profile_bits(guarded)
    for value in (float("nan"), float("inf")):
        poisoned(guarded, guarded_model, "parameter", value)
    assert all(same_bits(a, b) for a, b in zip(profile_bits(guarded), before, strict=True))
    assert all(torch.signbit(profile["0.weight"][:2]).all() for profile in guarded.profiles)


def test_a_low_precision_model_is_staged_and_checked_in_float32() -> None:
    runs = {}
    for name, poison in (("guarded", True), ("reference", False)):
        model = net(dtype=torch.bfloat16)
        ema = PowerEMA(model, SIGMAS, skip_nonfinite=poison)
        for step in range(1, 9):
            train_step(model, step)
            if step == 5:
                if poison:
                    poisoned(ema, model, "parameter", float("inf"))
                else:
                    ema.step += 1
            else:
                ema.update()
        runs[name] = ema
    assert runs["guarded"].profiles[0]["0.weight"].dtype == torch.float32
    # one copy of the weights: the group's staging, which the check reads (its scratch is one number per tensor)
    assert isinstance(runs["guarded"]._guard, FiniteCheck)
    staging = runs["guarded"]._groups[0].staging
    assert len(staging) == 8 and all(t.dtype == torch.float32 for t in staging)  # parameters and floating buffers
    assert runs["guarded"]._guard.plans[0].scratch.numel() == 8  # one float32 sum per (small) tensor
    assert same_profiles(runs["guarded"], runs["reference"]) and skipped_updates(runs["guarded"]) == 1


@pytest.mark.parametrize("device", DEVICES)
def test_a_guarded_update_allocates_nothing_and_writes_only_when_it_averages(device: str) -> None:
    """Zero bytes allocated by a clean update and by a skipped one, and no tensor made even inside a kernel (a
    reduction to one element of a large tensor allocates its per-thread buffer: ``copy_correct.guards.host``). A
    clean update raises each profile tensor's version by one; a skipped one writes nothing on the CPU (decided on the
    host, once for all profiles), and on CUDA runs every kernel with the flag (each version +1, nothing read back)."""
    model = net(device)
    model.register_parameter("large", nn.Parameter(torch.randn(300, 300, device=device)))  # 90,000 elements
    ema = PowerEMA(model, SIGMAS, skip_nonfinite=True)
    ema.update()
    for value, written in ((0.5, 1), (float("nan"), 0 if device == "cpu" else 1)):  # a clean update, a skipped one
        versions = [{k: v._version for k, v in profile.items()} for profile in ema.profiles]
        with torch.no_grad():
            model[0].weight[0, 0] = value
        with CopyAudit() as audit, MemoryProbe(device) as memory:
            ema.update()
        assert audit.bytes_allocated == 0, audit.summary()
        assert memory.peak_bytes == 0, memory.report()
        for profile, before in zip(ema.profiles, versions, strict=True):
            assert all(v._version == before[k] + written for k, v in profile.items())
        with torch.autograd.profiler.profile() as profile:
            ema.update()
        names = {event.name for event in profile.function_events}
        assert not names & MAKERS
        if device != "cpu":  # a CPU tensor's value is read without a sync: only the device guard reads nothing back
            assert "aten::_local_scalar_dense" not in names
    assert skipped_updates(ema) == 2  # the profiled update was bad too
    assert ema.applied_step == 3 and ema.updated_step == 5

    # The control: an isfinite check per tensor (PR #24307's) allocates, and reading a counter from the device syncs.
    with MemoryProbe(device) as control, torch.autograd.profiler.profile() as profile:
        assert ema.applied_step == 3
        assert not all(bool(torch.isfinite(t).all()) for t in model.state_dict().values() if t.is_floating_point())
    names = {event.name for event in profile.function_events}
    assert control.peak_bytes > 0 and names & MAKERS and "aten::_local_scalar_dense" in names


def test_the_decision_is_what_guards(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mutation control: with the check's answer forced to "finite", the same poisoned update poisons every profile,
    so the tests above fail without the decision."""
    monkeypatch.setattr(FiniteCheck, "finite", lambda self, groups: True)
    model = net()
    ema = PowerEMA(model, SIGMAS, skip_nonfinite=True)
    assert isinstance(ema._guard, FiniteCheck)
    train_step(model, 1)
    ema.update()
    poisoned(ema, model, "parameter", float("nan"))
    assert all(profile["0.weight"].isnan().any() for profile in ema.profiles) and skipped_updates(ema) == 0
    assert ema.applied_step == 2


def test_the_guard_on_cpu_profiles_decides_on_the_host_and_writes_nothing_when_it_skips() -> None:
    model = net()
    assert not PowerEMA(model, SIGMAS).skip_nonfinite  # opt-in
    ema = PowerEMA(model, SIGMAS, skip_nonfinite=True)
    assert isinstance(ema._guard, FiniteCheck)
    train_step(model, 1)
    ema.update()
    before = profile_bits(ema)
    versions = [{k: v._version for k, v in profile.items()} for profile in ema.profiles]
    poisoned(ema, model, "buffer", -float("inf"))
    assert all(same_bits(a, b) for a, b in zip(profile_bits(ema), before, strict=True)) and skipped_updates(ema) == 1
    assert [{k: v._version for k, v in profile.items()} for profile in ema.profiles] == versions
    assert (ema.applied_step, ema.updated_step, ema.snapshot()["step"]) == (1, 2, 1)
    with pytest.raises(TypeError, match=r"skip_nonfinite must be True or False, got str 'yes'"):
        PowerEMA(model, SIGMAS, skip_nonfinite="yes")  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_guard_on_cuda_decides_on_the_device() -> None:
    """On CUDA the guard is the device one, which stages itself (the groups' staging freed)."""
    model = net("cuda", torch.bfloat16)
    guarded = PowerEMA(model, SIGMAS, skip_nonfinite=True)
    assert guarded.skip_nonfinite and not isinstance(guarded._guard, FiniteCheck)
    assert all(group.staging == [] for group in guarded._groups)


def test_a_finite_update_whose_sum_overflows_is_made() -> None:
    """The CPU check sums each tensor, and a finite tensor's sum can overflow to Inf: such an update is still made, as
    unguarded (the check reads the tensor again, exactly). The control: the sum alone says "not finite"."""
    models = {}
    for guard in (True, False):
        model = net()
        model.register_parameter("large", nn.Parameter(torch.zeros(300, 300)))  # summed per row
        with torch.no_grad():
            model[0].weight[0, :4] = 3e38  # one row of a small tensor, summed whole: 1.2e39, over float32's max
            model.large[7, :4] = 3e38
        models[guard] = (model, PowerEMA(model, SIGMAS, skip_nonfinite=guard))
    for step in range(1, 4):
        for model, ema in models.values():
            generator = torch.Generator().manual_seed(step)
            with torch.no_grad():  # no forward pass: it would make the BatchNorm statistics Inf
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=generator), alpha=0.05)
            ema.update()
    guarded, plain = models[True][1], models[False][1]
    assert skipped_updates(guarded) == 0 and guarded.applied_step == 3 and same_profiles(guarded, plain)
    assert (
        not torch.isfinite(models[True][0][0].weight.sum()) and not torch.isfinite(models[True][0].large.sum(1)).all()
    )


def test_integer_buffers_are_copied_into_every_profile_and_kept_on_a_skip() -> None:
    model = net()
    ema = PowerEMA(model, (0.05, 0.08, 0.10), skip_nonfinite=True)
    train_step(model, 1)
    ema.update()
    assert all(int(profile["1.num_batches_tracked"]) == 1 for profile in ema.profiles)
    train_step(model, 2)
    poisoned(ema, model, "buffer", float("nan"))
    assert all(int(profile["1.num_batches_tracked"]) == 1 for profile in ema.profiles)
    ema.update()
    assert all(int(profile["1.num_batches_tracked"]) == 2 for profile in ema.profiles)


@pytest.mark.parametrize("device", DEVICES)
def test_skipped_and_the_applied_step_round_trip_and_snapshots_record_the_applied_step(
    device: str, tmp_path: Path
) -> None:
    model = net(device)
    ema = PowerEMA(model, SIGMAS, skip_nonfinite=True)
    for step in range(1, 7):
        train_step(model, step)
        if step in (3, 6):
            poisoned(ema, model, "buffer", float("inf"))
        else:
            ema.update()
    state = ema.state_dict()
    assert (state["skipped"], state["applied_step"], state["step"], state["updated_step"]) == (2, 5, 6, 6)
    snapshot = ema.snapshot()
    assert (snapshot["step"], snapshot["skipped"]) == (5, 2)  # the profiles hold the weights of steps 1..5
    torch.save(state, tmp_path / "power_ema.pt")
    restored = PowerEMA(net(device), SIGMAS, skip_nonfinite=True)
    restored.load_state_dict(torch.load(tmp_path / "power_ema.pt", weights_only=True))
    assert (skipped_updates(restored), restored.applied_step) == (2, 5)
    restored._model.load_state_dict(model.state_dict())
    for ema_ in (ema, restored):  # the same next update: beta from step 5 to step 7
        ema_.update()
    assert same_profiles(restored, ema)

    old = {k: v for k, v in state.items() if k not in ("skipped", "applied_step")}  # saved without the guard
    restored.load_state_dict(old)
    assert (skipped_updates(restored), restored.applied_step) == (0, 6)
    unguarded = PowerEMA(net(device), SIGMAS, skip_nonfinite=False)
    unguarded.load_state_dict(state)
    assert (
        skipped_updates(unguarded) == 0
        and "skipped" not in unguarded.state_dict()
        and "skipped" not in unguarded.snapshot()
    )


def test_synthesis_from_snapshots_with_skips_is_that_of_the_run_without_those_updates(tmp_path: Path) -> None:
    """Snapshots record the applied step, so ``synthesize`` of a guarded run equals that of a run that made no update
    at the skipped steps; the control, a snapshot labelled with the host's step, shifts the reconstruction."""
    runs = {}
    for name in ("guarded", "reference"):
        model = net()
        ema = PowerEMA(model, SIGMAS, skip_nonfinite=name == "guarded")
        directory = tmp_path / name
        for step in range(1, 41):
            train_step(model, step)
            if step in (7, 20, 33):  # step 20 is a snapshot step: that snapshot holds the profiles of step 19
                if name == "guarded":
                    poisoned(ema, model, "parameter", float("nan"))
                else:
                    ema.step += 1
            else:
                ema.update()
            if step % 10 == 0:
                ema.save_snapshot(directory)
        runs[name] = directory
    names = [[p.name for p in snapshot_paths(d)] for d in runs.values()]
    assert names[0] == names[1] == [f"power-ema-{t:09d}.pt" for t in (10, 19, 30, 40)]
    guarded = synthesize(snapshot_paths(runs["guarded"]), sigma_rel=0.07)
    reference = synthesize(snapshot_paths(runs["reference"]), sigma_rel=0.07)
    assert same_bits(bits(guarded), bits(reference))

    shifted = torch.load(snapshot_paths(runs["guarded"])[1], weights_only=True)
    shifted["step"] = 20  # the control: the host's updated_step, which counts the skipped update
    paths = snapshot_paths(runs["guarded"])
    torch.save(shifted, paths[1])
    assert not same_bits(bits(synthesize(paths, sigma_rel=0.07)), bits(reference))


def test_a_model_not_finite_at_construction_is_refused() -> None:
    model = net()
    model.register_buffer("mask", torch.full((4,), -float("inf")))
    with pytest.raises(ValueError, match=r"skip_nonfinite=True, but the model's \['mask'\] hold NaN or Inf"):
        PowerEMA(model, SIGMAS, skip_nonfinite=True)
    ema = PowerEMA(model, SIGMAS)
    assert not ema.skip_nonfinite and ema._guard is None and skipped_updates(ema) == 0
    ema.update()  # without the guard nothing is checked, nothing counted: the -inf is averaged as it is (NaN)
    assert skipped_updates(ema) == 0 and all(not torch.isfinite(profile["mask"]).any() for profile in ema.profiles)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_guarded_update_has_no_host_sync() -> None:
    model = net("cuda")
    ema = PowerEMA(model, SIGMAS, update_every=2, skip_nonfinite=True)
    low = net("cuda", torch.bfloat16)
    staged = PowerEMA(low, SIGMAS, skip_nonfinite=True)  # float32 profiles of a bf16 model: staged in float32
    for step in range(1, 9):
        for m, e in ((model, ema), (low, staged)):
            train_step(m, step)
            flat = m[0].weight.detach().view(-1)
            kept = flat[3].clone()
            if step in (2, 4):
                flat[3] = float("nan")
            with no_host_sync():
                e.update()
            flat[3] = kept
    assert (skipped_updates(ema), skipped_updates(staged)) == (2, 2)
    assert (ema.applied_step, staged.applied_step) == (8, 8)
    for e in (ema, staged):
        assert all(torch.isfinite(t).all() for p in e.profiles for t in p.values() if t.is_floating_point())
