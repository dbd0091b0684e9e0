"""``average_module``: a module of the model's class whose parameters and buffers are an average's own tensors.

Copy contract: the module's structure (submodules, settings, hooks) is a ``copy.deepcopy`` of the model's, but no
tensor the average holds is copied: each parameter is a new ``nn.Parameter`` object (``requires_grad=False``) on the
average's storage, each averaged buffer is the average's tensor itself, so the module holds the average at all
times, at no memory cost, and a write into it (``load_state_dict``, timm's ``load_checkpoint``, a forward in training
mode updating BatchNorm statistics) is a write into the average. A buffer the average leaves out
(``include_buffers=False``, ``trainable_only``, ``exclude``) is the model's own object, shared; a parameter it leaves
out is a new ``nn.Parameter`` (``requires_grad=False``) on the live parameter's storage: its live values, no copy.
Tensors that are plain attributes (not parameters or buffers) are deep-copied, as ``export`` copies them. Autograd:
the parameters need no grad, so nothing done with the module records a graph through the average.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from copy import deepcopy
from typing import Any

import torch
from torch import nn

from copy_correct.averages.batch_norm import first_item, recompute_statistics
from copy_correct.core.checks import integer
from copy_correct.core.module_tensors import state_entries

__all__ = ["AverageAsModule", "average_module"]


def average_module(model: nn.Module, averages: Mapping[str, torch.Tensor]) -> nn.Module:
    """The module described above, in eval mode; ``averages`` maps the model's ``state_dict`` names that are averaged
    to the average's tensors (names sharing one tensor in the model share one in ``averages``)."""
    memo: dict[int, torch.Tensor] = {}
    for name, tensor, owner in state_entries(model):
        if id(tensor) in memo or (name not in averages and owner is not None):
            continue
        if name not in averages:  # a parameter left out of the average: its live storage, without grad
            memo[id(tensor)] = nn.Parameter(tensor.detach(), requires_grad=False)
            continue
        average = averages[name]
        memo[id(tensor)] = nn.Parameter(average, requires_grad=False) if owner is None else average
    for buffer in model.buffers():  # the buffers left out of the average: shared, not copied
        memo.setdefault(id(buffer), buffer)
    return deepcopy(model, memo).eval()


class AverageAsModule:
    """``EMA``'s average as a module (``module``) and its BatchNorm statistics recomputed there (``update_bn``); the
    class it is mixed into keeps the shadows (``copy_correct.averages.shadow.Shadows``) and ``_swap``."""

    _module: nn.Module | None
    _swap: Any
    sharded: bool
    shadow: dict[str, torch.Tensor]

    @property
    def module(self) -> nn.Module:
        """The average as a module of the model's class, in eval mode, made on first use, whose tensors are the
        shadow's own storage (``copy_correct.averages.average_module``): for evaluation, ``save_pretrained``, timm's
        ``CheckpointSaver``. Its ``load_state_dict`` is refused, naming ``load_average``."""
        tracked = self._tracked(None)
        if self.sharded:
            raise RuntimeError(
                "EMA.module would deep-copy the model's structure, which FSDP2 forbids for a sharded one: load "
                "ema.full_state_dict() (gathered once) into an unsharded instance of the model instead"
            )
        if self._watch.stale():  # read per batch in an evaluation loop: the walk only after a registration
            self._check_model(tracked)
        if self._module is None:
            self._module = average_module(tracked, self.shadow)
            self._module.register_load_state_dict_pre_hook(_counterless_load)
        return self._module

    def update_bn(
        self,
        loader: Iterable[Any],
        *,
        batches: int | None = None,
        to_input: Callable[[Any], Any] = first_item,
        device: str | torch.device | None = None,
    ) -> int:
        """Recompute the average's BatchNorm running statistics by forward passes of the averaged weights (``module``)
        over ``loader``, as ``torch.optim.swa_utils.update_bn`` does for a model (``copy_correct.averages.batch_norm``),
        into the shadow; the live model is not touched, and the next ``update`` averages on from them. ``batches``:
        at most this many; ``to_input``: a batch to the module's input (default: a list's or tuple's first item);
        ``device``: where the inputs go. The number of batches run. Refused in one line: inside ``average_weights``,
        for a sharded model, and for an average that does not keep the statistics."""
        if self._swap is not None:
            raise RuntimeError("EMA.update_bn inside EMA.average_weights: call it before or after the block")
        if self.sharded:
            raise RuntimeError("EMA.update_bn runs the average as a module, which a sharded (FSDP2) EMA cannot make")
        if batches is not None:
            batches = integer("batches", batches, 1)
        target = torch.device(device) if device is not None else None
        return recompute_statistics(self.module, self.shadow, loader, batches=batches, to_input=to_input, device=target)


def _counterless_load(module: nn.Module, *_: Any) -> None:
    """``EMA.module``'s ``load_state_dict`` pre-hook: refuse, naming the load that keeps the counters."""
    raise RuntimeError(
        "ema.module.load_state_dict would replace the average without its counters (the next warm-up update would "
        "copy the live weights over it): load an average with ema.load_average(state_dict, step=n), n the update "
        "calls it stands for, or an EMA state with ema.load_state_dict(state)"
    )
