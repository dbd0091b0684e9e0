"""``EMA.update_bn``: the average's BatchNorm statistics recomputed by forward passes of the averaged weights, written
into the shadow, bit for bit what ``torch.optim.swa_utils.update_bn`` gives a copy of the average, with the live
model untouched. Controls: the statistics as averaged (not those of the averaged weights), ``swa_utils.update_bn`` run
on the live model (which it rewrites)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import update_bn
from torch.utils.data import DataLoader, TensorDataset

from copy_correct import EMA
from tests.conftest import DEVICES


def net(device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 4))
    return model.to(device)


def loader(device: str = "cpu", n: int = 96) -> DataLoader:
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 8, generator=generator) * 2 + 1, torch.randn(n, 4, generator=generator)
    return DataLoader(TensorDataset(x.to(device), y.to(device)), batch_size=16)


def trained_with_average(device: str) -> tuple[nn.Module, EMA]:
    """Twenty SGD steps with the EMA updated after each: the live statistics and weights move apart from the
    average's."""
    model = net(device)
    ema = EMA(model, decay=0.9, warmup=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    model.train()
    for step in range(20):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step)).to(device)
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        ema.update(model)
    return model, ema


def state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in module.state_dict().items()}


@pytest.mark.parametrize("device", DEVICES)
def test_the_statistics_are_swa_utils_on_a_copy_of_the_average_and_the_live_model_is_untouched(device: str) -> None:
    model, ema = trained_with_average(device)
    live, averaged = state(model), {name: t.clone() for name, t in ema.shadow.items()}
    reference = ema.export()
    update_bn(loader(device), reference)  # torch's recomputation, on a copy holding the average
    assert ema.update_bn(loader(device)) == 6
    expected = reference.state_dict()
    assert all(torch.equal(ema.shadow[name], expected[name]) for name in ema.shadow)
    assert all(torch.equal(t, live[name]) for name, t in model.state_dict().items())  # nothing of the live model
    assert torch.equal(ema.shadow["0.weight"], averaged["0.weight"])  # the weights are the average's still
    assert not torch.equal(ema.shadow["1.running_mean"], averaged["1.running_mean"])  # control: as averaged
    assert ema.shadow["1.num_batches_tracked"].item() == 6

    update_bn(loader(device), model)  # control: torch's own call on the live model rewrites its statistics
    assert not torch.equal(model.state_dict()["1.running_mean"], live["1.running_mean"])


def test_batches_caps_the_passes_and_to_input_reads_a_batch() -> None:
    _, ema = trained_with_average("cpu")
    reference = ema.export()
    update_bn([x for x, _ in loader()][:2], reference)
    assert ema.update_bn(({"x": x} for x, _ in loader()), batches=2, to_input=lambda batch: batch["x"]) == 2
    expected = reference.state_dict()
    assert torch.equal(ema.shadow["1.running_var"], expected["1.running_var"])


def test_the_next_update_averages_on_from_the_recomputed_statistics() -> None:
    model, ema = trained_with_average("cpu")
    ema.update_bn(loader())
    recomputed = ema.shadow["1.running_mean"].clone()
    ema.update(model)
    assert torch.equal(ema.shadow["1.running_mean"], recomputed.lerp(model[1].running_mean, 0.1))


def test_an_average_without_the_statistics_a_model_without_batchnorm_and_an_empty_loader_are_refused() -> None:
    model, _ = trained_with_average("cpu")
    without = EMA(model, include_buffers=False)
    with pytest.raises(ValueError, match=r"'1\.running_mean' is not averaged"):
        without.update_bn(loader())
    with pytest.raises(ValueError, match="has no BatchNorm with running statistics"):
        EMA(nn.Linear(8, 4)).update_bn(loader())
    ema = EMA(model)
    ema.update(model)
    before = {name: t.clone() for name, t in ema.shadow.items()}
    with pytest.raises(ValueError, match="the loader gave no batch"):
        ema.update_bn([])
    assert all(torch.equal(before[name], t) for name, t in ema.shadow.items())  # nothing reset
    with pytest.raises(RuntimeError, match=r"inside EMA\.average_weights"), ema.average_weights(model):
        ema.update_bn(loader())


def test_the_random_numbers_drawn_for_it_are_drawn_again_after() -> None:
    """A shuffled loader and dropout draw from the generator; afterwards it is where it was, so training goes on
    as without the call. The control: the same passes through torch's own ``update_bn`` move it."""
    _, ema = trained_with_average("cpu")
    shuffled = DataLoader(TensorDataset(torch.randn(64, 8)), batch_size=16, shuffle=True)
    torch.manual_seed(5)
    ema.update_bn(shuffled)
    after = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(torch.rand(3), after)
    torch.manual_seed(5)
    update_bn(shuffled, ema.export())
    assert not torch.equal(torch.rand(3), after)
    own = torch.Generator().manual_seed(3)  # a loader with its generator of its own, as the recipes' data modules
    ordered = DataLoader(TensorDataset(torch.randn(64, 8)), batch_size=16, shuffle=True, generator=own)
    order = [batch[0].sum().item() for batch in ordered]
    own.manual_seed(3)
    ema.update_bn(ordered)
    assert [batch[0].sum().item() for batch in ordered] == order  # the next epoch's order, as without the call
    own.manual_seed(3)
    update_bn(ordered, ema.export())  # the control
    assert [batch[0].sum().item() for batch in ordered] != order
