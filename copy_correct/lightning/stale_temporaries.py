"""``StaleTemporaries``: when training starts, remove the temporary files that killed writers left in the run's
checkpoint folders and in the folder of the checkpoint it resumes from (``copy_correct.files.stale_temporaries``).

Which folders: the ``dirpath`` of every checkpoint callback of this trainer (a fresh run's are new and empty; a run
of one's own Trainer that reuses its folder finds its earlier kills' files there) and the folder of
``trainer.ckpt_path``, the run resumed from, where the kills happened: a resumed run otherwise only reads that
folder, and removes nothing there but ``.NAME.tmp-PID`` entries of processes that no longer exist, which nothing
reads. Each is searched with the folders below it (``power_ema/``, a sharded checkpoint's hidden directory).

Global rank 0 alone removes (the writers of checkpoints and snapshots; ``is_live`` asks about this machine's
processes), in ``on_train_start``, once a resumed run's checkpoint path is known; it prints one line when it
removed something (the count, the bytes, the folders).
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info

from copy_correct.files.stale_temporaries import remove_stale_temporaries

__all__ = ["StaleTemporaries"]


class StaleTemporaries(pl.Callback):
    """Remove stale ``.NAME.tmp-PID`` files when training starts (module docstring). ``removed``: what this fit
    removed, each path with its bytes."""

    def __init__(self) -> None:
        self.removed: list[tuple[Path, int]] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.removed = []
        if trainer.global_rank != 0:
            return
        for folder in folders(trainer):
            self.removed += remove_stale_temporaries(folder)
        if self.removed:
            where = ", ".join(sorted({str(folder) for folder in folders(trainer)}))
            size = sum(n for _, n in self.removed)
            rank_zero_info(
                f"removed {len(self.removed)} temporary files of killed writers ({size / 1e6:.1f} MB) in {where}"
            )


def folders(trainer: pl.Trainer) -> list[Path]:
    """The checkpoint callbacks' folders and the resumed checkpoint's, without repeats."""
    found = [Path(c.dirpath) for c in trainer.checkpoint_callbacks if getattr(c, "dirpath", None)]
    if trainer.ckpt_path:
        found.append(Path(trainer.ckpt_path).parent)
    unique: dict[Path, None] = {}
    for folder in found:
        unique.setdefault(folder.resolve(), None)
    return list(unique)
