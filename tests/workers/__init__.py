"""Worker scripts the multi-process tests start: one process per rank, each saving what it measured."""

from __future__ import annotations

import os
import sys

import torch.distributed as dist


def join_as_lightning_rank(rank: int, world: int = 2) -> None:
    """The environment by which every ``Trainer`` this process makes joins the processes the worker spawned, as rank
    ``rank`` of ``world`` on one node (``TEST_PORT``: the test's own port), instead of launching processes itself."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["TEST_PORT"], WORLD_SIZE=str(world), NODE_RANK="0",
        LOCAL_RANK=str(rank), RANK=str(rank),
    )  # fmt: skip


def end_rank() -> None:
    """End this rank's process once every rank is done: a barrier, the process group destroyed, then ``os._exit(0)``.

    ``destroy_process_group`` does not stop gloo's threads while anything still holds the group (FSDP2's state does,
    out of Python's reach), so they outlive it. Left to a normal exit, one of them that drops the last reference to a
    tensor with Python state after the interpreter began finalizing takes the GIL, is ended mid-destructor, and the
    process aborts: "terminate called without an active exception", SIGABRT. Exiting without finalizing leaves
    those threads nothing to touch; what the rank saved is already closed, and its output is flushed first."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
