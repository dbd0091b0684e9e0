"""EMACallback in real Trainers: per-optimizer-step updates, EMA evaluation beside live, checkpoints, DDP."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from components import EMACallback

ROOT = Path(__file__).resolve().parents[1]


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val/loss", nn.functional.mse_loss(self.net(x), y))
        self.log("val/weight_sum", self.net[0].weight.sum())

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test/weight_sum", self.net[0].weight.sum())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def loader(n: int = 128) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n, 8, generator=generator), torch.randn(n, 1, generator=generator))
    return DataLoader(data, batch_size=16)  # no shuffling: a resumed run sees the same batches


def trainer(tmp_path: Path, callbacks: list[pl.Callback], **kwargs: Any) -> pl.Trainer:
    defaults = {
        "accelerator": "cpu", "max_epochs": 2, "logger": False, "enable_progress_bar": False,
        "enable_model_summary": False, "default_root_dir": tmp_path, "num_sanity_val_steps": 0,
    }  # fmt: skip
    if not any(isinstance(c, ModelCheckpoint) for c in callbacks):
        defaults["enable_checkpointing"] = False
    return pl.Trainer(callbacks=callbacks, **{**defaults, **kwargs})


def test_updates_once_per_optimizer_step_with_accumulation(tmp_path: Path) -> None:
    ema = EMACallback(decay=0.9)
    t = trainer(tmp_path, [ema], accumulate_grad_batches=2, limit_val_batches=0)
    t.fit(Regressor(), loader())
    assert t.global_step == 8  # 16 batches, one optimizer step per 2
    assert ema.ema is not None and ema.ema.step == ema.ema.num_updates == 8


def test_delayed_start_copies_until_start_step(tmp_path: Path) -> None:
    ema = EMACallback(decay=0.9, start_step=10)
    module = Regressor()
    trainer(tmp_path, [ema], max_epochs=1, limit_val_batches=0).fit(module, loader())  # 8 steps
    assert ema.ema is not None and ema.ema.num_updates == 0
    for name, value in module.state_dict().items():
        assert torch.equal(ema.ema.shadow[name], value)


def test_validation_and_test_log_ema_metrics_beside_live_ones(tmp_path: Path) -> None:
    ema = EMACallback(decay=0.9)
    module = Regressor()
    checkpoint = ModelCheckpoint(dirpath=tmp_path, monitor="val/loss_ema", save_top_k=1)
    t = trainer(tmp_path, [ema, checkpoint])
    t.fit(module, loader(), loader(64))
    metrics = t.callback_metrics
    assert {"val/loss", "val/loss_ema", "val/weight_sum", "val/weight_sum_ema"} <= set(metrics)
    assert ema.ema is not None
    live_sum, ema_sum = module.net[0].weight.sum(), ema.ema.shadow["net.0.weight"].sum()
    assert not torch.isclose(live_sum, ema_sum)
    torch.testing.assert_close(metrics["val/weight_sum"], live_sum.detach())
    torch.testing.assert_close(metrics["val/weight_sum_ema"], ema_sum)
    assert checkpoint.best_model_score is not None  # monitored the EMA metric without error
    assert torch.equal(module.net[0].weight.sum(), live_sum)  # live weights back after the EMA pass
    t.test(module, loader())
    torch.testing.assert_close(t.callback_metrics["test/weight_sum_ema"], ema_sum)
    torch.testing.assert_close(t.callback_metrics["test/weight_sum"], live_sum.detach())


@pytest.mark.parametrize(("evaluate", "expected"), [("ema", "shadow"), ("live", "live")])
def test_evaluate_modes(evaluate: str, expected: str, tmp_path: Path) -> None:
    ema = EMACallback(decay=0.9, evaluate=evaluate)
    module = Regressor()
    t = trainer(tmp_path, [ema])
    t.fit(module, loader(), loader(64))
    assert "val/weight_sum_ema" not in t.callback_metrics
    assert ema.ema is not None
    value = ema.ema.shadow["net.0.weight"].sum() if expected == "shadow" else module.net[0].weight.sum().detach()
    torch.testing.assert_close(t.callback_metrics["val/weight_sum"], value)


def test_ema_weights_at_end(tmp_path: Path) -> None:
    ema = EMACallback(decay=0.9, ema_weights_at_end=True)
    module = Regressor()
    trainer(tmp_path, [ema], limit_val_batches=0).fit(module, loader())
    assert ema.ema is not None
    assert all(torch.equal(module.state_dict()[k], v) for k, v in ema.ema.shadow.items())


def test_resume_reproduces_the_uninterrupted_shadow_exactly(tmp_path: Path) -> None:
    pl.seed_everything(0)
    straight = EMACallback(decay=0.9, warmup=True)
    trainer(tmp_path / "a", [straight], max_epochs=4, limit_val_batches=0).fit(Regressor(), loader())

    pl.seed_everything(0)
    first = EMACallback(decay=0.9, warmup=True)
    save = ModelCheckpoint(dirpath=tmp_path / "b", save_last=True)
    trainer(tmp_path / "b", [first, save], max_epochs=2, limit_val_batches=0).fit(Regressor(), loader())
    checkpoint = torch.load(tmp_path / "b" / "last.ckpt", weights_only=True)  # plain tensors and numbers
    assert any("EMACallback" in key for key in checkpoint["callbacks"])

    resumed = EMACallback(decay=0.9, warmup=True)
    trainer(tmp_path / "c", [resumed], max_epochs=4, limit_val_batches=0).fit(
        Regressor(), loader(), ckpt_path=tmp_path / "b" / "last.ckpt"
    )
    assert straight.ema is not None and resumed.ema is not None
    assert (resumed.ema.step, resumed.ema.num_updates) == (straight.ema.step, straight.ema.num_updates) == (32, 32)
    for name, value in straight.ema.shadow.items():
        assert torch.equal(resumed.ema.shadow[name], value), name

    class ForgetsItsState(EMACallback):  # the control: a resume that starts a fresh average
        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            pass

    fresh = ForgetsItsState(decay=0.9, warmup=True)
    trainer(tmp_path / "d", [fresh], max_epochs=4, limit_val_batches=0).fit(
        Regressor(), loader(), ckpt_path=tmp_path / "b" / "last.ckpt"
    )
    assert fresh.ema is not None
    assert not torch.equal(fresh.ema.shadow["net.0.weight"], straight.ema.shadow["net.0.weight"])


def _ddp_shadows(out: Path, *args: str) -> tuple[dict, dict]:
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "scripts" / "ddp_ema.py"), str(out), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(out / "rank0.pt", weights_only=True), torch.load(out / "rank1.pt", weights_only=True)


def test_ddp_two_cpu_processes_keep_identical_shadows(tmp_path: Path) -> None:
    rank0, rank1 = _ddp_shadows(tmp_path)
    assert rank0.keys() == rank1.keys() and len(rank0) == 9
    for name in rank0:
        assert torch.equal(rank0[name], rank1[name]), name
    (tmp_path / "control").mkdir()
    rank0, rank1 = _ddp_shadows(tmp_path / "control", "control")  # without the buffer broadcast
    assert all(torch.equal(rank0[k], rank1[k]) for k in rank0 if "running" not in k)  # parameters agree
    assert not torch.equal(rank0["net.1.running_mean"], rank1["net.1.running_mean"])  # statistics do not


def test_bad_arguments_fail_at_construction() -> None:
    with pytest.raises(ValueError, match="evaluate must be one of"):
        EMACallback(evaluate="sometimes")
    with pytest.raises(ValueError, match="decay must be in"):
        EMACallback(decay=1.5)
