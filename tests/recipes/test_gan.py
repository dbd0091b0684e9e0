"""Recipe `gan`: gradient separation of the two steps (with the undetached step as the control), one generator forward
per step, D frozen in the G step, the memory the detach saves, an EMA update that allocates nothing and a swap that
restores the live weights bit for bit, logged values without a graph; outputs and sample quality of the default run.

The copy proofs take the model and the data from the project's configuration (``conf/recipe/gan.yaml`` composed by
Hydra, as ``train.py`` does), so they prove whatever network and data that names: the recipe's own (``as
configured``), and DCGAN's networks on a folder of images (``own images``), chosen by configuration alone. No test
here pins a network's size."""

from __future__ import annotations

import csv
import json
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from copy_correct.averages.posthoc import load_snapshot, snapshot_paths
from copy_correct.lightning import GraphRetentionCheck
from copy_correct.probes import CopyAudit, MemoryProbe
from recipes import build as run_builder
from recipes.gan import GAN, _bce, discriminator_loss
from recipes.networks import ConvDiscriminator, ConvGenerator, has_batch_norm
from tests.conftest import (
    DEVICES,
    ON_CPU,
    OWN_IMAGES,
    QUIET,
    compose_config,
    fit_on_a_uniform_folder,
    run_train,
    warning_lines,
    write_images,
    write_own_images,
)

# EMAWeights(module="generator")'s state in a checkpoint: the average (the GAN's names) and the live weights
GENERATOR_EMA = "EMAWeights{'decay': 0.999, 'module': 'generator'}"
# Short runs: a judge of one epoch on the 100 samples the grid needs, no validation.
SHORT = ("model.judge_epochs=1", "model.eval_samples=100", "trainer.limit_val_batches=0", "trainer.max_epochs=-1")


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Unlabelled 16x16 images (RGB, or grey where the project's default data is): another data set, for another
    network."""
    return write_own_images(tmp_path_factory.mktemp("images"), "gan", 48)


CONFIGS = [
    pytest.param((), id="as configured"),
    pytest.param((*OWN_IMAGES, "data.batch_size=16"), id="own images"),
]


def build(overrides: tuple[str, ...], image_folder: Path, tmp_path: Path, *extra: str) -> tuple[pl.Trainer, GAN, Any]:
    """Trainer, model and data module exactly as ``python train.py +recipe=gan OVERRIDES`` would make them."""
    args = [o.format(images=image_folder) for o in overrides]
    cfg = compose_config("+recipe=gan", *QUIET, *SHORT, *args, *extra, output_dir=tmp_path)
    return run_builder.build(cfg)


def networks_on(
    device: str, overrides: tuple[str, ...], image_folder: Path, tmp_path: Path
) -> tuple[nn.Module, nn.Module, torch.Tensor, torch.Tensor]:
    """The configured generator and discriminator on ``device``, a training batch of real images in [-1, 1] shaped
    as the generator's output, and as many latents."""
    _, model, datamodule = build(overrides, image_folder, tmp_path)
    real = next(iter(datamodule.train_dataloader()))[0].view(-1, *model.image_shape) * 2 - 1
    z = torch.randn(len(real), model.hparams.latent, device=device)
    return model.generator.to(device), model.discriminator.to(device), real.to(device), z


class StepInspector(pl.Callback):
    """Checks, just before each optimizer step, which module holds gradients and that D's flags came back."""

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


@pytest.mark.parametrize("overrides", CONFIGS)
def test_each_step_writes_gradients_only_into_its_own_network_and_logs_no_graph(
    overrides: tuple[str, ...], image_folder: Path, tmp_path: Path
) -> None:
    trainer, model, datamodule = build(overrides, image_folder, tmp_path, "trainer.max_steps=6")
    inspector, guard = StepInspector(), GraphRetentionCheck(mode="raise")
    trainer.callbacks += [inspector, guard]  # the guard fails the fit at the first step whose outputs hold a graph
    trainer.fit(model, datamodule=datamodule)
    assert inspector.checked == {"generator": 3, "discriminator": 3}  # Lightning counts each optimizer's step
    logged = {k: v for k, v in trainer.callback_metrics.items() if k.startswith("train/")}
    assert logged and all(v.grad_fn is None and not v.requires_grad for v in logged.values())


@pytest.mark.parametrize("overrides", CONFIGS)
def test_generator_runs_once_per_training_step(overrides: tuple[str, ...], image_folder: Path, tmp_path: Path) -> None:
    trainer, model, datamodule = build(overrides, image_folder, tmp_path, "trainer.max_steps=10")
    calls = []
    model.generator.register_forward_hook(lambda *_: calls.append(1))
    trainer.fit(model, datamodule=datamodule)  # 5 training steps, two optimizer steps each
    assert len(calls) == 5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("overrides", CONFIGS)
def test_detach_keeps_gradients_out_of_the_generator_and_the_control_does_not(
    overrides: tuple[str, ...], device: str, image_folder: Path, tmp_path: Path
) -> None:
    g, d, real, z = networks_on(device, overrides, image_folder, tmp_path)
    fake = g(z)
    d_loss = discriminator_loss(d, real, fake.detach())
    assert all(x is None for x in torch.autograd.grad(d_loss, list(g.parameters()), allow_unused=True))
    control = discriminator_loss(d, real, fake)  # without detach()
    assert all(x is not None for x in torch.autograd.grad(control, list(g.parameters()), retain_graph=True))
    control.backward()
    assert all(p.grad is not None for p in g.parameters())  # the control trains G with D's objective


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("overrides", CONFIGS)
def test_discriminator_step_peak_memory_is_lower_with_detach(
    overrides: tuple[str, ...], device: str, image_folder: Path, tmp_path: Path
) -> None:
    g, d, real, z = networks_on(device, overrides, image_folder, tmp_path)

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


@pytest.mark.parametrize("overrides", CONFIGS)
def test_the_generator_ema_updates_without_allocating_and_its_swap_is_exact(
    overrides: tuple[str, ...], image_folder: Path, tmp_path: Path
) -> None:
    trainer, model, datamodule = build(overrides, image_folder, tmp_path, "trainer.max_steps=8")
    trainer.fit(model, datamodule=datamodule)
    ema, g = model.g_ema, model.generator
    assert ema is not None
    with CopyAudit() as audit:
        ema.update(g)
    assert audit.bytes_allocated == 0, audit.summary()
    assert audit.count("_foreach_lerp_") > 0
    pairs = [(s, p) for s, p in zip(ema.shadow.values(), g.state_dict().values(), strict=True) if s.is_floating_point()]
    with CopyAudit() as control:  # the control: an out-of-place average makes a new tensor per weight
        [s.lerp(p, 0.001) for s, p in pairs]
    assert control.bytes_allocated > 0

    live = {k: v.clone() for k, v in g.state_dict().items()}
    g.train()
    with ema.average_weights(g):
        assert all(torch.equal(g.state_dict()[k], v) for k, v in ema.shadow.items())
        g(torch.randn(4, model.hparams.latent))  # a train-mode forward, as DCGAN samples: BatchNorm writes its stats
    assert all(torch.equal(g.state_dict()[k], v) for k, v in live.items())  # the live weights, bit for bit
    assert any(not torch.equal(live[k], v) for k, v in ema.shadow.items())  # not vacuous: the average differs


def test_a_discriminator_with_batchnorm_sees_real_and_fake_apart_and_one_forward_would_mix_them() -> None:
    torch.manual_seed(0)
    d = ConvDiscriminator((3, 16, 16), 8)
    assert has_batch_norm(d)
    real, fake = torch.rand(8, 3, 16, 16) * 2 - 1, torch.rand(8, 3, 16, 16) * 2 - 1
    torch.testing.assert_close(discriminator_loss(d, real, fake), _bce(d(real), 1.0) + _bce(d(fake), 0.0))
    mixed = d(torch.cat([real, fake]))  # the control: one forward normalises each half with both halves' statistics
    assert not torch.allclose(mixed[:8], d(real))


def test_short_run_writes_samples_and_summary(tmp_path: Path) -> None:
    args = [
        "+recipe=gan", "trainer.max_epochs=2", "trainer.check_val_every_n_epoch=1", "model.eval_samples=200",
        "model.judge_epochs=2", "trainer.enable_progress_bar=false", f"hydra.run.dir={tmp_path}",
    ]  # fmt: skip
    result = run_train(*args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert warning_lines(result.stderr) == []
    summary = json.loads((tmp_path / "summary.json").read_text())
    checkpoint = torch.load(summary["checkpoints"]["last"], weights_only=True)
    # The judge rates confidence only where the data has labels: the digits, a folder of class folders; a starter
    # whose default data is a user's folder of unlabelled images has FID alone.
    rated = {"quality/fid_ema", "quality/fid_floor"}
    if checkpoint["hyper_parameters"]["num_classes"] is not None:
        rated |= {"quality/confidence_ema", "quality/confidence"}
    assert rated <= set(summary["metrics"])
    assert (tmp_path / "samples.png").is_file() and (tmp_path / "samples_epoch001.png").is_file()
    generator_ema = checkpoint["callbacks"][GENERATOR_EMA]
    assert "ema" in generator_ema and bool(checkpoint["state_dict"]["judge_trained"])
    # The checkpoint's generator is the average, what a user loading it to sample wants; the live one is beside it.
    loaded = GAN.load_from_checkpoint(summary["checkpoints"]["last"], weights_only=True)
    average, live = generator_ema["ema"]["shadow"], generator_ema["live"]
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in average.items())
    assert any(not torch.equal(live[k], v) for k, v in average.items())  # not vacuous: the two differ


@pytest.mark.parametrize("follow", [True, False], ids=["cadence-follows-the-epoch", "control-configured-10"])
def test_a_folder_whose_epoch_is_shorter_than_the_logging_interval_logs_its_steps(follow: bool, tmp_path: Path) -> None:
    """40 images, 36 to train on in batches of 16: 3 batches an epoch, fewer than the configured
    ``log_every_n_steps=10``. Built as ``train.py`` builds it, the trainer logs every 3 steps, so each epoch's last step
    is in metrics.csv and Lightning warns of nothing. The control puts the configured 10 back: no training step is
    logged in the 6 steps and Lightning warns that it will not."""
    from recipes.build import build

    root = write_images(tmp_path / "images", 40, size=32, channels=1)
    args = ["+recipe=gan", "data=images", f"data.root={root}", "data.batch_size=16", ON_CPU, *QUIET, *SHORT]
    trainer, model, datamodule = build(compose_config(*args, "trainer.max_epochs=2", output_dir=tmp_path / "run"))
    assert trainer.log_every_n_steps == 3
    if not follow:
        trainer.log_every_n_steps = 10
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, datamodule=datamodule)
    short = [w for w in caught if "smaller than the logging interval" in str(w.message)]
    metrics = tmp_path / "run" / "metrics.csv"  # the logger writes none when nothing was logged
    rows = list(csv.DictReader(metrics.open())) if metrics.exists() else []
    logged = [row["step"] for row in rows if row.get("train/d_loss")]
    if follow:
        assert not short and len(logged) == 2, (short, logged)  # one row an epoch
    else:
        assert short and not logged


def test_unlabelled_images_get_frechet_figures_and_a_monitored_best_checkpoint(
    image_folder: Path, tmp_path: Path
) -> None:
    """No labels: the judge is an autoencoder, the figures are Frechet distances only, and the best checkpoint is
    chosen on the EMA generator's distance (``recipe.monitor``)."""
    trainer, model, datamodule = build(
        CONFIGS[1].values[0], image_folder, tmp_path, "trainer.max_epochs=2", "trainer.limit_val_batches=1",
        "trainer.check_val_every_n_epoch=1", "trainer.max_steps=-1",
    )  # fmt: skip
    assert model.judge.num_classes is None
    trainer.fit(model, datamodule=datamodule)
    metrics = trainer.callback_metrics
    assert {"quality/fid_ema", "quality/fid", "quality/fid_floor"} <= set(metrics)
    assert not any("confidence" in k or "min_class" in k for k in metrics)
    best = trainer.checkpoint_callback
    assert best is not None and best.monitor == "quality/fid_ema" and Path(best.best_model_path).is_file()
    assert (tmp_path / "samples.png").is_file()


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


def test_the_generators_posthoc_snapshots_change_nothing_in_training(tmp_path: Path) -> None:
    """``callbacks.posthoc_ema`` (on by default): profiles and snapshots of the generator alone, named as the GAN's
    ``state_dict``; the run ends with every weight, the EMA and torch's generator exactly as the run without it."""
    ended = {}
    for name, extra in (("with", "callbacks.posthoc_ema.snapshot_every=2"), ("without", "callbacks.posthoc_ema=null")):
        trainer, model, datamodule = build((), tmp_path, tmp_path / name, "trainer.max_steps=12", extra)  # 6 batches
        trainer.fit(model, datamodule=datamodule)
        assert model.g_ema is not None
        ended[name] = (model.state_dict(), model.g_ema.state_dict()["shadow"], torch.get_rng_state())
    paths = snapshot_paths(tmp_path / "with" / "checkpoints" / "power_ema")
    assert [load_snapshot(p)["step"] for p in paths] == [2, 4, 6]  # one generator step a batch
    last = load_snapshot(paths[-1])
    assert last["module"] == "generator" and set(last["profiles"][0]) == {
        f"generator.{k}" for k in model.generator.state_dict()
    }
    assert not (tmp_path / "without" / "checkpoints" / "power_ema").exists()  # not vacuous: the control has none
    for with_, without in zip(ended["with"], ended["without"], strict=True):
        if isinstance(with_, dict):
            assert with_.keys() == without.keys() and all(torch.equal(with_[k], without[k]) for k in with_)
        else:
            assert torch.equal(with_, without)


def test_a_sharded_strategy_is_refused_in_setup(tmp_path: Path) -> None:
    """Lightning's ModelParallelStrategy gives the module a device mesh before ``setup``; the subprocess test in
    tests/distributed/test_fsdp.py (slow) runs it under trainer=fsdp."""
    _, model, _ = build((), Path(), tmp_path)
    model._device_mesh = object()  # what ModelParallelStrategy sets
    with pytest.raises(ValueError, match="recipe gan does not run sharded: it alternates two networks"):
        model.setup("fit")


def test_a_uniform_grey_48_pixel_folder_trains_with_data_root_alone(tmp_path: Path) -> None:
    """Size and channels from the files, DCGAN's networks for a 48-pixel side (control: ``fit_on_a_uniform_folder``)."""
    model = fit_on_a_uniform_folder("gan", 48, 1, tmp_path, "model.eval_samples=100", "model.judge_epochs=1")
    assert isinstance(model.generator, ConvGenerator)
