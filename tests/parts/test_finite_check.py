"""``FiniteCheck`` (``copy_correct.guards.host``), the CPU guard's decision, on every kind of tensor it plans for: a
NaN, an Inf or a -Inf anywhere is found, a finite tensor whose sum overflows is not taken for one, and no call
allocates, not even inside a kernel. Each claim has its control."""

from __future__ import annotations

import pytest
import torch

from copy_correct.guards.host import _GEMV, GRAIN, FiniteCheck
from copy_correct.probes import MemoryProbe

MAKERS = {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::_to_copy", "aten::clone", "aten::zeros"}
SHAPES = {
    "0-dim": (),
    "empty": (0, 5),
    "small": (3, 7),
    "rows, summed": (300, 300),  # over GRAIN elements, under _GEMV: the sum kernel per row
    "rows, gemv": (1100, 1000),  # from _GEMV elements: rows times ones
    "one long row": (1, GRAIN + 5),  # too few rows: aminmax
    "long vector": (GRAIN + 5,),  # one dimension: aminmax
    "conv weight": (64, 32, 3, 3),
}


def tensors(dtype: torch.dtype) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    made = [torch.randn(shape, generator=generator).to(dtype) for shape in SHAPES.values()]
    transposed = torch.randn(1000, 1100, generator=generator).to(dtype).t()  # large and not contiguous
    return [*made, transposed]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_a_nan_or_an_inf_anywhere_is_found_and_nothing_is_allocated(dtype: torch.dtype) -> None:
    values = tensors(dtype)
    assert values[4].numel() >= _GEMV and not values[-1].is_contiguous()
    check = FiniteCheck([values])
    assert check.finite([values])
    for t in values:
        if t.numel() == 0:
            continue
        index = tuple(size // 2 for size in t.shape)  # a middle element (() for a 0-dim tensor)
        kept = t[index].clone()
        for poison in (float("nan"), float("inf"), -float("inf")):
            t[index] = poison
            with MemoryProbe("cpu") as memory, torch.autograd.profiler.profile() as profile:
                found = not check.finite([values])
            assert found, (tuple(t.shape), poison)
            assert memory.peak_bytes == 0, memory.report()
            assert not {event.name for event in profile.function_events} & MAKERS
        t[index] = kept
        assert check.finite([values])  # the scratch a bad call left is overwritten: the next clean call is finite

    # The control: a sum to one element of a large tensor allocates the kernel's per-thread buffer.
    with torch.autograd.profiler.profile() as profile:
        values[3].sum()
    assert {event.name for event in profile.function_events} & MAKERS


def test_a_finite_tensor_whose_sum_overflows_is_finite() -> None:
    big = [torch.full((300, 300), 3e38), torch.full((5,), 3e38), torch.full((1100, 1000), 3e38)]
    assert not torch.isfinite(big[0].sum())  # the control: the sum alone would call it non-finite
    assert FiniteCheck([big]).finite([big])
    big[2][7, 7] = float("inf")
    assert not FiniteCheck([big]).finite([big])


def test_groups_of_several_dtypes_are_checked_each() -> None:
    single, double = [torch.ones(4, 4)], [torch.ones(3, dtype=torch.float64)]
    check = FiniteCheck([single, double])
    assert check.finite([single, double])
    double[0][1] = float("nan")
    assert not check.finite([single, double])
    with pytest.raises(ValueError, match="FiniteCheck takes groups of CPU tensors of one dtype each"):
        FiniteCheck([[torch.ones(2), torch.ones(2, dtype=torch.float64)]])
