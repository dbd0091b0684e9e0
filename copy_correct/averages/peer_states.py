"""Load a peer's saved average into ours with its counters, so the average goes on where the peer's left off: never
a silent restart. Each refusal is one ``ValueError`` line saying what is wrong and what to do.

Copy contract: the peer's tensors are only read; ``EMA.load_average`` and ``PowerEMA.load_state_dict`` copy them into
the average's own tensors in place (nothing of the state is kept or aliased). Nothing else is written.

``tests/peers/test_states.py`` trains with each peer, loads its state here, goes on with both on the same steps and
compares the averages.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from copy_correct.averages.ema import EMA
from copy_correct.averages.peer_schedules import diffusers_schedule
from copy_correct.averages.power_ema import PowerEMA
from copy_correct.core.checks import integer

__all__ = ["diffusers_settings", "load_diffusers_state", "load_ema_pytorch_state", "load_posthoc_ema_state"]

_DIFFUSERS_SETTINGS = ("decay", "min_decay", "update_after_step", "use_ema_warmup", "inv_gamma", "power")


def _keys(state: Any, needed: tuple[str, ...], what: str) -> None:
    """``ValueError`` unless ``state`` is a mapping holding every key of ``needed`` (``what`` names its kind)."""
    if not isinstance(state, Mapping):
        raise ValueError(f"expected {what}, got {type(state).__name__}")
    absent = [key for key in needed if key not in state]
    if absent:
        raise ValueError(f"not {what}: it has no {', '.join(map(repr, absent))}")


def _count(value: Any, name: str) -> int:
    """A saved counter (an int or a 0-dim integer tensor) as an int >= 0, else a ``ValueError`` naming it."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_floating_point():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"the state's {name} must be a count (an int >= 0), got {value!r}")
    return value


def _by_name(weights: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], what: str) -> dict:
    """``weights`` restricted to ``expected``'s names, each of its shape; ``ValueError`` naming the first missing
    name or shape difference."""
    for name, ours in expected.items():
        if name not in weights:
            raise ValueError(f"{what} has no {name!r}: it is not an average of this model")
        if tuple(weights[name].shape) != tuple(ours.shape):
            raise ValueError(f"{what} has {name!r} of shape {tuple(weights[name].shape)}, ours {tuple(ours.shape)}")
    return {name: weights[name] for name in expected}


def diffusers_settings(state: Mapping[str, Any]) -> dict[str, Any]:
    """The schedule settings of a diffusers ``EMAModel.state_dict()``, as ``diffusers_schedule``'s arguments:
    ``EMA(model, include_buffers=False, **diffusers_schedule(**diffusers_settings(state)))`` builds the EMA that
    ``load_diffusers_state`` continues it in. A new dict; the state is only read."""
    _keys(state, _DIFFUSERS_SETTINGS, "a diffusers EMAModel.state_dict()")
    return {key: state[key] for key in _DIFFUSERS_SETTINGS}


def load_diffusers_state(ema: EMA, state: Mapping[str, Any]) -> None:
    """Continue a diffusers ``EMAModel`` in ``ema``: its ``shadow_params`` (in ``model.parameters()`` order) become
    ``ema``'s average by parameter name, with ``step=optimization_step`` (the updates ``EMAModel.step`` made).

    Refused, in one line: a state that is not an ``EMAModel.state_dict()``; an ``ema`` whose schedule is not
    ``diffusers_schedule`` of the saved settings (the first setting that differs is named, with the call that builds
    the right EMA); shadow parameters of another count or shape than the tracked model's parameters; an ``ema`` that
    also averages buffers, which diffusers does not keep (build it with ``include_buffers=False``)."""
    _keys(state, (*_DIFFUSERS_SETTINGS, "optimization_step", "shadow_params"), "a diffusers EMAModel.state_dict()")
    expected = diffusers_schedule(**diffusers_settings(state))
    ours = ema.schedule_state()
    for name, value in expected.items():
        if ours[name] != value:
            raise ValueError(
                f"the EMA's {name} is {ours[name]!r}, the diffusers state's schedule has {value!r}: build "
                "EMA(model, include_buffers=False, **diffusers_schedule(**diffusers_settings(state)))"
            )
    model = ema.live_model
    if model is None:
        raise ValueError("this EMA tracks no model (a copy): give it one with ema.track(model) before loading")
    shadow_params = state["shadow_params"]
    parameters = list(model.parameters())
    if not isinstance(shadow_params, (list, tuple)) or len(shadow_params) != len(parameters):
        count = len(shadow_params) if isinstance(shadow_params, (list, tuple)) else type(shadow_params).__name__
        raise ValueError(f"the diffusers state has {count} shadow_params, the model {len(parameters)} parameters")
    index = {id(p): i for i, p in enumerate(parameters)}
    weights = {name: shadow_params[index[id(p)]] for name, p in model.named_parameters(remove_duplicate=False)}
    buffers = sorted(set(ema.shadow) - set(weights))
    if buffers:
        raise ValueError(
            f"this EMA also averages buffers ({', '.join(map(repr, buffers[:3]))}), which a diffusers state does not "
            "hold: build it with include_buffers=False"
        )
    weights = _by_name(weights, ema.shadow, "the diffusers state")
    ema.load_average(weights, step=_count(state["optimization_step"], "optimization_step"))


def load_ema_pytorch_state(ema: EMA, state: Mapping[str, Any]) -> None:
    """Continue an ema-pytorch ``EMA`` in ``ema``: the ``ema_model.`` entries of its ``state_dict()`` become
    ``ema``'s average, with ``step`` (its ``update()`` calls). The state holds no schedule: build ``ema`` with
    ``EMA(model, **ema_pytorch_schedule(...))`` of the same arguments as the ema-pytorch ``EMA``. Loaded before that
    schedule's ``start_step``, the two averages differ until it (``ema_pytorch_schedule`` says why), not after.

    Refused, in one line: a state without ``initted``, ``step`` or ``ema_model.`` entries; one not initted (no update
    made: nothing averaged to load); one lacking a tensor of ``ema``'s average or holding it in another shape.
    ema-pytorch never writes integer buffers into its average: ``num_batches_tracked`` is loaded as saved, and the
    next update copies the live one."""
    _keys(state, ("initted", "step"), "an ema-pytorch EMA.state_dict()")
    if not bool(state["initted"]):
        raise ValueError(
            "the ema-pytorch state is not initted: it made no update, so it holds no average to load; start "
            "EMA(model, **ema_pytorch_schedule(...)) afresh instead"
        )
    prefix = "ema_model."
    weights = {key[len(prefix) :]: t for key, t in state.items() if key.startswith(prefix)}
    if not weights:
        raise ValueError("not an ema-pytorch EMA.state_dict(): it has no 'ema_model.' entries")
    ema.load_average(_by_name(weights, ema.shadow, "the ema-pytorch state"), step=_count(state["step"], "step"))


def load_posthoc_ema_state(power_ema: PowerEMA, state: Mapping[str, Any], *, update_every: int) -> None:
    """Continue an ema-pytorch ``PostHocEMA`` in ``power_ema``: ``ema_models.<i>`` becomes profile ``i``.
    ``power_ema`` must be built with ``PostHocEMA``'s ``sigma_rels`` in its order (the state holds no ``gammas``) and
    ``update_every=1``; ``update_every`` is ``PostHocEMA``'s, which the state does not hold either (ema-pytorch's
    default is 100).

    ``KarrasEMA``'s update after ``c`` calls uses ``beta = (1 - 1/(c + 2)) ** (gamma + 1)``, which is
    ``PowerEMA``'s ``(previous / step) ** (gamma + 1)`` at ``step = c + 2``: its first weights count for two steps.
    After ``N`` calls its profiles are ours at ``step = updated_step = N + 1``, and so loaded they go on as
    KarrasEMA's: bit for bit in the tests (sigma_rels 0.05 and 0.10), to float32 rounding in general (the two compute
    ``gamma`` and ``beta`` in different float64 operations). Loaded at ``step = N`` they drift (2e-4 after 150 more
    steps in the tests).

    Refused, in one line: ``update_every > 1``, where ``KarrasEMA`` applies the one-step ``beta`` on every n-th step
    and no counters make ours (``beta`` for the n steps since the last update) continue it; a profile count that is
    not ``len(power_ema.sigma_rels)``; profiles not initted (nothing averaged), of different steps, or lacking a
    tensor of ours or holding it in another shape."""
    if integer("update_every", update_every, 1) != 1:
        raise ValueError(
            f"PostHocEMA with update_every={update_every!r} cannot be continued: its KarrasEMA applies the one-step "
            "beta on every n-th step, PowerEMA's beta stands for the n steps; only update_every=1 maps exactly"
        )
    if power_ema.update_every != 1:
        raise ValueError(f"power_ema has update_every={power_ema.update_every}: build it with update_every=1")
    _keys(state, (), "a PostHocEMA.state_dict()")
    models: dict[int, dict[str, Any]] = {}
    for key, value in state.items():
        head, _, rest = key.partition(".")
        index, _, name = rest.partition(".")
        if head == "ema_models" and index.isdigit():
            models.setdefault(int(index), {})[name] = value
    if sorted(models) != list(range(len(power_ema.sigma_rels))):
        raise ValueError(
            f"the PostHocEMA state has {len(models)} ema_models, power_ema {len(power_ema.sigma_rels)} sigma_rels: "
            "build PowerEMA with PostHocEMA's sigma_rels, in its order"
        )
    profiles, steps = [], set()
    for i in sorted(models):
        what = f"ema_models.{i} of the PostHocEMA state"
        _keys(models[i], ("initted", "step"), f"a KarrasEMA state ({what})")
        if not bool(models[i]["initted"]):
            raise ValueError(f"{what} is not initted: it made no update, so it holds no average to load")
        steps.add(_count(models[i]["step"], f"ema_models.{i}.step"))
        weights = {key[len("ema_model.") :]: t for key, t in models[i].items() if key.startswith("ema_model.")}
        profiles.append(_by_name(weights, power_ema.profiles[i], what))
    if len(steps) != 1:
        raise ValueError(f"the PostHocEMA state's ema_models are at different steps {sorted(steps)}: not one run")
    step = steps.pop() + 1
    power_ema.load_state_dict(
        {"sigma_rels": list(power_ema.sigma_rels), "step": step, "updated_step": step, "profiles": profiles}
    )
