"""Worker scripts the multi-process tests start: one process per rank, each saving what it measured."""

from __future__ import annotations

import atexit
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

# The threads a gloo process group runs: its run loops, its TCP loop, and (on the rank that hosts it) its TCPStore.
GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop", "pt_tcpstore_uv")


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


def record_exit_census(path: Path) -> None:
    """At this process's exit (``atexit``: after ``main``, before the interpreter finalizes), save to ``path`` whether
    a default process group is still initialized and the names of gloo's threads still running (Linux)."""

    def record() -> None:
        names = [(task / "comm").read_text().strip() for task in Path("/proc/self/task").iterdir()]
        torch.save({"group": dist.is_initialized(), "threads": sorted(n for n in names if n in GLOO_THREADS)}, path)

    atexit.register(record)
