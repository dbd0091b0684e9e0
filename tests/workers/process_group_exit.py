"""Run by tests/recipes/test_process_group.py: 2 gloo processes join a process group, pass a barrier and exit, each
having ended the group with ``end_process_group`` (``ended``) or not (``left``: the control, as Lightning leaves a gloo
group). Each records at its exit (``record_exit_census``) whether the group is still initialized and which of gloo's
threads still run, as ``OUT/rank{R}.pt``."""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from recipes.process_group import end_process_group
from tests.workers import record_exit_census


def main(rank: int, out: Path, mode: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["TEST_PORT"])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    record_exit_census(out / f"rank{rank}.pt")
    dist.barrier()  # a collective whose work holds no tensor: the control's exit cannot abort on it
    if mode == "ended":
        end_process_group()


if __name__ == "__main__":
    torch.multiprocessing.spawn(main, args=(Path(sys.argv[1]), sys.argv[2]), nprocs=2)
