"""What a user coming from timm, diffusers, ema-pytorch or Lightning reaches for, answered in one line naming ours.

Copy contract: none; these only raise.

An attribute the averages do not have is looked up here (``__getattr__`` runs only for a missing attribute, so
this costs the averages' own attributes nothing): a peer's name raises ``AttributeError`` saying what it is there
and what it is here; any other name raises Python's usual message.

``EMA.step``, the count of ``update`` calls, is an ``UpdateCount``: an ``int`` in every use (arithmetic, compares,
format, ``json``), which answers diffusers' ``ema.step(model.parameters())`` naming ``ema.update(model)``. It is made
on each read from the plain ``int`` the average keeps, and ``state_dict`` saves that plain ``int``, so the counts in
our states load anywhere. A raw ``ema.step`` saved by the user pickles as this class: ``torch.load(weights_only=True)``
takes it where ``copy_correct`` is imported (it is registered as a safe global here), and refuses it, naming it,
elsewhere: save ``int(ema.step)`` for a file that must load without this package.
"""

from __future__ import annotations

from typing import NoReturn

import torch

__all__ = ["EMA_NAMES", "POWER_EMA_NAMES", "UpdateCount", "missing", "not_callable"]


class UpdateCount(int):
    """``EMA.step``: the number of ``update`` calls, an ``int``; called as diffusers' ``EMAModel.step`` is, it
    raises naming ours."""

    __slots__ = ()

    def __call__(self, *args: object, **kwargs: object) -> NoReturn:
        raise TypeError(
            f"ema.step is the number of update calls ({int(self)}), not diffusers' EMAModel.step: average the model "
            "with ema.update(model), which takes the module, not its parameters()"
        )


torch.serialization.add_safe_globals([UpdateCount])  # a raw ema.step a user saved loads where this is imported

# name -> (whose it is and what it does there, what to use here); {cls} is the class's name
EMA_NAMES = {
    "model": ("ema-pytorch's live model", "the live model is ema.live_model; the average is ema.module"),
    "ema_model": ("ema-pytorch's average", "ema.module (the average as a module) or ema.export() (a copy)"),
    "online_model": ("ema-pytorch's live model", "ema.live_model"),
    "shadow_params": ("diffusers' list of averaged parameters", "ema.shadow (a dict by state_dict name)"),
    "store": ("diffusers' backup before copy_to", "`with ema.average_weights(model):` (backs up and restores itself)"),
    "restore": ("diffusers' restore after copy_to", "`with ema.average_weights(model):` (restores on exit)"),
    "optimization_step": ("diffusers' counter", "ema.step (update calls) and ema.num_updates (averaging updates)"),
    "get_decay": ("timm's and diffusers' decay of a step", "ema.decay_at(k) (k: averaging updates, ema.num_updates)"),
    "get_current_decay": ("ema-pytorch's decay now", "ema.decay_at(ema.num_updates)"),
    "cur_decay_value": ("diffusers' last decay", "ema.decay_at(ema.num_updates - 1)"),
    "set": ("timm's copy of the model into the average", "ema.load_average(model.state_dict(), step=ema.step)"),
    "copy_params_from_model_to_ema": (
        "ema-pytorch's copy into the average",
        "ema.load_average(model.state_dict(), step=ema.step)",
    ),
    "copy_params_from_ema_to_model": ("ema-pytorch's copy into the model", "ema.copy_to(model)"),
    "eval": ("a module's eval()", "ema.module is the average as a module, in eval mode; ema.module.eval() works"),
    "train": ("a module's train()", "ema.module is the average as a module"),
    "forward": ("a module's forward", "ema.module(x), or the model inside `with ema.average_weights(model):`"),
    "to": ("a module's to()", "build the EMA after model.to(...), or EMA(model, device=...) for the average's device"),
    "parameters": ("a module's parameters()", "ema.module.parameters() (the average), ema.shadow by name"),
    "averaged_model": ("ema-pytorch's average", "ema.module"),
    "use_ema_warmup": ("diffusers' warm-up switch", "ema.schedule.warmup ('ratio' is diffusers' default ramp)"),
    "inv_gamma": ("diffusers' and ema-pytorch's ramp scale", "ema.schedule.warmup_gamma"),
    "update_after_step": ("timm's, diffusers' and ema-pytorch's start", "ema.start_step (peer_schedules maps it)"),
    "beta": ("ema-pytorch's decay", "ema.decay"),
}
POWER_EMA_NAMES = {
    "model": ("ema-pytorch's live model", "the live model is power_ema.live_model"),
    "ema_models": ("ema-pytorch's KarrasEMA per gamma", "power_ema.profiles (one dict per sigma_rel)"),
    "synthesize_ema_model": ("ema-pytorch's post-hoc average", "copy_correct.synthesize(snapshot_dir, sigma_rel)"),
    "checkpoint": ("ema-pytorch's snapshot of the profiles", "power_ema.save_snapshot(directory)"),
    "checkpoint_folder": ("ema-pytorch's snapshot directory", "power_ema.snapshot_dir"),
    "checkpoint_every_num_steps": ("ema-pytorch's snapshot period", "power_ema.snapshot_every"),
    "eval": ("a module's eval()", "the profiles are tensors: copy_correct.synthesize(...) gives an average to load"),
    "forward": ("a module's forward", "synthesize an average and load it into a model"),
}


def missing(owner: object, name: str, names: dict[str, tuple[str, str]]) -> NoReturn:
    """Raise the ``AttributeError`` for ``owner.name``: a peer's name in one line naming ours, else Python's."""
    cls = type(owner).__name__
    if name in names:
        whose, ours = names[name]
        raise AttributeError(f"{cls} has no {name!r} ({whose}): {ours}")
    raise AttributeError(f"{cls!r} object has no attribute {name!r}")


def not_callable(owner: object, names: dict[str, tuple[str, str]]) -> NoReturn:
    """``owner(x)``, a peer's module-style call of its average, refused in one line naming ours."""
    _, ours = names["forward"]
    raise TypeError(f"{type(owner).__name__} is not a module and runs nothing: {ours}")
