"""frozen(): flags off inside, restored exactly after (mixed flags, exceptions); gradients still reach inputs."""

import pytest
import torch
from torch import nn

from copy_correct import frozen


def test_no_gradient_reaches_the_frozen_module_but_its_input_gets_one() -> None:
    producer, critic = nn.Linear(4, 4), nn.Linear(4, 1)
    out = producer(torch.randn(8, 4))
    with frozen(critic):
        critic(out).sum().backward()
    assert all(p.grad is None for p in critic.parameters())
    assert all(p.grad is not None for p in producer.parameters())

    out = producer(torch.randn(8, 4))  # the control: without frozen() the critic is written too
    critic(out).sum().backward()
    assert all(p.grad is not None for p in critic.parameters())


def test_mixed_flags_are_restored_exactly_even_after_an_exception() -> None:
    module = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    module[0].bias.requires_grad_(False)
    before = [p.requires_grad for p in module.parameters()]
    with pytest.raises(RuntimeError, match="boom"), frozen(module):
        assert not any(p.requires_grad for p in module.parameters())
        raise RuntimeError("boom")
    assert [p.requires_grad for p in module.parameters()] == before == [True, False, True, True]
