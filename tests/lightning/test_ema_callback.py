"""EMACallback in real Trainers: per-optimizer-step updates, EMA evaluation beside live, checkpoints, DDP."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from copy_correct import EMA
from copy_correct.lightning import EMACallback

ROOT = Path(__file__).resolve().parents[2]


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


State = dict[str, torch.Tensor]


class Truth(pl.Callback):
    """After each optimizer step's EMA update (so placed after EMACallback): copies of the live weights and the
    average, by global step. Neither changes while validation runs, so these are what a checkpoint saved then
    must hold."""

    def __init__(self, ema: EMACallback) -> None:
        self.ema = ema
        self.at: dict[int, tuple[State, State]] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        assert self.ema.ema is not None and not self.ema.ema.swapped
        live = {k: v.clone() for k, v in pl_module.state_dict().items()}
        self.at[trainer.global_step] = live, {k: v.clone() for k, v in self.ema.ema.shadow.items()}


class SavesOnEvaluationEnd(pl.Callback):
    """A user callback saving with ``trainer.save_checkpoint`` at the end of every validation and test."""

    def __init__(self, directory: Path) -> None:
        self.directory, self.saves = directory, 0

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.saves += 1
        trainer.save_checkpoint(self.directory / f"user-{self.saves}.ckpt")

    on_test_end = on_validation_end


class SavesInItsOwnHook(Regressor):
    """A module saving from its own hook, which runs during the EMA pass of ``evaluate="both"`` too."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        self.directory, self.saves = directory, 0

    def on_validation_epoch_end(self) -> None:
        self.saves += 1
        self.trainer.save_checkpoint(self.directory / f"module-{self.saves}.ckpt")


def same(state: State, expected: State) -> bool:
    """Bit for bit, every name of ``expected``, in ``state``'s dtype (a float64 average in a float32 model)."""
    return all(torch.equal(state[k].cpu(), v.cpu().to(state[k].dtype)) for k, v in expected.items())


def verdict(path: Path, truth: Truth, state_key: str) -> str:
    """What a checkpoint holds, against the live weights and the average at its global step. Right: the average as
    the weights with the live weights in the callback state (``checkpoint_weights="ema"``, the default) or the live
    weights as the weights (``"live"``), the average in the EMA state either way; a weights-only save, the average
    (``"ema"``) or the live weights (``"live"``) as the weights."""
    checkpoint = torch.load(path, weights_only=True)
    live, average = truth.at[checkpoint["global_step"]]
    assert not same(live, average)  # else the comparison below could not tell them apart
    weights, mode = checkpoint["state_dict"], truth.ema.checkpoint_weights
    if "callbacks" not in checkpoint:
        expected = average if mode == "ema" else live
        return "right (weights only)" if same(weights, expected) else "weights only: not the expected weights"
    ours = checkpoint["callbacks"].get(state_key)
    if ours is None:
        return "no EMA state"
    saved_live = ours["live"] if mode == "ema" else weights
    if not same(saved_live, live):
        return "the live weights are the average" if same(saved_live, average) else "the live weights: neither"
    if not same(ours["ema"]["shadow"], average) or (mode == "ema" and not same(weights, average)):
        return "the average: not it"
    return "right"


def run_scenario(
    name: str, directory: Path, accelerator: str, checkpoint_weights: str = "ema"
) -> tuple[list[str], Regressor, Truth, EMACallback]:
    """Trains (and evaluates) a Regressor in one configuration that saves during an EMA pass; what each save holds."""
    both = name == "module hook, evaluate=both"
    shadow_dtype = torch.float64 if name == "staged shadow (float64)" else None
    evaluate = "both" if both else "ema"
    ema = EMACallback(decay=0.9, evaluate=evaluate, shadow_dtype=shadow_dtype, checkpoint_weights=checkpoint_weights)
    truth = Truth(ema)
    callbacks: list[pl.Callback] = [ema, truth]
    kwargs: dict[str, Any] = {"accelerator": accelerator, "devices": 1}
    if name in ("ModelCheckpoint on validation end", "staged shadow (float64)", "weights-only ModelCheckpoint"):
        callbacks.append(
            ModelCheckpoint(
                directory, monitor="val/loss", save_top_k=-1, save_on_train_epoch_end=False,
                save_weights_only=name.startswith("weights-only"),
            )
        )  # fmt: skip
    elif name == "mid-epoch validation":  # ModelCheckpoint then saves after each validation, by default
        callbacks.append(ModelCheckpoint(directory, monitor="val/loss", save_top_k=-1))
        kwargs["val_check_interval"] = 0.5
    elif name == "user callback before EMACallback":
        callbacks.insert(0, SavesOnEvaluationEnd(directory))
    elif name in ("user callback after EMACallback", "validate() and test()"):
        callbacks.append(SavesOnEvaluationEnd(directory))
    module = SavesInItsOwnHook(directory) if both else Regressor()
    t = trainer(directory, callbacks, **kwargs)
    if name == "validate() and test()":
        t.fit(module, loader())  # no validation while fitting: the saves come from validate() and test()
        t.validate(module, loader(64))
        t.test(module, loader(64))
    else:
        t.fit(module, loader(), loader(64))
    return [verdict(path, truth, ema.state_key) for path in sorted(directory.glob("*.ckpt"))], module, truth, ema


SCENARIOS = [
    "ModelCheckpoint on validation end",
    "staged shadow (float64)",
    "weights-only ModelCheckpoint",
    "mid-epoch validation",
    "user callback before EMACallback",
    "user callback after EMACallback",
    "validate() and test()",
    "module hook, evaluate=both",
]
SAVES = {"mid-epoch validation": 4, "validate() and test()": 2, "module hook, evaluate=both": 4}  # others: 2


# Every scenario with the default checkpoint_weights="ema"; with "live", those where the two differ most.
CASES = [(name, "ema") for name in SCENARIOS] + [
    ("ModelCheckpoint on validation end", "live"),
    ("weights-only ModelCheckpoint", "live"),
    ("module hook, evaluate=both", "live"),
]


@pytest.mark.parametrize(("name", "checkpoint_weights"), CASES)
def test_checkpoints_saved_during_the_ema_evaluation_hold_the_live_weights_and_the_average(
    name: str, checkpoint_weights: str, device: torch.device, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    verdicts, module, truth, ema = run_scenario(name, tmp_path / "fixed", device.type, checkpoint_weights)
    expected = "right (weights only)" if "weights-only" in name else "right"
    assert verdicts == [expected] * SAVES.get(name, 2)
    assert ema.ema is not None and not ema.ema.swapped
    assert same(module.state_dict(), truth.at[max(truth.at)][0])  # the live weights, back after every pass

    # The control: trainer.save_checkpoint left as it was before the fix.
    monkeypatch.setattr(EMACallback, "_save_outside_the_pass", lambda self, save: save)
    verdicts, *_ = run_scenario(name, tmp_path / "control", device.type, checkpoint_weights)
    if "weights-only" in name and checkpoint_weights == "ema":
        assert verdicts == ["right (weights only)"] * 2  # saved inside the pass, the average: right by chance
    elif "weights-only" in name:
        assert "weights only: not the expected weights" in verdicts, verdicts
    elif name == "module hook, evaluate=both":
        assert "no EMA state" in verdicts, verdicts  # saved inside the pass, where no callback is present
    else:
        assert "the live weights are the average" in verdicts, verdicts


def test_resume_from_a_checkpoint_saved_during_the_ema_evaluation_ends_bit_for_bit_as_the_straight_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def run(directory: Path, max_epochs: int, save: bool = False, ckpt_path: Path | None = None) -> tuple[State, State]:
        pl.seed_everything(0)
        ema = EMACallback(decay=0.9, warmup=True, evaluate="ema")
        callbacks: list[pl.Callback] = [ema]
        if save:  # last.ckpt on validation end: inside the EMA pass
            callbacks.append(ModelCheckpoint(directory, save_last=True, save_on_train_epoch_end=False))
        module = Regressor()
        trainer(directory, callbacks, max_epochs=max_epochs).fit(module, loader(), loader(64), ckpt_path=ckpt_path)
        assert ema.ema is not None
        return module.state_dict(), dict(ema.ema.shadow)

    straight = run(tmp_path / "straight", 4)
    run(tmp_path / "first", 2, save=True)
    checkpoint = torch.load(tmp_path / "first" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 16
    resumed = run(tmp_path / "resumed", 4, ckpt_path=tmp_path / "first" / "last.ckpt")
    assert same(resumed[0], straight[0]) and same(resumed[1], straight[1])

    # The control: the first run saves as before the fix, with the average in state_dict (the live weights lost).
    monkeypatch.setattr(EMACallback, "_save_outside_the_pass", lambda self, save: save)
    run(tmp_path / "first_unfixed", 2, save=True)
    monkeypatch.undo()
    control = run(tmp_path / "control", 4, ckpt_path=tmp_path / "first_unfixed" / "last.ckpt")
    assert not same(control[0], straight[0]) and not same(control[1], straight[1])


class FailsInTheSecondValidation(Regressor):
    def __init__(self, error: type[BaseException]) -> None:
        super().__init__()
        self.error = error

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if self.current_epoch == 1 and batch_idx == 1:
            raise self.error("in the EMA evaluation")
        super().validation_step(batch, batch_idx)


@contextmanager
def sigint_handler_kept() -> Iterator[None]:
    """Lightning ignores SIGINT from a KeyboardInterrupt on; this test process should not."""
    handler = signal.getsignal(signal.SIGINT)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)


@pytest.mark.parametrize(("error", "exits_with"), [(RuntimeError, RuntimeError), (KeyboardInterrupt, SystemExit)])
def test_an_exception_in_the_ema_evaluation_restores_the_live_weights_before_lightning_saves(
    error: type[BaseException], exits_with: type[BaseException], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``OnExceptionCheckpoint`` saves in ``on_exception``, which Lightning calls once ``fit``'s loops unwound."""

    def fail(directory: Path) -> tuple[str, Regressor, Truth]:
        ema = EMACallback(decay=0.9, evaluate="ema")
        truth = Truth(ema)
        module = FailsInTheSecondValidation(error)
        t = trainer(directory, [ema, truth, OnExceptionCheckpoint(directory)], enable_checkpointing=True)
        with sigint_handler_kept(), pytest.raises(exits_with):
            t.fit(module, loader(), loader(64))
        return verdict(directory / "on_exception.ckpt", truth, ema.state_key), module, truth

    result, module, truth = fail(tmp_path / "fixed")
    assert result == "right"
    assert same(module.state_dict(), truth.at[max(truth.at)][0])

    @contextmanager
    def swaps_back_only_without_an_exception(self: EMA, model: torch.nn.Module | None = None) -> Iterator[Any]:
        self._swap = swap = self._swap_in(model)
        yield model
        self._swap_out(swap)
        self._swap = None

    monkeypatch.setattr(EMA, "average_weights", swaps_back_only_without_an_exception)  # the control
    result, module, truth = fail(tmp_path / "control")
    assert result == "the live weights are the average"
    assert not same(module.state_dict(), truth.at[max(truth.at)][0])


def _ddp_shadows(out: Path, *args: str) -> tuple[dict, dict]:
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "workers" / "ddp_ema.py"), str(out), *args],
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


class Clocked(Regressor):
    """Each batch is drawn from (epoch, batch index), which Lightning restores on resume, so a run resumed mid-epoch
    sees the batches the uninterrupted one saw (a plain DataLoader would start the epoch's data over)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(1000 * self.current_epoch + batch_idx)
        x, y = torch.randn(16, 8, generator=generator), torch.randn(16, 1, generator=generator)
        return nn.functional.mse_loss(self.net(x), y)


def clock(batches: int = 6) -> DataLoader:
    return DataLoader(range(batches), batch_size=None)


def fit_clocked(
    directory: Path, accumulate: int, update_every: int, ckpt_path: Path | None = None, save: bool = False
) -> tuple[State, EMACallback]:
    pl.seed_everything(0)
    ema = EMACallback(decay=0.9, update_every=update_every, evaluate="live")
    callbacks: list[pl.Callback] = [ema]
    if save:  # a checkpoint after every optimizer step: what a run killed right after it would have left
        callbacks.append(ModelCheckpoint(directory, filename="{step}", every_n_train_steps=1, save_top_k=-1))
    module = Clocked()
    t = trainer(directory, callbacks, accumulate_grad_batches=accumulate, limit_val_batches=0)
    t.fit(module, clock(), ckpt_path=ckpt_path)
    return module.state_dict(), ema


def resumes_as_the_uninterrupted_run(tmp_path: Path, accumulate: int, update_every: int) -> list[int]:
    """The steps at which a run killed there and resumed ends, live weights and average, unlike the straight run."""
    live, straight = fit_clocked(tmp_path / "straight", accumulate, update_every, save=True)
    assert straight.ema is not None and straight.ema.step == 12 // accumulate
    paths = sorted((tmp_path / "straight").glob("step=*.ckpt"))
    assert len(paths) == 12 // accumulate  # one per optimizer step, the last one included
    differ = []
    for path in paths:
        step = int(path.stem.split("=")[1])
        resumed_live, resumed = fit_clocked(tmp_path / f"resumed-{step}", accumulate, update_every, ckpt_path=path)
        assert resumed.ema is not None
        same_counters = (resumed.ema.step, resumed.ema.num_updates) == (straight.ema.step, straight.ema.num_updates)
        if not (same_counters and same(resumed_live, live) and same(resumed.ema.shadow, straight.ema.shadow)):
            differ.append(step)
    return differ


@pytest.mark.parametrize("update_every", [1, 3])
@pytest.mark.parametrize("accumulate", [1, 2, 3])
def test_a_run_killed_at_any_step_and_resumed_ends_bit_for_bit_as_the_uninterrupted_one(
    accumulate: int, update_every: int, tmp_path: Path
) -> None:
    assert resumes_as_the_uninterrupted_run(tmp_path, accumulate, update_every) == []


def test_the_control_reading_the_step_before_lightning_restores_it_updates_once_too_often(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def on_fit_start(self: EMACallback, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._ensure_ema(pl_module)
        self._last_step = trainer.global_step  # before the fix: 0 here, also in a resumed run

    monkeypatch.setattr(EMACallback, "on_fit_start", on_fit_start)
    monkeypatch.setattr(EMACallback, "on_train_start", lambda *args: None)
    assert resumes_as_the_uninterrupted_run(tmp_path, 2, 1) == [1, 2, 3, 4, 5]  # every mid-run kill


class Wide(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(8, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 256), nn.Linear(256, 1)
        )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def train_wide(directory: Path, checkpoint_weights: str) -> tuple[Wide, EMACallback, Path]:
    pl.seed_everything(0)
    ema = EMACallback(decay=0.9, evaluate="live", checkpoint_weights=checkpoint_weights)
    module = Wide()
    save = ModelCheckpoint(directory, filename="last")
    trainer(directory, [ema, save], max_epochs=1, limit_val_batches=0).fit(module, loader())
    return module, ema, directory / "last.ckpt"


@pytest.mark.parametrize("checkpoint_weights", ["ema", "live"])
def test_load_from_checkpoint_returns_the_average_by_default(checkpoint_weights: str, tmp_path: Path) -> None:
    module, ema, path = train_wide(tmp_path, checkpoint_weights)
    assert ema.ema is not None
    loaded = Wide.load_from_checkpoint(path, weights_only=True)  # what a user does for inference
    average, live = dict(ema.ema.shadow), module.state_dict()
    assert not same(live, average)
    assert same(loaded.state_dict(), average if checkpoint_weights == "ema" else live)  # "live": the control


def test_a_checkpoint_holding_the_average_as_weights_stores_it_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module, _, ema_path = train_wide(tmp_path / "ema", "ema")
    _, _, live_path = train_wide(tmp_path / "live", "live")
    weights = sum(t.numel() * t.element_size() for t in module.state_dict().values())
    assert weights > 250_000
    assert abs(ema_path.stat().st_size - live_path.stat().st_size) < 0.02 * weights  # both: the weights twice

    # the control: the average put in as a copy of the shadow
    import copy_correct.lightning.ema_callback as ema_callback

    copy_in = ema_callback._average_into_weights
    monkeypatch.setattr(
        ema_callback,
        "_average_into_weights",
        lambda weights, average: copy_in(weights, {k: v.clone() for k, v in average.items()}),
    )
    _, _, copied_path = train_wide(tmp_path / "copied", "ema")
    assert copied_path.stat().st_size - live_path.stat().st_size > 0.98 * weights  # the weights three times


def test_a_checkpoint_of_the_average_resumed_without_the_callback_trains_on_from_it_and_lightning_warns(
    tmp_path: Path,
) -> None:
    """What the docstring promises a user who drops the callback: no live weights to put back, and a warning."""
    module, ema, path = train_wide(tmp_path / "run", "ema")
    assert ema.ema is not None
    average = {k: v.clone() for k, v in ema.ema.shadow.items()}
    resumed = Wide()
    t = trainer(tmp_path / "resumed", [], max_epochs=1, limit_val_batches=0, limit_train_batches=0)
    with pytest.warns(UserWarning, match=r"Please add the following callbacks: \[.*\"EMACallback\{"):
        t.fit(resumed, loader(), ckpt_path=path)
    assert same(resumed.state_dict(), average) and not same(resumed.state_dict(), module.state_dict())
