"""``recipes.allocation``: a failed allocation, numpy's or torch's, read as the bytes it asked for and said in one line
naming the key; any other error is not one (the control), so it is raised as it was."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from recipes.allocation import allocated, allocation_bytes, readable, too_big


def test_the_bytes_of_numpys_and_torchs_failed_allocations() -> None:
    with pytest.raises(MemoryError) as numpy_said:
        np.zeros(2**50, np.uint8)  # 1 PiB: more than any machine maps
    with pytest.raises(RuntimeError) as torch_said:
        torch.empty(2**50, dtype=torch.uint8)
    assert allocation_bytes(numpy_said.value) == 2**50 == allocation_bytes(torch_said.value)
    cuda = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of ...")
    assert allocation_bytes(cuda) == 2 * 2**30
    assert allocation_bytes(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None  # the control
    assert allocation_bytes(ValueError("can't allocate memory: you tried to allocate 8 bytes")) is None


def test_the_line_names_what_the_bytes_and_the_key() -> None:
    line = too_big(MemoryError(), "model.buffer_size=10 (a buffer)", "model.buffer_size")
    assert line is not None and line.startswith("model.buffer_size=10 (a buffer) needs more memory, which cannot be")
    assert readable(46_000_000_000_000) == "41.8 TiB" and readable(512) == "512 B"
    assert too_big(RuntimeError("something else"), "model", "model.hidden") is None


def test_allocated_refuses_what_fails_and_passes_what_fits_on() -> None:
    with pytest.raises(ValueError, match=r"^data\.size=9 needs 1\.0 PiB \(1,125,899,906,842,624 bytes\), which cannot"):
        allocated(lambda: np.zeros(2**50, np.uint8), "data.size=9", "data.size")
    with pytest.raises(RuntimeError, match="not an allocation"):  # the control: another error is raised as it was
        allocated(lambda: (_ for _ in ()).throw(RuntimeError("not an allocation")), "data.size=9", "data.size")
    assert allocated(lambda: np.zeros(8), "data.size=9", "data.size").nbytes == 64
