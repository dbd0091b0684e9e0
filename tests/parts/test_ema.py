"""EMA: numerics (closed form, AveragedModel, warm-up, bf16), copy contract (no allocation, no graph, not a
parameter), average_weights (bit-exact, bounded memory), state round trip, pickle and deepcopy, and clear errors."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from copy_correct import EMA
from copy_correct.probes import CopyAudit, MemoryProbe, find_graph_refs, shares_storage
from tests.conftest import DEVICES


def net(device: str = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    return model.to(device=device, dtype=dtype)


def perturb(model: nn.Module, scale: float = 0.1) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p), alpha=scale)


@pytest.mark.parametrize("device", DEVICES)
def test_closed_form_with_frozen_online_weights(device: str) -> None:
    model = net(device)
    ema = EMA(model, decay=0.9, warmup=False)
    e0 = {k: v.clone() for k, v in ema.shadow.items()}
    perturb(model, 1.0)
    for _ in range(25):
        ema.update(model)
    for name, w in model.state_dict().items():
        if w.is_floating_point():
            expected = w + (e0[name] - w) * 0.9**25
            torch.testing.assert_close(ema.shadow[name], expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_matches_averaged_model_over_50_updates(device: str) -> None:
    model = net(device)
    ema = EMA(model, decay=0.99, warmup=False, include_buffers=False)
    reference = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.99))
    reference.update_parameters(model)  # AveragedModel's first update copies; ours copied at construction
    for _ in range(50):
        perturb(model)
        ema.update(model)
        reference.update_parameters(model)
    ref = dict(reference.module.named_parameters())
    for name, _ in model.named_parameters():
        torch.testing.assert_close(ema.shadow[name], ref[name].detach(), rtol=1e-6, atol=1e-6)


def test_batchnorm_buffers_are_averaged_and_the_step_counter_copied() -> None:
    model = net()
    ema = EMA(model, decay=0.5, warmup=False)
    model.train()
    model(torch.randn(8, 16) + 3)  # moves running stats, num_batches_tracked -> 1
    ema.update(model)
    bn = model[1]
    torch.testing.assert_close(ema.shadow["1.running_mean"], 0.5 * torch.zeros(32) + 0.5 * bn.running_mean)
    assert ema.shadow["1.num_batches_tracked"].item() == 1
    assert ema.shadow["1.num_batches_tracked"].dtype == torch.int64
    without = EMA(model, include_buffers=False)
    assert not any("running" in k or "num_batches" in k for k in without.shadow)


@pytest.mark.parametrize("device", DEVICES)
def test_update_allocates_nothing_and_the_articles_loop_does(device: str) -> None:
    model = net(device)
    ema = EMA(model, decay=0.99, warmup=False)
    ema.update(model)
    with CopyAudit() as ours, MemoryProbe(device) as ours_memory:
        ema.update(model)
    assert ours.bytes_allocated == 0, ours.summary()
    assert ours_memory.peak_bytes == 0
    assert ours.count("_foreach_lerp_") == 8  # 4 weights/biases + BN weight, bias, running mean, var

    shadow = {k: v.clone() for k, v in model.state_dict().items() if v.is_floating_point()}
    live = model.state_dict()
    with CopyAudit() as control, MemoryProbe(device) as control_memory, torch.no_grad():
        for name, e in shadow.items():
            e.copy_(0.99 * e + (1 - 0.99) * live[name])
    size = sum(e.numel() * e.element_size() for e in shadow.values())
    assert control.bytes_allocated == 3 * size  # two products and a sum per tensor
    assert control_memory.peak_bytes > 0


def test_update_in_grad_mode_builds_no_graph_and_the_shadow_is_no_parameter() -> None:
    model = net()
    ema = EMA(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        loss = model(torch.randn(8, 16)).square().mean()
        loss.backward()
        optimizer.step()
        ema.update(model)  # grad mode is on here
    assert torch.is_grad_enabled()
    assert find_graph_refs(ema, name="ema") == []
    assert all(
        not t.requires_grad and t.grad_fn is None and not isinstance(t, nn.Parameter) for t in ema.shadow.values()
    )
    in_model = [*model.parameters(), *model.buffers()]
    in_optimizer = [p for g in optimizer.param_groups for p in g["params"]]
    for t in ema.shadow.values():
        assert not any(t is x or shares_storage(t, x) for x in in_model + in_optimizer)
    assert len(list(model.parameters())) == 6


def test_tied_weights_share_one_shadow() -> None:
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    model[1].weight = model[0].weight
    ema = EMA(model)
    assert ema.shadow["0.weight"] is ema.shadow["1.weight"]
    with CopyAudit() as audit:
        ema.update(model)
    assert audit.count("_foreach_lerp_") == 1


def test_warmup_ramp_start_step_and_update_every() -> None:
    model = net()
    ema = EMA(model, decay=0.999, warmup=True)
    assert ema.decay_at(0) == 0.0
    assert ema.decay_at(9) == pytest.approx(1 - 10 ** (-2 / 3))
    assert ema.decay_at(10**7) == 0.999
    perturb(model)
    ema.update(model)  # decay 0: the shadow becomes the weights
    torch.testing.assert_close(ema.shadow["0.weight"], model[0].weight.detach())

    delayed = EMA(model, decay=0.5, warmup=False, start_step=2, update_every=3)
    for _ in range(2):
        perturb(model)
        delayed.update(model)  # before start_step: copies
    torch.testing.assert_close(delayed.shadow["0.weight"], model[0].weight.detach())
    before = delayed.shadow["0.weight"].clone()
    perturb(model)
    delayed.update(model)  # step 2: averages
    torch.testing.assert_close(delayed.shadow["0.weight"], 0.5 * before + 0.5 * model[0].weight.detach())
    after = delayed.shadow["0.weight"].clone()
    perturb(model)
    delayed.update(model)  # step 3: skipped (every 3rd from start)
    perturb(model)
    delayed.update(model)  # step 4: skipped
    assert torch.equal(delayed.shadow["0.weight"], after)
    assert (delayed.step, delayed.num_updates) == (5, 1)


def test_bf16_shadow_stalls_where_the_default_fp32_shadow_tracks() -> None:
    """Decay 0.9999: each update moves the shadow by 1e-4 of the gap, below bf16's resolution near 1."""
    model = nn.Linear(64, 64, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        model.weight.fill_(1.0)
    ours = EMA(model, decay=0.9999, warmup=False)  # fp32 shadow for a bf16 model
    control = EMA(model, decay=0.9999, warmup=False, shadow_dtype=torch.bfloat16)
    assert ours.shadow["weight"].dtype == torch.float32
    with torch.no_grad():
        model.weight.fill_(2.0)
    with CopyAudit() as audit:
        ours.update(model)
    assert audit.bytes_allocated == 0  # the bf16 -> fp32 staging buffer was allocated at construction
    for _ in range(999):
        ours.update(model)
        control.update(model)
    expected = 2.0 - 0.9999**1000  # about 1.0952
    assert ours.shadow["weight"].float().mean().item() == pytest.approx(expected, abs=1e-4)
    assert control.shadow["weight"].float().mean().item() == 1.0  # every update rounded away


@pytest.mark.parametrize("device", DEVICES)
def test_average_weights_copies_in_and_restores_bit_exactly_through_one_backup(device: str) -> None:
    model = net(device)
    ema = EMA(model, decay=0.9)
    perturb(model, 1.0)
    ema.update(model)
    perturb(model, 1.0)
    live = {k: v.clone() for k, v in model.state_dict().items()}
    averaged = {k: v.clone() for k, v in ema.shadow.items()}
    weights = sum(v.numel() * v.element_size() for v in live.values())
    x = torch.randn(8, 16, device=device)
    model.eval()
    with MemoryProbe(device) as probe, ema.average_weights(model):
        pass
    assert probe.peak_bytes == weights  # one backup of the live values (one flat tensor per dtype group)...
    assert probe.net_bytes == 0  # ...freed on exit
    with ema.average_weights(model):
        for name, value in model.state_dict().items():
            assert torch.equal(value, averaged[name])
        with torch.no_grad():
            out_ema = model(x)
    for name, value in model.state_dict().items():
        assert torch.equal(value, live[name])  # live values back, bit for bit
        assert torch.equal(ema.shadow[name], averaged[name])  # shadow intact
    reference = copy.deepcopy(model)
    reference.load_state_dict(averaged)
    with torch.no_grad():
        assert torch.equal(out_ema, reference(x))

    block = ema.average_weights(model)  # the control: a block never exited keeps its backup (and the average in)
    with MemoryProbe(device) as control:
        block.__enter__()
    assert control.net_bytes == weights and same(model.state_dict(), averaged)
    block.__exit__(None, None, None)
    assert same(model.state_dict(), live)


def scratch_swap(model: nn.Module, ema: EMA) -> None:
    """The swap ``average_weights`` made before issue 20: shadow and live values exchanged through a scratch buffer,
    no backup; called again, it swaps back."""
    with torch.no_grad():
        for name, live in model.state_dict().items():
            scratch = live.clone()
            live.copy_(ema.shadow[name])
            ema.shadow[name].copy_(scratch)


@pytest.mark.parametrize("device", DEVICES)
def test_nothing_written_to_the_model_inside_average_weights_reaches_the_average(device: str) -> None:
    """DCGAN samples with the generator in training mode: its forward writes BatchNorm's running statistics and
    ``num_batches_tracked``, which hold the average inside the block."""
    model, ema, live, average = swapped_pair(device)
    model.train()
    with ema.average_weights(model):
        model(torch.randn(8, 16, device=device))  # train mode: BatchNorm statistics written
        assert not same(model.state_dict(), average)  # the writes landed in the model's copy...
    assert same(model.state_dict(), live) and same(ema.shadow, average)  # ...which was discarded

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    written = r"2 parameter\(s\) of the model were written inside the block \('0.weight'"
    with pytest.raises(RuntimeError, match=written), ema.average_weights(model):
        model[0].weight.grad = torch.ones_like(model[0].weight)
        model[3].bias.grad = torch.ones_like(model[3].bias)
        optimizer.step()  # an optimizer step inside the block: refused on exit, and undone
    assert same(model.state_dict(), live) and same(ema.shadow, average)

    scratch_swap(model, ema)  # the control: the swap before the fix, and the same forward
    model(torch.randn(8, 16, device=device))
    scratch_swap(model, ema)
    assert same(model.state_dict(), live)  # the live weights come back...
    assert not same(ema.shadow, average)  # ...but the forward's statistics became the average
    assert ema.shadow["1.num_batches_tracked"].item() == average["1.num_batches_tracked"].item() + 1


def swapped_pair(device: str = "cpu") -> tuple[nn.Module, EMA, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A model whose live weights differ from its EMA's average, and copies of both."""
    model = net(device)
    ema = EMA(model, decay=0.9)
    perturb(model, 1.0)
    ema.update(model)
    perturb(model, 1.0)
    return model, ema, cloned(model.state_dict()), cloned(ema.shadow)


def cloned(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in state.items()}


def same(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> bool:
    """Bit for bit, every name of ``expected``."""
    return all(torch.equal(state[k], v) for k, v in expected.items())


@pytest.mark.parametrize("error", [KeyError, KeyboardInterrupt])
def test_average_weights_restores_model_and_shadow_after_an_exception(error: type[BaseException]) -> None:
    model, ema, live, average = swapped_pair()
    with pytest.raises(error), ema.average_weights(model):
        raise error("boom")
    assert same(model.state_dict(), live) and same(ema.shadow, average) and not ema.swapped
    block = ema.average_weights(model)  # the control: a swap whose exit never runs leaves the average in the model
    block.__enter__()
    assert same(model.state_dict(), average) and not same(model.state_dict(), live)
    block.__exit__(None, None, None)


@pytest.mark.parametrize("device", DEVICES)
def test_inside_average_weights_update_and_copy_to_raise_and_the_live_weights_come_back(device: str) -> None:
    model, ema, live, average = swapped_pair(device)
    with ema.average_weights(model):
        assert ema.swapped
        with pytest.raises(
            RuntimeError, match=r"EMA.update inside EMA.average_weights: the model holds a copy of the average"
        ):
            ema.update(model)
        with pytest.raises(RuntimeError, match=r"EMA.copy_to\(model\) inside EMA.average_weights"):
            ema.copy_to()
    assert same(model.state_dict(), live) and same(ema.shadow, average)
    assert (ema.step, ema.num_updates) == (1, 1)

    with ema.average_weights(model):  # the control: the guard switched off, as before the fix
        ema._swap = None
        ema.update(model)  # accepted: averages the average (in the model) into itself
    assert (ema.step, ema.num_updates) == (2, 2) and same(ema.shadow, average)  # an update counted, nothing learnt


@pytest.mark.parametrize("device", DEVICES)
def test_inside_average_weights_shadow_and_state_dict_hold_the_average_apart_from_the_model(
    device: str, tmp_path
) -> None:
    model, ema, live, average = swapped_pair(device)
    with ema.average_weights(model):
        assert same(ema.shadow, average) and same(model.state_dict(), average)
        assert not any(shares_storage(ema.shadow[k], v) for k, v in model.state_dict().items())
        state = ema.state_dict()
        torch.save(state, tmp_path / "ema.pt")
    assert same(torch.load(tmp_path / "ema.pt", weights_only=True)["shadow"], average)
    assert same(model.state_dict(), live) and same(state["shadow"], average)  # still the average after the block

    scratch_swap(model, ema)  # the control: inside the swap before the fix, the shadow held the live weights
    assert same(ema.state_dict()["shadow"], live)
    scratch_swap(model, ema)


def test_load_state_dict_inside_average_weights_loads_the_average_and_the_live_weights_come_back() -> None:
    model, ema, live, _ = swapped_pair()
    other_model = net()
    other = EMA(other_model, decay=0.9)
    perturb(other_model, 1.0)
    other.update(other_model)
    loaded = cloned(other.shadow)
    with ema.average_weights(model):
        ema.load_state_dict(other.state_dict(), new_schedule=True)
        assert same(model.state_dict(), loaded)  # the block goes on with the loaded average
    assert same(model.state_dict(), live) and same(ema.shadow, loaded)

    with ema.average_weights(model):  # the control: the guard switched off
        ema._swap = None
        ema.load_state_dict(EMA(net()).state_dict(), new_schedule=True)
        assert not same(model.state_dict(), cloned(ema.shadow))  # the block goes on with the average before the load


@pytest.mark.parametrize("device", DEVICES)
def test_nested_average_weights_changes_nothing_and_restores_bit_exactly(device: str) -> None:
    model, ema, live, average = swapped_pair(device)
    with ema.average_weights(model):
        with MemoryProbe(device) as inner_memory, ema.average_weights(model) as inner:
            assert inner is model and same(model.state_dict(), average)
        assert ema.swapped and same(model.state_dict(), average)
    assert inner_memory.peak_bytes == 0  # no second backup
    assert same(model.state_dict(), live) and same(ema.shadow, average) and not ema.swapped
    with pytest.raises(KeyboardInterrupt), ema.average_weights(model), ema.average_weights(model):
        raise KeyboardInterrupt
    assert same(model.state_dict(), live) and same(ema.shadow, average) and not ema.swapped

    with pytest.raises(RuntimeError, match="written inside the block"), ema.average_weights(model):
        ema._swap = None  # the control: the guard switched off
        with MemoryProbe(device) as control, ema.average_weights(model):
            pass
    assert control.peak_bytes > 0  # a second backup, of the average the model already held...
    assert same(model.state_dict(), live) and same(ema.shadow, average)  # ...and its writes refused by the outer block


@pytest.mark.parametrize("device", DEVICES)
def test_export_is_a_new_module_holding_the_average(device: str, tmp_path) -> None:
    model, ema, live, average = swapped_pair(device)
    model.eval()  # the forward leaves the BatchNorm statistics as they are
    model(torch.randn(8, 16, device=device)).square().mean().backward()
    with MemoryProbe(device) as probe:
        exported = ema.export()
    assert probe.net_bytes == sum(t.numel() * t.element_size() for t in model.state_dict().values())  # no grads
    assert same(exported.state_dict(), average) and all(p.grad is None for p in exported.parameters())
    assert same(model.state_dict(), live) and same(ema.shadow, average)
    ours = [*model.parameters(), *model.buffers(), *ema.shadow.values()]
    assert not any(shares_storage(t, x) for t in exported.state_dict().values() for x in ours)
    torch.save(exported.state_dict(), tmp_path / "ema_model.pt")
    assert same(torch.load(tmp_path / "ema_model.pt", weights_only=True), average)

    model.train()
    assert not ema.export().training  # a copy for inference, in eval mode, whatever the model's mode

    with ema.average_weights(model) as swapped:
        inside = ema.export()
        kept = swapped  # the control: the module the block hands out, kept after it
    assert same(inside.state_dict(), average) and same(model.state_dict(), live)
    assert same(kept.state_dict(), live) and not same(kept.state_dict(), average)  # the swap did not last


def test_copy_to_state_round_trip_and_weights_only_load(tmp_path) -> None:
    model = net()
    ema = EMA(model, decay=0.8, warmup=True)
    for _ in range(5):
        perturb(model)
        ema.update(model)
    path = tmp_path / "ema.pt"
    torch.save(ema.state_dict(), path)
    restored = EMA(net(), decay=0.8, warmup=True)
    restored.load_state_dict(torch.load(path, weights_only=True))
    assert (restored.step, restored.num_updates) == (5, 5)
    assert all(torch.equal(restored.shadow[k], v) for k, v in ema.shadow.items())
    target = net()
    restored.copy_to(target)  # another instance: by state_dict name
    assert all(torch.equal(target.state_dict()[k], v) for k, v in ema.shadow.items())
    with pytest.raises(ValueError, match="cannot copy the EMA into this model"):
        restored.copy_to(nn.Linear(16, 32))


def test_load_state_dict_mismatch_is_a_clear_error() -> None:
    ema = EMA(net())
    state = ema.state_dict()
    with pytest.raises(ValueError, match=r"missing \['0.bias'\]"):
        ema.load_state_dict({**state, "shadow": {k: v for k, v in state["shadow"].items() if k != "0.bias"}})
    with pytest.raises(ValueError, match=r"'0.weight' has shape \(2, 2\), the model's is \(32, 16\)"):
        ema.load_state_dict({**state, "shadow": {**state["shadow"], "0.weight": torch.zeros(2, 2)}})
    with pytest.raises(ValueError, match="'shadow' mapping"):
        ema.load_state_dict({})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"decay": 1.0}, "decay must be in"),
        ({"decay": -0.1}, "decay must be in"),
        ({"update_every": 0}, "update_every"),
        ({"start_step": -1}, "start_step"),
        ({"warmup_power": 0}, "warmup_power"),
        ({"shadow_dtype": torch.int32}, "shadow_dtype"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EMA(net(), **kwargs)


def test_other_model_and_moved_model_are_clear_errors() -> None:
    model = net()
    ema = EMA(model)
    with pytest.raises(ValueError, match="another model"):
        ema.update(net())
    model.to(torch.float64)
    with pytest.raises(RuntimeError, match=r"moved from cpu/torch\.float32"):
        ema.update(model)


def test_shadow_on_another_device_or_dtype_stages_once() -> None:
    model = net()
    ema = EMA(model, shadow_dtype=torch.float64)
    ema.update(model)
    with CopyAudit() as audit:
        ema.update(model)
    assert audit.bytes_allocated == 0
    assert ema.shadow["0.weight"].dtype == torch.float64
    live = {k: v.clone() for k, v in model.state_dict().items()}
    with ema.average_weights(model):
        pass
    assert all(torch.equal(v, live[k]) for k, v in model.state_dict().items())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_update_has_no_host_sync_and_a_cpu_shadow_works() -> None:
    model = net("cuda")
    ema = EMA(model, decay=0.99)
    ema.update(model)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            ema.update(model)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    host = EMA(model, decay=0.5, device="cpu")
    perturb(model)
    host.update(model)
    assert host.shadow["0.weight"].device.type == "cpu"
    live = {k: v.clone() for k, v in model.state_dict().items()}
    with host.average_weights(model):
        torch.testing.assert_close(model[0].weight.cpu(), host.shadow["0.weight"])
    assert all(torch.equal(v, live[k]) for k, v in model.state_dict().items())


def test_integer_buffers_are_copied_where_averaged_model_freezes_them() -> None:
    """AveragedModel (Lightning's EMAWeightAveraging path) averages num_batches_tracked as a float and
    truncates it back into int64: it stays at its first value. Ours copies it."""
    model = net()
    ema = EMA(model, decay=0.999)
    peer = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999), use_buffers=True)
    model.train()
    for _ in range(100):
        model(torch.randn(8, 16))
        ema.update(model)
        peer.update_parameters(model)
    assert model[1].num_batches_tracked.item() == 100
    assert ema.shadow["1.num_batches_tracked"].item() == 100
    assert peer.module[1].num_batches_tracked.item() == 1  # the control: frozen by truncation


def test_initial_share_and_a_warning_when_a_mostly_initial_average_is_first_used() -> None:
    """The default ramp's first decay is 0: the average never keeps the weights it was built from. A constant 0.999
    over a 300-step run keeps 74% of them (a DCGAN's EMA samples collapsed so)."""
    model = net()
    ramped, constant = EMA(model, decay=0.999), EMA(model, decay=0.999, warmup=False)
    assert ramped.warmup and ramped.initial_share == constant.initial_share == 1.0
    for _ in range(300):
        perturb(model, 0.01)
        ramped.update(model)
        constant.update(model)
    assert ramped.initial_share == 0.0
    assert constant.initial_share == pytest.approx(0.999**300) and 0.74 < constant.initial_share < 0.75
    mostly_initial = r"the average is still 74% the weights it started from after 300 updates"
    with pytest.warns(RuntimeWarning, match=mostly_initial), constant.average_weights(model):
        pass
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        constant.export()  # once per EMA
        with ramped.average_weights(model):
            pass
        ramped.copy_to(net())


def user_net(device: str = "cpu") -> nn.Module:
    """A user's network: BatchNorm, Dropout, and an output layer tied to the input layer."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 16))
    model[4].weight = model[0].weight
    return model.to(device)


def train_a_little(model: nn.Module, ema: EMA, steps: int = 3) -> None:
    """A few steps of a training loop that changes every averaged tensor: parameters and BatchNorm statistics."""
    model.train()
    for _ in range(steps):
        perturb(model)
        with torch.no_grad():
            model(torch.randn(8, 16, device=next(model.parameters()).device))
        ema.update(model)


COPIES = {"pickle": lambda ema: pickle.loads(pickle.dumps(ema)), "deepcopy": copy.deepcopy}


@pytest.mark.parametrize("shadow_dtype", [None, torch.float64], ids=["shadow beside the model", "staged shadow"])
@pytest.mark.parametrize("how", list(COPIES))
@pytest.mark.parametrize("device", DEVICES)
def test_a_pickled_or_deep_copied_ema_is_independent_and_tracks_no_model_until_given_one(
    device: str, how: str, shadow_dtype: torch.dtype | None
) -> None:
    model = user_net(device)
    ema = EMA(model, decay=0.9, shadow_dtype=shadow_dtype)
    train_a_little(model, ema)
    copied = COPIES[how](ema)

    # The same average and counters, in storage of its own; tied tensors still one.
    assert same(copied.shadow, ema.shadow)
    assert (copied.step, copied.num_updates) == (ema.step, ema.num_updates) == (3, 3)
    theirs = [*ema.shadow.values(), *model.state_dict().values()]
    assert not any(shares_storage(t, x) for t in copied.shadow.values() for x in theirs)
    assert copied.shadow["0.weight"] is copied.shadow["4.weight"]

    # No model travels: what needs one says so, what does not works.
    assert copied.live_model is None and ema.live_model is model
    for needs_a_model in (copied.update, copied.copy_to, copied.export, lambda: copied.average_weights().__enter__()):
        with pytest.raises(RuntimeError, match=r"is a copy .* and tracks no model yet: pass the model"):
            needs_a_model()
    fresh = user_net(device)
    copied.copy_to(fresh)  # another model, by name
    assert same(fresh.state_dict(), {k: v.to(fresh.state_dict()[k].dtype) for k, v in ema.shadow.items()})
    assert copied.state_dict()["shadow"]["0.weight"] is copied.shadow["0.weight"]

    # Given the model, it averages as the original does, and an update of either never reaches the other.
    perturb(model)
    ema.update(model)
    copied.update(model)  # tracks the model from here on
    assert copied.live_model is model and same(copied.shadow, ema.shadow)
    before = cloned(ema.shadow)
    perturb(model)
    copied.update(model)
    assert same(ema.shadow, before) and not same(copied.shadow, before)
    after = cloned(copied.shadow)
    ema.update(model)
    assert same(copied.shadow, after) and not same(ema.shadow, before)
    live = cloned(model.state_dict())
    with copied.average_weights(model):
        assert same(model.state_dict(), {k: v.to(model.state_dict()[k].dtype) for k, v in after.items()})
    assert same(model.state_dict(), live)

    # The controls: the EMA's state as it is (weak references to the buffers' owners) is what pickle refused; a copy
    # that shares the shadow's storage (copy.copy) writes into the original's average.
    with pytest.raises(TypeError, match="weakref"):
        pickle.dumps(ema.__dict__)
    shallow = copy.copy(ema)
    assert all(shares_storage(t, ema.shadow[k]) for k, t in shallow.shadow.items())
    before = cloned(ema.shadow)
    perturb(model)
    shallow.update(model)
    assert not same(ema.shadow, before)


def test_a_copy_tracks_only_a_model_with_the_shadows_names_shapes_and_ties() -> None:
    model = user_net()
    ema = EMA(model)
    copied = copy.deepcopy(ema)
    with pytest.raises(ValueError, match="another model"):
        ema.track(user_net())  # the original tracks its model already
    ema.track(model)  # the same one: accepted
    with pytest.raises(
        ValueError, match=r"cannot track the model: '0.weight' is \(16, 16\) torch.float32 in the shadow, "
    ):
        copied.track(nn.Sequential(nn.Linear(16, 8)))
    untied = user_net()
    untied[4].weight = nn.Parameter(untied[0].weight.detach().clone())
    with pytest.raises(ValueError, match=r"'4\.weight' is tied to another tensor in the shadow, not in the model"):
        copied.track(untied)
    with pytest.raises(
        ValueError, match=r"the shadow has \['1.bias', '1.num_batches_tracked', .*\], the model has not"
    ):
        copied.track(nn.Sequential(nn.Linear(16, 16)))
    assert copied.live_model is None  # a refused model is not tracked
    with pytest.raises(ValueError, match=r"the model ties \['4.weight'\] to other tensors, the shadow does not"):
        copy.deepcopy(EMA(untied)).track(model)
    copied.track(model)
    assert copied.live_model is model


def test_a_copy_taken_inside_average_weights_holds_the_average_and_is_not_swapped() -> None:
    model, ema, live, average = swapped_pair()
    with ema.average_weights(model):
        copied = copy.deepcopy(ema)
        pickled = pickle.loads(pickle.dumps(ema))
    for other in (copied, pickled):
        assert not other.swapped and same(other.shadow, average)
        other.update(model)  # the live weights, back after the block
        assert not same(other.shadow, average)
    assert same(model.state_dict(), live) and same(ema.shadow, average)
