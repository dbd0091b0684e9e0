"""A callback the DDP tests add with ``+callbacks.rank_state``: each rank saves what it ended with.

Saved to ``DIRPATH/rank{R}.pt`` (tensors only, loads with ``weights_only=True``): the module's state_dict,
the EMA shadow (``EMAWeights``) or the GAN's generator EMA when present, the logged metrics, the global
RNG state, and, for a
classifier, this rank's own count of validation samples, correct predictions and summed loss, computed
after fit on the validation shard this rank was given. Sharded tensors (``trainer=fsdp``) are saved gathered (every
rank joins the all-gathers), and the EMA's local shards beside them as ``ema_local``.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

from copy_correct.core.sharding import is_sharded
from copy_correct.lightning import EMAWeights


class SaveRankState(pl.Callback):
    def __init__(self, dirpath: str) -> None:
        self.dirpath = Path(dirpath)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        state: dict[str, object] = {
            "model": {k: _full(v).detach().cpu().clone() for k, v in pl_module.state_dict().items()},
            "metrics": {k: v.detach().cpu().clone() for k, v in trainer.callback_metrics.items()},
            "rng": torch.get_rng_state(),
        }
        ema = next((c.ema for c in trainer.callbacks if isinstance(c, EMAWeights)), None)
        ema = ema or getattr(pl_module, "g_ema", None)
        if ema is not None:
            state["ema"] = {k: _full(v).cpu().clone() for k, v in ema.shadow.items()}
            state["ema_local"] = {k: v.to_local().cpu().clone() for k, v in ema.shadow.items() if is_sharded(v)}
        if "val/acc" in trainer.callback_metrics:
            state["local"] = self._local_validation(trainer, pl_module)
        self.dirpath.mkdir(parents=True, exist_ok=True)
        torch.save(state, self.dirpath / f"rank{trainer.global_rank}.pt")

    @staticmethod
    @torch.no_grad()
    def _local_validation(trainer: pl.Trainer, pl_module: pl.LightningModule) -> torch.Tensor:
        pl_module.eval()
        seen = correct = 0
        loss = 0.0
        for batch in trainer.val_dataloaders:
            x, y = pl_module.on_after_batch_transfer(batch, 0)
            if trainer.datamodule is not None:
                x, y = trainer.datamodule.on_after_batch_transfer((x, y), 0)
            logits = pl_module(x.to(pl_module.device))
            seen += len(y)
            correct += int((logits.argmax(dim=1) == y.to(logits.device)).sum())
            loss += float(F.cross_entropy(logits, y.to(logits.device), reduction="sum"))
        return torch.tensor([seen, correct, loss], dtype=torch.float64)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if is_sharded(t) else t
