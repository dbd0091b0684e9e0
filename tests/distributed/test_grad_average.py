"""GradientAverager, 2 CPU processes over gloo (``tests/workers/grad_average.py``): every rank ends with the mean
gradient, in place, with no allocation after the first call."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.conftest import run_rank_script


def _run(out: Path) -> list[dict]:
    return run_rank_script("grad_average.py", out)


def test_two_processes_end_with_the_same_mean_gradient_in_place(tmp_path: Path) -> None:
    rank0, rank1 = _run(tmp_path)
    for g0, g1 in zip(rank0["grads"], rank1["grads"], strict=True):
        assert torch.equal(g0, g1)
    assert torch.equal(rank0["grads"][0], torch.full((3, 4), 1.5))
    assert rank0["grads"][1].dtype == torch.float64  # its own dtype group, its own flat buffer
    assert torch.equal(rank0["grads"][2], torch.full((2,), 1.0))  # rank 0 had none: it counted as zeros
    assert rank0["kept"].all() and rank1["kept"].all()  # written in place
    assert int(rank0["allocated"]) == int(rank1["allocated"]) == 0
    # Control: before averaging, the ranks held different gradients.
    assert not torch.equal(rank0["before"][0], rank1["before"][0])
