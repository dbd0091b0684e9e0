"""Run by tests/distributed/test_sharded_posthoc_callback.py: 2 gloo processes train an FSDP2-sharded Regressor with
``PostHocEMASnapshots(module="net")`` under Lightning's ``ModelParallelStrategy`` (as ``AtomicModelParallelStrategy``,
whose checkpoint directories carry the ``digests.json`` that ``copy-correct posthoc`` checks), several times in the
same processes, and save what the tests compare.

Runs (4 optimizer steps an epoch, a snapshot every 2 steps, a ``ModelCheckpoint`` at every epoch's end):

* ``straight-dcp`` / ``straight-file``: 4 epochs, distributed checkpoints (directories) / single files;
* ``resumed-dcp`` / ``resumed-file``: to 4 epochs from the straight run's checkpoint after epoch 2;
* ``control``: the dcp resume with a callback that ignores its state (fresh profiles).

Runs ending off the snapshot schedule (a snapshot every 5 steps; distributed checkpoints), so the callback takes its
final snapshot when ``fit`` ends:

* ``final``: 3 epochs (12 steps): snapshots at 5 and 10, the final one at 12;
* ``stopped``: 1 epoch (4 steps, fewer than ``snapshot_every``): only the final snapshot, at 4; then resumed in the
  same directory from its checkpoint to 3 epochs, which removes that file once it writes step 5's.

Each rank saves, per run, its profiles' shards (``to_local()``) and its step; rank 0 also saves the straight-dcp run's
live weights after every optimizer step, gathered (every rank joins), with rank 0's buffers: what the profiles average
(the other runs train the same). Each rank also saves which snapshot files it had when the stopped run stopped.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from copy_correct.averages.posthoc import load_snapshot
from copy_correct.core.sharding import local
from copy_correct.lightning import AtomicModelParallelStrategy, PostHocEMASnapshots
from tests.lightning.test_ema_weights import loader
from tests.workers import end_rank, join_as_lightning_rank
from tests.workers.sharded_callback import ShardedRegressor, full

KWARGS: dict[str, Any] = {"snapshot_every": 2, "module": "net"}


class WithoutState(PostHocEMASnapshots):
    """Resumes with fresh profiles: finds its state under ``PostHocEMASnapshots``'s key, and ignores it."""

    @property
    def state_key(self) -> str:
        return super().state_key.replace(type(self).__qualname__, "PostHocEMASnapshots")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


class OwnStatistics(pl.Callback):
    """This rank's own BatchNorm statistics after its last step, before ``PostHocEMASnapshots`` (after it in the
    callbacks) copies rank 0's in: what each rank would average without that copy."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.running_mean = pl_module.net[1].running_mean.clone()


class Truth(pl.Callback):
    """The live weights after each optimizer step, gathered (every rank joins, rank 0 keeps)."""

    def __init__(self) -> None:
        self.at: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.at[trainer.global_step] = {k: full(v) for k, v in pl_module.state_dict().items()}


def fit(
    directory: Path,
    distributed: bool,
    ckpt_path: Path | None = None,
    callback: type = PostHocEMASnapshots,
    *,
    epochs: int = 4,
    snapshot_every: int = KWARGS["snapshot_every"],
):
    pl.seed_everything(0)
    own, posthoc, truth = OwnStatistics(), callback(**{**KWARGS, "snapshot_every": snapshot_every}), Truth()
    strategy = AtomicModelParallelStrategy(
        data_parallel_size=2, tensor_parallel_size=1, save_distributed_checkpoint=distributed
    )
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=epochs, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=directory, callbacks=[
            own, posthoc, truth, ModelCheckpoint(directory, filename="{epoch}", save_top_k=-1),
        ],
    )  # fmt: skip
    trainer.fit(ShardedRegressor(), loader(), ckpt_path=ckpt_path)
    assert posthoc.power_ema is not None and posthoc.power_ema.sharded and posthoc.writes
    with torch.no_grad():
        profiles = [{k: local(v).clone() for k, v in profile.items()} for profile in posthoc.power_ema.profiles]
    return {"profiles": profiles, "step": posthoc.power_ema.step, "own_running_mean": own.running_mean}, truth.at


def main(rank: int, out: Path) -> None:
    join_as_lightning_rank(rank)
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    for kind, distributed in (("dcp", True), ("file", False)):
        results[f"straight-{kind}"], truth = fit(out / f"straight-{kind}", distributed)
        if kind == "dcp" and rank == 0:
            torch.save(truth, out / "truth.pt")
        second = out / f"straight-{kind}" / "epoch=1.ckpt"
        results[f"resumed-{kind}"], _ = fit(out / f"resumed-{kind}", distributed, ckpt_path=second)
    results["control"], _ = fit(out / "control", True, out / "straight-dcp" / "epoch=1.ckpt", WithoutState)
    results["final"], _ = fit(out / "final", True, epochs=3, snapshot_every=5)
    results["stopped"], _ = fit(out / "stopped", True, epochs=1, snapshot_every=5)
    results["stopped-files"] = {  # this rank's snapshot files when the run stopped: is each marked final
        p.name: bool(load_snapshot(p).get("final", False))
        for p in sorted((out / "stopped" / "power_ema").glob(f"*-rank{rank}of2.pt"))
    }
    stopped = out / "stopped" / "epoch=0.ckpt"
    results["stopped-resumed"], _ = fit(out / "stopped", True, stopped, epochs=3, snapshot_every=5)
    torch.save(results, out / f"rank{rank}.pt")
    end_rank()


if __name__ == "__main__":
    torch.multiprocessing.spawn(main, args=(Path(sys.argv[1]),), nprocs=2)
