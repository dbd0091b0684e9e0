"""``EMA`` and ``PowerEMA`` are one shadow machinery (``copy_correct.averages.shadow``): the same misuse raises the same
exception with the same words in both, the same argument has the same name, and the skip count is read one way."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable

import pytest
import torch
from torch import nn

from copy_correct import EMA, PowerEMA, skipped_updates

AVERAGES: dict[str, Callable[..., EMA | PowerEMA]] = {"EMA": EMA, "PowerEMA": PowerEMA}


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))


@pytest.mark.parametrize("kind", AVERAGES)
def test_a_copy_with_no_model_is_a_runtime_error_naming_track(kind: str) -> None:
    twin = pickle.loads(pickle.dumps(AVERAGES[kind](net())))
    with pytest.raises(RuntimeError, match=rf"^this {kind} is a copy \(pickle or copy.deepcopy\) and tracks no model"):
        twin.update()


@pytest.mark.parametrize("kind", AVERAGES)
def test_another_model_is_a_value_error_in_both(kind: str) -> None:
    average = AVERAGES[kind](net())
    with pytest.raises(ValueError, match=rf"^this {kind} was built for another model object"):
        average.update(net())
    with pytest.raises(ValueError, match=rf"^this {kind} was built for another model object"):
        average.track(net())


@pytest.mark.parametrize("kind", AVERAGES)
def test_a_copy_given_a_model_of_other_shapes_names_the_tensor(kind: str) -> None:
    twin = copy.deepcopy(AVERAGES[kind](net()))
    other = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
    with pytest.raises(ValueError, match=rf"^this {kind} cannot track the model: '0.weight' is \(8, 4\)"):
        twin.track(other)
    assert twin.live_model is None  # refused whole: still a copy with no model


@pytest.mark.parametrize("kind", AVERAGES)
def test_a_changed_model_is_named_alike(kind: str) -> None:
    model = net()
    average = AVERAGES[kind](model)
    model[2] = nn.Linear(8, 3)
    with pytest.raises(RuntimeError, match=rf"^{kind}: .*'2.weight'"):
        average.update()


@pytest.mark.parametrize("kind", AVERAGES)
def test_the_float32_copy_of_a_bf16_model_is_shadow_dtype_in_both(kind: str) -> None:
    model = net().to(torch.bfloat16)
    made = AVERAGES[kind](model)
    chosen = AVERAGES[kind](model, shadow_dtype=torch.float64)
    first = made.shadow if kind == "EMA" else made.profiles[0]
    second = chosen.shadow if kind == "EMA" else chosen.profiles[0]
    assert first["0.weight"].dtype == torch.float32 and second["0.weight"].dtype == torch.float64
    with pytest.raises(TypeError, match=r"^shadow_dtype must be a floating torch\.dtype"):
        AVERAGES[kind](model, shadow_dtype="bfloat16")


@pytest.mark.parametrize("kind", AVERAGES)
def test_skip_counts_are_read_one_way(kind: str) -> None:
    model = net()
    average = AVERAGES[kind](model, skip_nonfinite=True)
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    average.update()
    assert skipped_updates(average) == 1 and skipped_updates(AVERAGES[kind](net())) == 0
    assert not hasattr(type(average), "skipped")


def test_control_the_checks_tell_the_two_apart() -> None:
    """The messages above are matched from their first character: an EMA's message does not pass for a PowerEMA's."""
    twin = pickle.loads(pickle.dumps(EMA(net())))
    with pytest.raises(RuntimeError) as raised:
        twin.update()
    assert str(raised.value).startswith("this EMA ") and not str(raised.value).startswith("this PowerEMA ")
