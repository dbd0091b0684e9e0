"""``FiniteCheck``: whether tensors on the CPU hold only finite values, decided on the host from one reduction per
tensor, for the guarded updates' CPU path (``EMA``, ``PowerEMA``, ``hard_update``, ``soft_update``).

Copy contract: the check reads each tensor once and writes only its own scratch, allocated at construction (one
element per small tensor, one per leading-dimension row of a large one, two per long row, twice as many for a
half-precision tensor); a call allocates nothing, not even inside a kernel (but for a one-dimensional tensor of more
than ``GRAIN`` elements that is not contiguous, which ``aminmax`` copies first), and reads one or two numbers back (a
CPU tensor's value: no sync). The tensors are never written and autograd sees nothing (it runs under the caller's
``no_grad``).

How, and why it is exact:

* A float32/float64 tensor is summed into the scratch: a sum is NaN or infinite when any element is, and finite when
  every element is, unless the finite elements' sum overflows. A sum to one element of more than ``GRAIN`` elements
  would allocate a per-thread buffer, so a large tensor is summed per row of its first dimension into its own rows of
  the scratch: from ``_GEMV`` elements as a matrix-vector product with a vector of ones (gemv; the rows of a tensor
  that is not contiguous by the sum kernel). Why gemv: from memory it read the benchmarks' weights in 0.36-0.40 of
  the time of the in-place lerp of the same tensors, the sum kernel in about 0.5 (2 CPU threads).
* A float16/bfloat16 tensor is reduced to its maxima and minima over the same dims (a sum in its precision could
  overflow, one in float32 would cast it to a new tensor first); a tensor of one long row by ``aminmax``.
* A sum of the scratch says whether every partial result is finite. If one is not, the tensor is read again for its
  maxima and minima into its own elements of the scratch (they cannot overflow), so a finite tensor whose sum
  overflowed still counts as finite: an update is never skipped for an overflow. What the check costs beside the
  update is on the ema recipe's page.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

__all__ = ["GRAIN", "FiniteCheck"]

GRAIN = 32768  # at::internal::GRAIN_SIZE: a reduction of more elements runs in parallel
_GEMV = 1 << 20  # from this many elements the rows are summed by gemv, which reads faster; below, its call costs more
_HALF = (torch.float16, torch.bfloat16)
_sum = torch._C._VariableFunctions.sum  # torch.sum without its Python wrapper: called per tensor, per update


class _Plan:
    """How one group (one dtype, on the CPU) is reduced, per tensor: over which dims (``dims``: all of them, into one
    element; all but the first, into one element per row; ``None``: ``aminmax`` into two elements), into which
    elements of the scratch (``outs``), and for a float32/float64 tensor of rows, the vector of ones that gemv
    multiplies them by (``ones``). A float16/bfloat16 tensor's elements are its maxima then its minima."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        dtype = tensors[0].dtype
        self.half = dtype in _HALF
        self.dims: list[tuple[int, ...] | None] = []
        self.ones: list[torch.Tensor | None] = []
        sizes = []
        widest = max((t.numel() // t.shape[0] for t in tensors if t.dim() >= 2 and t.shape[0]), default=0)
        ones = torch.ones(widest, dtype=dtype)
        for t in tensors:
            if t.numel() <= GRAIN:  # one element: a serial reduction (an empty tensor sums to 0)
                self.dims.append(tuple(range(t.dim())))
                size = 1
            elif t.dim() >= 2 and t.shape[0] >= 2:  # one element per row
                self.dims.append(tuple(range(1, t.dim())))
                size = t.shape[0]
            else:  # one long row: a minimum and a maximum
                self.dims.append(None)
                size = 2
            rows = size > 1 and self.dims[-1] is not None
            self.ones.append(ones[: t.numel() // t.shape[0]] if rows and not self.half and t.numel() >= _GEMV else None)
            sizes.append(size * 2 if self.half and self.dims[-1] is not None and t.numel() else size)
        self.scratch = torch.zeros(sum(sizes), dtype=dtype)
        self.outs: list[torch.Tensor] = []  # per tensor, its elements of the scratch
        offset = 0
        for size in sizes:
            self.outs.append(self.scratch[offset : offset + size])
            offset += size
        self.targets = [out.view(()) if out.shape[0] == 1 else out for out in self.outs]  # what a reduction writes
        self.low, self.high = torch.zeros((), dtype=dtype), torch.zeros((), dtype=dtype)
        self.total = torch.zeros((), dtype=dtype)

    def reduce(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Write every tensor's partial results into the scratch; whether all of them are finite."""
        for t, target, dims, ones in zip(tensors, self.targets, self.dims, self.ones, strict=True):
            if ones is None and not self.half and dims is not None:  # the usual small tensor: a sum
                _sum(t, dims, False, out=target)
            elif dims is None:
                torch.aminmax(t, out=(target[0], target[1]))
            elif ones is not None and t.is_contiguous():  # the rows times ones: BLAS's gemv reads faster here
                # addmv with beta=0 ignores what the target held (a NaN of the last call); torch 2.7's mv allocates
                torch.addmv(target, t.view(target.shape[0], -1), ones, beta=0, out=target)
            elif self.half and t.numel():  # exact in half precision, where a sum would overflow
                half = target.shape[0] // 2
                _extreme(torch.amax, t, dims, target[:half])
                _extreme(torch.amin, t, dims, target[half:])
            else:
                _sum(t, dims, False, out=target)
        if self.scratch.numel() <= GRAIN and not self.half:  # a serial sum, one number read back
            _sum(self.scratch, (0,), False, out=self.total)
            if math.isfinite(self.total.item()):
                return True
        return self._finite(self.scratch)

    def exact(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether every tensor is finite: each one whose partial results are not is read again for its maxima and
        minima (into its own elements of the scratch: no copy of a tensor that is not contiguous, as ``aminmax`` of
        the whole would make), which cannot overflow."""
        for t, out, dims in zip(tensors, self.outs, self.dims, strict=True):
            if self._finite(out):
                continue
            if dims is None or self.half:  # its elements already are its extremes
                return False
            for extreme in (torch.amax, torch.amin):
                _extreme(extreme, t, dims, out)
                if not self._finite(out):
                    return False
        return True

    def _finite(self, t: torch.Tensor) -> bool:
        """Whether a contiguous part of the scratch is finite."""
        torch.aminmax(t, out=(self.low, self.high))
        return math.isfinite(self.low.item()) and math.isfinite(self.high.item())


def _extreme(reduce: Callable[..., torch.Tensor], t: torch.Tensor, dims: tuple[int, ...], out: torch.Tensor) -> None:
    """``torch.amax`` or ``torch.amin`` of ``t`` over ``dims`` into ``out`` (one element, or one per row)."""
    reduce(t, dims, out=out.view(()) if out.shape[0] == 1 else out)


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
