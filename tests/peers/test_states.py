"""A peer's saved average loaded into ours (``copy_correct.averages.peer_states``) goes on as the peer's does: train a
while with the peer, save its state, load it into ours built with the matching schedule, then take the same further
steps with both and compare the averages (to float32 rounding: the peers' arithmetic is not ours operation for
operation).

Controls: the same average loaded with its counters at 0 (the silent reset these loaders refuse to make) is far from
the peer's after one more update; a load without counters, and one into the wrong schedule, are refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from copy_correct.averages.ema import EMA
from copy_correct.averages.peer_schedules import diffusers_schedule, ema_pytorch_schedule
from copy_correct.averages.peer_states import (
    diffusers_settings,
    load_diffusers_state,
    load_ema_pytorch_state,
    load_posthoc_ema_state,
)
from copy_correct.averages.power_ema import PowerEMA
from tests.peers.test_schedules import largest_difference, trained

BEFORE, AFTER = 150, 150  # steps with the peer alone, then with both
F32_SUMS = 1e-5  # float32 rounding over a few hundred updates of weights of size about 1


def cloned(state: dict[str, Any]) -> dict[str, Any]:
    """A saved copy of a peer's state (theirs hold references to the live average, as a state_dict does)."""
    return {key: [t.clone() for t in v] if isinstance(v, list) else v.clone() if torch.is_tensor(v) else v
            for key, v in state.items()}  # fmt: skip


# -- diffusers ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args", [{}, {"decay": 0.999, "use_ema_warmup": True, "update_after_step": 5}], ids=str)
def test_diffusers_state_goes_on_in_ours(args: dict[str, Any]) -> None:
    training_utils = pytest.importorskip("diffusers.training_utils")
    model, step = trained(10)
    peer = training_utils.EMAModel(model.parameters(), **args)
    for _ in range(BEFORE):
        step()
        peer.step(model.parameters())
    state = cloned(peer.state_dict())
    schedule = diffusers_schedule(**diffusers_settings(state))
    mine, reset = EMA(model, include_buffers=False, **schedule), EMA(model, include_buffers=False, **schedule)
    load_diffusers_state(mine, state)
    reset.load_average(dict(mine.shadow), step=0)  # control: the same average, counters at 0
    assert (mine.step, mine.num_updates) == (BEFORE, BEFORE - schedule["start_step"])
    for n in range(AFTER):
        step()
        peer.step(model.parameters())
        mine.update()
        reset.update()
        theirs = {name: t for (name, _), t in zip(model.named_parameters(), peer.shadow_params, strict=True)}
        assert largest_difference(theirs, mine.shadow) < F32_SUMS
        assert n > 0 or largest_difference(theirs, reset.shadow) > 1e-2


def test_diffusers_state_refused_where_it_would_not_go_on() -> None:
    training_utils = pytest.importorskip("diffusers.training_utils")
    model, step = trained(11)
    peer = training_utils.EMAModel(model.parameters(), decay=0.999)
    step()
    peer.step(model.parameters())
    state = cloned(peer.state_dict())
    right = diffusers_schedule(**diffusers_settings(state))
    counted = EMA(model, include_buffers=False, **right)
    with pytest.raises(ValueError, match=r"the EMA's warmup is 'power', the diffusers state's schedule has 'ratio'"):
        load_diffusers_state(EMA(model, decay=0.999, include_buffers=False), state)
    with pytest.raises(ValueError, match=r"also averages buffers \('1\.num_batches_tracked', .*include_buffers=False"):
        load_diffusers_state(EMA(model, **right), state)
    with pytest.raises(ValueError, match="the diffusers state has 3 shadow_params, the model 6 parameters"):
        load_diffusers_state(counted, state | {"shadow_params": state["shadow_params"][:3]})
    with pytest.raises(ValueError, match=r"not a diffusers EMAModel.state_dict\(\): it has no 'optimization_step'"):
        load_diffusers_state(counted, {k: v for k, v in state.items() if k != "optimization_step"})
    with pytest.raises(ValueError, match="without its counters"):  # ours: an average without counters
        counted.load_state_dict({"shadow": dict(counted.shadow)})


# -- ema-pytorch --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args", [{}, {"beta": 0.999, "update_after_step": 25, "update_every": 4}], ids=str)
def test_ema_pytorch_state_goes_on_in_ours(args: dict[str, Any]) -> None:
    ema_pytorch = pytest.importorskip("ema_pytorch")
    model, step = trained(12)
    peer = ema_pytorch.EMA(model, **args)
    for _ in range(BEFORE):
        step()
        peer.update()
    state = cloned(peer.state_dict())
    mine, reset = EMA(model, **ema_pytorch_schedule(**args)), EMA(model, **ema_pytorch_schedule(**args))
    load_ema_pytorch_state(mine, state)
    reset.load_average(dict(mine.shadow), step=0)  # control: the same average, counters at 0
    first = None
    for _ in range(AFTER):
        step()
        peer.update()
        mine.update()
        reset.update()
        theirs = peer.ema_model.state_dict()
        assert largest_difference(theirs, mine.shadow) < F32_SUMS
        if first is None and reset.num_updates > 0:
            first = largest_difference(theirs, reset.shadow)
    assert first is not None and first > 1e-2


def test_ema_pytorch_state_refused_without_an_average() -> None:
    ema_pytorch = pytest.importorskip("ema_pytorch")
    model, _ = trained(13)
    peer = ema_pytorch.EMA(model)
    with pytest.raises(ValueError, match="the ema-pytorch state is not initted: it made no update"):
        load_ema_pytorch_state(EMA(model, **ema_pytorch_schedule()), cloned(peer.state_dict()))
    peer.update()
    state = {k: v for k, v in cloned(peer.state_dict()).items() if k != "ema_model.3.bias"}
    with pytest.raises(ValueError, match=r"the ema-pytorch state has no '3\.bias'"):
        load_ema_pytorch_state(EMA(model, **ema_pytorch_schedule()), state)


# -- PostHocEMA ---------------------------------------------------------------------------------------------------

SIGMA_RELS = (0.05, 0.10)


def posthoc(model: torch.nn.Module, folder: Path, **kwargs: Any) -> Any:
    post_hoc_ema = pytest.importorskip("ema_pytorch.post_hoc_ema")
    return post_hoc_ema.PostHocEMA(
        model, sigma_rels=SIGMA_RELS, checkpoint_every_num_steps="manual", checkpoint_folder=str(folder), **kwargs
    )


def profile_difference(peer: Any, power_ema: PowerEMA) -> float:
    return max(
        largest_difference(karras.ema_model.state_dict(), profile)
        for karras, profile in zip(peer.ema_models, power_ema.profiles, strict=True)
    )


def test_posthoc_ema_state_goes_on_in_ours_one_step_later(tmp_path: Path) -> None:
    """Loaded at ``step = updated_step = N + 1`` the profiles go on as KarrasEMA's; at ``N`` (the step count as
    saved) they drift, and at 0 (a reset) the next update copies the live weights."""
    model, step = trained(14)
    peer = posthoc(model, tmp_path, update_every=1)
    for _ in range(BEFORE):
        step()
        peer.update()
    state = cloned(peer.state_dict())
    mine = PowerEMA(model, SIGMA_RELS)
    load_posthoc_ema_state(mine, state, update_every=1)
    assert (mine.step, mine.updated_step) == (BEFORE + 1, BEFORE + 1)
    as_saved, reset = PowerEMA(model, SIGMA_RELS), PowerEMA(model, SIGMA_RELS)
    for control, at in ((as_saved, BEFORE), (reset, 0)):
        control.load_state_dict(mine.state_dict() | {"step": at, "updated_step": at, "applied_step": at})
    differences = []
    for _ in range(AFTER):
        step()
        for average in (peer, mine, as_saved, reset):
            average.update()
        differences.append([profile_difference(peer, p) for p in (mine, as_saved, reset)])
    assert max(d[0] for d in differences) < F32_SUMS  # measured: 0.0, bit for bit
    assert max(d[1] for d in differences) > F32_SUMS  # measured: 2.0e-4
    assert differences[0][2] > 1e-2  # measured: 0.088 after the first update


def test_posthoc_ema_state_refused_where_it_would_not_go_on(tmp_path: Path) -> None:
    model, step = trained(15)
    fresh = posthoc(model, tmp_path / "fresh", update_every=1)
    with pytest.raises(ValueError, match=r"ema_models\.0 of the PostHocEMA state is not initted"):
        load_posthoc_ema_state(PowerEMA(model, SIGMA_RELS), cloned(fresh.state_dict()), update_every=1)
    every = posthoc(model, tmp_path / "every", update_every=100)
    step()
    every.update()
    with pytest.raises(ValueError, match="update_every=100 cannot be continued: its KarrasEMA applies the one-step"):
        load_posthoc_ema_state(PowerEMA(model, SIGMA_RELS), cloned(every.state_dict()), update_every=100)
    with pytest.raises(ValueError, match="the PostHocEMA state has 2 ema_models, power_ema 3 sigma_rels"):
        load_posthoc_ema_state(PowerEMA(model, (*SIGMA_RELS, 0.15)), cloned(every.state_dict()), update_every=1)
    with pytest.raises(ValueError, match="power_ema has update_every=2: build it with update_every=1"):
        load_posthoc_ema_state(PowerEMA(model, SIGMA_RELS, update_every=2), cloned(every.state_dict()), update_every=1)
