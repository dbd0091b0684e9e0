"""Recipe ``gan``: a GAN on 8x8 digits whose generator runs once per step and whose two steps never leak
gradients into each other.

    python train.py +recipe=gan

What it shows, per training step:
  * ``fake = G(z)`` runs once. The discriminator step sees ``fake.detach()``: the same values, no graph,
    so its backward stops at the detach (no gradient reaches G, nothing of G's graph is walked or kept).
  * The generator step reuses ``fake`` and goes through D inside ``frozen(D)``: gradients flow through D to
    G, but none is written into D's parameters; D's ``requires_grad`` flags come back exactly afterwards.
  * An ``EMA`` of the generator's weights (as in StyleGAN) is updated in place after each step; samples
    and quality figures come from it, with the live generator's figures logged beside them.

Quality is judged by a digits classifier trained on the real training split when the run starts (seeded,
part of this recipe): on ``eval_samples`` generated digits, the mean confidence of its prediction and the
share of the rarest predicted class (mode collapse shows as a class near 0), and a Frechet distance on
its penultimate features, computed by torchmetrics' ``FrechetInceptionDistance`` with that classifier as
the feature extractor, beside the same distance between real training and real validation digits (the
floor). Each validation epoch writes ``samples_epochNNN.png`` and ``samples.png`` (EMA generator).

Change first: ``Generator`` and ``Discriminator``.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torchmetrics.image.fid import FrechetInceptionDistance

from components import EMA, GradientAverager, frozen

__all__ = ["Discriminator", "DigitsGAN", "Generator", "Judge", "discriminator_loss"]

# The judge is in eval mode on purpose: trained once before the GAN, it only evaluates.
warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode at the start of training")

PIXELS = 64


class Generator(nn.Module):
    def __init__(self, latent: int, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(latent, hidden), nn.LeakyReLU(0.2), nn.Linear(hidden, hidden), nn.LeakyReLU(0.2),
            nn.Linear(hidden, PIXELS), nn.Tanh(),
        )  # fmt: skip

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(z)


class Discriminator(nn.Module):
    def __init__(self, hidden: int, dropout: float) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(PIXELS, hidden), nn.LeakyReLU(0.2), nn.Dropout(dropout),
            nn.Linear(hidden, hidden), nn.LeakyReLU(0.2), nn.Dropout(dropout),
            nn.Linear(hidden, 1),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(1)


class Judge(nn.Module):
    """The evaluation classifier; ``features`` (penultimate layer) feed the Frechet distance."""

    num_features = 128

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(PIXELS, 128), nn.ReLU(), nn.Linear(128, self.num_features), nn.ReLU())
        self.head = nn.Linear(self.num_features, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def fit(self, images: torch.Tensor, labels: torch.Tensor, epochs: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        optimizer = torch.optim.Adam(self.parameters(), lr=1e-3)
        with torch.enable_grad():
            for _ in range(epochs):
                for index in torch.randperm(len(images), generator=generator).split(64):
                    loss = F.cross_entropy(self(images[index]), labels[index])
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    optimizer.step()
        self.eval()


class _Features(nn.Module):
    """The judge's penultimate layer as a torchmetrics feature extractor."""

    def __init__(self, judge: Judge) -> None:
        super().__init__()
        self.judge = judge
        self.num_features = judge.num_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.judge.body(x)


class DigitsGAN(pl.LightningModule):
    """Unconditional GAN on sklearn digits scaled to [-1, 1], with manual optimisation."""

    def __init__(
        self,
        latent: int = 32,
        hidden: int = 256,
        d_dropout: float = 0.3,
        lr: float = 2e-4,
        beta1: float = 0.5,
        ema_decay: float = 0.999,
        eval_samples: int = 2000,
        judge_epochs: int = 30,
        seed: int = 0,
    ) -> None:
        super().__init__()
        for name, value in {"latent": latent, "hidden": hidden, "eval_samples": eval_samples}.items():
            if value < 1:
                raise ValueError(f"model.{name} must be >= 1, got {value}")
        if not lr > 0:
            raise ValueError(f"model.lr must be > 0, got {lr}")
        if not 0 <= d_dropout < 1:
            raise ValueError(f"model.d_dropout must be in [0, 1), got {d_dropout}")
        if not 0 <= beta1 < 1:
            raise ValueError(f"model.beta1 must be in [0, 1), got {beta1}")
        if not 0 <= ema_decay < 1:
            raise ValueError(f"model.ema_decay must be in [0, 1), got {ema_decay}")
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.generator = Generator(latent, hidden)
        self.discriminator = Discriminator(hidden, d_dropout)
        self.judge = Judge()
        self.register_buffer("judge_trained", torch.tensor(False))  # checkpointed: a resumed run keeps its judge
        self.g_ema: EMA | None = None  # made in on_fit_start, once the generator is on its device
        self._g_grads: GradientAverager | None = None  # under DDP only
        self._d_grads: GradientAverager | None = None
        self._pending_ema: dict[str, Any] | None = None
        self.fid_floor: float | None = None

    def train(self, mode: bool = True) -> DigitsGAN:
        super().train(mode)
        self.judge.eval()  # the judge is trained once, before the GAN, and only evaluates afterwards
        return self

    # -- training ----------------------------------------------------------------------------------------

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        opt_g, opt_d = self.optimizers()
        real = batch[0] * 2 - 1
        z = torch.randn(real.shape[0], self.hparams.latent, device=self.device)
        fake = self.generator(z)  # the only generator forward of this step

        # Copy decision: D sees fake.detach(): shared storage, no graph, so this backward never enters G.
        # One D forward over [real; fake] (torch.cat copies the two small batches) instead of two.
        d_loss = discriminator_loss(self.discriminator, real, fake.detach())
        self._backward(d_loss, self._d_grads)
        opt_d.step()
        opt_d.zero_grad(set_to_none=True)  # gradients live only between a backward and its step

        # Copy decision: reuse `fake` (no second forward); D frozen, so G's backward writes nothing into D.
        with frozen(self.discriminator):
            g_loss = _bce(self.discriminator(fake), 1.0)
            self._backward(g_loss, self._g_grads)
        opt_g.step()
        opt_g.zero_grad(set_to_none=True)
        assert self.g_ema is not None
        self.g_ema.update(self.generator)
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

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        betas = (self.hparams.beta1, 0.999)
        return [
            torch.optim.Adam(self.generator.parameters(), lr=self.hparams.lr, betas=betas, fused=True),
            torch.optim.Adam(self.discriminator.parameters(), lr=self.hparams.lr, betas=betas, fused=True),
        ]

    def setup(self, stage: str) -> None:
        if self.device_mesh is not None:  # Lightning's ModelParallelStrategy (trainer=fsdp) gives the module a mesh
            raise ValueError(
                "recipe gan does not run sharded: it alternates two networks and averages their gradients itself, "
                "and keeps its generator EMA from before any sharding; use trainer=default, cpu, gpu or ddp, not fsdp"
            )

    def on_fit_start(self) -> None:
        if self.trainer.world_size > 1:
            self._g_grads = GradientAverager(self.generator.parameters())
            self._d_grads = GradientAverager(self.discriminator.parameters())
        self.g_ema = EMA(self.generator, decay=self.hparams.ema_decay, warmup=True)
        if self._pending_ema is not None:
            self.g_ema.load_state_dict(self._pending_ema)
            self._pending_ema = None
        if not self.judge_trained:
            train_x, train_y = (t.to(self.device) for t in self.trainer.datamodule.train_set.tensors)
            self.judge.train()
            self.judge.fit(train_x * 2 - 1, train_y, self.hparams.judge_epochs, self.hparams.seed)
            self.judge_trained.fill_(True)
        if self.global_rank > 0:
            # Lightning seeds every rank alike: without this each rank would draw the same z and the same dropout
            # masks, and a bigger world would not see more distinct fakes. Rank 0 keeps a single process's stream.
            torch.manual_seed(self.hparams.seed + self.global_rank)

    # -- evaluation ----------------------------------------------------------------------------------------

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        """Quality is measured once per validation epoch, in ``on_validation_epoch_end``."""

    def on_validation_epoch_end(self) -> None:
        if self.g_ema is None or self.trainer.sanity_checking:
            return
        data = self.trainer.datamodule
        train_x = data.train_set.tensors[0].to(self.device) * 2 - 1
        if self.fid_floor is None:
            val_x = data.val_set.tensors[0].to(self.device) * 2 - 1
            self.fid_floor = self.frechet(train_x, val_x)
        z = torch.randn(
            self.hparams.eval_samples, self.hparams.latent, device=self.device,
            generator=torch.Generator(self.device).manual_seed(self.hparams.seed),
        )  # fmt: skip
        live = self.generator(z)
        with self.g_ema.average_weights(self.generator):
            averaged = self.generator(z)
        for suffix, samples in (("_ema", averaged), ("", live)):
            confidence, rarest = self.judge_samples(samples)
            self.log(f"quality/confidence{suffix}", confidence)
            self.log(f"quality/min_class_fraction{suffix}", rarest)
            self.log(f"quality/fid{suffix}", self.frechet(train_x, samples))
        self.log("quality/fid_floor", self.fid_floor)
        if self.trainer.is_global_zero:
            self.write_grid(averaged[:100], Path(self.trainer.default_root_dir))

    def judge_samples(self, samples: torch.Tensor) -> tuple[float, float]:
        probs = self.judge(samples).softmax(dim=1)
        counts = torch.bincount(probs.argmax(dim=1), minlength=10)
        return probs.max(dim=1).values.mean().item(), (counts.min() / len(samples)).item()

    def frechet(self, real: torch.Tensor, fake: torch.Tensor) -> float:
        fid = FrechetInceptionDistance(feature=_Features(self.judge)).to(self.device)
        fid.update(real, real=True)
        fid.update(fake, real=False)
        return fid.compute().item()

    def write_grid(self, samples: torch.Tensor, directory: Path) -> None:
        images = ((samples.reshape(10, 10, 8, 8) + 1) * 127.5).clamp(0, 255).to(torch.uint8).cpu().numpy()
        grid = np.pad(images, ((0, 0), (0, 0), (1, 1), (1, 1))).transpose(0, 2, 1, 3).reshape(100, 100)
        picture = Image.fromarray(grid).resize((400, 400), Image.NEAREST)
        directory.mkdir(parents=True, exist_ok=True)
        picture.save(directory / f"samples_epoch{self.current_epoch:03d}.png")
        picture.save(directory / "samples.png")

    # -- checkpoints ---------------------------------------------------------------------------------------

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.g_ema is not None:
            checkpoint["generator_ema"] = self.g_ema.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._pending_ema = checkpoint.get("generator_ema")


def _bce(logits: torch.Tensor, target: float) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits, torch.full_like(logits, target))


def discriminator_loss(discriminator: nn.Module, real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
    """``bce(D(real), 1) + bce(D(fake), 0)`` with a single forward over both batches."""
    logits = discriminator(torch.cat([real, fake]))
    targets = torch.cat([torch.ones(len(real), device=logits.device), torch.zeros(len(fake), device=logits.device)])
    return 2 * F.binary_cross_entropy_with_logits(logits, targets)
