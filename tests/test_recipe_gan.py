"""Recipe `gan`: gradient separation of the two steps (with the undetached step as the control), one
generator forward per step, the memory the detach saves, outputs and sample quality of the default run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from components import MemoryProbe
from recipes.digits import DigitsDataModule
from recipes.gan import DigitsGAN, Discriminator, Generator, _bce, discriminator_loss
from tests.conftest import DEVICES, run_train, warning_lines


class StepInspector(pl.Callback):
    """Checks, just before each optimizer step, which module holds gradients."""

    def __init__(self) -> None:
        self.checked = {"generator": 0, "discriminator": 0}

    def on_before_optimizer_step(self, trainer: pl.Trainer, module: Any, optimizer: Any) -> None:
        g, d = list(module.generator.parameters()), list(module.discriminator.parameters())
        stepping_d = any(p is d[0] for group in optimizer.param_groups for p in group["params"])
        if stepping_d:
            assert all(p.grad is None for p in g), "the discriminator step wrote gradients into the generator"
            assert all(p.grad is not None for p in d)
            self.checked["discriminator"] += 1
        else:
            assert all(p.grad is None for p in d), "the generator step wrote gradients into the discriminator"
            assert all(p.requires_grad for p in d), "the discriminator's flags were not restored"
            assert all(p.grad is not None for p in g)
            self.checked["generator"] += 1


def fit(module: DigitsGAN, callbacks: list[pl.Callback], max_steps: int) -> None:
    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=max_steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, callbacks=callbacks,
    )  # fmt: skip
    trainer.fit(module, datamodule=DigitsDataModule(batch_size=32))


def test_each_step_writes_gradients_only_into_its_own_network() -> None:
    inspector = StepInspector()
    fit(DigitsGAN(judge_epochs=1), [inspector], max_steps=6)  # Lightning counts each optimizer's step
    assert inspector.checked == {"generator": 3, "discriminator": 3}


def test_generator_runs_once_per_training_step() -> None:
    module = DigitsGAN(judge_epochs=1)
    calls = []
    module.generator.register_forward_hook(lambda *_: calls.append(1))
    fit(module, [], max_steps=10)  # 5 training steps, two optimizer steps each
    assert len(calls) == 5


@pytest.mark.parametrize("device", DEVICES)
def test_detach_keeps_gradients_out_of_the_generator_and_the_control_does_not(device: str) -> None:
    torch.manual_seed(0)
    g, d = Generator(32, 256).to(device), Discriminator(256, 0.0).to(device)
    real = torch.rand(64, 64, device=device) * 2 - 1
    fake = g(torch.randn(64, 32, device=device))
    d_loss = discriminator_loss(d, real, fake.detach())
    torch.testing.assert_close(d_loss, _bce(d(real), 1.0) + _bce(d(fake.detach()), 0.0))  # one forward, same loss
    assert all(x is None for x in torch.autograd.grad(d_loss, list(g.parameters()), allow_unused=True))
    control = discriminator_loss(d, real, fake)  # without detach()
    assert all(x is not None for x in torch.autograd.grad(control, list(g.parameters()), retain_graph=True))
    control.backward()
    assert all(p.grad is not None for p in g.parameters())  # the control trains G with D's objective


@pytest.mark.parametrize("device", DEVICES)
def test_discriminator_step_peak_memory_is_lower_with_detach(device: str) -> None:
    torch.manual_seed(0)
    g, d = Generator(32, 256).to(device), Discriminator(256, 0.0).to(device)
    real = torch.rand(256, 64, device=device) * 2 - 1
    z = torch.randn(256, 32, device=device)

    def d_step(detach: bool) -> int:
        fake = g(z)  # built outside the probe: the same for both
        with MemoryProbe(device) as probe:
            loss = discriminator_loss(d, real, fake.detach() if detach else fake)
            loss.backward(retain_graph=not detach)  # the generator step still needs fake's graph
        for p in [*g.parameters(), *d.parameters()]:
            p.grad = None
        return probe.peak_bytes

    with_detach, without = d_step(True), d_step(False)
    print(f"discriminator step peak on {device}: {with_detach} B with detach(), {without} B without")
    generator_grads = sum(p.numel() * p.element_size() for p in g.parameters())
    assert without - with_detach >= generator_grads  # G's parameter gradients, at least


def test_short_run_writes_samples_and_summary(tmp_path: Path) -> None:
    args = [
        "+recipe=gan", "trainer.max_epochs=2", "trainer.check_val_every_n_epoch=1", "model.eval_samples=200",
        "model.judge_epochs=2", "trainer.enable_progress_bar=false", f"hydra.run.dir={tmp_path}",
    ]  # fmt: skip
    result = run_train(*args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert warning_lines(result.stderr) == []
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert {"quality/confidence_ema", "quality/fid_ema", "quality/fid_floor", "quality/confidence"} <= set(
        summary["metrics"]
    )
    assert (tmp_path / "samples.png").is_file() and (tmp_path / "samples_epoch001.png").is_file()
    checkpoint = torch.load(summary["checkpoints"]["last"], weights_only=True)
    assert "generator_ema" in checkpoint and bool(checkpoint["state_dict"]["judge_trained"])


@pytest.mark.slow  # the full default run: 200 epochs, about 100 s on 2 cores
def test_default_run_samples_are_confident_and_cover_every_class(tmp_path: Path) -> None:
    result = run_train("+recipe=gan", "trainer.enable_progress_bar=false", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    m = summary["metrics"]
    print(
        f"gan default run ({summary['wall_s']} s): EMA confidence {m['quality/confidence_ema']:.3f}, rarest class "
        f"{m['quality/min_class_fraction_ema']:.3f}, FID {m['quality/fid_ema']:.2f} (live {m['quality/fid']:.2f}, "
        f"floor {m['quality/fid_floor']:.2f})"
    )
    assert m["quality/confidence_ema"] >= 0.75
    assert m["quality/min_class_fraction_ema"] >= 0.04
    assert m["quality/fid_ema"] > m["quality/fid_floor"]  # the floor is a floor


def test_a_sharded_strategy_is_refused_in_setup() -> None:
    """Lightning's ModelParallelStrategy gives the module a device mesh before ``setup``; the subprocess test in
    tests/test_fsdp.py (slow) runs it under trainer=fsdp."""
    model = DigitsGAN()
    model._device_mesh = object()  # what ModelParallelStrategy sets
    with pytest.raises(ValueError, match="recipe gan does not run sharded: it alternates two networks"):
        model.setup("fit")
