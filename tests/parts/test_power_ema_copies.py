"""``pickle`` and ``copy.deepcopy`` of a ``PowerEMA``: the profiles in new storage (ties kept), the counters, never the
model; the copy averages nothing until it is given the model (``track``, ``update(model)``), and from then on stays
equal, bit for bit, to the original fed the same steps. The control: a copy that takes the model along (the old
behaviour) averages its own frozen copy of the weights, not the training ones."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from copy_correct import PowerEMA, skipped_updates
from copy_correct.lightning import PostHocEMASnapshots
from tests.parts.test_power_ema_nonfinite import net, train_step

COPIES: dict[str, Callable[[Any], Any]] = {
    "pickle": lambda obj: pickle.loads(pickle.dumps(obj)),
    "deepcopy": copy.deepcopy,
}


class Tied(nn.Module):
    """Two names of one weight in the state_dict (a decoder tied to an encoder)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(4, 4)
        self.decoder = nn.Linear(4, 4)
        self.decoder.weight = self.encoder.weight


def same(a: PowerEMA, b: PowerEMA) -> bool:
    return all(
        p.keys() == q.keys() and all(torch.equal(p[n], q[n]) for n in p)
        for p, q in zip(a.profiles, b.profiles, strict=True)
    )


@pytest.mark.parametrize("how", COPIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_copy_holds_new_profiles_and_no_model_and_follows_the_original_once_given_it(
    how: str, dtype: torch.dtype
) -> None:
    model = net(dtype=dtype)
    ema = PowerEMA(model)
    for step in range(1, 4):
        train_step(model, step)
        ema.update()
    twin = COPIES[how](ema)
    assert twin.live_model is None and twin.step == ema.step == 3 and same(twin, ema)
    assert twin.profiles[0]["0.weight"].dtype == torch.float32  # the bf16 model's float32 profiles
    assert all(
        t.untyped_storage().data_ptr() != ema.profiles[0][n].untyped_storage().data_ptr()
        for n, t in twin.profiles[0].items()
    )
    with pytest.raises(RuntimeError, match="tracks no model yet"):
        twin.update()
    for step in range(4, 8):
        train_step(model, step)
        ema.update()
        twin.update(model)  # the first gives the copy the model
    assert twin.live_model is model and twin.step == ema.step == 7 and same(twin, ema)


@pytest.mark.parametrize("how", COPIES)
def test_ties_are_kept_and_a_model_that_is_not_the_profiles_is_refused(how: str) -> None:
    model = Tied()
    twin = COPIES[how](PowerEMA(model))
    assert twin.profiles[0]["encoder.weight"] is twin.profiles[0]["decoder.weight"]
    with pytest.raises(ValueError, match=r"the model has '0.weight', the shadow has not"):
        twin.track(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(ValueError, match=r"'encoder.weight' is \(4, 4\) torch.float32 in the shadow, \(3, 4\)"):
        other = Tied()
        other.encoder = nn.Linear(4, 3)
        other.decoder.weight = other.encoder.weight
        twin.track(other)
    untied = Tied()
    untied.decoder.weight = nn.Parameter(untied.encoder.weight.detach().clone())
    with pytest.raises(ValueError, match=r"'decoder.weight' is tied to another tensor in the shadow, not in the model"):
        twin.track(untied)
    assert twin.live_model is None  # refused: still a copy with no model
    twin.track(model)
    with pytest.raises(ValueError, match="was built for another model object"):
        twin.track(Tied())


def test_a_copy_of_a_guarded_power_ema_skips_a_poisoned_update_after_it_is_given_the_model() -> None:
    model = net()
    ema = PowerEMA(model, skip_nonfinite=True)
    train_step(model, 1)
    ema.update()
    twin = copy.deepcopy(ema)
    twin.track(model)
    before = [{n: t.clone() for n, t in p.items()} for p in twin.profiles]
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    twin.update()
    assert skipped_updates(twin) == 1 and all(
        torch.equal(p[n], b[n]) for p, b in zip(twin.profiles, before, strict=True) for n in p
    )


def test_control_a_copy_that_takes_the_model_along_averages_frozen_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    model = net()
    ema = PowerEMA(model)
    train_step(model, 1)
    ema.update()
    monkeypatch.setattr(PowerEMA, "__getstate__", lambda self: self.__dict__)  # as before: the model deep-copied too
    twin = copy.deepcopy(ema)
    assert twin.live_model is not None and twin.live_model is not model  # a second model, frozen at the copy
    for step in range(2, 5):
        train_step(model, step)
        ema.update()
        twin.update()  # no error: it averages its own copy
    assert not same(twin, ema)


def test_a_copied_callback_gives_its_profiles_the_module_when_fit_starts() -> None:
    from types import SimpleNamespace

    module = nn.Module()
    module.net = net()
    callback = PostHocEMASnapshots(module="net")
    callback.power_ema = PowerEMA(module.net)
    twin = pickle.loads(pickle.dumps(callback))
    assert twin.power_ema is not None and twin.power_ema.live_model is None
    twin.on_fit_start(SimpleNamespace(global_rank=0), module)  # type: ignore[arg-type]
    assert twin.power_ema.live_model is module.net


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("guarded", [False, True], ids=["plain", "skip_nonfinite"])
def test_a_copy_keeps_its_cpu_profiles_and_averages_a_cuda_model_into_them(guarded: bool) -> None:
    """The copy's profiles stay where they are (the CPU) when the model it is given lives on a GPU: each update stages
    the live values onto the profiles' device. The reference: the original, fed the same weights on the CPU."""
    model = net()
    ema = PowerEMA(model, skip_nonfinite=guarded)
    train_step(model, 1)
    ema.update()
    twin = copy.deepcopy(ema)
    cuda = net("cuda")
    cuda.load_state_dict(model.state_dict())
    twin.track(cuda)
    for step in range(2, 6):
        train_step(model, step)
        cuda.load_state_dict(model.state_dict())  # the same weights on the GPU
        ema.update()
        twin.update()
    assert all(t.device.type == "cpu" for profile in twin.profiles for t in profile.values())
    assert same(twin, ema)
    if guarded:
        with torch.no_grad():
            cuda[0].weight[0, 0] = float("nan")
        twin.update()
        assert skipped_updates(twin) == 1 and all(
            torch.isfinite(t).all() for t in twin.profiles[0].values() if t.is_floating_point()
        )
