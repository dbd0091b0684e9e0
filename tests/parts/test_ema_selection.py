"""Which tensors an average keeps (``copy_correct.averages.selection``): ``trainable_only`` averages a LoRA adapter
without a second copy of its frozen base (the shadow's bytes measured against the adapters' own), ``exclude`` leaves
out names by prefix or by a function; the tensors left out hold no shadow, and ``average_weights``, ``module`` and
``export`` give their live values. Each test's control is the same average without the selection."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

from copy_correct import EMA, PowerEMA
from copy_correct.probes import MemoryProbe, shares_storage
from tests.conftest import DEVICES


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable low-rank update ``B @ A`` (LoRA, Hu et al. 2021)."""

    def __init__(self, base: nn.Linear, rank: int) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features) * 0.01)
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.lora_a.T @ self.lora_b.T


def adapted(device: str = "cpu") -> nn.Module:
    """A frozen MLP with BatchNorm, LoRA on both linears, and a trainable head with its own BatchNorm."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 64)).requires_grad_(False)
    base[0], base[3] = LoRALinear(base[0], 4), LoRALinear(base[3], 4)
    return nn.Sequential(base, nn.Linear(64, 8), nn.BatchNorm1d(8)).to(device)


def trained(model: nn.Module, steps: int = 3) -> None:
    """A few optimizer steps of the parameters that require grad, in training mode (BatchNorm statistics move)."""
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model.train()
    device = next(model.parameters()).device
    for _ in range(steps):
        model(torch.randn(16, 64, device=device)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


ADAPTERS = ["0.0.lora_a", "0.0.lora_b", "0.3.lora_a", "0.3.lora_b", "1.weight", "1.bias"]
HEAD_NORM = ["2.weight", "2.bias", "2.running_mean", "2.running_var", "2.num_batches_tracked"]


@pytest.mark.parametrize("device", DEVICES)
def test_trainable_only_keeps_the_adapters_and_their_modules_buffers_and_its_memory_is_theirs(device: str) -> None:
    model = adapted(device)
    with MemoryProbe(device) as ours:
        ema = EMA(model, trainable_only=True)
    assert sorted(ema.shadow) == sorted(ADAPTERS + HEAD_NORM)  # the frozen BatchNorm's statistics are not averaged
    state = model.state_dict()
    assert ours.net_bytes == sum(state[name].numel() * state[name].element_size() for name in ADAPTERS + HEAD_NORM)

    with MemoryProbe(device) as control:  # the control: a shadow of everything, the frozen base's copy included
        full = EMA(model)
    assert control.net_bytes == sum(t.numel() * t.element_size() for t in state.values())
    assert sorted(full.shadow) == sorted(state)


def test_a_parameter_frozen_or_unfrozen_later_keeps_the_choice_made_at_construction() -> None:
    model = adapted()
    ema = EMA(model, decay=0.5, warmup=False, trainable_only=True)
    before = model[1].weight.detach().clone()
    model[0][0].base.weight.requires_grad_(True)  # unfrozen after the EMA was built: still not averaged
    trained(model)
    model[1].weight.requires_grad_(False)  # frozen after: still averaged
    ema.update(model)
    assert "0.0.base.weight" not in ema.shadow
    assert torch.equal(ema.shadow["1.weight"], before.lerp(model[1].weight.detach(), 0.5))
    assert not torch.equal(ema.shadow["1.weight"], before)  # the control: the weights moved, and so did the average


def test_a_new_trainable_tensor_is_a_change_of_the_model_and_a_new_frozen_one_is_not() -> None:
    model = adapted()
    ema = EMA(model, trainable_only=True)
    model.add_module("frozen_extra", nn.Linear(2, 2).requires_grad_(False))
    ema.update(model)  # not what the rule keeps: no shadow, no refusal
    model.add_module("new_head", nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match=r"'new_head\.weight' added"):
        ema.update(model)


def test_exclude_by_prefix_and_by_function_leaves_those_tensors_out() -> None:
    model = adapted()
    by_prefix = EMA(model, exclude=("0.",))
    assert sorted(by_prefix.shadow) == sorted(["1.weight", "1.bias", *HEAD_NORM])
    by_function = EMA(model, exclude=lambda name, tensor: tensor.dim() < 2)  # no biases, no BatchNorm statistics
    assert all(model.state_dict()[name].dim() >= 2 for name in by_function.shadow)
    assert "0.0.base.weight" in by_function.shadow and "1.bias" not in by_function.shadow
    assert "0.0.base.weight" in EMA(model).shadow and "1.bias" in EMA(model).shadow  # the control: kept without


@pytest.mark.parametrize("exclude", ["head.", 3, ("head.", 4), ("",)])
def test_an_exclude_that_is_not_prefixes_or_a_function_is_refused_in_one_line(exclude: object) -> None:
    with pytest.raises(TypeError, match="exclude must be a tuple of state_dict name prefixes") as refused:
        EMA(adapted(), exclude=exclude)
    assert "\n" not in str(refused.value)
    if exclude == "head.":
        assert "('head.',)" in str(refused.value)


def test_nothing_left_to_average_is_refused_naming_the_rule() -> None:
    model = adapted().requires_grad_(False)
    with pytest.raises(ValueError, match="no floating trainable parameters or buffers"):
        EMA(model, trainable_only=True)


@pytest.mark.parametrize("device", DEVICES)
def test_average_weights_module_and_export_give_the_live_values_of_what_is_left_out(device: str) -> None:
    model = adapted(device)
    ema = EMA(model, decay=0.5, warmup=False, trainable_only=True)
    trained(model)
    model[0][0].base.weight.data.add_(1.0)  # a left-out tensor that changed since: its live values are given
    ema.update(model)
    live = {name: t.clone() for name, t in model.state_dict().items()}
    frozen = "0.0.base.weight"
    with ema.average_weights(model):
        inside = model.state_dict()
        assert torch.equal(inside[frozen], live[frozen])
        assert torch.equal(inside["1.weight"], ema.shadow["1.weight"])
        assert not torch.equal(inside["1.weight"], live["1.weight"])  # the control: an averaged one is swapped
    average = ema.module.state_dict(keep_vars=True)
    assert torch.equal(average[frozen], live[frozen]) and shares_storage(average[frozen], model[0][0].base.weight)
    assert not average[frozen].requires_grad and average[frozen] is not model[0][0].base.weight
    assert shares_storage(average["1.weight"], ema.shadow["1.weight"])
    exported = ema.export().state_dict()
    assert torch.equal(exported[frozen], live[frozen]) and torch.equal(exported["1.weight"], ema.shadow["1.weight"])


def test_power_ema_profiles_and_snapshots_keep_only_the_chosen_tensors() -> None:
    model = adapted()
    power = PowerEMA(model, trainable_only=True, exclude=("2.",))
    trained(model)
    power.update(model)
    assert all(sorted(profile) == sorted(ADAPTERS) for profile in power.profiles)
    assert sorted(power.snapshot()["profiles"][0]) == sorted(ADAPTERS)
    assert len(PowerEMA(model).profiles[0]) == len(model.state_dict())  # the control


def test_a_copy_keeps_the_choice_and_tracks_the_model_again() -> None:
    model = adapted()
    ema = EMA(model, trainable_only=True)
    copied = pickle.loads(pickle.dumps(ema))
    copied.track(model)
    copied.update(model)
    assert sorted(copied.shadow) == sorted(ema.shadow)
