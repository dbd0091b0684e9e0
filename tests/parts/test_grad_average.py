"""GradientAverager in one process: nothing to average, the gradients left as they are; bad input refused. The
two-process proof is ``tests/distributed/test_grad_average.py``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from copy_correct import GradientAverager


def test_one_process_is_left_alone_and_bad_input_is_refused() -> None:
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    GradientAverager([p]).average()
    assert torch.equal(p.grad, torch.full((3,), 2.0))
    with pytest.raises(ValueError, match="at least one parameter that requires grad"):
        GradientAverager([nn.Parameter(torch.ones(2), requires_grad=False)])
