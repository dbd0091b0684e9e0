"""Each peer's EMA schedule in ``EMA``'s arguments: ``EMA(model, **timm_schedule(decay=0.9998))`` averages at the
calls where the peer does, with the decays it applies.

Copy contract: none; each function checks numbers and returns a new dict of ``EMA`` keyword arguments (``decay``,
``warmup``, ``warmup_power``, ``warmup_gamma``, ``warmup_offset``, ``min_decay``, ``half_life``, ``update_every``,
``start_step``; torchtitan's also the tensors it averages: ``trainable_only=True``, ``include_buffers=False``).
Settings a peer's mode does not read come back as ``DecaySchedule``'s defaults, so two calls that schedule alike give
equal dicts.

Our rule (``EMA.update``): call ``c`` (0-based) copies the weights while ``c < start_step``; from ``start_step`` an
averaging update is made when ``(c - start_step) % update_every == 0``, number ``k`` (0-based) with decay
``schedule.at(k)``. ``tests/peers/test_schedules.py`` compares every call up to 20,000 and 2,000 log-spaced calls up
to 10**7 with each peer's own code, and the averages of a small trained model.
"""

from __future__ import annotations

import math
from typing import Any

from copy_correct.core.checks import flag, integer, number

__all__ = ["diffusers_schedule", "ema_pytorch_schedule", "lightning_schedule", "timm_schedule", "torchtitan_schedule"]

_UNREAD = {"warmup_power": 2 / 3, "warmup_gamma": 1.0, "warmup_offset": 0.0, "min_decay": 0.0, "half_life": 0.05}


def _schedule(decay: float, warmup: str, start_step: int, update_every: int = 1, **ramp: float) -> dict[str, Any]:
    """The ``EMA`` keyword arguments: ``ramp`` holds what ``warmup`` reads, the rest are the defaults."""
    return {"decay": decay, "warmup": warmup, **_UNREAD, **ramp, "update_every": update_every, "start_step": start_step}


def _floor(min_decay: Any, decay: float, name: str) -> float:
    """``min_decay`` checked: in ``[0, 1)`` and not above ``decay`` (where it is, the peer applies it at every update;
    give that value as ``decay`` instead)."""
    floor = number(name, min_decay, "[0, 1)")
    if floor > decay:
        raise ValueError(
            f"{name} ({floor}) exceeds the decay ({decay}): every update would use {floor}; pass it as decay"
        )
    return floor


def timm_schedule(
    decay: float = 0.9999,
    min_decay: float = 0.0,
    update_after_step: int = 0,
    use_warmup: bool = False,
    warmup_gamma: float = 1.0,
    warmup_power: float = 2 / 3,
    step_given: bool = True,
) -> dict[str, Any]:
    """timm's ``ModelEmaV3`` (its defaults), updated as timm's ``train.py`` does: ``update(model, step=n)`` after
    optimizer step ``n = 1, 2, ...``, i.e. ``step = c + 1`` at our call ``c``.

    ``get_decay(step)`` is 0 (a copy) while ``step - update_after_step - 1 <= 0``, then ``decay``, or with
    ``use_warmup`` ``1 - (1 + s / warmup_gamma) ** -warmup_power`` clipped to ``[min_decay, decay]``, with
    ``s = c - update_after_step``: ours with ``start_step=update_after_step`` and warm-up ``"copy"`` or ``"power"``
    (update ``k`` is ``s``), equal decay for decay, in the same float64 operations; both lerp by ``1 - decay``, so
    the averages are equal bit for bit. ``min_decay`` is read only with ``use_warmup``.

    ``step_given=False``: ``update(model)`` without ``step`` uses ``decay`` from the first update, from the weights
    the EMA was built with; timm then ignores ``update_after_step`` and ``use_warmup``, and so does the mapping
    (warm-up ``"none"``). ``ModelEmaV2`` and ``ModelEma`` (default decay 0.9999) do the same:
    ``timm_schedule(decay, step_given=False)``.

    Where the averages can differ: timm averages every floating ``state_dict`` entry (BatchNorm statistics too) and
    copies integer ones, as ``EMA`` does by default; with ``exclude_buffers=True`` it copies the buffers, where
    ``EMA(include_buffers=False)`` keeps none. ``ModelEmaV2``/``ModelEma`` compute ``decay * e + (1 - decay) * m``
    instead of a lerp (float32 rounding), and a bfloat16 timm average is rounded stochastically.
    """
    decay = number("decay", decay, "[0, 1)")
    update_after_step = integer("update_after_step", update_after_step, 0)
    use_warmup = flag("use_warmup", use_warmup)
    warmup_gamma = number("warmup_gamma", warmup_gamma, "(0, inf)")
    warmup_power = number("warmup_power", warmup_power, "(0, inf)")
    min_decay = number("min_decay", min_decay, "[0, 1)")
    if not flag("step_given", step_given):
        return _schedule(decay, "none", 0)
    if not use_warmup:
        return _schedule(decay, "copy", update_after_step)
    floor = _floor(min_decay, decay, "min_decay")
    ramp = {"warmup_power": warmup_power, "warmup_gamma": warmup_gamma, "min_decay": floor}
    return _schedule(decay, "power", update_after_step, **ramp)


def diffusers_schedule(
    decay: float = 0.9999,
    min_decay: float = 0.0,
    update_after_step: int = 0,
    use_ema_warmup: bool = False,
    inv_gamma: float = 1.0,
    power: float = 2 / 3,
) -> dict[str, Any]:
    """diffusers' ``EMAModel`` (its defaults), with ``step(parameters)`` once per optimizer step.

    ``step`` raises ``optimization_step`` to ``c + 1`` at our call ``c`` before ``get_decay``, which is 0 (a copy)
    while ``s = c - update_after_step <= 0``, then ``(1 + s) / (10 + s)``, or with ``use_ema_warmup``
    ``1 - (1 + s / inv_gamma) ** -power``, clipped to ``[min_decay, decay]``: ours with ``start_step=update_after_step``
    and warm-up ``"ratio"`` or ``"power"`` (update ``k`` is ``s``), equal decay for decay, in the same float64
    operations. ``diffusers_settings(state)`` (``copy_correct.averages.peer_states``) reads these from a saved state.

    Where the averages can differ: diffusers averages parameters only (build the EMA with ``include_buffers=False``),
    copies a parameter with ``requires_grad=False`` at every step where ``EMA`` averages it, and computes
    ``s - (1 - decay) * (s - p)`` instead of a lerp (float32 rounding; its copy at decay 0 too). ``EMAModel(module)``
    given a module instead of its parameters (deprecated) turns ``use_ema_warmup`` on.
    """
    decay = number("decay", decay, "[0, 1)")
    floor = _floor(min_decay, decay, "min_decay")
    update_after_step = integer("update_after_step", update_after_step, 0)
    ramp = {"min_decay": floor}
    if flag("use_ema_warmup", use_ema_warmup):
        ramp |= {"warmup_gamma": number("inv_gamma", inv_gamma, "(0, inf)")}
        ramp |= {"warmup_power": number("power", power, "(0, inf)")}
        return _schedule(decay, "power", update_after_step, **ramp)
    number("inv_gamma", inv_gamma, "(0, inf)")
    number("power", power, "(0, inf)")
    return _schedule(decay, "ratio", update_after_step, **ramp)


def ema_pytorch_schedule(
    beta: float = 0.9999,
    update_after_step: int = 100,
    update_every: int = 10,
    inv_gamma: float = 1.0,
    power: float = 2 / 3,
    min_value: float = 0.0,
) -> dict[str, Any]:
    """ema-pytorch's ``EMA`` (its defaults), with ``update()`` once per optimizer step.

    ema-pytorch's call ``c`` copies at ``c = 0`` and at every multiple of ``update_every`` up to ``update_after_step``
    (``U``), and lerps at every multiple ``c > U`` with decay ``1 - (1 + (c - U) / inv_gamma) ** -power`` clipped to
    ``[min_value, beta]``. With ``L`` the largest multiple of ``update_every`` (``E``) not above ``U``, ours with
    ``start_step=L``, ``update_every=E``, warm-up ``"power"``, ``warmup_gamma=inv_gamma / E`` and
    ``warmup_offset=(L - U) / E`` copies at ``L`` (update 0) as ema-pytorch does, and averages at the same calls
    ``c = L + k E`` with the same ramp: ``(k + (L - U) / E) / (inv_gamma / E) = (c - U) / inv_gamma``.

    Where the averages can differ: before call ``L`` ema-pytorch's average is the weights of its last copy, ours the
    weights of the current call (from ``L`` on they are the same). ema-pytorch computes the decay in float32 torch
    operations, ours in float64 (the decays agree to float32 rounding), and never writes integer buffers into its
    average (``num_batches_tracked`` keeps the value it was built with; ``EMA`` copies the live one).
    ``param_or_buffer_names_no_ema``, ``ignore_names`` and ``update_model_with_ema_every`` have no counterpart;
    ``beta=1`` (frozen) is refused.
    """
    beta = number("beta", beta, "[0, 1)")
    update_after_step = integer("update_after_step", update_after_step, 0)
    update_every = integer("update_every", update_every, 1)
    last_copy = update_after_step // update_every * update_every
    ramp = {
        "warmup_power": number("power", power, "(0, inf)"),
        "warmup_gamma": number("inv_gamma", inv_gamma, "(0, inf)") / update_every,
        "warmup_offset": (last_copy - update_after_step) / update_every,
        "min_decay": _floor(min_value, beta, "min_value"),
    }
    return _schedule(beta, "power", last_copy, update_every, **ramp)


def lightning_schedule(
    decay: float = 0.999,
    update_every_n_steps: int = 1,
    update_starting_at_step: int | None = None,
    update_starting_at_epoch: int | None = None,
) -> dict[str, Any]:
    """Lightning's ``EMAWeightAveraging`` callback (its defaults), with ``ema.update()`` after every optimizer step
    (our call ``c`` is Lightning's ``step_idx``).

    Lightning updates at each ``step_idx >= update_starting_at_step`` that is a multiple of ``update_every_n_steps``;
    its first update copies (``AveragedModel``'s ``n_averaged == 0``), every later one uses ``decay``: ours with
    ``start_step`` the first such ``step_idx``, ``update_every=update_every_n_steps`` and warm-up ``"copy"``. The
    defaults are also torch's ``AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay))`` updated every step,
    whose lerp by ``1 - decay`` gives our floating averages bit for bit.

    ``update_starting_at_epoch`` updates at epoch ends, which no step schedule places: it is refused.

    Where the averages can differ: before ``start_step`` Lightning's average is the weights it was built with, ours
    the weights of the current call. Lightning's ``avg_fn`` (``get_ema_avg_fn``) computes ``decay * e + (1 - decay) *
    m`` instead of a lerp (float32 rounding) and, with ``use_buffers=True``, applies it to integer buffers too,
    truncating (``num_batches_tracked`` stays behind the live count; ``EMA`` copies it); so does ``AveragedModel``.
    """
    if update_starting_at_epoch is not None:
        raise ValueError(
            f"update_starting_at_epoch={update_starting_at_epoch!r} updates at epoch ends, which no step schedule "
            "places: use update_starting_at_step (steps per epoch times the epoch)"
        )
    decay = number("decay", decay, "[0, 1)")
    every = integer("update_every_n_steps", update_every_n_steps, 1)
    start = 0 if update_starting_at_step is None else integer("update_starting_at_step", update_starting_at_step, 0)
    return _schedule(decay, "copy", -(-start // every) * every, every)


def torchtitan_schedule(
    decay: float | None = None,
    half_life_fraction: float = 0.05,
    start_step: int = 0,
    step_bias: int = 0,
    update_every_n_steps: int = 1,
) -> dict[str, Any]:
    """torchtitan's ``EMAOptimizersContainer`` (its defaults), stepped as its trainer does: ``step(current_step)``
    after optimizer step ``current_step = 1, 2, ...``, i.e. ``current_step = c + 1`` at our call ``c``; and what it
    averages, the parameters that require grad (``trainable_only=True``, ``include_buffers=False``).

    torchtitan updates at each ``current_step >= start_step`` with ``(current_step - start_step) %
    update_every_n_steps == 0``, with ``decay`` or, without one, ``2 ** (-1 / (half_life_fraction * n))``, ``n =
    max((current_step - start_step + step_bias) // update_every_n_steps, 1)``, and never copies: ours with
    ``start_step`` the first such call, ``update_every=update_every_n_steps`` and warm-up ``"half_life"`` (or
    ``"none"`` with its ``decay``), whose update ``k`` has ``n = max(k + warmup_offset, 1)``, ``warmup_offset`` the
    firings before our first (1 where torchtitan's ``start_step`` is 0: its first firing is its ``n``-th step) plus
    ``step_bias // update_every_n_steps``. The decay is the same float64 expression and both lerp by ``1 - decay``, so
    from the first update on the averages are equal bit for bit; ``decay`` (ours, the ramp's ceiling) is the largest
    float below 1, which the ramp never reaches.

    Where the averages can differ: before ``start_step`` torchtitan's average is the weights it was built with, ours
    the weights of the current call (its first update then weighs them by ``2 ** (-1 / half_life_fraction)``, under
    1e-6 at 0.05).
    """
    every = integer("update_every_n_steps", update_every_n_steps, 1)
    first = integer("start_step", start_step, 0)
    bias = integer("step_bias", step_bias, 0)
    start = first - 1 if first >= 1 else every - 1  # our first call c with c + 1 = first + j * every, j >= 0
    ramp = {"half_life": number("half_life_fraction", half_life_fraction, "(0, inf)")}
    ramp["warmup_offset"] = float((start + 1 - first) // every + bias // every)
    selection = {"trainable_only": True, "include_buffers": False}
    if decay is not None:
        return _schedule(number("decay", decay, "[0, 1)"), "none", start, every) | selection
    return _schedule(math.nextafter(1.0, 0.0), "half_life", start, every, **ramp) | selection
