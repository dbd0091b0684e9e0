"""Each peer's schedule as ``copy_correct.averages.peer_schedules`` says it, against the peer's own code: at each call,
whether the peer copies, averages (with which decay) or does nothing, and ours by ``EMA``'s rule and ``EMA.decay_at``;
then the averages of a small model trained side by side. Each peer's tests skip where it is not installed.

A call's action is ``None`` (no write), ``0.0`` (a copy) or the decay of an averaging update. Compared at every call
below 20,000 and at 2,000 log-spaced calls up to 10**7 (``-m slow``: every call up to 10**7). Each comparison has a
control: a plausible wrong mapping, which the same comparison catches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from benchmarks.peers import Missing, timm_model_ema
from copy_correct.averages.ema import EMA
from copy_correct.averages.peer_schedules import (
    diffusers_schedule,
    ema_pytorch_schedule,
    lightning_schedule,
    timm_schedule,
    torchtitan_schedule,
)

DENSE = 20_000
CALLS = [*range(DENSE), *np.unique(np.geomspace(DENSE, 10**7, 2_000).astype(int)).tolist()]
F32 = 2.0**-24  # a float32 ulp just below 1: ema-pytorch's decays are float32 values
Actions = Iterator[float | None]


def ours(schedule: dict[str, Any], calls: Iterable[int]) -> Actions:
    """Our action at each call (``EMA.update``'s rule, ``EMA.decay_at``)."""
    ema = EMA(nn.Linear(1, 1), **schedule)
    start, every = ema.start_step, ema.update_every
    return (0.0 if c < start else None if (c - start) % every else ema.decay_at((c - start) // every) for c in calls)


def first_difference(
    calls: Iterable[int], peer: Actions, mine: Actions, *, start: int = 0, tolerance: float = 0.0
) -> str | None:
    """The first call from ``start`` on where the actions differ (a decay by more than ``tolerance``), as a line;
    ``None`` if none."""
    for c, theirs, our in zip(calls, peer, mine, strict=True):
        if c >= start and ((theirs is None) != (our is None) or (theirs is not None and abs(theirs - our) > tolerance)):
            return f"call {c}: peer {theirs!r}, ours {our!r}"
    return None


# -- timm ---------------------------------------------------------------------------------------------------------

TIMM = [
    {},
    {"decay": 0.9998, "use_warmup": True},
    {"decay": 0.999, "use_warmup": True, "min_decay": 0.5, "update_after_step": 50, "warmup_gamma": 2.0},
    {"decay": 0.99, "use_warmup": True, "warmup_power": 0.75, "update_after_step": 7},
    {"decay": 0.999, "update_after_step": 10},
    {"decay": 0.999, "use_warmup": True, "update_after_step": 10, "step_given": False},
]


def timm_module() -> Any:
    module = timm_model_ema()
    if isinstance(module, Missing):
        pytest.skip(module)
    return module


def timm_actions(args: dict[str, Any], calls: Iterable[int]) -> Actions:
    """``ModelEmaV3.get_decay`` at each call, as timm's ``train.py`` calls ``update(model, step=n)`` (``n = c + 1``)."""
    given = args.get("step_given", True)
    ema = timm_module().ModelEmaV3(nn.Linear(1, 1), **{k: v for k, v in args.items() if k != "step_given"})
    return (ema.get_decay(c + 1 if given else None) for c in calls)


@pytest.mark.parametrize("args", TIMM, ids=str)
def test_timm_decays_are_ours_exactly(args: dict[str, Any]) -> None:
    peer = list(timm_actions(args, CALLS))
    assert first_difference(CALLS, iter(peer), ours(timm_schedule(**args), CALLS)) is None
    late = timm_schedule(**args) | {"start_step": timm_schedule(**args)["start_step"] + 1}  # control: one call late
    assert first_difference(CALLS, iter(peer), ours(late, CALLS)) is not None


# -- diffusers ----------------------------------------------------------------------------------------------------

DIFFUSERS = [
    {},
    {"use_ema_warmup": True},
    {"decay": 0.999, "min_decay": 0.9, "update_after_step": 30},
    {"decay": 0.9995, "use_ema_warmup": True, "inv_gamma": 5, "power": 0.75, "min_decay": 0.1, "update_after_step": 7},
]


def diffusers_actions(args: dict[str, Any], calls: Iterable[int]) -> Actions:
    """``EMAModel.get_decay`` at each call: ``step`` raises ``optimization_step`` to ``c + 1`` first."""
    training_utils = pytest.importorskip("diffusers.training_utils")
    ema = training_utils.EMAModel(nn.Linear(1, 1).parameters(), **args)
    return (ema.get_decay(c + 1) for c in calls)


@pytest.mark.parametrize("args", DIFFUSERS, ids=str)
def test_diffusers_decays_are_ours_exactly(args: dict[str, Any]) -> None:
    peer = list(diffusers_actions(args, CALLS))
    schedule = diffusers_schedule(**args)
    assert first_difference(CALLS, iter(peer), ours(schedule, CALLS)) is None
    other = schedule | {"warmup": "power" if schedule["warmup"] == "ratio" else "ratio"}  # control: the other ramp
    assert first_difference(CALLS, iter(peer), ours(other, CALLS)) is not None


# -- ema-pytorch --------------------------------------------------------------------------------------------------

EMA_PYTORCH = [
    {},
    {"update_after_step": 105, "update_every": 10},
    {"update_after_step": 0, "update_every": 1},
    {"beta": 0.999, "update_after_step": 7, "update_every": 3, "inv_gamma": 2.0, "power": 0.75, "min_value": 0.5},
    {"beta": 0.99, "update_after_step": 3, "update_every": 5},
]


def ema_pytorch_actions(args: dict[str, Any], calls: Iterable[int]) -> Actions:
    """What ema-pytorch's own ``EMA.update()`` does at each call (ascending), recorded: its copy and its averaging
    update are replaced on the instance by recorders (the latter reads ``get_current_decay()``, as it would). A call
    past the first is reached by setting the ``step`` buffer, as that many calls leave it."""
    ema_pytorch = pytest.importorskip("ema_pytorch")
    ema = ema_pytorch.EMA(nn.Linear(1, 1), **args)
    actions: list[float | None] = []
    ema.copy_params_from_model_to_ema = lambda: actions.append(0.0)
    ema.update_moving_average = lambda *_: actions.append(ema.get_current_decay())
    for c in calls:
        ema.step.fill_(c)
        ema.update()
        yield actions.pop() if actions else None


@pytest.mark.parametrize("args", EMA_PYTORCH, ids=str)
def test_ema_pytorch_decays_are_ours_to_float32_rounding(args: dict[str, Any]) -> None:
    schedule = ema_pytorch_schedule(**args)
    start = schedule["start_step"]
    peer, mine = list(ema_pytorch_actions(args, CALLS)), list(ours(schedule, CALLS))
    assert first_difference(CALLS, iter(peer), iter(mine), start=start, tolerance=2 * F32) is None
    # before start_step ema-pytorch copies or does nothing, we copy: never an average on either side
    assert set(peer[:start]) <= {0.0, None} and set(mine[:start]) <= {0.0}
    # controls: the ramp one update ahead; ema-pytorch's arguments taken as they read (where that differs: E > 1)
    controls = [schedule | {"warmup_offset": schedule["warmup_offset"] + 1}]
    naive = schedule | {"start_step": args.get("update_after_step", 100), "warmup_gamma": args.get("inv_gamma", 1.0)}
    controls += [naive | {"warmup_offset": 0.0}] if schedule["update_every"] > 1 else []
    for control in controls:
        assert first_difference(CALLS, iter(peer), ours(control, CALLS), start=start, tolerance=2 * F32) is not None


# -- Lightning ----------------------------------------------------------------------------------------------------

LIGHTNING = [
    {},
    {"decay": 0.99, "update_every_n_steps": 3},
    {"decay": 0.999, "update_every_n_steps": 4, "update_starting_at_step": 10},
    {"decay": 0.9, "update_starting_at_step": 5},
]


def lightning_actions(args: dict[str, Any], calls: Iterable[int]) -> Actions:
    """``EMAWeightAveraging.should_update(step_idx=c)`` at each call (ascending); ``AveragedModel`` copies at its
    first update and averages with the callback's decay after."""
    callbacks = pytest.importorskip("lightning.pytorch.callbacks")
    callback = callbacks.EMAWeightAveraging(**args)
    decay, averaged = args.get("decay", 0.999), False
    for c in calls:
        if callback.should_update(step_idx=c):
            yield decay if averaged else 0.0
            averaged = True
        else:
            yield None


@pytest.mark.parametrize("args", LIGHTNING, ids=str)
def test_lightning_decays_are_ours_exactly(args: dict[str, Any]) -> None:
    schedule = lightning_schedule(**args)
    start = schedule["start_step"]
    peer = list(lightning_actions(args, CALLS))
    assert first_difference(CALLS, iter(peer), ours(schedule, CALLS), start=start) is None
    assert set(peer[:start]) <= {None}  # Lightning holds the weights it was built with until then, we copy
    late = schedule | {"start_step": start + schedule["update_every"]}  # control: the first update missed
    assert first_difference(CALLS, iter(peer), ours(late, CALLS), start=start) is not None


def test_lightning_refuses_an_epoch_start() -> None:
    with pytest.raises(ValueError, match="update_starting_at_epoch=2 updates at epoch ends"):
        lightning_schedule(update_starting_at_epoch=2)


# -- torchtitan ---------------------------------------------------------------------------------------------------
# torchtitan is not a pip package; ``Titan`` is its ``EMAOptimizersContainer.step`` and ``_decay_at`` (torchtitan
# its ``ema.py`` module, PR #3985) written out: the EMA a clone at construction, then at each
# ``current_step`` a lerp by ``1 - decay`` of the parameters that require grad, or nothing.

TORCHTITAN = [
    {},
    {"half_life_fraction": 0.1, "start_step": 100},
    {"half_life_fraction": 0.05, "update_every_n_steps": 4},
    {"half_life_fraction": 0.02, "start_step": 7, "update_every_n_steps": 3, "step_bias": 10},
    {"decay": 0.999, "start_step": 5, "update_every_n_steps": 2},
    {"half_life_fraction": 0.2, "step_bias": 5},
    {"decay": 0.99},
]


class Titan:
    """torchtitan's EMA of ``model``'s trainable parameters, stepped with ``step(current_step)``."""

    def __init__(self, model: nn.Module | None, **config: Any) -> None:
        self.decay, self.half_life = config.get("decay"), config.get("half_life_fraction", 0.05)
        self.start, self.bias = config.get("start_step", 0), config.get("step_bias", 0)
        self.every = config.get("update_every_n_steps", 1)
        self.params = [] if model is None else [p for p in model.parameters() if p.requires_grad]
        self.ema = [p.detach().clone() for p in self.params]

    def decay_at(self, current_step: int) -> float | None:
        """The decay of the update at ``current_step``, or ``None`` where it makes none."""
        if current_step < self.start or (current_step - self.start) % self.every:
            return None
        if self.decay is not None:
            return self.decay
        num_updates = max((current_step - self.start + self.bias) // self.every, 1)
        return 2.0 ** (-1.0 / (self.half_life * num_updates))

    def step(self, current_step: int) -> None:
        decay = self.decay_at(current_step)
        if decay is not None:
            torch._foreach_lerp_(self.ema, [p.detach() for p in self.params], 1.0 - decay)


@pytest.mark.parametrize("args", TORCHTITAN, ids=str)
def test_torchtitan_decays_are_ours_exactly(args: dict[str, Any]) -> None:
    schedule, titan = torchtitan_schedule(**args), Titan(None, **args)
    start = schedule["start_step"]
    peer = [titan.decay_at(c + 1) for c in CALLS]
    assert first_difference(CALLS, iter(peer), ours(schedule, CALLS), start=start) is None
    assert set(peer[:start]) <= {None}  # torchtitan holds the weights it was built with until then, we copy
    shifted = schedule | {"warmup_offset": schedule["warmup_offset"] + 1}  # control: its count one update ahead
    late = schedule | {"start_step": start + schedule["update_every"]}  # control: its first update missed
    for control in (shifted, late) if args.get("decay") is None else (late,):
        assert first_difference(CALLS, iter(peer), ours(control, CALLS), start=start) is not None


@pytest.mark.parametrize("args", [a for a in TORCHTITAN if torchtitan_schedule(**a)["start_step"] == 0], ids=str)
def test_torchtitan_averages_are_ours_bit_for_bit(args: dict[str, Any]) -> None:
    """From a start at the first step: the same lerps of the same weights, so the same averages; a frozen layer and
    the BatchNorm statistics, which torchtitan leaves out, are left out of ours too."""
    model, step = trained(6)
    model[3].requires_grad_(False)
    peer = Titan(model, **args)
    mine = EMA(model, **torchtitan_schedule(**args))
    control = EMA(model, **torchtitan_schedule(**args) | {"warmup": "power"})  # another ramp
    for current_step in range(1, 301):
        step()
        peer.step(current_step)
        mine.update()
        control.update()
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    assert sorted(mine.shadow) == sorted(names)
    assert all(torch.equal(theirs, mine.shadow[name]) for name, theirs in zip(names, peer.ema, strict=True))
    assert largest_difference(dict(zip(names, peer.ema, strict=True)), control.shadow) > 1e-4


# -- every call up to 10**7 ---------------------------------------------------------------------------------------

EVERY: list[tuple[Callable[[dict[str, Any], Iterable[int]], Actions], Callable[..., dict[str, Any]], dict]] = [
    (timm_actions, timm_schedule, TIMM[2]),
    (diffusers_actions, diffusers_schedule, DIFFUSERS[3]),
    (lightning_actions, lightning_schedule, LIGHTNING[2]),
]


@pytest.mark.slow
@pytest.mark.parametrize(("actions", "schedule", "args"), EVERY, ids=["timm", "diffusers", "lightning"])
def test_every_call_up_to_ten_million(actions: Callable, schedule: Callable, args: dict[str, Any]) -> None:
    calls, start = range(10**7), schedule(**args)["start_step"]
    assert first_difference(calls, actions(args, calls), ours(schedule(**args), calls), start=start) is None


# -- the averages -------------------------------------------------------------------------------------------------


def trained(steps: int, seed: int = 0) -> tuple[nn.Module, Callable[[], None]]:
    """A small network with a BatchNorm, and one random SGD step of it (same seed, same steps)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step() -> None:
        optimizer.zero_grad()
        model(torch.randn(16, 4)).square().mean().backward()
        optimizer.step()

    return model, step


def largest_difference(average: dict[str, torch.Tensor], shadow: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference over the floating tensors of ``shadow``, looked up by name in ``average``."""
    floating = [(average[n].double(), t.double()) for n, t in shadow.items() if t.is_floating_point()]
    return max((a - b).abs().max().item() for a, b in floating)


@pytest.mark.parametrize("args", TIMM, ids=str)
def test_timm_v3_averages_are_ours_exactly(args: dict[str, Any]) -> None:
    """timm's lerp with ``1 - get_decay(step)`` is ours bit for bit, BatchNorm statistics and counter included."""
    model, step = trained(0)
    given = args.get("step_given", True)
    peer = timm_module().ModelEmaV3(model, **{k: v for k, v in args.items() if k != "step_given"})
    mine, control = EMA(model, **timm_schedule(**args)), EMA(model, decay=peer.decay, warmup=not given)
    for n in range(1, 301):
        step()
        peer.update(model, step=n) if given else peer.update(model)
        mine.update()
        control.update()
    theirs = peer.module.state_dict()
    assert all(torch.equal(theirs[name], t) for name, t in mine.shadow.items())
    assert largest_difference(theirs, control.shadow) > 1e-3  # control: the warm-up the other way round


def test_timm_v2_averages_are_ours_to_float32_rounding() -> None:
    """``ModelEmaV2`` (constant decay, ``decay * e + (1 - decay) * m``) is ``timm_schedule(decay, step_given=False)``
    to float32 rounding; the control copies at its first update, as V3 given ``step`` does."""
    model, step = trained(1)
    peer = timm_module().ModelEmaV2(model, decay=0.99)
    mine = EMA(model, **timm_schedule(decay=0.99, step_given=False))
    control = EMA(model, **timm_schedule(decay=0.99))
    for _ in range(300):
        step()
        peer.update(model)
        mine.update()
        control.update()
    theirs = peer.module.state_dict()
    assert largest_difference(theirs, mine.shadow) < 1e-5
    assert largest_difference(theirs, control.shadow) > 1e-3


@pytest.mark.parametrize("args", DIFFUSERS, ids=str)
def test_diffusers_averages_are_ours_to_float32_rounding(args: dict[str, Any]) -> None:
    """diffusers' ``s - (1 - decay) * (s - p)`` against our lerp, parameters only (``include_buffers=False``)."""
    training_utils = pytest.importorskip("diffusers.training_utils")
    model, step = trained(2)
    peer = training_utils.EMAModel(model.parameters(), **args)
    mine = EMA(model, include_buffers=False, **diffusers_schedule(**args))
    control = EMA(model, include_buffers=False, **timm_schedule(decay=peer.decay))  # no ramp
    for _ in range(300):
        step()
        peer.step(model.parameters())
        mine.update()
        control.update()
    theirs = {name: t for (name, _), t in zip(model.named_parameters(), peer.shadow_params, strict=True)}
    assert largest_difference(theirs, mine.shadow) < 1e-5
    assert largest_difference(theirs, control.shadow) > 1e-3


@pytest.mark.parametrize("args", EMA_PYTORCH, ids=str)
def test_ema_pytorch_averages_are_ours_to_float32_rounding(args: dict[str, Any]) -> None:
    """ema-pytorch's own ``update()`` over 300 calls; its integer buffers keep the value it was built with."""
    ema_pytorch = pytest.importorskip("ema_pytorch")
    model, step = trained(3)
    peer = ema_pytorch.EMA(model, **args)
    schedule = ema_pytorch_schedule(**args)
    mine = EMA(model, **schedule)
    control = EMA(model, **schedule | {"warmup_offset": schedule["warmup_offset"] + 1})  # the ramp one update ahead
    for _ in range(300):
        step()
        peer.update()
        mine.update()
        control.update()
    theirs = peer.ema_model.state_dict()
    assert largest_difference(theirs, mine.shadow) < 1e-5
    assert largest_difference(theirs, control.shadow) > 1e-5
    assert theirs["1.num_batches_tracked"] == 0 < mine.shadow["1.num_batches_tracked"]  # theirs never written


def test_averaged_model_is_lightning_schedule_bit_for_bit() -> None:
    """torch's ``AveragedModel`` with ``get_ema_multi_avg_fn`` (a lerp by ``1 - decay`` after a first copy) is
    ``lightning_schedule(decay)``'s EMA bit for bit on floating tensors; it truncates the averaged integer counter."""
    swa_utils = pytest.importorskip("torch.optim.swa_utils")
    model, step = trained(5)
    peer = swa_utils.AveragedModel(model, multi_avg_fn=swa_utils.get_ema_multi_avg_fn(0.99), use_buffers=True)
    mine = EMA(model, **lightning_schedule(decay=0.99))
    control = EMA(model, decay=0.99, warmup=False)  # control: no first copy
    for _ in range(300):
        step()
        peer.update_parameters(model)
        mine.update()
        control.update()
    theirs = peer.module.state_dict()
    assert all(torch.equal(theirs[name], t) for name, t in mine.shadow.items() if t.is_floating_point())
    assert largest_difference(theirs, control.shadow) > 1e-3
    assert theirs["1.num_batches_tracked"] < mine.shadow["1.num_batches_tracked"] == 300


def test_lightning_averages_are_ours_to_float32_rounding(tmp_path: Any) -> None:
    """A real ``Trainer`` fit with ``EMAWeightAveraging`` beside our EMA updated after every optimizer step."""
    pl = pytest.importorskip("lightning.pytorch")
    args = {"decay": 0.99, "update_every_n_steps": 3, "update_starting_at_step": 10}
    model, _ = trained(4)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def training_step(self, batch: torch.Tensor, _: int) -> torch.Tensor:
            return self.net(batch).square().mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = Module()
    mine = EMA(module, **lightning_schedule(**args))
    control = EMA(module, **lightning_schedule(**args | {"update_starting_at_step": 0}))  # no start

    class Ours(pl.Callback):
        def on_train_batch_end(self, *_: Any) -> None:
            mine.update()
            control.update()

    averaging = pl.callbacks.EMAWeightAveraging(**args)
    trainer = pl.Trainer(
        max_steps=300, callbacks=[averaging, Ours()], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(module, torch.utils.data.DataLoader(torch.randn(300 * 16, 4), batch_size=16))
    theirs = averaging._average_model.module.state_dict()
    assert largest_difference(theirs, mine.shadow) < 1e-5
    assert largest_difference(theirs, control.shadow) > 1e-3
    # Lightning's avg_fn truncates the averaged counter (88 against 298 here); we copy it
    assert theirs["net.1.num_batches_tracked"] < mine.shadow["net.1.num_batches_tracked"] == 298
