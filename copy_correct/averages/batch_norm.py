"""``recompute_statistics``: the BatchNorm running statistics of an average, recomputed by forward passes of the
averaged weights, as ``torch.optim.swa_utils.update_bn`` recomputes a model's.

Why: an average's BatchNorm statistics averaged step by step are not the statistics of the averaged weights (the
activations they normalise come from other weights), which is why torch's SWA recomputes them and ema-pytorch #29
asks for it. Each BatchNorm's statistics are reset and its momentum set to ``None`` (a cumulative average over the
batches), the module runs in training mode over the loader under ``no_grad``, and the momenta and modes are put back.

Copy contract: the module given is ``EMA.module``, whose buffers are the shadow's own tensors, so the statistics are
written into the average in place and nothing else: the live model, its statistics and its parameters are not
touched, and nothing is allocated beyond the forward passes' activations. The random number generators (the CPU's,
the CUDA devices' the average lives on, and a ``DataLoader``'s own ``generator=`` and its sampler's) are restored
afterwards, so the numbers the loader's shuffling and any dropout drew are drawn again by the training that follows:
a run with ``update_bn`` trains as one without. Autograd sees nothing.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["batch_norms", "first_item", "recompute_statistics"]

_NONE = object()


def first_item(batch: Any) -> Any:
    """A batch's input, as ``swa_utils.update_bn`` takes it: the first item of a list or tuple, else the batch."""
    return batch[0] if isinstance(batch, (list, tuple)) else batch


def batch_norms(module: nn.Module) -> dict[str, _BatchNorm]:
    """The BatchNorm layers of ``module`` that keep running statistics, by name."""
    return {
        name: layer
        for name, layer in module.named_modules()
        if isinstance(layer, _BatchNorm) and layer.track_running_stats
    }


def recompute_statistics(
    module: nn.Module,
    averaged: Mapping[str, torch.Tensor],
    loader: Iterable[Any],
    *,
    batches: int | None,
    to_input: Callable[[Any], Any],
    device: torch.device | None,
) -> int:
    """Recompute the statistics of ``module``'s BatchNorm layers over ``loader`` (at most ``batches`` batches, each
    through ``to_input``, moved to ``device`` when given); the number of batches run. ``averaged`` are the average's
    tensors by name: a layer whose statistics are not among them (shared with the live model) is refused in one line,
    before anything is written; so are a module with no BatchNorm statistics and a loader with no batch."""
    layers = batch_norms(module)
    if not layers:
        raise ValueError(f"update_bn: {type(module).__name__} has no BatchNorm with running statistics to recompute")
    missing = [f"{name}.running_mean" for name in layers if f"{name}.running_mean" not in averaged]
    if missing:
        raise ValueError(
            f"update_bn writes the average's BatchNorm statistics, and {missing[0]!r} is not averaged (include_buffers"
            "=False, trainable_only or exclude left it out): build the EMA with those buffers, or recompute a model's "
            "own statistics with torch.optim.swa_utils.update_bn"
        )
    devices = sorted({t.device.index or 0 for t in averaged.values() if t.device.type == "cuda"})
    generators = _generators(loader)
    states = [generator.get_state() for generator in generators]
    try:
        with torch.random.fork_rng(devices=devices):  # the loader's shuffling and any dropout draw from a copy
            iterator = iter(loader)
            first = next(iterator, _NONE)
            if first is _NONE or batches == 0:
                raise ValueError("update_bn: the loader gave no batch, and statistics of no batch would be none")
            return _run(module, layers, itertools.chain([first], iterator), batches, to_input, device)
    finally:
        for generator, saved in zip(generators, states, strict=True):
            generator.set_state(saved)


def _generators(loader: Any) -> list[torch.Generator]:
    """The generators a ``DataLoader`` draws its order and its workers' seeds from (``generator=``, its sampler's),
    each once."""
    sampler = getattr(loader, "sampler", None)
    batch_sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    found = [getattr(holder, "generator", None) for holder in (loader, sampler, batch_sampler)]
    return list({id(g): g for g in found if isinstance(g, torch.Generator)}.values())


def _run(
    module: nn.Module,
    layers: Mapping[str, _BatchNorm],
    batches_given: Iterable[Any],
    batches: int | None,
    to_input: Callable[[Any], Any],
    device: torch.device | None,
) -> int:
    """The statistics reset, then the passes in training mode under ``no_grad``; momenta and modes put back."""
    momenta = {layer: layer.momentum for layer in layers.values()}
    modes = {layer: layer.training for layer in module.modules()}
    count = 0
    try:
        with torch.no_grad():
            for layer in layers.values():
                layer.reset_running_stats()
                layer.momentum = None  # a cumulative average over the batches
            module.train()
            for batch in batches_given:
                if batches is not None and count >= batches:
                    break
                inputs = to_input(batch)
                module(inputs.to(device) if device is not None else inputs)
                count += 1
    finally:
        for layer, momentum in momenta.items():
            layer.momentum = momentum
        for layer, training in modes.items():
            layer.training = training
    return count
