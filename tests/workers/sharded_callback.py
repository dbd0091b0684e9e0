"""Run by tests/distributed/test_sharded_callback.py: 2 gloo processes train an FSDP2-sharded Regressor with
``EMAWeights`` under Lightning's ``ModelParallelStrategy``, several times in the same processes, and save what the
tests compare.

Runs (``evaluate="ema"``; a ``ModelCheckpoint`` saves at the end of every validation, inside the EMA pass):

* ``straight-dcp`` / ``straight-file``: 4 epochs, distributed checkpoints (directories) / single files;
* ``resumed-dcp`` / ``resumed-file``: 4 epochs from the straight run's checkpoint after epoch 2;
* ``control``: the same resume with a callback that forgets its state (a fresh average);
* ``unfixed``: 2 epochs with ``trainer.save_checkpoint`` left as it was before checkpoints stepped out of the EMA pass.

Each rank saves, per run, its model and EMA shards (``to_local()``) and the counters; rank 0 also saves, per global
step, the gathered live weights and average after the step's update (what a checkpoint taken then must hold).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import FSDPModule, fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from copy_correct.core.sharding import is_sharded
from copy_correct.lightning import EMAWeights
from tests.lightning.test_ema_weights import Regressor, loader
from tests.workers import end_rank, join_as_lightning_rank
from tests.workers.without_state import EMAWeightsWithoutState


class ShardedRegressor(Regressor):
    def configure_model(self) -> None:
        if isinstance(self.net, FSDPModule):
            return
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, foreach=True)


class Truth(pl.Callback):
    """After each step's EMA update: the gathered live weights and average (every rank gathers, rank 0 keeps)."""

    def __init__(self, ema: EMAWeights) -> None:
        self.ema, self.at = ema, {}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        assert self.ema.ema is not None
        live = {k: full(v) for k, v in pl_module.state_dict().items()}
        self.at[trainer.global_step] = live, self.ema.ema.full_state_dict()


def full(t: torch.Tensor) -> torch.Tensor:
    """A new full CPU tensor of ``t``: on a mesh of one rank ``full_tensor()`` is the shard itself, so it is cloned."""
    return (t.full_tensor() if is_sharded(t) else t.detach()).cpu().clone()


def fit(directory: Path, distributed: bool, epochs: int, ckpt_path: Path | None = None, callback: type = EMAWeights):
    pl.seed_everything(0)
    ema = callback(decay=0.9, warmup=True, evaluate="ema")
    truth = Truth(ema)
    checkpoint = ModelCheckpoint(directory, filename="{epoch}", save_top_k=-1, save_on_train_epoch_end=False)
    strategy = ModelParallelStrategy(
        data_parallel_size=2, tensor_parallel_size=1, save_distributed_checkpoint=distributed
    )
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=epochs, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=directory, num_sanity_val_steps=0,
        callbacks=[ema, truth, checkpoint],
    )  # fmt: skip
    module = ShardedRegressor()
    trainer.fit(module, loader(), loader(64), ckpt_path=ckpt_path)
    assert ema.ema is not None and ema.ema.sharded
    with torch.no_grad():
        shards = {
            "model": {k: v.to_local().clone() for k, v in module.state_dict().items() if is_sharded(v)},
            "ema": {k: v.to_local().clone() for k, v in ema.ema.shadow.items() if is_sharded(v)},
            "counters": (int(ema.ema.step), ema.ema.num_updates),
        }
    return shards, truth.at


def main(rank: int, out: Path) -> None:
    join_as_lightning_rank(rank)
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    truths: dict[str, Any] = {}
    for kind, distributed in (("dcp", True), ("file", False)):
        results[f"straight-{kind}"], truths[kind] = fit(out / f"straight-{kind}", distributed, 4)
        second = out / f"straight-{kind}" / "epoch=1.ckpt"
        results[f"resumed-{kind}"], _ = fit(out / f"resumed-{kind}", distributed, 4, ckpt_path=second)
    results["control"], _ = fit(out / "control", True, 4, out / "straight-dcp" / "epoch=1.ckpt", EMAWeightsWithoutState)
    with mock.patch.object(EMAWeights, "_save_outside_the_pass", lambda self, save: save):
        _, truths["unfixed"] = fit(out / "unfixed", True, 2)
    torch.save(results, out / f"rank{rank}.pt")
    if rank == 0:
        torch.save(truths, out / "truth.pt")
    end_rank()


if __name__ == "__main__":
    torch.multiprocessing.spawn(main, args=(Path(sys.argv[1]),), nprocs=2)
