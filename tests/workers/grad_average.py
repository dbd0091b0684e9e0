"""Run by tests/parts/test_grad_average.py: 2 gloo processes average different gradients; each saves what it got.

Rank r's gradients are ``r + 1`` everywhere (so the mean is 1.5); the last parameter has no gradient on
rank 0. Saved per rank: the gradients before (the control) and after ``average()``, whether each gradient kept
its storage, and the bytes a second ``average()`` allocated (``CopyAudit``).
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from copy_correct import GradientAverager
from copy_correct.probes import CopyAudit
from tests.workers import end_rank


def main(rank: int, out: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["TEST_PORT"])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    params = [
        nn.Parameter(torch.zeros(3, 4)),
        nn.Parameter(torch.zeros(5, dtype=torch.float64)),
        nn.Parameter(torch.zeros(2)),
    ]
    for p in params[:2] if rank == 0 else params:
        p.grad = torch.full_like(p, rank + 1.0)
    before = [p.grad.clone() if p.grad is not None else None for p in params]
    storages = [p.grad.untyped_storage().data_ptr() if p.grad is not None else None for p in params]
    averager = GradientAverager(params)
    averager.average()
    with CopyAudit() as audit:
        averager.average()  # averaging the mean again changes nothing and allocates nothing
    kept = [s is None or p.grad.untyped_storage().data_ptr() == s for p, s in zip(params, storages, strict=True)]
    torch.save(
        {"before": before, "grads": [p.grad for p in params], "kept": torch.tensor(kept),
         "allocated": torch.tensor(audit.bytes_allocated)},
        out / f"rank{rank}.pt",
    )  # fmt: skip
    end_rank()


if __name__ == "__main__":
    torch.multiprocessing.spawn(main, args=(Path(sys.argv[1]),), nprocs=2)
