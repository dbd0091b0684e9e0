"""Worker scripts the multi-process tests start: one process per rank, each saving what it measured."""

from __future__ import annotations

import os


def join_as_lightning_rank(rank: int, world: int = 2) -> None:
    """The environment by which every ``Trainer`` this process makes joins the processes the worker spawned, as rank
    ``rank`` of ``world`` on one node (``TEST_PORT``: the test's own port), instead of launching processes itself."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["TEST_PORT"], WORLD_SIZE=str(world), NODE_RANK="0",
        LOCAL_RANK=str(rank), RANK=str(rank),
    )  # fmt: skip
