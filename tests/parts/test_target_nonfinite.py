"""``hard_update`` / ``soft_update`` with ``skip_nonfinite=True``: a NaN or an Inf in the online weights or floating
buffers leaves the target bit for bit as it was (``-0.0`` entries included), and the next clean updates end where
they would have without the poisoned one, with nothing allocated per update after the first: decided on the host
before anything is written for a CPU target (a skipped update writes nothing), on the device for a CUDA one. Each claim
has its control: without the guard one such update poisons the target (a soft update keeps the NaN for good, since
every later average reads it), and with the CPU check's answer forced to "finite" the guarded update poisons it too."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from copy_correct import hard_update, make_target, skipped_updates, soft_update
from copy_correct.guards.host import FiniteCheck
from copy_correct.probes import CopyAudit, MemoryProbe
from tests.conftest import DEVICES
from tests.cuda_sync import no_host_sync
from tests.parts.test_ema_nonfinite import MAKERS, POISONS, bits, net, same_bits, train_step

TAU = 0.05


def update(target: nn.Module, online: nn.Module, tau: float, guard: bool) -> None:
    if tau == 1.0:
        hard_update(target, online, skip_nonfinite=guard)
    else:
        soft_update(target, online, tau, skip_nonfinite=guard)


def poisoned(online: nn.Module, where: str, value: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Put ``value`` into one element of a weight or of BatchNorm's ``running_var``; (tensor, kept) to restore it."""
    tensor = online[0].weight if where == "parameter" else online[1].running_var
    kept = tensor.view(-1)[3].clone()
    with torch.no_grad():
        tensor.view(-1)[3] = value
    return tensor, kept


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tau", [TAU, 1.0], ids=["soft", "hard"])
@pytest.mark.parametrize("where", ["parameter", "buffer"])
@pytest.mark.parametrize("value", POISONS)
def test_a_poisoned_update_leaves_the_target_and_the_next_ones_as_if_it_never_happened(
    device: str, tau: float, where: str, value: float
) -> None:
    runs = {}
    for name, poison, guard in (("guarded", True, True), ("never poisoned", False, True), ("control", True, False)):
        online = net(device)
        target = make_target(online)
        for step in range(8):
            train_step(online, step)
            if poison and step == 4:
                tensor, kept = poisoned(online, where, value)
                before = bits(target.state_dict())
                update(target, online, tau, guard)
                if guard:
                    assert same_bits(bits(target.state_dict()), before)  # skipped: every bit as it was
                with torch.no_grad():
                    tensor.view(-1)[3] = kept
            else:
                update(target, online, tau, guard)
        runs[name] = target
    assert skipped_updates(runs["guarded"]) == 1 and skipped_updates(runs["never poisoned"]) == 0
    if tau == 1.0:  # a hard update forgets: the next one restores everything
        assert same_bits(bits(runs["guarded"].state_dict()), bits(runs["never poisoned"].state_dict()))
    else:  # a soft one remembers: as if step 4's update had not been made
        skipped = net(device)
        expected = make_target(skipped)
        for step in range(8):
            train_step(skipped, step)
            if step != 4:
                soft_update(expected, skipped, tau)
        assert same_bits(bits(runs["guarded"].state_dict()), bits(expected.state_dict()))
    # The control: unguarded, the soft target keeps the NaN or Inf for good; the hard one holds it until the next copy.
    control = runs["control"][0].weight if where == "parameter" else runs["control"][1].running_var
    assert torch.isfinite(control).all() == (tau == 1.0)


@pytest.mark.parametrize("device", DEVICES)
def test_minus_zero_entries_and_integer_buffers_survive_a_skipped_update(device: str) -> None:
    online = net(device)
    target = make_target(online)
    with torch.no_grad():
        target[0].weight[0, :4] = -0.0
        target[1].num_batches_tracked.fill_(-7)
    before = bits(target.state_dict())
    poisoned(online, "parameter", float("nan"))
    soft_update(target, online, TAU, skip_nonfinite=True)
    assert same_bits(bits(target.state_dict()), before)
    assert target[0].weight[0, :4].signbit().all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tau", [TAU, 1.0], ids=["soft", "hard"])
def test_clean_guarded_updates_are_the_plain_ones(device: str, tau: float) -> None:
    online = net(device)
    guarded, plain = make_target(online), make_target(online)
    for step in range(5):
        train_step(online, step)
        update(guarded, online, tau, True)
        update(plain, online, tau, False)
        assert same_bits(bits(guarded.state_dict()), bits(plain.state_dict()))
    assert skipped_updates(guarded) == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tau", [TAU, 1.0], ids=["soft", "hard"])
def test_a_guarded_update_allocates_nothing_after_the_first_and_raises_each_version_as_it_writes(
    device: str, tau: float
) -> None:
    """A clean update raises every version by one. A skipped one on the CPU writes nothing, so no version moves (a
    backward through a target tensor saved before it stays valid: its values are the same); on CUDA the device guard
    writes every tensor whatever it decides, and raises each version by one as well."""
    online = net(device)
    target = make_target(online)
    update(target, online, tau, True)  # the first builds the guard's scratch
    for value in (0.5, float("nan")):  # a clean update, then a skipped one
        versions = {k: v._version for k, v in target.state_dict().items()}
        with torch.no_grad():
            online[0].weight[0, 0] = value
        with CopyAudit() as audit, MemoryProbe(device) as memory:
            update(target, online, tau, True)
        assert audit.bytes_allocated == 0, audit.summary()
        assert memory.peak_bytes == 0, memory.report()
        raised = 0 if device == "cpu" and value != 0.5 else 1
        assert all(v._version == versions[k] + raised for k, v in target.state_dict().items())
        with torch.autograd.profiler.profile() as profile:
            update(target, online, tau, True)
        assert not {event.name for event in profile.function_events} & MAKERS
    assert skipped_updates(target) == 2


def test_the_guard_follows_tensors_that_to_replaces_and_keeps_its_count() -> None:
    """``model.to(...)`` replaces buffers and swaps parameters' storage: a guard built before writes into the new
    storage after (a copy through views of the old would leave the target's weights as they were)."""
    online = net()
    target = make_target(online)
    _, kept = poisoned(online, "buffer", float("inf"))
    hard_update(target, online, skip_nonfinite=True)
    online[1].running_var.view(-1)[3] = kept
    for parameter in target.parameters():
        parameter.data = parameter.data.clone()  # what .to(...) does to a parameter: the same object, new storage
    train_step(online, 1)
    hard_update(target, online, skip_nonfinite=True)
    assert same_bits(bits(target.state_dict()), bits(online.state_dict()))
    for network in (target, online):
        network.to(torch.float64).to(torch.float32)  # new buffer objects, parameters' data swapped
    train_step(online, 2)
    hard_update(target, online, skip_nonfinite=True)
    assert skipped_updates(target) == 1
    assert same_bits(bits(target.state_dict()), bits(online.state_dict()))


@pytest.mark.parametrize("tau", [TAU, 1.0], ids=["soft", "hard"])
def test_the_cpu_check_is_what_guards_a_forced_finite_answer_lets_the_poison_in(
    tau: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mutation control of the CPU path: the same poisoned update, guarded, with ``FiniteCheck.finite`` answering
    "finite" whatever it reads, poisons the target and counts no skip; with the real check it skips."""
    runs = {}
    for name in ("guarded", "check forced"):
        online = net()
        target = make_target(online)
        update(target, online, tau, True)  # the guard built
        if name == "check forced":
            monkeypatch.setattr(FiniteCheck, "finite", lambda self, groups: True)
        poisoned(online, "parameter", float("nan"))
        update(target, online, tau, True)
        monkeypatch.undo()
        runs[name] = target
    assert torch.isfinite(runs["guarded"][0].weight).all() and skipped_updates(runs["guarded"]) == 1
    assert torch.isnan(runs["check forced"][0].weight.view(-1)[3]) and skipped_updates(runs["check forced"]) == 0


def test_finite_weights_whose_sum_overflows_are_not_skipped() -> None:
    """The CPU check sums each tensor; a sum that overflows to Inf over finite values is read again exactly, so the
    update is made. The control: the same weights with one Inf are skipped."""
    for value, skips in ((3e38, 0), (float("inf"), 1)):
        online = net()
        target = make_target(online)
        with torch.no_grad():
            online[0].weight.fill_(3e38)  # finite, and their float32 sum is Inf
            online[0].weight.view(-1)[5] = value
        assert torch.isinf(online[0].weight.sum())
        hard_update(target, online, skip_nonfinite=True)
        assert skipped_updates(target) == skips
        assert torch.equal(target[0].weight, online[0].weight) == (skips == 0)


def test_a_dropped_target_frees_its_guard() -> None:
    online = net()
    target = make_target(online)
    soft_update(target, online, TAU, skip_nonfinite=True)
    probe = target[0].weight
    del target
    gc.collect()
    from copy_correct.guards.device import TARGET_GUARDS

    assert all(probe is not t for tensors, _, _ in TARGET_GUARDS.values() for t in tensors)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_guarded_target_updates_have_no_host_sync() -> None:
    online = net("cuda")
    target = make_target(online)
    soft_update(target, online, TAU, skip_nonfinite=True)  # the first builds the scratch
    for step in range(4):
        if step == 2:
            tensor, kept = poisoned(online, "parameter", float("nan"))
        with no_host_sync():
            update(target, online, TAU if step % 2 else 1.0, True)
        if step == 2:
            with torch.no_grad():
                tensor.view(-1)[3] = kept
    assert skipped_updates(target) == 1
    assert all(torch.isfinite(t).all() for t in target.state_dict().values() if t.is_floating_point())
