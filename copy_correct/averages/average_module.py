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

from collections.abc import Mapping
from copy import deepcopy

import torch
from torch import nn

from copy_correct.core.module_tensors import state_entries

__all__ = ["average_module"]


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
