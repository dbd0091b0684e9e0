"""``FiniteCheck``: whether tensors on the CPU hold only finite values, decided on the host from one reduction per
tensor, for the guarded updates' CPU path (``copy_correct._nonfinite.HostGuard``).

Copy contract: the check reads each tensor once and writes only its own scratch, allocated at construction (one
element per small tensor, one per leading-dimension row of a large one, two per half-precision tensor); a call
allocates nothing, not even inside a kernel, and reads two numbers back (a CPU tensor's value: no sync). The tensors
are never written and autograd sees nothing (it runs under the caller's ``no_grad``).

How, and why it is exact:

* A float32/float64 tensor is summed, its sum written into the scratch: a sum is NaN or infinite when any element is
  (NaN propagates; ``inf + -inf`` is NaN), and finite when every element is, unless the finite elements' sum overflows.
  A sum to a single element of more than ``GRAIN`` elements runs in two passes over a per-thread buffer that the
  kernel allocates, so a large tensor is summed per row of its first dimension instead (its own rows of the scratch,
  no buffer; the same single read of every element).
* A float16/bfloat16 tensor (a half-precision average's staging) and a large one-dimensional one are reduced by
  ``aminmax`` into two elements of the scratch: no overflow, and a sum in float32 would cast the tensor to a new one
  first.
* ``aminmax`` of the scratch says whether every partial result is finite. If one is not, each tensor whose partial
  result is not finite is read again with ``aminmax`` (exact: a minimum and a maximum cannot overflow), so a finite
  tensor whose sum overflowed still counts as finite: an update is never skipped for an overflow.

A sum streams the tensor at the machine's read bandwidth (``aminmax``, computing two results per element, measured
2.4x slower on the benchmarks' models, 2 CPU threads), so the check costs one read of the weights: a third of an
update in place that reads two tensors and writes one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["GRAIN", "FiniteCheck"]

GRAIN = 32768  # at::internal::GRAIN_SIZE: a reduction of more elements runs in parallel
_HALF = (torch.float16, torch.bfloat16)
_sum = torch._C._VariableFunctions.sum  # torch.sum without its Python wrapper: called per tensor, per update


class _Plan:
    """How one group (one dtype, on the CPU) is reduced: per tensor, its view of the scratch and the dims to sum
    (``None``: ``aminmax`` into two elements of the scratch)."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        dtype = tensors[0].dtype
        sizes: list[int] = []
        self.dims: list[tuple[int, ...] | None] = []
        for t in tensors:
            if t.numel() == 0 or (t.numel() <= GRAIN and dtype not in _HALF):  # one element: a serial sum
                sizes.append(1)
                self.dims.append(tuple(range(t.dim())))
            elif t.dim() >= 2 and t.shape[0] >= 2 and dtype not in _HALF:  # one element per row: no buffer
                sizes.append(t.shape[0])
                self.dims.append(tuple(range(1, t.dim())))
            else:
                sizes.append(2)
                self.dims.append(None)
        self.scratch = torch.zeros(sum(sizes), dtype=dtype)
        self.outs: list[torch.Tensor] = []  # per tensor, its elements of the scratch
        offset = 0
        for size in sizes:
            self.outs.append(self.scratch[offset : offset + size])
            offset += size
        self.targets = [  # where each reduction writes: an element, the rows, or a minimum and a maximum
            out.view(()) if dims is not None and out.numel() == 1 else (out[0], out[1]) if dims is None else out
            for out, dims in zip(self.outs, self.dims, strict=True)
        ]
        self.low, self.high = torch.zeros((), dtype=dtype), torch.zeros((), dtype=dtype)

    def reduce(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Write every tensor's partial results into the scratch; whether all of them are finite."""
        for t, target, dims in zip(tensors, self.targets, self.dims, strict=True):
            if dims is None:
                torch.aminmax(t, out=target)
            else:
                _sum(t, dims, False, out=target)
        return self._finite(self.scratch)

    def exact(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether every tensor is finite, reading again with ``aminmax`` each one whose partial results are not."""
        return all(self._finite(out) or self._finite(t) for t, out in zip(tensors, self.outs, strict=True))

    def _finite(self, t: torch.Tensor) -> bool:
        if t.numel() == 0:
            return True
        torch.aminmax(t, out=(self.low, self.high))
        return math.isfinite(self.low.item()) and math.isfinite(self.high.item())


class FiniteCheck:
    """Whether the tensors of ``groups`` (per group: tensors of one floating dtype, on the CPU) hold only finite values;
    ``finite`` takes tensors of the same shapes and dtypes each call (the live values, resolved anew)."""

    def __init__(self, groups: Sequence[Sequence[torch.Tensor]]) -> None:
        for tensors in groups:
            if any(t.device.type != "cpu" or t.dtype != tensors[0].dtype for t in tensors):
                raise ValueError("FiniteCheck takes groups of CPU tensors of one dtype each")
        self.plans = [_Plan(tensors) for tensors in groups if tensors]

    def finite(self, groups: Sequence[Sequence[torch.Tensor]]) -> bool:
        """True when every element of every tensor is finite (exactly: see the module's docstring)."""
        values = [tensors for tensors in groups if tensors]
        ok = [plan.reduce(tensors) for plan, tensors in zip(self.plans, values, strict=True)]
        if all(ok):
            return True
        return all(good or plan.exact(t) for good, plan, t in zip(ok, self.plans, values, strict=True))
