"""Run by tests/lightning/test_atomic_sharded_checkpoint.py:
``python tests/workers/sharded_kill.py OUT STRATEGY KILL DEVICE``.

2 gloo processes (DEVICE ``cpu``; ``cuda``: 1 NCCL process, since NCCL takes one GPU per process) train an
FSDP2-sharded Regressor for 2 epochs under STRATEGY (``ours``: AtomicModelParallelStrategy; ``lightning``:
ModelParallelStrategy), a ``ModelCheckpoint`` writing ``epoch=N.ckpt`` then ``last.ckpt`` in OUT at the end of each
epoch, both distributed checkpoints. During the second save of ``last.ckpt``, rank 0 SIGKILLs the
process group (both ranks and this script) at KILL:

* ``shards``: every rank's shard file written (rank 0 waits for rank 1's, if any), before ``.metadata`` and
  ``meta.pt``;
* ``meta``: the shards and ``.metadata`` written, before ``meta.pt``;
* ``none``: no kill; the run ends.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.checkpoint import FileSystemWriter

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from copy_correct.lightning import AtomicModelParallelStrategy
from tests.lightning.test_ema_weights import loader
from tests.workers import join_as_lightning_rank
from tests.workers.sharded_callback import ShardedRegressor

STRATEGIES = {"ours": AtomicModelParallelStrategy, "lightning": ModelParallelStrategy}


def kill_at(point: str, rank: int, world: int, out: Path) -> None:
    """Patch this rank's writers so that rank 0 kills everything at ``point`` of the second ``last.ckpt`` save."""
    saves = {"shards": 0, "meta": 0}
    rank1_wrote = out / "rank1-wrote-second-last"

    def second(kind: str, path: Any) -> bool:
        if "last.ckpt" in str(path):
            saves[kind] += 1
        return "last.ckpt" in str(path) and saves[kind] == 2

    write_data = FileSystemWriter.write_data

    def write_then_maybe_kill(self: FileSystemWriter, *args: Any) -> Any:
        written = write_data(self, *args)
        if second("shards", self.path) and point == "shards":
            if rank == 1:
                rank1_wrote.touch()
            else:
                while world > 1 and not rank1_wrote.exists():
                    time.sleep(0.01)
                os.killpg(0, signal.SIGKILL)
        return written

    save = torch.save

    def maybe_kill_then_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
        if str(f).endswith("meta.pt") and second("meta", f) and point == "meta":
            os.killpg(0, signal.SIGKILL)
        return save(obj, f, *args, **kwargs)

    FileSystemWriter.write_data = write_then_maybe_kill  # type: ignore[method-assign]
    torch.save = maybe_kill_then_save


def main(rank: int, out: Path, strategy: str, point: str, device: str, world: int) -> None:
    join_as_lightning_rank(rank, world)
    torch.set_num_threads(1)
    kill_at(point, rank, world, out)
    pl.seed_everything(0)
    checkpoint = ModelCheckpoint(out, filename="{epoch}", save_top_k=-1, save_last=True)
    trainer = pl.Trainer(
        accelerator=device, devices=world, max_epochs=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=out, num_sanity_val_steps=0, callbacks=[checkpoint],
        strategy=STRATEGIES[strategy](
            data_parallel_size=world, tensor_parallel_size=1, save_distributed_checkpoint=True
        ),
    )  # fmt: skip
    trainer.fit(ShardedRegressor(), loader(), loader(64))


if __name__ == "__main__":
    device = sys.argv[4]
    world = 2 if device == "cpu" else 1
    torch.multiprocessing.spawn(main, args=(Path(sys.argv[1]), sys.argv[2], sys.argv[3], device, world), nprocs=world)
