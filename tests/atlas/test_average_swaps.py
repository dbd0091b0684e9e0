"""Atlas rows on an average's copy of the weights taken for the live ones: a run resumed with the average in the live
model (schnetpack #785, anemoi-core #1373), and an evaluation that swaps in an average before its first update
(Lightning #21754). One test per row of ``docs/copy-atlas.md``, with ``copy_correct.EMA`` on the atlas's small model
(a Linear and a BatchNorm1d), trained a few SGD steps on fixed data.

Each test carries its control: the buggy pattern, measured the same way, shows the problem.
"""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from torch import nn

from copy_correct import EMA
from tests.atlas.test_copy_atlas import COLS, small_model
from tests.conftest import DEVICES

DECAY = 0.9


def batches(device: str, steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(8, COLS, generator=g).to(device) for _ in range(steps)]


def train(model: nn.Module, optimizer: torch.optim.Optimizer, data: list[torch.Tensor], ema: EMA | None) -> None:
    """One SGD step per batch, the average updated after each when there is one."""
    model.train()
    for x in data:
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if ema is not None:
            ema.update()


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k].double(), b[k].double()) for k in a)


def checkpoint(state: dict) -> dict:
    """``state`` through ``torch.save`` and ``torch.load``, as a resumed run reads it."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


# --------------------------------------------------------------------------------------------------
# rows: resuming with the average in the live model
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_ema_resumed_from_the_average_instead_of_the_live_weights(device):
    data = batches(device, 6)
    # the run that is never interrupted: 4 steps, a checkpoint, 2 more
    model = small_model(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ema = EMA(model, decay=DECAY)
    train(model, optimizer, data[:4], ema)
    live, average = snapshot(model), {k: t.clone() for k, t in ema.shadow.items()}
    assert not same(live, average)  # the two differ: which one is resumed matters
    good = checkpoint({"model": model.state_dict(), "ema": ema.state_dict()})
    with ema.average_weights(model):  # a checkpoint written during an evaluation on the average (schnetpack #785)
        swapped = checkpoint({"model": model.state_dict(), "ema": ema.state_dict()})
    assert same(snapshot(model), live)  # the live weights came back after the block ...
    assert same(swapped["model"], average)  # ... but the file holds the average as the model
    train(model, optimizer, data[4:], ema)
    end_live, end_average = snapshot(model), {k: t.clone() for k, t in ema.shadow.items()}

    def resume(saved: dict, model_state: dict[str, torch.Tensor]) -> tuple[nn.Module, EMA]:
        resumed = small_model(device)
        resumed.load_state_dict(model_state)
        resumed_ema = EMA(resumed, decay=DECAY)
        resumed_ema.load_state_dict(saved["ema"])
        return resumed, resumed_ema

    # controls: the live model loaded with the average, from the file written in the swap or from the EMA's state
    for saved, model_state in ((swapped, swapped["model"]), (good, good["ema"]["shadow"])):
        resumed, resumed_ema = resume(saved, model_state)
        assert same(snapshot(resumed), average) and not same(
            snapshot(resumed), live
        )  # training restarts from the average
        train(resumed, torch.optim.SGD(resumed.parameters(), lr=0.1), data[4:], resumed_ema)
        assert not close(snapshot(resumed), end_live)  # ... and goes elsewhere than the uninterrupted run
        assert not close(dict(resumed_ema.shadow), end_average)  # dragging the average with it

    # the fix: the live weights into the model, the EMA's state into the EMA
    resumed, resumed_ema = resume(good, good["model"])
    assert same(snapshot(resumed), live) and same(dict(resumed_ema.shadow), average)
    assert (resumed_ema.step, resumed_ema.num_updates) == (4, 4)
    train(resumed, torch.optim.SGD(resumed.parameters(), lr=0.1), data[4:], resumed_ema)
    assert close(snapshot(resumed), end_live) and close(dict(resumed_ema.shadow), end_average)


# --------------------------------------------------------------------------------------------------
# rows: evaluating an average before its first update
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_swapping_in_an_average_before_its_first_update_evaluates_the_initial_weights(device):
    data = batches(device, 3)
    model = small_model(device)
    initial = snapshot(model)
    ema = EMA(model, decay=DECAY)  # its shadow: a copy of the weights as they are now
    train(model, torch.optim.SGD(model.parameters(), lr=0.1), data, None)  # updates start later (a delayed start)
    live = snapshot(model)
    assert not same(live, initial)
    assert ema.num_updates == 0 and ema.initial_share == 1.0

    # control: a validation that swaps the average in now evaluates the weights the EMA was built from, and is told so
    told = r"the average is still 100% the weights it started from after 0 updates"
    with pytest.warns(RuntimeWarning, match=told), ema.average_weights(model):
        evaluated = snapshot(model)
    assert same(evaluated, initial) and not same(evaluated, live)
    assert same(snapshot(model), live)  # the live weights are back after the block

    # the fix Lightning took: swap only once the average has been updated; until then, evaluate the live weights
    def evaluated_weights(average: EMA) -> dict[str, torch.Tensor]:
        if average.num_updates == 0:
            return snapshot(model)
        with average.average_weights(model):
            return snapshot(model)

    assert same(evaluated_weights(EMA(model, decay=DECAY)), live)
    # after the first update of the default warm-up (its decay is 0) the average is the live weights, and quiet
    first = EMA(model, decay=DECAY)
    first.update()
    assert first.initial_share == 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert same(evaluated_weights(first), live)
    # without a warm-up, one update leaves the average 90% the weights it started from: decay ** updates, and a warning
    cold_model = small_model(device)  # the same initial weights
    assert same(snapshot(cold_model), initial)
    cold = EMA(cold_model, decay=DECAY, warmup=False)
    cold_model.load_state_dict(live)
    cold.update()
    assert cold.initial_share == pytest.approx(DECAY)
    told = r"still 90% the weights it started from after 1 updates"
    with pytest.warns(RuntimeWarning, match=told), cold.average_weights(cold_model):
        mixed = snapshot(cold_model)
    weight = "0.weight"
    torch.testing.assert_close(mixed[weight], torch.lerp(initial[weight], live[weight], 1 - DECAY))
