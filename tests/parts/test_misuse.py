"""Misuse refused in one line, nothing overwritten: the target updates' arguments reversed (stable-baselines3's
``polyak_update(params, target_params)`` order) or given as ``.parameters()``, and wrong types, out-of-range values
and modules with nothing to average across ``EMA``, ``PowerEMA``, ``ReplayBuffer``, ``FrameReplayBuffer`` and the
target updates. Each refusal is checked for its type, its words and its single line; the calls that must keep working
(CleanRL's two trainable networks, numpy numbers) are checked beside them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import copy_correct.target as target_module
from copy_correct import EMA, FrameReplayBuffer, PowerEMA, ReplayBuffer, hard_update, make_target, soft_update


def qnet(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))


def snapshot(model: nn.Module) -> dict[str, tuple[torch.Tensor, int]]:
    """Every tensor's bits (a copy) and version counter: equal snapshots mean nothing was written."""
    return {name: (t.detach().clone(), t._version) for name, t in model.state_dict(keep_vars=True).items()}


def assert_unchanged(model: nn.Module, before: dict[str, tuple[torch.Tensor, int]]) -> None:
    for name, t in model.state_dict(keep_vars=True).items():
        saved, version = before[name]
        assert t._version == version, name
        assert torch.equal(t.detach().reshape(-1).view(torch.uint8), saved.reshape(-1).view(torch.uint8)), name


def refused(call: Callable[[], Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match) as caught:
        call()
    assert "\n" not in str(caught.value)


REVERSED = [
    pytest.param(lambda online, target: hard_update(online, target), "hard_update", id="hard_update"),
    pytest.param(lambda online, target: soft_update(online, target, 0.005), "soft_update", id="soft_update"),
]


@pytest.mark.parametrize(("call", "name"), REVERSED)
def test_stable_baselines3_order_with_a_make_target_target_is_refused_and_writes_nothing(
    call: Callable[[nn.Module, nn.Module], None], name: str
) -> None:
    online = qnet()
    target = make_target(online)
    torch.optim.SGD(online.parameters(), lr=0.1).step()  # trained: online and target differ
    with torch.no_grad():
        next(online.parameters()).add_(1.0)
    online_before, target_before = snapshot(online), snapshot(target)
    refused(
        lambda: call(online, target),
        ValueError,
        rf"^{name}\(target, online\): target requires grad and online is frozen .* the arguments look reversed; pass "
        r"the network you train second \(stable-baselines3's polyak_update takes them the other way round",
    )
    assert_unchanged(online, online_before)
    assert_unchanged(target, target_before)
    call(target, online)  # the right order still works after a refusal
    assert torch.equal(next(target.parameters()), next(online.parameters())) == (name == "hard_update")


@pytest.mark.parametrize(("call", "name"), REVERSED)
def test_control_the_reversed_call_overwrites_the_trained_network_when_nothing_tells_the_order(
    call: Callable[[nn.Module, nn.Module], None], name: str
) -> None:
    """The control: with a trainable second network (nothing to tell the order by) the same reversed call goes
    through and writes into the network being trained, so the test above can fail."""
    online = qnet()
    second = qnet(seed=1)
    online_before = snapshot(online)
    call(online, second)
    with pytest.raises(AssertionError):
        assert_unchanged(online, online_before)


def test_cleanrl_two_trainable_networks_keep_working() -> None:
    """CleanRL's DQN: ``target_network = QNetwork(envs)`` (requires grad) loaded from ``q_network``."""
    q_network = qnet()
    target_network = qnet(seed=1)
    target_network.load_state_dict(q_network.state_dict())
    assert all(p.requires_grad for p in target_network.parameters())
    torch.optim.SGD(q_network.parameters(), lr=0.1).step()
    with torch.no_grad():
        next(q_network.parameters()).add_(1.0)
    online = q_network.state_dict()
    expected = {k: t.lerp(online[k], 0.25) if t.is_floating_point() else online[k].clone()
                for k, t in target_network.state_dict().items()}  # fmt: skip
    soft_update(target_network, q_network, 0.25)
    for k, t in target_network.state_dict().items():
        torch.testing.assert_close(t, expected[k], rtol=0, atol=0)
    hard_update(target_network, q_network)
    assert all(torch.equal(t, q_network.state_dict()[k]) for k, t in target_network.state_dict().items())


def test_a_partly_frozen_online_network_is_not_taken_for_a_target() -> None:
    """Fine-tuning with a frozen backbone: some online parameters train, so the order is not reversed."""
    online = qnet()
    online[0].requires_grad_(False)
    target = qnet(seed=1)
    hard_update(target, online)
    assert torch.equal(target[3].weight, online[3].weight)


PARAMETER_ITERABLES = [
    pytest.param(lambda o, t: hard_update(t.parameters(), o.parameters()), "target", "generator", id="sb3-parameters"),
    pytest.param(lambda o, t: soft_update(t, o.parameters(), 0.005), "online", "generator", id="soft-online-generator"),
    pytest.param(lambda o, t: hard_update(list(t.parameters()), o), "target", "list", id="list-of-tensors"),
    pytest.param(lambda o, t: hard_update(t, o.state_dict()), "online", "OrderedDict", id="state_dict"),
    pytest.param(lambda o, t: make_target(o.parameters()), "online", "generator", id="make_target"),
    pytest.param(lambda o, t: make_target(o, into=list(t.parameters())), "into", "list", id="make_target-into"),
    pytest.param(lambda o, t: EMA(o.parameters()), "model", "generator", id="EMA"),
    pytest.param(lambda o, t: PowerEMA(list(o.parameters())), "model", "list", id="PowerEMA"),
]


@pytest.mark.parametrize(("call", "name", "kind"), PARAMETER_ITERABLES)
def test_parameter_iterables_where_a_module_goes_are_refused_naming_the_argument(
    call: Callable[[nn.Module, nn.Module], Any], name: str, kind: str
) -> None:
    """Not supported: a list of parameters has no buffers and no names to pair tensors by."""
    online = qnet()
    target = make_target(online)
    torch.optim.SGD(online.parameters(), lr=0.1).step()
    with torch.no_grad():
        next(online.parameters()).add_(1.0)
    online_before, target_before = snapshot(online), snapshot(target)
    refused(
        lambda: call(online, target),
        TypeError,
        rf"^{name} must be an nn\.Module, got {kind}: pass the module itself, not its parameters\(\) or state_dict",
    )
    assert_unchanged(online, online_before)
    assert_unchanged(target, target_before)


LINEAR = nn.Linear(2, 2)
INTERVAL = r"\(0, 0\.2887\)"

MISUSES = [
    # the target updates
    pytest.param(lambda: soft_update(make_target(LINEAR), LINEAR, "0.005"), TypeError,
                 r"^tau must be a number in \(0, 1\], got str '0\.005'$", id="tau-str"),
    pytest.param(lambda: soft_update(make_target(LINEAR), LINEAR, True), TypeError,
                 r"^tau must be a number in \(0, 1\], got bool True$", id="tau-bool"),
    pytest.param(lambda: soft_update(make_target(LINEAR), LINEAR, 0), ValueError,
                 r"^tau must be in \(0, 1\], got 0$", id="tau-0"),
    pytest.param(lambda: soft_update(make_target(LINEAR), LINEAR, float("nan")), ValueError,
                 r"^tau must be in \(0, 1\], got nan$", id="tau-nan"),
    pytest.param(lambda: hard_update(make_target(LINEAR), LINEAR, skip_nonfinite="no"), TypeError,
                 r"^skip_nonfinite must be True or False, got str 'no'$", id="skip_nonfinite-str"),
    pytest.param(lambda: hard_update(nn.ReLU(), nn.ReLU()), ValueError,
                 r"^target and online \(ReLU\) have no floating parameters or buffers: nothing to update$",
                 id="target-nothing-floating"),
    # EMA
    pytest.param(lambda: EMA(LINEAR, decay="0.99"), TypeError,
                 r"^decay must be a number in \[0, 1\), got str '0\.99'$", id="ema-decay-str"),
    pytest.param(lambda: EMA(LINEAR, decay=1.0), ValueError, r"^decay must be in \[0, 1\), got 1\.0$",
                 id="ema-decay-1"),
    pytest.param(lambda: EMA(LINEAR, warmup="no"), ValueError,
                 r"^warmup must be True, False or one of \('none', 'copy', 'power', 'ratio', 'half_life'\), got 'no'$",
                 id="ema-warmup"),
    pytest.param(lambda: EMA(LINEAR, warmup=1), TypeError, r"^warmup must be True, False or one of .*, got int 1$",
                 id="ema-warmup-type"),
    pytest.param(lambda: EMA(LINEAR, min_decay=0.5, decay=0.4), ValueError,
                 r"^min_decay \(0.5\) must not exceed decay \(0.4\)$", id="ema-min_decay"),
    pytest.param(lambda: EMA(LINEAR, warmup_gamma=0), ValueError, r"^warmup_gamma must be in \(0, inf\), got 0$",
                 id="ema-warmup_gamma"),
    pytest.param(lambda: EMA(LINEAR, half_life=0), ValueError, r"^half_life must be in \(0, inf\), got 0$",
                 id="ema-half_life"),
    pytest.param(lambda: EMA(LINEAR, trainable_only="yes"), TypeError, r"^trainable_only must be True or False",
                 id="ema-trainable_only"),
    pytest.param(lambda: EMA(LINEAR, warmup_offset=-1), ValueError,
                 r"^warmup_offset must be a finite number > -1, got -1$", id="ema-warmup_offset"),
    pytest.param(lambda: EMA(LINEAR, warmup_power=0), ValueError, r"^warmup_power must be in \(0, inf\), got 0$",
                 id="ema-warmup_power"),
    pytest.param(lambda: EMA(LINEAR, update_every=True), TypeError,
                 r"^update_every must be an integer >= 1, got bool True$", id="ema-update_every-bool"),
    pytest.param(lambda: EMA(LINEAR, update_every=2.0), TypeError,
                 r"^update_every must be an integer >= 1, got float 2\.0$", id="ema-update_every-float"),
    pytest.param(lambda: EMA(LINEAR, start_step=-1), ValueError, r"^start_step must be >= 0, got -1$",
                 id="ema-start_step"),
    pytest.param(lambda: EMA(LINEAR, include_buffers=None), TypeError,
                 r"^include_buffers must be True or False, got NoneType None$", id="ema-include_buffers"),
    pytest.param(lambda: EMA(LINEAR, shadow_dtype="float32"), TypeError,
                 r"^shadow_dtype must be a floating torch\.dtype \(torch\.float32\) or None, got str 'float32'$",
                 id="ema-shadow_dtype-str"),
    pytest.param(lambda: EMA(LINEAR, shadow_dtype=torch.int64), ValueError,
                 r"^shadow_dtype must be a floating dtype, got torch\.int64$", id="ema-shadow_dtype-int"),
    pytest.param(lambda: EMA(LINEAR, device="gpu"), ValueError,
                 r"^device must be a torch\.device or a device string such as 'cpu' or 'cuda:0', got 'gpu'$",
                 id="ema-device"),
    pytest.param(lambda: EMA(LINEAR, skip_nonfinite=1), TypeError,
                 r"^skip_nonfinite must be True or False, got int 1$", id="ema-skip_nonfinite"),
    pytest.param(lambda: EMA(nn.ReLU()), ValueError,
                 r"^model \(ReLU\) has no floating parameters or buffers: nothing to average$", id="ema-relu"),
    pytest.param(lambda: EMA(nn.BatchNorm1d(2, affine=False), include_buffers=False), ValueError,
                 r"^model \(BatchNorm1d\) has no floating parameters \(include_buffers=False\): nothing to average$",
                 id="ema-buffers-only"),
    # PowerEMA
    pytest.param(lambda: PowerEMA(LINEAR, sigma_rels=0.05), TypeError,
                 rf"^sigma_rels must be a sequence of numbers in {INTERVAL}, one per profile, such as "
                 r"\(0\.05, 0\.10\), got float 0\.05$", id="power-sigma_rels-number"),
    pytest.param(lambda: PowerEMA(LINEAR, sigma_rels="0.05"), TypeError,
                 r"^sigma_rels must be a sequence of numbers .* got str '0\.05'$", id="power-sigma_rels-str"),
    pytest.param(lambda: PowerEMA(LINEAR, sigma_rels=(0.05, "0.1")), TypeError,
                 rf"^sigma_rels\[1\] must be a number in {INTERVAL}, got str '0\.1'$", id="power-sigma_rels-item"),
    pytest.param(lambda: PowerEMA(LINEAR, sigma_rels=(0.05, 0.5)), ValueError,
                 rf"^sigma_rel must be a number in {INTERVAL} .*got 0\.5$", id="power-sigma_rels-range"),
    pytest.param(lambda: PowerEMA(LINEAR, sigma_rels=()), ValueError,
                 r"^sigma_rels must be one or more distinct values, got \(\)$", id="power-sigma_rels-empty"),
    pytest.param(lambda: PowerEMA(LINEAR, update_every="2"), TypeError,
                 r"^update_every must be an integer >= 1, got str '2'$", id="power-update_every"),
    pytest.param(lambda: PowerEMA(LINEAR, snapshot_every=True, snapshot_dir="."), TypeError,
                 r"^snapshot_every must be an integer >= 1, got bool True$", id="power-snapshot_every"),
    pytest.param(lambda: PowerEMA(LINEAR, snapshot_every=10, snapshot_dir=3), TypeError,
                 r"^snapshot_dir must be a path \(str or os\.PathLike\) or None, got int 3$", id="power-snapshot_dir"),
    pytest.param(lambda: PowerEMA(LINEAR, shadow_dtype="bfloat16"), TypeError,
                 r"^shadow_dtype must be a floating torch\.dtype", id="power-shadow_dtype"),
    pytest.param(lambda: PowerEMA(LINEAR, include_buffers="yes"), TypeError,
                 r"^include_buffers must be True or False, got str 'yes'$", id="power-include_buffers"),
    pytest.param(lambda: PowerEMA(nn.ReLU()), ValueError,
                 r"^model \(ReLU\) has no floating parameters or buffers: nothing to average$", id="power-relu"),
    # ReplayBuffer
    pytest.param(lambda: ReplayBuffer("1000", (4,)), TypeError, r"^capacity must be an integer >= 1, got str '1000'$",
                 id="replay-capacity-str"),
    pytest.param(lambda: ReplayBuffer(1000.0, (4,)), TypeError,
                 r"^capacity must be an integer >= 1, got float 1000\.0$", id="replay-capacity-float"),
    pytest.param(lambda: ReplayBuffer(True, (4,)), TypeError, r"^capacity must be an integer >= 1, got bool True$",
                 id="replay-capacity-bool"),
    pytest.param(lambda: ReplayBuffer(8, (4,), num_envs="2", autoreset_mode="next_step"), TypeError,
                 r"^num_envs must be None or an integer >= 1, got str '2'$", id="replay-num_envs"),
    pytest.param(lambda: ReplayBuffer(8, (True, 2)), TypeError,
                 r"^obs must be a gymnasium space or a shape \(a sequence of ints\), got \(True, 2\)$",
                 id="replay-shape-bool"),
    pytest.param(lambda: ReplayBuffer(8, (4,), action="2"), TypeError,
                 r"^action must be a gymnasium space or a shape \(a sequence of ints\), got '2'$", id="replay-action"),
    pytest.param(lambda: ReplayBuffer(8, (4,), device=0.0), TypeError,
                 r"^device must be a torch\.device or a device string such as 'cpu' or 'cuda:0', got float 0\.0$",
                 id="replay-device"),
    # FrameReplayBuffer
    pytest.param(lambda: FrameReplayBuffer("1000", (4, 8, 8)), TypeError,
                 r"^capacity must be an integer >= 1, got str '1000'$", id="frames-capacity"),
    pytest.param(lambda: FrameReplayBuffer(100, (4, 8, 8), num_envs=True, autoreset_mode="next_step"), TypeError,
                 r"^num_envs must be None or an integer >= 1, got bool True$", id="frames-num_envs"),
    pytest.param(lambda: FrameReplayBuffer(100, (4, 8, 8), padding="edge"), ValueError,
                 r"^padding must be one of reset, zero, got 'edge'$", id="frames-padding"),
]  # fmt: skip


@pytest.mark.parametrize(("call", "error", "match"), MISUSES)
def test_misuse_is_refused_in_one_line_naming_the_argument(
    call: Callable[[], Any], error: type[Exception], match: str
) -> None:
    refused(call, error, match)


def filled_replay() -> ReplayBuffer:
    buffer = ReplayBuffer(8, (4,))
    buffer.add(np.zeros(4, np.float32), 1, 0.5, np.ones(4, np.float32), False)
    return buffer


def filled_frames() -> FrameReplayBuffer:
    buffer = FrameReplayBuffer(16, (2, 3, 3))
    first, second = np.zeros((2, 3, 3), np.uint8), np.ones((2, 3, 3), np.uint8)
    second[0] = 0
    buffer.add(first, 0, 1.0, second, False)
    return buffer


SAMPLES = [
    pytest.param("64", TypeError, r"^batch_size must be an integer >= 1, got str '64'$", id="batch_size-str"),
    pytest.param(True, TypeError, r"^batch_size must be an integer >= 1, got bool True$", id="batch_size-bool"),
    pytest.param(0, ValueError, r"^batch_size must be >= 1, got 0$", id="batch_size-0"),
]


@pytest.mark.parametrize("make", [filled_replay, filled_frames], ids=["ReplayBuffer", "FrameReplayBuffer"])
@pytest.mark.parametrize(("batch_size", "error", "match"), SAMPLES)
def test_sample_refuses_a_batch_size_that_is_not_a_positive_integer(
    make: Callable[[], Any], batch_size: Any, error: type[Exception], match: str
) -> None:
    buffer = make()
    refused(lambda: buffer.sample(batch_size), error, match)
    refused(
        lambda: buffer.sample(2, generator=3), TypeError, r"^generator must be a torch\.Generator or None, got int 3$"
    )
    assert buffer.sample(np.int64(2))["reward"].shape == (2,)  # numpy integers are integers


def test_numpy_numbers_and_int_tau_are_taken() -> None:
    """Numbers are numbers whatever their type, bools aside: numpy's are taken, and ``tau=1`` is a hard update."""
    online = qnet()
    target = make_target(online)
    with torch.no_grad():
        next(online.parameters()).add_(1.0)
    soft_update(target, online, 1)
    assert torch.equal(next(target.parameters()), next(online.parameters()))
    soft_update(target, online, np.float32(0.5), skip_nonfinite=np.bool_(False))
    assert EMA(online, decay=np.float64(0.9), update_every=np.int64(2)).update_every == 2
    assert PowerEMA(online, sigma_rels=np.array([0.05, 0.1])).sigma_rels == (0.05, 0.1)
    assert ReplayBuffer(np.int64(8), (np.int64(4),), num_envs=np.int32(2), autoreset_mode="next_step").capacity == 8
    assert EMA(nn.BatchNorm1d(2, affine=False)).shadow  # floating buffers alone are something to average


def test_a_refused_reversed_pair_builds_no_lists() -> None:
    """The order is checked before a pair's lists are built: a refused call leaves nothing cached for its pair."""
    online = qnet()
    target = make_target(online)
    with pytest.raises(ValueError, match="look reversed"):
        hard_update(online, target)
    assert online not in target_module._CACHE
    hard_update(target, online)
    assert target_module._CACHE[target].online() is online
