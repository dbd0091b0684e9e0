"""``FiniteCheck``: whether tensors on the CPU hold only finite values, decided on the host from one reduction per
tensor, for the guarded updates' CPU path (``EMA``, ``PowerEMA``, ``hard_update``, ``soft_update``).

Copy contract: the check reads each tensor once and writes only its own scratch, allocated at construction (one
element per small tensor, one per leading-dimension row of a large one, two per half-precision tensor); a call
allocates nothing, not even inside a kernel, and reads one or two numbers back (a CPU tensor's value: no sync). The
tensors are never written and autograd sees nothing (it runs under the caller's ``no_grad``).

How, and why it is exact:

* A float32/float64 tensor is summed, its sum written into the scratch: a sum is NaN or infinite when any element is
  (NaN propagates; ``inf + -inf`` is NaN), and finite when every element is, unless the finite elements' sum overflows.
  A sum to a single element of more than ``GRAIN`` elements runs in two passes over a per-thread buffer that the
  kernel allocates, so a large tensor is summed per row of its first dimension instead, into its own rows of the
  scratch: as a matrix-vector product with a vector of ones (BLAS's gemv; the rows of a tensor that is not contiguous,
  by the sum kernel). Both read every element once; from memory, gemv read the benchmarks' weights in 0.36-0.40 of
  the time of the in-place lerp of the same tensors, the sum kernel in about 0.5 (2 CPU threads).
* A float16/bfloat16 tensor (a half-precision average's staging) and a large one-dimensional one are reduced by
  ``aminmax`` into two elements of the scratch: no overflow, and a sum in float32 would cast the tensor to a new one
  first.
* A sum of the scratch (``aminmax`` when it is larger than ``GRAIN`` or not finite) says whether every partial result
  is finite. If one is not, each tensor whose partial result is not finite is read again with ``aminmax`` (exact: a
  minimum and a maximum cannot overflow), so a finite tensor whose sum overflowed still counts as finite: an update is
  never skipped for an overflow.

So the check costs one read of the weights, where an update in place reads two tensors and writes one: a third of it
if a read-only stream moved bytes as fast as the update's streams; on the 2-core machine of ``docs/benchmarks.md`` it
moves them a little slower, and the check measures 0.36-0.40 of the update.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["GRAIN", "FiniteCheck"]

GRAIN = 32768  # at::internal::GRAIN_SIZE: a reduction of more elements runs in parallel
_GEMV = 1 << 20  # from this many elements the rows are summed by gemv, which reads faster; below, its call costs more
_HALF = (torch.float16, torch.bfloat16)
_sum = torch._C._VariableFunctions.sum  # torch.sum without its Python wrapper: called per tensor, per update


class _Plan:
    """How one group (one dtype, on the CPU) is reduced, per tensor: into which elements of the scratch, and how
    (``hows``: the dims to sum; a vector of ones to multiply the rows by; ``None``: ``aminmax``)."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        dtype = tensors[0].dtype
        sizes: list[int] = []
        self.hows: list[tuple[int, ...] | torch.Tensor | None] = []
        widest = max((t.numel() // t.shape[0] for t in tensors if t.dim() >= 2 and t.shape[0]), default=0)
        ones = torch.ones(widest, dtype=dtype)
        for t in tensors:
            if t.numel() == 0 or (t.numel() <= GRAIN and dtype not in _HALF):  # one element: a serial sum
                sizes.append(1)
                self.hows.append(tuple(range(t.dim())))
            elif t.dim() >= 2 and t.shape[0] >= 2 and dtype not in _HALF:  # one element per row
                sizes.append(t.shape[0])
                self.hows.append(ones[: t.numel() // t.shape[0]] if t.numel() >= _GEMV else tuple(range(1, t.dim())))
            else:
                sizes.append(2)
                self.hows.append(None)
        self.scratch = torch.zeros(sum(sizes), dtype=dtype)
        self.outs: list[torch.Tensor] = []  # per tensor, its elements of the scratch
        offset = 0
        for size in sizes:
            self.outs.append(self.scratch[offset : offset + size])
            offset += size
        self.targets = [  # where each reduction writes: an element, the rows, or a minimum and a maximum
            (out[0], out[1]) if how is None else out.view(()) if out.numel() == 1 else out
            for out, how in zip(self.outs, self.hows, strict=True)
        ]
        self.low, self.high = torch.zeros((), dtype=dtype), torch.zeros((), dtype=dtype)
        self.total = torch.zeros((), dtype=dtype)

    def reduce(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Write every tensor's partial results into the scratch; whether all of them are finite."""
        for t, target, how in zip(tensors, self.targets, self.hows, strict=True):
            if isinstance(how, tuple):  # all dims (one element) or all but the first (the rows)
                _sum(t, how, False, out=target)
            elif how is None:
                torch.aminmax(t, out=target)
            elif t.is_contiguous():  # the rows times ones: BLAS's gemv, which reads faster than a sum here
                torch.mv(t.view(target.shape[0], -1), how, out=target)
            else:
                _sum(t, tuple(range(1, t.dim())), False, out=target)
        if self.scratch.numel() <= GRAIN and self.scratch.dtype not in _HALF:  # a serial sum, one number read back
            _sum(self.scratch, (0,), False, out=self.total)
            if math.isfinite(self.total.item()):
                return True
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
        if len(self.plans) == 1 and len(groups) == 1:  # one dtype: the usual case, with the least Python per call
            return self.plans[0].reduce(groups[0]) or self.plans[0].exact(groups[0])
        values = [tensors for tensors in groups if tensors]
        ok = [plan.reduce(tensors) for plan, tensors in zip(self.plans, values, strict=True)]
        if all(ok):
            return True
        return all(good or plan.exact(t) for good, plan, t in zip(ok, self.plans, values, strict=True))
