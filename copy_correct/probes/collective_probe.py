"""``CollectiveProbe``: the collectives (all-gather, reduce-scatter, all-reduce, broadcast, barrier ...) a block
of code issues on this rank, with the bytes each one carries.

Copy contract: the probe copies nothing and keeps no tensor; it records op names and sizes only.

    with CollectiveProbe() as probe:      # enter it on every rank
        ema.update(model)
    assert probe.count == 0, probe.summary()

How: a ``TorchDispatchMode`` that sees every op below autograd on this thread, and records those of the two
namespaces torch's collectives dispatch through: ``c10d`` (``torch.distributed.all_reduce``, ``broadcast``,
``all_gather_into_tensor``, ``barrier``, ``all_gather_object`` ..., and FSDP2's all-gathers and reduce-scatters) and
``_c10d_functional`` (the functional collectives behind ``DTensor.full_tensor()`` and other redistributions). A
collective issued by another thread (a communication hook running in autograd's backward threads) is not seen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from copy_correct.core.torch_internals import TorchDispatchMode, tree_leaves

__all__ = ["CollectiveProbe"]

_NAMESPACES = ("c10d", "_c10d_functional")
_BOOKKEEPING = {"wait_tensor", "_wrap_tensor_autograd"}  # waits on a functional collective: not a collective


@dataclass(frozen=True)
class Collective:
    """One collective: its op name (``c10d.allreduce_``) and the bytes of the tensors it was given."""

    op: str
    nbytes: int


class CollectiveProbe(TorchDispatchMode):
    """Context manager recording the collectives issued inside it: ``.collectives``, ``.count``, ``.nbytes``."""

    def __init__(self) -> None:
        super().__init__()
        self.collectives: list[Collective] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        namespace = func.namespace
        name = func.overloadpacket.__name__
        if namespace in _NAMESPACES and name not in _BOOKKEEPING:
            sent = sum(t.numel() * t.element_size() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
            self.collectives.append(Collective(f"{namespace}.{name}", sent))
        return func(*args, **kwargs)

    @property
    def count(self) -> int:
        """How many collectives were issued."""
        return len(self.collectives)

    @property
    def nbytes(self) -> int:
        """The bytes of the tensors given to them (inputs and output buffers alike)."""
        return sum(c.nbytes for c in self.collectives)

    def summary(self) -> str:
        """One line per kind of collective: count and bytes."""
        kinds: dict[str, list[int]] = {}
        for c in self.collectives:
            kinds.setdefault(c.op, []).append(c.nbytes)
        if not kinds:
            return "no collectives"
        return "\n".join(f"{op} x{len(sizes)}, {sum(sizes)} bytes" for op, sizes in sorted(kinds.items()))
