"""Run by tests/lightning/test_ema_weights_module.py: 2 gloo processes train an FSDP2-sharded two-module
LightningModule (``TwoNets``: generator and critic) with ``EMAWeights(module="generator", evaluate="ema")`` under
Lightning's ``ModelParallelStrategy``, and save what the test compares.

Runs, in distributed checkpoints (``dcp``) and single files (``file``), a ``ModelCheckpoint`` saving after every
validation (inside the EMA pass): ``straight-KIND``, 3 epochs; ``resumed-KIND``, 3 epochs from the straight run's
checkpoint after epoch 1. Each rank saves per run its model and EMA shards (``to_local()``) and the counters; rank 0
also saves, per global step, the gathered live weights and average after the step's update.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import FSDPModule, fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from copy_correct.core.sharding import is_sharded
from copy_correct.lightning import EMAWeights
from tests.lightning.test_ema_weights import loader
from tests.lightning.test_ema_weights_module import TwoNets
from tests.workers import end_rank, join_as_lightning_rank
from tests.workers.sharded_callback import Truth


class ShardedTwoNets(TwoNets):
    def configure_model(self) -> None:
        if isinstance(self.generator, FSDPModule):
            return
        mesh = self.device_mesh["data_parallel"]
        for net in (self.generator, self.critic):
            for layer in net:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(net, mesh=mesh)

    def on_validation_epoch_start(self) -> None:
        pass  # the records of the single-process tests are not needed here

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, foreach=True)


def fit(directory: Path, distributed: bool, ckpt_path: Path | None = None) -> tuple[dict[str, Any], dict]:
    pl.seed_everything(0)
    ema = EMAWeights(decay=0.9, evaluate="ema", module="generator")
    truth = Truth(ema)
    checkpoint = ModelCheckpoint(directory, filename="{epoch}", save_top_k=-1, save_on_train_epoch_end=False)
    strategy = ModelParallelStrategy(
        data_parallel_size=2, tensor_parallel_size=1, save_distributed_checkpoint=distributed
    )
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=3, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=directory, num_sanity_val_steps=0,
        callbacks=[ema, truth, checkpoint],
    )  # fmt: skip
    module = ShardedTwoNets()
    module.averager = ema
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
        results[f"straight-{kind}"], truths[kind] = fit(out / f"straight-{kind}", distributed)
        second = out / f"straight-{kind}" / "epoch=1.ckpt"
        results[f"resumed-{kind}"], _ = fit(out / f"resumed-{kind}", distributed, ckpt_path=second)
    torch.save(results, out / f"rank{rank}.pt")
    if rank == 0:
        torch.save(truths, out / "truth.pt")
    end_rank()


if __name__ == "__main__":
    torch.multiprocessing.spawn(main, args=(Path(sys.argv[1]),), nprocs=2)
