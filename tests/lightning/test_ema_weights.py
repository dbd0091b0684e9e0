"""EMAWeights in real Trainers: per-optimizer-step updates, EMA evaluation beside live (in what ``validate`` and
``test`` return and in one row of ``metrics.csv``), checkpoints (after ``fit`` too), copies, DDP."""

from __future__ import annotations

import copy
import csv
import pickle
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from copy_correct import EMA
from copy_correct.averages.weight_swap import swap_in, swap_out
from copy_correct.lightning import EMAWeights, IsolatedEvaluation
from copy_correct.lightning._ema_pass import EMAPass
from copy_correct.probes import shares_storage
from tests.conftest import DEVICES, child_env, free_port
from tests.lightning import test_isolated_evaluation as isolation

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
    ema = EMAWeights(decay=0.9)
    t = trainer(tmp_path, [ema], accumulate_grad_batches=2, limit_val_batches=0)
    t.fit(Regressor(), loader())
    assert t.global_step == 8  # 16 batches, one optimizer step per 2
    assert ema.ema is not None and ema.ema.step == ema.ema.num_updates == 8


def test_delayed_start_copies_until_start_step(tmp_path: Path) -> None:
    ema = EMAWeights(decay=0.9, start_step=10)
    module = Regressor()
    trainer(tmp_path, [ema], max_epochs=1, limit_val_batches=0).fit(module, loader())  # 8 steps
    assert ema.ema is not None and ema.ema.num_updates == 0
    for name, value in module.state_dict().items():
        assert torch.equal(ema.ema.shadow[name], value)


def test_validation_and_test_log_ema_metrics_beside_live_ones(tmp_path: Path) -> None:
    ema = EMAWeights(decay=0.9)
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
    ema = EMAWeights(decay=0.9, evaluate=evaluate)
    module = Regressor()
    t = trainer(tmp_path, [ema])
    t.fit(module, loader(), loader(64))
    assert "val/weight_sum_ema" not in t.callback_metrics
    assert ema.ema is not None
    value = ema.ema.shadow["net.0.weight"].sum() if expected == "shadow" else module.net[0].weight.sum().detach()
    torch.testing.assert_close(t.callback_metrics["val/weight_sum"], value)
    (returned,) = t.validate(module, loader(64), verbose=False)  # under the module's own names, one set
    assert set(returned) == {"val/loss", "val/weight_sum"}
    assert returned["val/weight_sum"] == pytest.approx(value.item())


def test_ema_weights_at_end(tmp_path: Path) -> None:
    ema = EMAWeights(decay=0.9, ema_weights_at_end=True)
    module = Regressor()
    trainer(tmp_path, [ema], limit_val_batches=0).fit(module, loader())
    assert ema.ema is not None
    assert all(torch.equal(module.state_dict()[k], v) for k, v in ema.ema.shadow.items())


def test_resume_reproduces_the_uninterrupted_shadow_exactly(tmp_path: Path) -> None:
    pl.seed_everything(0)
    straight = EMAWeights(decay=0.9, warmup=True)
    trainer(tmp_path / "a", [straight], max_epochs=4, limit_val_batches=0).fit(Regressor(), loader())

    pl.seed_everything(0)
    first = EMAWeights(decay=0.9, warmup=True)
    save = ModelCheckpoint(dirpath=tmp_path / "b", save_last=True)
    trainer(tmp_path / "b", [first, save], max_epochs=2, limit_val_batches=0).fit(Regressor(), loader())
    checkpoint = torch.load(tmp_path / "b" / "last.ckpt", weights_only=True)  # plain tensors and numbers
    assert any("EMAWeights" in key for key in checkpoint["callbacks"])

    resumed = EMAWeights(decay=0.9, warmup=True)
    trainer(tmp_path / "c", [resumed], max_epochs=4, limit_val_batches=0).fit(
        Regressor(), loader(), ckpt_path=tmp_path / "b" / "last.ckpt"
    )
    assert straight.ema is not None and resumed.ema is not None
    assert (resumed.ema.step, resumed.ema.num_updates) == (straight.ema.step, straight.ema.num_updates) == (32, 32)
    for name, value in straight.ema.shadow.items():
        assert torch.equal(resumed.ema.shadow[name], value), name

    class ForgetsItsState(EMAWeights):  # the control: a resume that starts a fresh average
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
    """After each optimizer step's EMA update (so placed after EMAWeights): copies of the live weights and the
    average, by global step. Neither changes while validation runs, so these are what a checkpoint saved then
    must hold."""

    def __init__(self, ema: EMAWeights) -> None:
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
) -> tuple[list[str], Regressor, Truth, EMAWeights]:
    """Trains (and evaluates) a Regressor in one configuration that saves during an EMA pass; what each save holds."""
    both = name == "module hook, evaluate=both"
    shadow_dtype = torch.float64 if name == "staged shadow (float64)" else None
    evaluate = "both" if both else "ema"
    ema = EMAWeights(decay=0.9, evaluate=evaluate, shadow_dtype=shadow_dtype, checkpoint_weights=checkpoint_weights)
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
    elif name == "user callback before EMAWeights":
        callbacks.insert(0, SavesOnEvaluationEnd(directory))
    elif name in ("user callback after EMAWeights", "validate() and test()"):
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
    "user callback before EMAWeights",
    "user callback after EMAWeights",
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
    monkeypatch.setattr(EMAWeights, "_save_outside_the_pass", lambda self, save: save)
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
        ema = EMAWeights(decay=0.9, warmup=True, evaluate="ema")
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
    monkeypatch.setattr(EMAWeights, "_save_outside_the_pass", lambda self, save: save)
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
        ema = EMAWeights(decay=0.9, evaluate="ema")
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
        self._swap = swap = swap_in(self._live_groups(model))
        yield model
        swap_out(self._model, swap)
        self._swap = None

    monkeypatch.setattr(EMA, "average_weights", swaps_back_only_without_an_exception)  # the control
    result, module, truth = fail(tmp_path / "control")
    assert result == "the live weights are the average"
    assert not same(module.state_dict(), truth.at[max(truth.at)][0])


def _ddp_shadows(out: Path, *args: str) -> tuple[dict, dict]:
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "workers" / "ddp_ema.py"), str(out), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=child_env(MASTER_PORT=free_port()),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(out / "rank0.pt", weights_only=True), torch.load(out / "rank1.pt", weights_only=True)


@pytest.mark.long  # a Lightning fit in 2 processes (gloo)
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
        EMAWeights(evaluate="sometimes")
    with pytest.raises(ValueError, match="decay must be in"):
        EMAWeights(decay=1.5)
    with pytest.raises(TypeError, match=r"^EMAWeights got an unexpected argument 'decay_rate': it takes decay, warmup"):
        EMAWeights(decay_rate=0.9)


def test_the_callback_takes_emas_arguments_as_ema_writes_them() -> None:
    """Each of ``EMA``'s arguments, read from its signature (``decay`` first, with ``EMA``'s default), and no other:
    the control, a name ``EMA`` does not take, is refused naming every one it takes."""
    from inspect import signature

    from copy_correct.averages.settings import defaults

    assert signature(EMAWeights).parameters["decay"].default == signature(EMA).parameters["decay"].default
    for name, value in defaults(EMA).items():
        assert EMAWeights(**{name: value})._ema_kwargs == {"decay": 0.999, name: value}
    takes = ", ".join(defaults(EMA))
    with pytest.raises(TypeError, match=rf"^EMAWeights got an unexpected argument 'snapshot_every': it takes {takes} "):
        EMAWeights(snapshot_every=10)


@pytest.mark.parametrize(
    "bad",
    [{"decay": 1.5}, {"warmup_power": "x"}, {"update_every": 0}, {"start_step": True}, {"shadow_dtype": torch.int64},
     {"device": "nowhere"}, {"device": 2.5}, {"skip_nonfinite": "yes"}, {"warmup": "sometimes"}],
)  # fmt: skip
def test_the_callback_refuses_a_bad_ema_argument_in_the_words_of_ema_without_building_one(
    bad: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises((TypeError, ValueError)) as by_ema:
        EMA(nn.Linear(1, 1), **bad)
    import copy_correct.lightning.ema_weights as ema_weights

    monkeypatch.setattr(ema_weights, "EMA", None)  # no EMA to build before fit
    with pytest.raises(by_ema.type) as by_callback:
        EMAWeights(**bad)
    assert str(by_callback.value) == str(by_ema.value)


def test_constructing_the_callback_draws_nothing_from_the_global_random_generator() -> None:
    """So a module built after it, after seeding, starts from the weights it would have without the callback."""
    state = torch.get_rng_state()
    EMAWeights(decay=0.9)
    assert torch.equal(torch.get_rng_state(), state)
    nn.Linear(1, 1)  # the control: a module built to check the arguments on would draw its weights
    assert not torch.equal(torch.get_rng_state(), state)


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
) -> tuple[State, EMAWeights]:
    pl.seed_everything(0)
    ema = EMAWeights(decay=0.9, update_every=update_every, evaluate="live")
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
    def on_fit_start(self: EMAWeights, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._ensure_ema(pl_module)
        self._last_step = trainer.global_step  # before the fix: 0 here, also in a resumed run

    monkeypatch.setattr(EMAWeights, "on_fit_start", on_fit_start)
    monkeypatch.setattr(EMAWeights, "on_train_start", lambda *args: None)
    assert resumes_as_the_uninterrupted_run(tmp_path, 2, 1) == [1, 2, 3, 4, 5]  # every mid-run kill


class Wide(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(8, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 256), nn.Linear(256, 1)
        )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def train_wide(directory: Path, checkpoint_weights: str) -> tuple[Wide, EMAWeights, Path]:
    pl.seed_everything(0)
    ema = EMAWeights(decay=0.9, evaluate="live", checkpoint_weights=checkpoint_weights)
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
    import copy_correct.lightning.ema_weights as ema_weights

    copy_in = ema_weights._average_into_weights
    monkeypatch.setattr(
        ema_weights,
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
    with pytest.warns(UserWarning, match=r"Please add the following callbacks: \[.*\"EMAWeights\{"):
        t.fit(resumed, loader(), ckpt_path=path)
    assert same(resumed.state_dict(), average) and not same(resumed.state_dict(), module.state_dict())


class Classifier(pl.LightningModule):
    """A user's own classifier, written as Lightning's docs write one: BatchNorm, Dropout, loss and accuracy logged
    per validation and test epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 3))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def evaluate(self, batch: Any, stage: str) -> None:
        x, y = batch
        logits = self.net(x)
        self.log(f"{stage}/loss", nn.functional.cross_entropy(logits, y))
        self.log(f"{stage}/acc", (logits.argmax(1) == y).float().mean())

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.evaluate(batch, "val")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.evaluate(batch, "test")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.3, momentum=0.9)


def labelled(n: int = 96) -> DataLoader:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=generator)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()), batch_size=16)


def before_the_fix(
    self: EMAWeights, trainer: pl.Trainer, pl_module: pl.LightningModule, loop: Any, run: Callable[[], Any]
) -> Callable[[], Any]:
    """The control: evaluation as it was before the fix, returning the live pass's results, each pass logging its
    own row."""

    def run_with_ema() -> Any:
        if trainer.sanity_checking:
            return run()
        self._run_pass(EMAPass(trainer, pl_module, self._ensure_ema(pl_module), self.suffix), run)
        return run()

    return run_with_ema


Evaluated = tuple[
    list[dict[str, float]], list[dict[str, float]], list[dict[str, str]], Classifier, EMAWeights, set[str]
]


def evaluate_with_a_csv_logger(directory: Path) -> Evaluated:
    """A user's classifier fitted for 2 epochs with validation, then validated and tested: what ``validate`` and
    ``test`` return, the rows of ``metrics.csv`` and the names in ``trainer.callback_metrics`` after ``validate``."""
    pl.seed_everything(0)
    ema = EMAWeights(decay=0.9)
    module = Classifier()
    t = trainer(directory, [ema], logger=CSVLogger(directory))
    t.fit(module, labelled(), labelled(48))
    validated = t.validate(module, labelled(48), verbose=False)
    names = set(t.callback_metrics)
    tested = t.test(module, labelled(48), verbose=False)
    with open(Path(t.log_dir or directory) / "metrics.csv") as file:
        return validated, tested, list(csv.DictReader(file)), module, ema, names


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Evaluated]:
    runs = {"fixed": evaluate_with_a_csv_logger(tmp_path_factory.mktemp("fixed"))}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(EMAWeights, "_evaluate_with_ema", before_the_fix)
        runs["before the fix"] = evaluate_with_a_csv_logger(tmp_path_factory.mktemp("before"))
    return runs


def test_validate_and_test_return_the_ema_metrics_beside_the_live_ones(
    evaluated: dict[str, Evaluated], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    validated, tested, _, module, ema, names = evaluated["fixed"]
    assert [set(d) for d in validated] == [{"val/loss", "val/acc", "val/loss_ema", "val/acc_ema"}]
    assert {"val/loss", "val/acc", "val/loss_ema", "val/acc_ema"} <= names  # what ModelCheckpoint monitors
    assert [set(d) for d in tested] == [{"test/loss", "test/acc", "test/loss_ema", "test/acc_ema"}]
    assert ema.ema is not None
    plain = trainer(tmp_path, [])  # what the live weights and the average give when each is validated on its own
    (live,) = plain.validate(module, labelled(48), verbose=False)
    (average,) = plain.validate(ema.ema.export(), labelled(48), verbose=False)
    assert live != average
    assert validated == [{**live, **{f"{name}_ema": value for name, value in average.items()}}]

    trainer(tmp_path, [ema]).validate(module, labelled(48))  # verbose: Lightning prints one table, of both passes
    printed = capsys.readouterr().out
    assert printed.count("Validate metric") == 1 and "val/acc_ema" in printed and "val/loss " in printed

    validated, tested, *_ = evaluated["before the fix"]  # the control: only the live pass's metrics come back
    assert [set(d) for d in validated] == [{"val/loss", "val/acc"}]
    assert [set(d) for d in tested] == [{"test/loss", "test/acc"}]


def test_each_evaluation_epoch_logs_the_live_and_the_ema_metrics_in_one_row_of_metrics_csv(
    evaluated: dict[str, Evaluated],
) -> None:
    def evaluation_rows(rows: list[dict[str, str]], stage: str) -> list[list[str]]:
        names = [f"{stage}/loss", f"{stage}/acc", f"{stage}/loss_ema", f"{stage}/acc_ema"]
        return [[name for name in names if row[name]] for row in rows if any(row[name] for name in names)]

    _, _, rows, *_ = evaluated["fixed"]
    both = ["val/loss", "val/acc", "val/loss_ema", "val/acc_ema"]
    assert evaluation_rows(rows, "val") == [both] * 3  # 2 epochs of fit, then validate()
    assert evaluation_rows(rows, "test") == [["test/loss", "test/acc", "test/loss_ema", "test/acc_ema"]]

    _, _, rows, *_ = evaluated["before the fix"]  # the control: the EMA pass's row, then the live pass's
    assert evaluation_rows(rows, "val") == [["val/loss_ema", "val/acc_ema"], ["val/loss", "val/acc"]] * 3


def saves_after_fit(directory: Path, checkpoint_weights: str) -> dict[str, str]:
    """A user's classifier fitted, then saved with ``trainer.save_checkpoint`` (weights-only and full) after the fit,
    after a ``validate`` and after a second ``fit`` of the same trainer: what each save holds (``verdict``)."""
    pl.seed_everything(0)
    ema = EMAWeights(decay=0.9, checkpoint_weights=checkpoint_weights)
    truth = Truth(ema)
    module = Classifier()
    t = trainer(directory, [ema, truth], max_epochs=1)
    verdicts = {}

    def save(when: str) -> None:
        for weights_only in (True, False):
            path = directory / f"{when}-{weights_only}.ckpt"
            t.save_checkpoint(path, weights_only=weights_only)
            verdicts[f"{when}, weights only" if weights_only else when] = verdict(path, truth, ema.state_key)

    t.fit(module, labelled(), labelled(48))
    save("after fit")
    t.validate(module, labelled(48), verbose=False)
    save("after validate")
    t.fit_loop.max_epochs = 2
    t.fit(module, labelled(), labelled(48))
    assert t.global_step == 12
    save("after a second fit")
    return verdicts


@pytest.mark.parametrize("checkpoint_weights", ["ema", "live"])
def test_every_save_after_fit_holds_what_a_save_during_it_holds(
    checkpoint_weights: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    verdicts = saves_after_fit(tmp_path / "fixed", checkpoint_weights)
    assert verdicts == {
        **{f"after {when}, weights only": "right (weights only)" for when in ("fit", "validate", "a second fit")},
        **{f"after {when}": "right" for when in ("fit", "validate", "a second fit")},
    }
    if checkpoint_weights == "live":
        return  # a weights-only save of the live weights needs no wrapper: the control would not differ

    teardown = EMAWeights.teardown

    def teardown_before_the_fix(
        self: EMAWeights, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str
    ) -> None:
        teardown(self, trainer, pl_module, stage)
        del trainer.save_checkpoint  # the save wrapper went with the evaluation wrappers

    monkeypatch.setattr(EMAWeights, "teardown", teardown_before_the_fix)
    verdicts = saves_after_fit(tmp_path / "control", checkpoint_weights)
    assert {when for when, held in verdicts.items() if held != "right"} == {
        f"after {when}, weights only" for when in ("fit", "validate", "a second fit")
    }
    assert {verdicts[f"after {when}, weights only"] for when in ("fit", "a second fit")} == {
        "weights only: not the expected weights"
    }


def test_after_fit_with_ema_weights_at_end_every_save_holds_the_average_also_as_the_live_weights(
    tmp_path: Path,
) -> None:
    """The module holds the average once ``fit`` ends, so a full save then holds it as the live weights too: a run
    resumed from it trains on from the average (the live weights it replaced are gone)."""
    pl.seed_everything(0)
    ema = EMAWeights(decay=0.9, ema_weights_at_end=True)
    truth = Truth(ema)
    t = trainer(tmp_path, [ema, truth], max_epochs=1)
    t.fit(Classifier(), labelled())
    assert ema.ema is not None
    average = {k: v.clone() for k, v in ema.ema.shadow.items()}
    full, weights = tmp_path / "full.ckpt", tmp_path / "weights.ckpt"
    t.save_checkpoint(full)
    t.save_checkpoint(weights, weights_only=True)
    saved = torch.load(full, weights_only=True)
    ours = saved["callbacks"][ema.state_key]
    assert same(saved["state_dict"], average) and same(ours["live"], average) and same(ours["ema"]["shadow"], average)
    assert same(torch.load(weights, weights_only=True)["state_dict"], average)
    assert not same(truth.at[t.global_step][0], average)  # the live weights at the end of training: not saved


def fit_and_save_after(directory: Path, max_epochs: int, ckpt_path: Path | None = None) -> tuple[State, State]:
    pl.seed_everything(0)
    ema = EMAWeights(decay=0.9, evaluate="ema")
    module = Regressor()
    t = trainer(directory, [ema], max_epochs=max_epochs)
    t.fit(module, loader(), loader(64), ckpt_path=ckpt_path)
    t.save_checkpoint(directory / "after-fit.ckpt")
    assert ema.ema is not None
    return module.state_dict(), dict(ema.ema.shadow)


def test_a_run_resumed_from_a_save_after_fit_ends_as_the_uninterrupted_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    straight = fit_and_save_after(tmp_path / "straight", 4)
    fit_and_save_after(tmp_path / "first", 2)
    resumed = fit_and_save_after(tmp_path / "resumed", 4, ckpt_path=tmp_path / "first" / "after-fit.ckpt")
    assert same(resumed[0], straight[0]) and same(resumed[1], straight[1])

    # The control: a resume that leaves the checkpoint's weights (the average) in the module trains on from them.
    monkeypatch.setattr(EMAWeights, "on_load_checkpoint", lambda *args: None)
    control = fit_and_save_after(tmp_path / "control", 4, ckpt_path=tmp_path / "first" / "after-fit.ckpt")
    assert not same(control[0], straight[0]) and not same(control[1], straight[1])


class CopiesDuringFit(pl.Callback):
    """Copies the EMAWeights at the end of the first training epoch: after setup, with the trainer's wrappers in
    place and the EMA tracking the module."""

    def __init__(self, ema: EMAWeights, copy_of: Callable[[Any], Any]) -> None:
        self.ema, self.copy_of, self.copied = ema, copy_of, None

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.copied is None:
            self.copied = self.copy_of(self.ema)


COPIES = {"pickle": lambda obj: pickle.loads(pickle.dumps(obj)), "deepcopy": copy.deepcopy}


def fit_one_epoch(directory: Path, ema: EMAWeights, module: Classifier, *more: pl.Callback) -> State:
    pl.seed_everything(0)
    trainer(directory, [ema, *more], max_epochs=1).fit(module, labelled(), labelled(48))
    assert ema.ema is not None
    return {k: v.clone() for k, v in ema.ema.shadow.items()}


def twin(module: Classifier) -> Classifier:
    """A new instance holding the module's weights: the model a copy of the callback goes on with."""
    other = Classifier()
    other.load_state_dict(module.state_dict())
    return other


def copies_go_on_alone(tmp_path: Path, copy_of: Callable[[Any], Any]) -> tuple[bool, bool]:
    """The original and a copy taken after fit each train one more epoch (the copy on a twin of the module): whether
    the copy ended as the original did, and whether the original's average stayed as its own epoch left it."""
    pl.seed_everything(0)
    ema, module = EMAWeights(decay=0.9), Classifier()
    fit_one_epoch(tmp_path / "first", ema, module)
    after, its_module = copy_of(ema), twin(module)
    original = fit_one_epoch(tmp_path / "original", ema, module)
    copied = fit_one_epoch(tmp_path / "copy", after, its_module)
    assert ema.ema is not None
    return same(copied, original), same(ema.ema.shadow, original)


@pytest.mark.parametrize("how", list(COPIES))
def test_a_pickled_or_deep_copied_callback_is_an_independent_working_callback_before_during_and_after_fit(
    how: str, tmp_path: Path
) -> None:
    copy_of = COPIES[how]
    pl.seed_everything(0)
    ema, module = EMAWeights(decay=0.9), Classifier()
    before = copy_of(ema)  # before setup
    during = CopiesDuringFit(ema, copy_of)
    trained = fit_one_epoch(tmp_path / "original", ema, module, during)
    after = copy_of(ema)
    pl.seed_everything(0)
    assert same(fit_one_epoch(tmp_path / "before", before, Classifier()), trained)  # trains as the original did

    # A copy holds the average in storage of its own, and tracks no module until a fit gives it one.
    assert ema.ema is not None and ema._trainer is not None
    for copied in (during.copied, after):
        assert isinstance(copied, EMAWeights) and copied.ema is not None
        assert copied.ema.live_model is None and copied._trainer is None and copied._wrapped == []
        assert not any(shares_storage(t, x) for t in copied.ema.shadow.values() for x in ema.ema.shadow.values())
    assert same(after.ema.shadow, trained) and after.ema.step == 6

    # Each goes on on its own: the copy one more epoch on a twin of the module ends as the original does on it.
    assert copies_go_on_alone(tmp_path / "alone", copy_of) == (True, True)


def test_the_control_a_copy_sharing_the_shadow_writes_into_the_originals_average(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(EMA, "__deepcopy__", lambda self, memo: copy.copy(self), raising=False)
    assert copies_go_on_alone(tmp_path, copy.deepcopy) == (False, False)


SCORES = [0.5, 0.3, 0.6, 0.2, 0.1]  # the monitored score of each epoch: it improves in epochs 0 and 2 only


class Scored(Regressor):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val/score", SCORES[self.current_epoch] + 0 * self.net(batch[0]).sum())


class EpochOfLast(pl.Callback):
    """The epoch each ``last.ckpt`` holds, read at the start of every epoch after the first and once after fit."""

    def __init__(self, directories: list[Path]) -> None:
        self.directories, self.seen = directories, []

    def look(self) -> None:
        self.seen.append(tuple(torch.load(d / "last.ckpt", weights_only=True)["epoch"] for d in self.directories))

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch:
            self.look()


def test_with_monitor_lightning_rewrites_last_ckpt_only_when_the_score_improves_and_a_second_checkpoint_every_epoch(
    tmp_path: Path,
) -> None:
    """What ``docs/recipes/ema.md`` says of ``ModelCheckpoint(monitor=..., save_last=True)`` in Lightning 2.6, and of
    the second ``ModelCheckpoint`` that ``conf/callbacks/default.yaml`` keeps for the resume point."""
    monitored, every = tmp_path / "monitored", tmp_path / "every"
    look = EpochOfLast([monitored, every])
    callbacks = [
        EMAWeights(decay=0.9),
        ModelCheckpoint(monitored, monitor="val/score_ema", mode="max", save_last=True, save_top_k=1),
        ModelCheckpoint(every, filename="last", save_on_train_epoch_end=True, enable_version_counter=False),
        look,
    ]
    trainer(tmp_path, callbacks, max_epochs=len(SCORES)).fit(Scored(), loader(), loader(32))
    look.look()
    assert [monitored_epoch for monitored_epoch, _ in look.seen] == [0, 0, 2, 2, 2]  # the best epoch's, not the last
    assert [every_epoch for _, every_epoch in look.seen] == [0, 1, 2, 3, 4]
    assert sorted(p.name for p in monitored.iterdir()) == ["epoch=2-step=24.ckpt", "last.ckpt"]


@pytest.mark.parametrize("device", DEVICES)
def test_the_ema_and_live_evaluation_passes_every_epoch_train_as_validating_once(device: str) -> None:
    """``EMAWeights``'s quiet EMA pass and the live pass after it, every epoch, under ``IsolatedEvaluation``: the
    weights, optimizer state, EMA and generators end as with one validation at the end. Control: without
    ``IsolatedEvaluation`` they do not."""

    def callbacks(isolated: bool) -> list[pl.Callback]:
        return [*([IsolatedEvaluation()] if isolated else []), EMAWeights(decay=0.9)]

    every_epoch = {"check_val_every_n_epoch": 1}
    once = isolation.fit(device, isolation.ONCE, callbacks(isolated=True))
    assert isolation.same(isolation.fit(device, every_epoch, callbacks(isolated=True)), once)
    assert not isolation.same(isolation.fit(device, every_epoch, callbacks(isolated=False)), once)
