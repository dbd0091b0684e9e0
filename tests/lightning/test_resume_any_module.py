"""A user's own LightningModule resumed with ``trainer.fit(..., ckpt_path=...)`` ends bit for bit as the uninterrupted
run: a module with BatchNorm, Dropout and ``torch.randn`` in its ``training_step``, a dataset whose ``__getitem__``
draws its augmentation from the global generator, a plain ``DataLoader(batch_size=8, shuffle=True)``, ``EMAWeights``,
``ResumeState()`` without arguments and ``ModelCheckpoint``; checkpoints at a batch's end mid-epoch, at a mid-epoch
validation's end and at an epoch's end; ``accumulate_grad_batches`` 1 and 3. The final weights, the EMA shadow, the
optimizer state and the order of the items trained on are compared with ``torch.equal`` and ``==``.

The controls: the same resumes without ``ResumeState``'s data-order part (the behaviour before it) end elsewhere;
with no randomness in training (Dropout p=0, no noise, no shuffling) that old behaviour was already exact, so the EMA
and the optimizer state always resumed exactly. What stays inexact is shown too: draws inside ``DataLoader`` workers
after a mid-epoch resume, and after any resume with ``persistent_workers=True`` (the order is still exact there), and
a loader that cannot be instrumented (an ``IterableDataset``), for which a mid-epoch resume warns."""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from copy_correct.lightning import EMAWeights, ResumeState
from copy_correct.lightning.resume_data_order import TrainDataOrder, _restart_at_first_fetch

ITEMS, BATCH, EPOCHS = 100, 8, 2  # 13 batches per epoch, the last one of 4 items
# Each resumed run keeps its checkpoints apart from the run it resumes (Lightning notes the other directory).
pytestmark = pytest.mark.filterwarnings("ignore:The dirpath has changed")


class Items(Dataset):
    """TensorDataset-like: (features, label, index); with ``augment``, noise drawn from the global generator in
    ``__getitem__`` (in a worker process where the loader has workers)."""

    def __init__(self, augment: bool = True, count: int = ITEMS) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(count, 8, generator=generator)
        self.y = torch.randint(0, 3, (count,), generator=generator)
        self.augment = augment

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        x = self.x[index] + 0.1 * torch.randn(8) if self.augment else self.x[index]
        return x, self.y[index], index


class Stream(IterableDataset):
    """The same items as an ``IterableDataset``, shuffled by the global generator in ``__iter__``."""

    def __len__(self) -> int:
        return ITEMS

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
        items = Items(augment=False)
        for index in torch.randperm(len(items)).tolist():
            yield items[index]


class UserModule(pl.LightningModule):
    """A user's classifier: BatchNorm, Dropout, noise drawn in the step and a draw at each epoch's start; it notes the
    items it trains on."""

    def __init__(self, dropout: float = 0.3, noise: float = 0.1) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(dropout), nn.Linear(32, 3))
        self.noise = noise
        self.register_buffer("shift", torch.zeros(()))  # module state: in the checkpoint, for a mid-epoch resume
        self.seen: list[int] = []

    def on_train_epoch_start(self) -> None:
        self.shift.copy_(self.noise * torch.rand(()))  # drawn before the epoch's iterator is made: it stays before

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, index = batch
        self.seen += index.tolist()
        x = x + self.noise * torch.randn_like(x) + self.shift
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y, _ = batch
        self.log("val/loss", nn.functional.cross_entropy(self.net(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


@dataclass
class Run:
    seen: list[int]
    weights: dict[str, torch.Tensor]
    shadow: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    checkpoints: Path
    accumulate: int


def fit(
    directory: Path,
    *,
    accumulate: int = 1,
    ckpt_path: Path | None = None,
    data: Dataset | None = None,
    module: Mapping[str, float] | None = None,
    resume_state: bool = True,
    **loader: Any,
) -> Run:
    """One fit, as a user writes it; a resumed one seeds the process otherwise (a fresh process need not match)."""
    seed = 0 if ckpt_path is None else 1
    torch.manual_seed(seed), np.random.seed(seed), random.seed(seed)
    model, ema = UserModule(**(module or {})), EMAWeights(decay=0.9)
    checkpoints = [
        ModelCheckpoint(directory / "batch", "{step}", every_n_train_steps=4, save_top_k=-1),
        ModelCheckpoint(directory / "validation", "{step}", monitor="val/loss", save_top_k=-1),
        ModelCheckpoint(directory / "epoch", "{epoch}", save_top_k=-1, save_on_train_epoch_end=True),
    ]
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=EPOCHS, accumulate_grad_batches=accumulate, val_check_interval=0.5,
        callbacks=[ema, *([ResumeState()] if resume_state else []), *checkpoints], logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=directory,
    )  # fmt: skip
    batches = {"batch_size": BATCH, "shuffle": True, **loader}
    train = DataLoader(data if data is not None else Items(), **batches)
    trainer.fit(model, train, DataLoader(Items(augment=False, count=16), batch_size=16), ckpt_path=ckpt_path)
    assert ema.ema is not None
    optimizer = trainer.optimizers[0].state_dict()
    return Run(model.seen, dict(model.state_dict()), dict(ema.ema.shadow), optimizer, directory, accumulate)


def saved_at(run: Run, kind: str) -> Path:
    """The run's checkpoint of ``kind`` in its second epoch: mid-epoch for ``batch`` and ``validation``, at the end of
    the first epoch for ``epoch``."""
    for path in sorted((run.checkpoints / kind).glob("*.ckpt"), key=lambda p: p.stat().st_mtime_ns):
        loops = torch.load(path, weights_only=True)["loops"]["fit_loop"]
        epoch = loops["epoch_progress"]["current"]["processed"]
        fetched = loops["epoch_loop.batch_progress"]["current"]["ready"]
        if kind == "epoch" or (epoch == 1 and 0 < fetched < -(-ITEMS // BATCH)):
            return path
    raise AssertionError(f"no {kind} checkpoint in the second epoch")


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where ``a`` and ``b`` differ: tensors by ``torch.equal``, the rest by ``==``."""
    if isinstance(a, Mapping):
        return [d for k in a for d in differences(a[k], b[k], f"{path}/{k}")] if set(a) == set(b) else [path]
    if isinstance(a, (list, tuple)) and not (a and isinstance(a[0], int)):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{path}/{i}")]
    if isinstance(a, torch.Tensor):
        return [] if torch.equal(a, b) else [path]
    return [] if a == b else [path]


def compare(resumed: Run, uninterrupted: Run) -> list[str]:
    """What the resumed run ended with that the uninterrupted one did not; its items must be the last ones
    the uninterrupted run trained on, in the same order."""
    tail = uninterrupted.seen[len(uninterrupted.seen) - len(resumed.seen) :]
    return (
        (["order"] if resumed.seen != tail else [])
        + [f"weights{d}" for d in differences(resumed.weights, uninterrupted.weights)]
        + [f"shadow{d}" for d in differences(resumed.shadow, uninterrupted.shadow)]
        + [f"optimizer{d}" for d in differences(resumed.optimizer, uninterrupted.optimizer)]
    )


@pytest.fixture(scope="module", params=[1, 3], ids=["accumulate1", "accumulate3"])
def uninterrupted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Run:
    return fit(tmp_path_factory.mktemp("uninterrupted"), accumulate=request.param)


@pytest.mark.parametrize("kind", ["batch", "validation", "epoch"])
def test_a_users_module_resumes_bit_for_bit(uninterrupted: Run, kind: str, tmp_path: Path) -> None:
    """Mid-epoch (``ModelCheckpoint(every_n_train_steps=4)`` at a batch's end, and at a mid-epoch validation's end)
    and at an epoch's end: the rest of the run sees the same items in the same order, the same dropout masks, noise
    and augmentation, and ends with the same weights, EMA shadow and optimizer state."""
    resumed = fit(tmp_path, accumulate=uninterrupted.accumulate, ckpt_path=saved_at(uninterrupted, kind))
    assert resumed.seen and compare(resumed, uninterrupted) == []


@pytest.mark.parametrize("kind", ["batch", "epoch"])
def test_control_without_the_data_order_the_resume_ends_elsewhere(
    uninterrupted: Run, kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ResumeState`` as it was: the global generators restored, the data order not. Mid-epoch Lightning starts the
    epoch over (other items); at the epoch's end the order is drawn one draw early, where the workers' base seed was."""
    monkeypatch.setattr(TrainDataOrder, "on_train_start", lambda self, trainer, state: None)
    resumed = fit(tmp_path, accumulate=uninterrupted.accumulate, ckpt_path=saved_at(uninterrupted, kind))
    assert {"order", "weights/net.0.weight", "shadow/net.0.weight"} <= set(compare(resumed, uninterrupted))


def test_an_uninterrupted_run_is_the_same_with_resume_state_as_without(uninterrupted: Run, tmp_path: Path) -> None:
    """The recording sampler draws nothing and yields the sampler's indices unchanged: with ``num_workers=0`` a run
    sees the same order and ends with the same weights as without ``ResumeState`` (before it existed)."""
    without = fit(tmp_path, accumulate=uninterrupted.accumulate, resume_state=False)
    assert without.seen == uninterrupted.seen and compare(without, uninterrupted) == []


def test_control_with_no_randomness_in_training_the_old_resume_was_already_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dropout p=0, no noise, no augmentation, no shuffling: resumed at an epoch's end without the data-order part
    (``ResumeState`` as it was), the run ends bit for bit, EMA shadow and optimizer state included. What the resumes
    above lacked was the data order and the draws that follow it, never the EMA's or the optimizer's state."""
    still = {"module": {"dropout": 0.0, "noise": 0.0}, "data": Items(augment=False), "shuffle": False}
    uninterrupted = fit(tmp_path / "uninterrupted", **still)  # type: ignore[arg-type]
    monkeypatch.setattr(TrainDataOrder, "on_train_start", lambda self, trainer, state: None)
    resumed = fit(tmp_path / "resumed", ckpt_path=saved_at(uninterrupted, "epoch"), **still)  # type: ignore[arg-type]
    assert compare(resumed, uninterrupted) == []


def test_a_loader_with_its_own_generator_resumes_bit_for_bit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``DataLoader(generator=g)``, ``g`` made afresh by each fit as a new process would: the checkpoint holds g's
    state, so the resumed order is the uninterrupted one's, mid-epoch and at an epoch's end. The control: without
    the data-order part, g starts over and the resumed epochs repeat the first one's order."""
    uninterrupted = fit(tmp_path / "uninterrupted", generator=torch.Generator().manual_seed(1))
    for kind in ("batch", "epoch"):
        resumed = fit(
            tmp_path / kind, ckpt_path=saved_at(uninterrupted, kind), generator=torch.Generator().manual_seed(1)
        )
        assert resumed.seen and compare(resumed, uninterrupted) == [], kind
    monkeypatch.setattr(TrainDataOrder, "on_train_start", lambda self, trainer, state: None)
    control = fit(
        tmp_path / "control", ckpt_path=saved_at(uninterrupted, "epoch"), generator=torch.Generator().manual_seed(1)
    )
    assert "order" in compare(control, uninterrupted)


@pytest.fixture(scope="module")
def with_workers(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """Two workers, items that draw nothing."""
    return fit(tmp_path_factory.mktemp("workers"), data=Items(augment=False), num_workers=2)


@pytest.mark.parametrize("kind", ["batch", "epoch"])
def test_with_workers_and_items_that_draw_nothing_the_resume_is_bit_for_bit(
    with_workers: Run, kind: str, tmp_path: Path
) -> None:
    """``num_workers=2``: the workers took indices from the unrecorded sampler before ``on_train_start``; the iterator
    is made again at the first fetch, recorded, so a mid-epoch checkpoint (here in the second epoch, as in the first)
    replays, and one at an epoch's end draws the next order where the uninterrupted run drew it."""
    resumed = fit(tmp_path, ckpt_path=saved_at(with_workers, kind), data=Items(augment=False), num_workers=2)
    assert resumed.seen and compare(resumed, with_workers) == []


def test_control_with_workers_a_fresh_fits_first_epoch_has_another_order_than_without_resume_state(
    with_workers: Run, tmp_path: Path
) -> None:
    """The price of recording the first epoch with workers: its iterator is made a second time, so that epoch's
    order (and what is drawn after it) differs from a run without ``ResumeState``; with ``num_workers=0`` it is the
    same (``test_an_uninterrupted_run_is_the_same_with_resume_state_as_without``)."""
    without = fit(tmp_path, data=Items(augment=False), num_workers=2, resume_state=False)
    assert without.seen[:ITEMS] != with_workers.seen[:ITEMS]
    assert sorted(without.seen[:ITEMS]) == sorted(with_workers.seen[:ITEMS])


def test_inexact_draws_inside_workers_after_a_mid_epoch_resume_or_with_persistent_workers(tmp_path: Path) -> None:
    """Augmentation drawn inside two workers. At an epoch's end the resume is exact (each epoch's workers are seeded
    from a base seed drawn where the uninterrupted run drew it). Mid-epoch the order is exact but the workers never
    process the skipped items, so their draws (and the weights) differ; with ``persistent_workers=True`` the workers'
    generators run on across epochs in the uninterrupted run and start afresh in a resumed one: order exact, draws
    not, even from an epoch's end. Nothing in the main process can restore a worker's generator."""
    uninterrupted = fit(tmp_path / "uninterrupted", num_workers=2)
    assert (
        compare(fit(tmp_path / "epoch", ckpt_path=saved_at(uninterrupted, "epoch"), num_workers=2), uninterrupted) == []
    )
    mid_epoch = fit(tmp_path / "batch", ckpt_path=saved_at(uninterrupted, "batch"), num_workers=2)
    assert "order" not in compare(mid_epoch, uninterrupted) and "weights/net.0.weight" in compare(
        mid_epoch, uninterrupted
    )
    persistent = {"num_workers": 2, "persistent_workers": True}
    uninterrupted = fit(tmp_path / "persistent", **persistent)
    resumed = fit(tmp_path / "persistent_epoch", ckpt_path=saved_at(uninterrupted, "epoch"), **persistent)
    assert "order" not in compare(resumed, uninterrupted) and "weights/net.0.weight" in compare(resumed, uninterrupted)


def test_a_loader_that_cannot_be_instrumented_warns_on_a_mid_epoch_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ``IterableDataset`` has no sampler to record: resumed mid-epoch, Lightning starts its stream over (as
    before ``ResumeState`` had a data-order part) and ``ResumeState`` says so in one line. At an epoch's end its
    iterator is made where the uninterrupted run made it, so the stream's own draws (a shuffle from the global
    generator here) are the uninterrupted run's; the control, without the data-order part, shuffles one draw early."""
    uninterrupted = fit(tmp_path / "uninterrupted", data=Stream(), shuffle=False)
    with pytest.warns(UserWarning, match=r"^train loader 0 \(an IterableDataset\): the rest of the interrupted epoch"):
        resumed = fit(tmp_path / "batch", ckpt_path=saved_at(uninterrupted, "batch"), data=Stream(), shuffle=False)
    assert "order" in compare(resumed, uninterrupted)
    resumed = fit(tmp_path / "epoch", ckpt_path=saved_at(uninterrupted, "epoch"), data=Stream(), shuffle=False)
    assert resumed.seen and compare(resumed, uninterrupted) == []
    monkeypatch.setattr(TrainDataOrder, "on_train_start", lambda self, trainer, state: None)
    control = fit(tmp_path / "control", ckpt_path=saved_at(uninterrupted, "epoch"), data=Stream(), shuffle=False)
    assert "order" in compare(control, uninterrupted)


class TwoLoaders(UserModule):
    """Two train loaders (Lightning's ``max_size_cycle``: the shorter one starts over mid-epoch), made again every
    epoch (``reload_dataloaders_every_n_epochs=1``)."""

    def train_dataloader(self) -> dict[str, DataLoader]:
        return {
            "long": DataLoader(Items(), batch_size=BATCH, shuffle=True),
            "short": DataLoader(Items(count=40), batch_size=BATCH, shuffle=True),
        }

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        losses = [super(TwoLoaders, self).training_step(batch[key], batch_idx) for key in ("long", "short")]
        return losses[0] + losses[1]


def test_two_loaders_reloaded_every_epoch_resume_bit_for_bit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every flattened train loader is recorded, loaders made for a new epoch too; the short loader's iteration that
    started mid-epoch replays from its own start (7 batches into the epoch, 2 of its own consumed). The control:
    without the data-order part the order differs."""
    runs = {}
    for name, ckpt_path in (("uninterrupted", None), ("resumed", "step=20.ckpt"), ("control", "step=20.ckpt")):
        if name == "control":
            monkeypatch.setattr(TrainDataOrder, "on_train_start", lambda self, trainer, state: None)
        seed = 0 if ckpt_path is None else 1
        torch.manual_seed(seed), np.random.seed(seed), random.seed(seed)
        model, ema = TwoLoaders(), EMAWeights(decay=0.9)
        trainer = pl.Trainer(
            accelerator="cpu", max_epochs=EPOCHS, reload_dataloaders_every_n_epochs=1, limit_val_batches=0,
            callbacks=[ema, ResumeState(), ModelCheckpoint(tmp_path / name, "{step}", every_n_train_steps=4,
                                                           save_top_k=-1)],
            logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
        )  # fmt: skip
        trainer.fit(model, ckpt_path=None if ckpt_path is None else tmp_path / "uninterrupted" / ckpt_path)
        assert ema.ema is not None
        optimizer = trainer.optimizers[0].state_dict()
        runs[name] = Run(model.seen, dict(model.state_dict()), dict(ema.ema.shadow), optimizer, tmp_path, 1)
    assert runs["resumed"].seen and compare(runs["resumed"], runs["uninterrupted"]) == []
    assert "order" in compare(runs["control"], runs["uninterrupted"])


def test_without_the_private_data_fetcher_of_lightning_2_6_the_restart_stops_with_a_clear_error() -> None:
    """The restart needs ``Trainer.fit_loop._data_fetcher`` (Lightning 2.6, private): another version's trainer
    without it is named in a ``RuntimeError``, not met with an ``AttributeError`` deep inside."""
    with pytest.raises(RuntimeError, match=rf"_data_fetcher \(Lightning 2\.6\), which Lightning {pl.__version__}"):
        _restart_at_first_fetch(SimpleNamespace(fit_loop=SimpleNamespace()), keep=None)  # type: ignore[arg-type]


def test_a_fetcher_that_fetched_ahead_is_not_restarted_and_says_so() -> None:
    """Train loaders without a length make Lightning fetch one batch ahead in ``setup_data``: a new iterator would
    follow that batch with the stream's start again, so it is left alone, with a warning (the control: a sized
    fetcher, which has fetched nothing, gets the restart)."""
    ahead = SimpleNamespace(iterator="lightning's", batches=["a batch"], combined_loader=None)
    with pytest.warns(UserWarning, match="the train loaders have no length, so Lightning fetched a batch already"):
        _restart_at_first_fetch(SimpleNamespace(fit_loop=SimpleNamespace(_data_fetcher=ahead)), keep=None)  # type: ignore[arg-type]
    assert ahead.iterator == "lightning's"
    sized = SimpleNamespace(iterator="lightning's", batches=[], combined_loader=None)
    _restart_at_first_fetch(SimpleNamespace(fit_loop=SimpleNamespace(_data_fetcher=sized)), keep=None)  # type: ignore[arg-type]
    assert sized.iterator != "lightning's"
