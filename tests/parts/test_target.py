"""Target networks: frozen copy, in-place hard/soft updates with no allocation; per-tensor loops as controls."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import copy_correct.core.module_tensors as _module_tensors
import copy_correct.target as target_module
from copy_correct import hard_update, make_target, soft_update
from copy_correct.probes import CopyAudit, MemoryProbe, storage_key
from tests.conftest import DEVICES


def qnet(device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 2)).to(device)


def step(online: nn.Module, optimizer: torch.optim.Optimizer, target: nn.Module) -> None:
    x = torch.randn(8, 4, device=next(online.parameters()).device)
    with torch.no_grad():
        bootstrap = target(x).max(dim=1).values
    loss = (online(x).max(dim=1).values - (1 + 0.9 * bootstrap)).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def keys(model: nn.Module) -> dict[str, int]:
    return {name: storage_key(t) for name, t in model.state_dict().items()}


@pytest.mark.parametrize("device", DEVICES)
def test_make_target_is_a_frozen_copy_with_its_own_storage(device: str) -> None:
    online = qnet(device)
    target = make_target(online)
    assert not target.training
    pairs = zip(target.state_dict(keep_vars=True).items(), online.state_dict(keep_vars=True).values(), strict=True)
    for (name, t), o in pairs:
        assert torch.equal(t, o), name
        assert storage_key(t) != storage_key(o), name
    assert all(not p.requires_grad for p in target.parameters())
    optimizer = torch.optim.Adam(p for p in [*online.parameters(), *target.parameters()] if p.requires_grad)
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(list(online.parameters()))


@pytest.mark.parametrize("device", DEVICES)
def test_make_target_into_a_network_copies_into_its_storage_and_freezes_it(device: str) -> None:
    """``into``: the way to a target of an already-sharded network (``tests/distributed/test_sharded.py``), here
    unsharded."""
    online = qnet(device)
    online[1].running_mean.add_(1.0)
    twin = nn.Sequential(nn.Linear(4, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 2)).to(device)
    before = keys(twin)
    assert make_target(online, into=twin) is twin
    assert keys(twin) == before  # written into its own storage, nothing replaced
    assert not twin.training and all(not p.requires_grad for p in twin.parameters())
    for (name, t), o in zip(twin.state_dict().items(), online.state_dict().values(), strict=True):
        assert torch.equal(t, o), name
    with pytest.raises(ValueError, match="same module"):
        make_target(online, into=online)
    with pytest.raises(ValueError, match=r"differ at '0.weight' / '0.weight': target \(64, 4\)"):
        make_target(online, into=nn.Sequential(nn.Linear(4, 64)))
    with pytest.raises(TypeError, match=r"into must be an nn\.Module, got str"):
        make_target(online, into="target")  # type: ignore[arg-type]


@pytest.mark.parametrize("device", DEVICES)
def test_target_never_sees_a_gradient_through_training_and_updates_in_grad_mode(device: str) -> None:
    online = qnet(device)
    target = make_target(online)
    optimizer = torch.optim.SGD(online.parameters(), lr=0.1)
    for _ in range(3):
        step(online, optimizer, target)
        hard_update(target, online)  # called in grad mode
        soft_update(target, online, 0.5)
    assert torch.is_grad_enabled()
    for p in target.parameters():
        assert not p.requires_grad and p.grad is None and p.grad_fn is None
    in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert not in_optimizer & {id(p) for p in target.parameters()}


@pytest.mark.parametrize("device", DEVICES)
def test_hard_update_is_in_place_bit_exact_and_bumps_each_version_once(device: str) -> None:
    online = qnet(device)
    target = make_target(online)
    online.train()
    online(torch.randn(8, 4, device=device))  # moves BatchNorm statistics
    with torch.no_grad():
        online[0].weight[0, 0] = float("nan")
        online[0].weight[0, 1] = float("inf")
        online[3].bias.add_(1)
    before_keys = keys(target)
    versions = {name: t._version for name, t in target.state_dict(keep_vars=True).items()}
    hard_update(target, online)
    for name, t in target.state_dict(keep_vars=True).items():
        assert torch.equal(t, online.state_dict()[name]) or name == "0.weight", name
        assert t._version == versions[name] + 1, name
    w = target[0].weight
    assert w[0, 0].isnan() and w[0, 1].isinf() and torch.equal(w[1:], online[0].weight[1:])
    assert keys(target) == before_keys  # same storage: in place
    assert target[1].num_batches_tracked.item() == 1
    versions = {name: t._version for name, t in target.state_dict(keep_vars=True).items()}
    soft_update(target, online, 0.5)
    assert all(t._version == versions[name] + 1 for name, t in target.state_dict(keep_vars=True).items())
    assert keys(target) == before_keys


@pytest.mark.parametrize("device", DEVICES)
def test_updates_allocate_nothing_and_the_per_tensor_patterns_do(device: str) -> None:
    online, tau = qnet(device), 0.05
    target = make_target(online)
    hard_update(target, online)
    soft_update(target, online, tau)  # the first call builds the lists
    with CopyAudit() as hard, MemoryProbe(device) as hard_memory:
        hard_update(target, online)
    with CopyAudit() as soft, MemoryProbe(device) as soft_memory:
        soft_update(target, online, tau)
    assert hard.bytes_allocated == soft.bytes_allocated == 0
    assert hard_memory.peak_bytes == soft_memory.peak_bytes == 0
    floats = [t for t in online.state_dict().values() if t.is_floating_point()]
    assert soft.count("_foreach_lerp_") == len(floats)
    assert hard.count("_foreach_copy_") == len(online.state_dict())

    with CopyAudit() as cleanrl, torch.no_grad():  # the control: CleanRL's way
        for t, q in zip(target.parameters(), online.parameters(), strict=True):
            t.data.copy_(tau * q.data + (1.0 - tau) * t.data)
    params = sum(p.numel() * p.element_size() for p in online.parameters())
    assert cleanrl.bytes_allocated == 3 * params
    with CopyAudit() as state_dict_way:
        target.load_state_dict(online.state_dict())
    assert state_dict_way.bytes_allocated == 0  # in place too, but walks both modules every call


def test_soft_update_matches_the_closed_form() -> None:
    online = qnet()
    target = make_target(online)
    t0 = {k: v.clone() for k, v in target.state_dict().items()}
    with torch.no_grad():
        for p in online.parameters():
            p.add_(1.0)
    for _ in range(10):
        soft_update(target, online, 0.1)
    for name, value in online.state_dict().items():
        if value.is_floating_point():
            expected = value + (t0[name] - value) * 0.9**10
            torch.testing.assert_close(target.state_dict()[name], expected, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(target.state_dict()[name], value)


def test_updates_follow_the_model_after_to() -> None:
    online = qnet()
    target = make_target(online)
    hard_update(target, online)
    online.to(torch.float64)
    target.to(torch.float64)  # replaces buffer objects; parameters keep theirs
    online.train()
    online(torch.randn(8, 4, dtype=torch.float64))
    hard_update(target, online)
    assert torch.equal(target[1].running_mean, online[1].running_mean)


def test_mismatched_networks_name_the_first_difference() -> None:
    online = qnet()
    wider = nn.Sequential(nn.Linear(4, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 2))
    with pytest.raises(ValueError, match=r"differ at '0.weight' / '0.weight': target \(64, 4\)"):
        hard_update(wider, online)
    with pytest.raises(ValueError, match=r"only the online has '3\.weight'"):
        hard_update(nn.Sequential(nn.Linear(4, 32), nn.BatchNorm1d(32)), online)
    with pytest.raises(ValueError, match="same module"):
        hard_update(online, online)
    half = make_target(online).to(torch.float16)
    with pytest.raises(ValueError, match=r"torch\.float16"):
        soft_update(half, online, 0.5)


@pytest.mark.parametrize("tau", [0.0, -0.1, 1.5])
def test_tau_outside_the_range_is_rejected(tau: float) -> None:
    online = qnet()
    with pytest.raises(ValueError, match=r"tau must be in \(0, 1\]"):
        soft_update(make_target(online), online, tau)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_updates_do_not_synchronize() -> None:
    online = qnet("cuda")
    target = make_target(online)
    hard_update(target, online)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        hard_update(target, online)
        soft_update(target, online, 0.01)
    finally:
        torch.cuda.set_sync_debug_mode("default")


ROOTS = {
    "BatchNorm1d at the root": lambda: nn.BatchNorm1d(8),
    "buffers in a submodule": lambda: nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)),
    "no buffers": lambda: nn.Linear(8, 8),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("root", ROOTS)
def test_a_dropped_target_is_freed_whatever_its_root_module_owns(
    root: str, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def dropped_target_survives() -> bool:
        online = ROOTS[root]().to(device)
        target = make_target(online)
        hard_update(target, online)
        soft_update(target, online, 0.5)
        ref = weakref.ref(target)
        del target
        gc.collect()
        return ref() is not None

    assert not dropped_target_survives()
    if root != "BatchNorm1d at the root":
        return
    # The control: the update lists holding each buffer's owner module strongly, as before the fix. The cache is keyed
    # by the target weakly, but its value then holds the target itself, so the entry never goes.
    monkeypatch.setattr(_module_tensors, "weakref", SimpleNamespace(ref=lambda module: lambda: module))
    assert dropped_target_survives()


WRAPPERS = {
    "torch.compile": torch.compile,
    "DataParallel": nn.DataParallel,
    "compiled DataParallel": lambda m: torch.compile(nn.DataParallel(m)),
}


@pytest.mark.parametrize("wrap", WRAPPERS)
def test_targets_of_compiled_and_wrapped_networks(wrap: str) -> None:
    """CleanRL and SB3 users compile their Q-network; the wrappers prefix every state_dict name (``_orig_mod.``,
    ``module.``), and the pair is the modules inside."""
    online = qnet()
    wrapped = WRAPPERS[wrap](online)
    target = make_target(wrapped)
    assert type(target) is nn.Sequential and keys(target).keys() == keys(online).keys()  # the module inside, copied
    with torch.no_grad():
        online[0].weight.add_(1.0)
    hard_update(target, wrapped)
    assert torch.equal(target[0].weight, online[0].weight)
    soft_update(WRAPPERS[wrap](target), wrapped, 0.5)  # a wrapped target too
    hard_update(target, online)  # the same pair, unwrapped: the same lists
    with CopyAudit() as audit:
        hard_update(target, wrapped)
    assert audit.bytes_allocated == 0

    with pytest.raises(ValueError, match=r"differ at '0.weight' / '(_orig_mod|module)\."):  # the control: no unwrapping
        target_module._build(target, wrapped)
