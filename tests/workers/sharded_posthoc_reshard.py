"""Run by tests/distributed/test_sharded_reshard.py: ``PostHocEMASnapshots(module="net")`` on an FSDP2-sharded
Regressor under Lightning's ``ModelParallelStrategy`` (as ``AtomicModelParallelStrategy``, whose checkpoint directories
carry the digests ``copy-correct posthoc`` checks), its distributed checkpoint saved at one world size and the fit
resumed at another, each world size its own group of gloo processes:

    python tests/workers/sharded_posthoc_reshard.py OUT WORLD save         # 2 epochs, a snapshot every 2 steps
    python tests/workers/sharded_posthoc_reshard.py OUT WORLD load FROM    # to 4 epochs, from FROM's last checkpoint

Rank 0 writes ``OUT/saved-WORLD.pt`` (the profiles gathered when the fit ends, its step, and the live weights after
every optimizer step, gathered) or ``OUT/loaded-FROM-to-WORLD.pt`` (the profiles as restored, gathered when training
starts, before any step, and the live weights after every step of the resumed fit)."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from copy_correct.averages.shadow import gathered
from copy_correct.lightning import AtomicModelParallelStrategy, PostHocEMASnapshots
from tests.lightning.test_ema_weights import loader
from tests.workers import end_rank, join_as_lightning_rank
from tests.workers.sharded_callback import ShardedRegressor
from tests.workers.sharded_posthoc_ema import Truth


class Restored(pl.Callback):
    """The profiles and step as restored, gathered when training starts (every rank gathers)."""

    def __init__(self, posthoc: PostHocEMASnapshots) -> None:
        self.posthoc = posthoc
        self.state: dict | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        power_ema = self.posthoc.power_ema
        assert power_ema is not None
        self.state = {"profiles": [gathered(p) for p in power_ema.profiles], "step": power_ema.step}


def fit(directory: Path, world: int, epochs: int, ckpt_path: Path | None = None) -> tuple[dict, dict]:
    """The fit's profiles, gathered (at its start when resumed, at its end otherwise), and its truth."""
    pl.seed_everything(0)
    posthoc, truth = PostHocEMASnapshots(snapshot_every=2, module="net"), Truth()
    restored = Restored(posthoc)
    strategy = AtomicModelParallelStrategy(
        data_parallel_size=world, tensor_parallel_size=1, save_distributed_checkpoint=True
    )
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_epochs=epochs, logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=directory, callbacks=[
            posthoc, truth, restored, ModelCheckpoint(directory, filename="{epoch}", save_top_k=-1),
        ],
    )  # fmt: skip
    trainer.fit(ShardedRegressor(), loader(), ckpt_path=ckpt_path)
    power_ema = posthoc.power_ema
    assert power_ema is not None and power_ema.sharded
    if ckpt_path is None:
        state = {"profiles": [gathered(p) for p in power_ema.profiles], "step": power_ema.step}
    else:
        assert restored.state is not None
        state = restored.state
    return state, truth.at


def main(rank: int, out: Path, world: int, mode: str, source: int) -> None:
    join_as_lightning_rank(rank, world)
    torch.set_num_threads(1)
    if mode == "save":
        state, truth = fit(out / f"run-{world}", world, epochs=2)
        name = f"saved-{world}.pt"
    else:
        last = out / f"run-{source}" / "epoch=1.ckpt"
        state, truth = fit(out / f"resumed-{source}-to-{world}", world, epochs=4, ckpt_path=last)
        name = f"loaded-{source}-to-{world}.pt"
    if rank == 0:
        torch.save({**state, "truth": truth}, out / name)
    end_rank()


if __name__ == "__main__":
    out_dir, world_size, what = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    source_world = int(sys.argv[4]) if what == "load" else 0
    torch.multiprocessing.spawn(main, args=(out_dir, world_size, what, source_world), nprocs=world_size)
