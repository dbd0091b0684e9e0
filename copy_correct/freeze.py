"""``frozen(module)``: turn a module's parameters' ``requires_grad`` off for a block, and back exactly.

Copy contract: nothing is copied; only the ``requires_grad`` flags change, and on exit (also after an
exception) every parameter gets back the flag it had on entry, mixed flags included.

Inside the block a forward through the module still builds a graph for its *inputs*, so gradients flow
through it to whatever produced them (the generator, in a GAN's generator step), but backward writes no
``.grad`` into the module's parameters.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

__all__ = ["frozen"]


@contextmanager
def frozen(module: nn.Module) -> Iterator[nn.Module]:
    """Run the block with every parameter of ``module`` not requiring grad; restore the flags after."""
    flags = [(p, p.requires_grad) for p in module.parameters()]
    for p, _ in flags:
        p.requires_grad_(False)
    try:
        yield module
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)
