"""Recipe ``gan``: a GAN whose generator runs once per step and whose two steps never leak gradients into each
other, on the 8x8 digits or on your own images.

    python train.py +recipe=gan                                           # 8x8 digits, MLP networks
    python train.py +recipe=gan data=images data.root=DIR                 # your images, DCGAN networks

Copy decisions, all in ``training_step``: ``fake = G(z)`` runs once; the discriminator step sees ``fake.detach()``
(shared storage, no graph: its backward never enters G); the generator step reuses ``fake`` through ``frozen(D)``
(gradients flow through D, none is written into it). Samples and quality figures come from the generator's EMA,
swapped in place for them and the live weights restored bit for bit.

Callbacks (``conf/recipe/gan.yaml``, then ``conf/callbacks/default.yaml``'s; files in ``copy_correct/lightning/``):
  * ``EMAWeights(module="generator")``, ``ema_weights.py``: the generator's EMA, updated in place after both steps;
    the checkpoint's generator weights are the average, the live ones in the callback's state.
  * ``PostHocEMASnapshots(module="generator")``, ``posthoc_ema_snapshots.py``: power-function profiles of the
    generator, snapshotted into ``checkpoints/power_ema/`` for ``copy-correct posthoc``.
  * every recipe's: ``IsolatedEvaluation`` (``isolated_evaluation.py``), ``ResumeState`` (``resume.py``),
    ``NonFiniteStop`` (``nonfinite_stop.py``), ``LastCheckpoint`` (``last_checkpoint.py``) and Lightning's
    ``ModelCheckpoint`` through ``AtomicCheckpointIO`` (``atomic_checkpoint.py``), ``RunSummary``
    (``run_summary.py``), ``StaleTemporaries`` (``stale_temporaries.py``), the progress bar (``recipes/progress.py``).

What each callback copies, the quality judge (``recipes/gan_quality.py``) and the figures: ``docs/recipes/gan.md``.

Change first: the data (``data=images data.root=DIR``, its keys in ``conf/data/images.yaml``) and the widths in
``conf/recipe/gan.yaml``; then the networks in ``recipes/networks.py``.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from copy_correct import EMA, GradientAverager, frozen
from copy_correct.lightning import EMAWeights
from recipes.gan_quality import GRID, SAMPLE_CHUNK, Judge, sample_grid
from recipes.model_setup import at_least_one, check_args
from recipes.networks import (
    ConvDiscriminator,
    ConvGenerator,
    MLPDiscriminator,
    MLPGenerator,
    has_batch_norm,
    image_shape_of,
    pick_network,
)

__all__ = ["GAN", "discriminator_loss"]


class GAN(pl.LightningModule):
    """Unconditional GAN on images scaled to [-1, 1], with manual optimisation.

    ``image_shape`` (channels, height, width) and ``num_classes`` (``None``: no labels) describe the data; ``train.py``
    fills them from the data module. ``network`` picks the networks (``recipes.networks.pick_network``): ``hidden`` is
    the MLPs' width, ``conv_width`` the channels of DCGAN's layers next to the image (its ``ngf`` and ``ndf``).
    """

    # The judge is in eval mode on purpose (trained once before the GAN, it only evaluates): ``train.py`` silences
    # Lightning's warning about it for this recipe's run.
    expected_warnings = (r"Found \d+ module\(s\) in eval mode at the start of training",)

    def __init__(
        self,
        image_shape: tuple[int, int, int] | None = None,
        num_classes: int | None = None,
        network: str = "auto",
        latent: int = 32,
        hidden: int = 256,
        conv_width: int = 64,
        d_dropout: float = 0.3,
        lr: float = 2e-4,
        beta1: float = 0.5,
        eval_samples: int = 2000,
        judge_epochs: int = 30,
        seed: int = 0,
    ) -> None:
        super().__init__()
        shape = image_shape_of(image_shape)
        at_least_one(latent=latent, hidden=hidden, conv_width=conv_width)
        grid = f">= {GRID * GRID} (each validation writes a {GRID}x{GRID} grid of samples)"
        check_args([
            ("eval_samples", eval_samples, eval_samples >= GRID * GRID, grid),
            ("lr", lr, lr > 0, "> 0"),
            ("d_dropout", d_dropout, 0 <= d_dropout < 1, "in [0, 1)"),
            ("beta1", beta1, 0 <= beta1 < 1, "in [0, 1)"),
        ])  # fmt: skip
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.image_shape = shape
        kind = pick_network(network, self.image_shape)
        if kind == "conv":
            self.generator: nn.Module = ConvGenerator(latent, conv_width, self.image_shape)
            self.discriminator: nn.Module = ConvDiscriminator(self.image_shape, conv_width)
        else:
            self.generator = MLPGenerator(latent, hidden, self.image_shape)
            self.discriminator = MLPDiscriminator(self.image_shape, hidden, d_dropout)
        self.judge = Judge(kind, self.image_shape, num_classes)
        self.register_buffer("judge_trained", torch.tensor(False))  # checkpointed: a resumed run keeps its judge
        self._g_grads: GradientAverager | None = None  # under DDP only
        self._d_grads: GradientAverager | None = None
        self._real: torch.Tensor | None = None  # eval_samples real training images in [-1, 1], on the device
        self.fid_floor: float | None = None

    def train(self, mode: bool = True) -> GAN:
        super().train(mode)
        self.judge.eval()  # the judge is trained once, before the GAN, and only evaluates afterwards
        return self

    def setup(self, stage: str) -> None:
        if self.device_mesh is not None:  # Lightning's ModelParallelStrategy (trainer=fsdp) gives the module a mesh
            raise ValueError(
                "recipe gan does not run sharded: it alternates two networks and averages their gradients itself, "
                "and keeps its generator EMA from before any sharding; use trainer=default, cpu, gpu or ddp, not fsdp"
            )

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        betas = (self.hparams.beta1, 0.999)
        return [
            torch.optim.Adam(self.generator.parameters(), lr=self.hparams.lr, betas=betas, fused=True),
            torch.optim.Adam(self.discriminator.parameters(), lr=self.hparams.lr, betas=betas, fused=True),
        ]

    def on_fit_start(self) -> None:
        if self.trainer.world_size > 1:
            self._g_grads = GradientAverager(self.generator.parameters())
            self._d_grads = GradientAverager(self.discriminator.parameters())
        real, labels = self.trainer.datamodule.eval_images("train", self.hparams.eval_samples)
        # Copy decision: to the device once, here; every validation compares against these same images.
        self._real = real.to(self.device).view(-1, *self.image_shape) * 2 - 1
        self._fit_judge_unless_resumed(labels)
        if self.global_rank > 0:
            # Lightning seeds every rank alike: without this each rank would draw the same z and the same dropout
            # masks, and a bigger world would not see more distinct fakes. Rank 0 keeps a single process's stream.
            torch.manual_seed(self.hparams.seed + self.global_rank)

    # -- The training step: G runs once, D steps on fake.detach(), G steps through a frozen D --

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        opt_g, opt_d = self.optimizers()
        real = batch[0].view(-1, *self.image_shape) * 2 - 1  # a flat digits batch is viewed as images: no copy
        z = torch.randn(real.shape[0], self.hparams.latent, device=self.device)
        # Copy decision: the only generator forward of this step; both steps below use its output.
        fake = self.generator(z)

        # Copy decision: D sees fake.detach(): shared storage, no graph, so this backward never enters G.
        d_loss = discriminator_loss(self.discriminator, real, fake.detach())
        self._backward(d_loss, self._d_grads)
        opt_d.step()
        opt_d.zero_grad(set_to_none=True)  # gradients live only between a backward and its step

        # Copy decision: reuse `fake` (no second forward); D frozen, so G's backward writes nothing into D.
        with frozen(self.discriminator):
            g_loss = _bce(self.discriminator(fake), 1.0)
            self._backward(g_loss, self._g_grads)
        opt_g.step()
        opt_g.zero_grad(set_to_none=True)  # EMAWeights updates the generator's EMA after this batch
        # Copy decision: the losses are logged detached: no logged value holds either step's graph.
        self.log_dict({"train/d_loss": d_loss.detach(), "train/g_loss": g_loss.detach()}, prog_bar=True)

    def _backward(self, loss: torch.Tensor, averager: GradientAverager | None) -> None:
        """Backward; under DDP, then average the stepping network's gradients over the ranks.

        DDP's reducer expects one backward per forward that reaches every parameter; each step here leaves
        one network unused, so its sync is switched off and the stepping network's gradients are averaged
        with one collective instead (nothing is reduced for the network that does not step)."""
        ddp = self.trainer.strategy.model
        if averager is None or not isinstance(ddp, DistributedDataParallel):
            self.manual_backward(loss)
            return
        with ddp.no_sync():
            self.manual_backward(loss)
        averager.average()

    # -- Validation: the live and the averaged generator's samples, judged; the grid from the average --

    @property
    def g_ema(self) -> EMA | None:
        """The generator's EMA: the ``EMAWeights`` callback's (built at ``fit``'s start); ``None`` before, or without
        that callback."""
        callbacks = self._trainer.callbacks if self._trainer is not None else []
        return next((c.ema for c in callbacks if isinstance(c, EMAWeights)), None)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        """Quality is measured once per validation epoch, in ``on_validation_epoch_end``."""

    def on_validation_epoch_end(self) -> None:
        ema = self.g_ema
        if ema is None or self._real is None or self.trainer.sanity_checking:
            return
        real = self._real
        if self.fid_floor is None:
            val, _ = self.trainer.datamodule.eval_images("val", self.hparams.eval_samples)
            self.fid_floor = self.judge.frechet_distance(real, val.to(self.device).view(-1, *self.image_shape) * 2 - 1)
        z = torch.randn(
            self.hparams.eval_samples, self.hparams.latent, device=self.device,
            generator=torch.Generator(self.device).manual_seed(self.hparams.seed),
        )  # fmt: skip
        live = self.sample(z)
        # Copy decision: the average copied into the generator in place for these samples, the live weights restored
        # bit for bit after them; nothing the generator writes meanwhile reaches the average.
        with ema.average_weights():
            averaged = self.sample(z)
        for suffix, samples in (("_ema", averaged), ("", live)):
            if self.judge.num_classes is not None:
                confidence, rarest = self.judge.confidence(samples)
                self.log(f"quality/confidence{suffix}", confidence)
                self.log(f"quality/min_class_fraction{suffix}", rarest)
            what = f"the {'averaged' if suffix else 'live'} generator's samples at global step {self.global_step}"
            self.log(f"quality/fid{suffix}", self.judge.frechet_distance(real, samples, what))
        self.log("quality/fid_floor", self.fid_floor)
        if self.trainer.is_global_zero:
            picture = sample_grid(averaged[: GRID * GRID])
            directory = Path(self.trainer.default_root_dir)
            directory.mkdir(parents=True, exist_ok=True)
            picture.save(directory / f"samples_epoch{self.current_epoch:03d}.png")
            picture.save(directory / "samples.png")

    def sample(self, z: torch.Tensor) -> torch.Tensor:
        """The generator's images for ``z``, made ``SAMPLE_CHUNK`` at a time (as the generator is: live or average)."""
        return torch.cat([self.generator(chunk) for chunk in z.split(SAMPLE_CHUNK)])

    # -- Resume: the judge is the module's own part; the averages, generators and data order are the callbacks' --

    def _fit_judge_unless_resumed(self, labels: torch.Tensor | None) -> None:
        """Train the judge on the real images (``labels`` ``None``: as an autoencoder), unless the checkpoint this
        fit resumed from holds a trained one (``judge_trained``, a buffer): a resumed run keeps the judge it had."""
        if self.judge_trained:
            return
        self.judge.train()
        target = None if labels is None else labels.to(self.device)
        self.judge.fit(self._real, target, self.hparams.judge_epochs, self.hparams.seed)
        self.judge_trained.fill_(True)


def discriminator_loss(discriminator: nn.Module, real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
    """``bce(D(real), 1) + bce(D(fake), 0)``, for the training step's discriminator step.

    A discriminator with BatchNorm (DCGAN's) gets two forwards, as DCGAN trains it: one forward over ``[real; fake]``
    would normalise each half with statistics of both, so D's output for a real image would depend on the fakes
    beside it, and the generator step, whose batch is all fake, would see other statistics than this step did.
    Without BatchNorm the two halves cannot meet, and one forward over both (``torch.cat`` copies the two small
    batches) costs one launch of each layer instead of two.
    """
    if has_batch_norm(discriminator):
        return _bce(discriminator(real), 1.0) + _bce(discriminator(fake), 0.0)
    # Copy decision: one copy of the two small batches, for one forward over both.
    logits = discriminator(torch.cat([real, fake]))
    targets = torch.cat([torch.ones(len(real), device=logits.device), torch.zeros(len(fake), device=logits.device)])
    return 2 * F.binary_cross_entropy_with_logits(logits, targets)


def _bce(logits: torch.Tensor, target: float) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits, torch.full_like(logits, target))
