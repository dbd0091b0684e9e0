"""Run by tests/distributed/test_sharded_reshard.py: ``EMAWeights`` on an FSDP2-sharded Regressor under Lightning's
``ModelParallelStrategy``, its distributed checkpoint saved at one world size and resumed at another, each world size
its own group of gloo processes:

    python tests/workers/sharded_callback_reshard.py OUT WORLD save          # 2 epochs, a checkpoint per epoch
    python tests/workers/sharded_callback_reshard.py OUT WORLD load FROM     # fit resumed from FROM's last checkpoint

``save`` writes the average gathered after the last step (``OUT/gathered-WORLD.pt``, rank 0); ``load`` resumes the
fit from the last checkpoint and writes the average it restored, gathered when training starts (before any step:
another world size splits the epoch otherwise, and the resumed loop may go on), with its counters
(``OUT/loaded-FROM-to-WORLD.pt``, rank 0)."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from copy_correct.lightning import EMAWeights
from tests.lightning.test_ema_weights import loader
from tests.workers import end_rank, join_as_lightning_rank
from tests.workers.sharded_callback import ShardedRegressor

EPOCHS = 2


class Restored(pl.Callback):
    """The average and counters as restored, gathered when training starts (every rank gathers)."""

    def __init__(self, ema: EMAWeights) -> None:
        self.ema = ema
        self.state: dict | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self.ema.ema is not None
        average = self.ema.ema
        self.state = {"ema": average.full_state_dict(), "counters": (int(average.step), average.num_updates)}


def fit(directory: Path, world: int, ckpt_path: Path | None = None) -> tuple[EMAWeights, Restored]:
    pl.seed_everything(0)
    ema = EMAWeights(decay=0.9, warmup=True, evaluate="ema")
    restored = Restored(ema)
    checkpoint = ModelCheckpoint(directory, filename="{epoch}", save_top_k=-1, save_on_train_epoch_end=False)
    strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1, save_distributed_checkpoint=True)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_epochs=EPOCHS, logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=directory, num_sanity_val_steps=0,
        callbacks=[ema, restored, checkpoint],
    )  # fmt: skip
    trainer.fit(ShardedRegressor(), loader(), loader(64), ckpt_path=ckpt_path)
    assert ema.ema is not None and ema.ema.sharded
    return ema, restored


def main(rank: int, out: Path, world: int, mode: str, source: int) -> None:
    join_as_lightning_rank(rank, world)
    torch.set_num_threads(1)
    if mode == "save":
        ema, _ = fit(out / f"run-{world}", world)
        assert ema.ema is not None
        state = {"ema": ema.ema.full_state_dict(), "counters": (int(ema.ema.step), ema.ema.num_updates)}
        name = f"gathered-{world}.pt"
    else:
        last = out / f"run-{source}" / f"epoch={EPOCHS - 1}.ckpt"
        _, restored = fit(out / f"resumed-{source}-to-{world}", world, last)
        state, name = restored.state, f"loaded-{source}-to-{world}.pt"
    if rank == 0:
        torch.save(state, out / name)
    end_rank()


if __name__ == "__main__":
    out_dir, world_size, what = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    source_world = int(sys.argv[4]) if what == "load" else 0
    torch.multiprocessing.spawn(main, args=(out_dir, world_size, what, source_world), nprocs=world_size)
