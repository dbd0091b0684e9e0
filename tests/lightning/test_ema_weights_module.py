"""``EMAWeights(module="generator")``: the average of one submodule of a two-module LightningModule. The other module
is untouched by the evaluation swaps and absent from the EMA, checkpoints name the average as the LightningModule's
``state_dict`` does, a resume ends bit for bit as the uninterrupted run, and a bad path fails at setup, naming it.
Controls: the whole module averaged (its critic swapped too), a resume that forgets the EMA state."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from copy_correct.lightning import EMAWeights
from tests.lightning.test_ema_weights import loader, trainer

KEY = "EMAWeights{'decay': 0.9, 'module': 'generator'}"


class TwoNets(pl.LightningModule):
    """A generator and a critic, both trained by one optimizer, with BatchNorm in each; each evaluation epoch records
    the weights it ran with, and the callback's average at that moment."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 8))
        self.critic = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
        self.seen: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = []
        self.averager: EMAWeights | None = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.critic(self.generator(x)), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val/loss", nn.functional.mse_loss(self.critic(self.generator(x)), y))

    def on_validation_epoch_start(self) -> None:
        assert self.averager is not None and self.averager.ema is not None
        self.seen.append((clone(self.state_dict()), clone(self.averager.ema.shadow)))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def clone(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in state.items()}


def part(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], v) for k, v in b.items())


def fit(
    directory: Path, callback: EMAWeights, *others: pl.Callback, epochs: int = 2, ckpt_path: Path | None = None
) -> tuple[TwoNets, pl.Trainer]:
    pl.seed_everything(0)
    module = TwoNets()
    module.averager = callback
    t = trainer(directory, [callback, *others], max_epochs=epochs)
    t.fit(module, loader(), loader(64), ckpt_path=ckpt_path)
    return module, t


@pytest.mark.parametrize("module", ["generator", None])
def test_the_evaluation_swaps_the_generator_alone_and_the_ema_holds_nothing_else(
    module: str | None, tmp_path: Path
) -> None:
    trained, t = fit(tmp_path, EMAWeights(decay=0.9, module=module))
    assert {"val/loss", "val/loss_ema"} <= set(t.callback_metrics)
    assert len(trained.seen) == 4  # per epoch: the EMA pass, then the live pass
    for (averaged, average), (live, _) in zip(trained.seen[::2], trained.seen[1::2], strict=True):
        if module is None:  # the control: the whole module averaged, its critic swapped too
            assert same(averaged, average) and not same(part(averaged, "critic."), part(live, "critic."))
            continue
        assert set(average) == set(part(live, "generator."))  # the EMA holds the generator's tensors, nothing else
        assert same(part(averaged, "generator."), average) and not same(part(live, "generator."), average)
        assert same(part(averaged, "critic."), part(live, "critic."))  # the critic ran with its live weights
    # The evaluation passes change no weight: the run ends as one without them, bit for bit.
    unevaluated, _ = fit(tmp_path / "live", EMAWeights(decay=0.9, module=module, evaluate="live"))
    assert same(trained.state_dict(), unevaluated.state_dict())


@pytest.mark.parametrize("checkpoint_weights", ["ema", "live"])
def test_a_checkpoint_names_the_generators_average_as_the_lightning_module_does(
    checkpoint_weights: str, tmp_path: Path
) -> None:
    callback = EMAWeights(decay=0.9, module="generator", checkpoint_weights=checkpoint_weights)
    trained, _ = fit(tmp_path, callback, ModelCheckpoint(tmp_path, filename="last"))
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert callback.ema is not None
    average = {f"generator.{k}": v for k, v in callback.ema.shadow.items()}
    live = trained.state_dict()
    assert not same(average, {k: live[k] for k in average})
    state = checkpoint["callbacks"][KEY]
    assert same(state["ema"]["shadow"], average)  # the EMA state names them as the LightningModule does
    weights = checkpoint["state_dict"]
    assert same(part(weights, "critic."), part(live, "critic."))  # the critic's live weights, whatever the setting
    if checkpoint_weights == "ema":
        assert same(part(weights, "generator."), part(average, "generator."))
        assert same(state["live"], {k: live[k] for k in average})  # the generator's live weights, nothing else
    else:  # the control: the live weights, the average in the EMA state only
        assert same(part(weights, "generator."), part(live, "generator.")) and "live" not in state
    loaded = TwoNets.load_from_checkpoint(tmp_path / "last.ckpt", weights_only=True)
    assert same(loaded.state_dict(), {**live, **average} if checkpoint_weights == "ema" else live)


class Forgetful(EMAWeights):
    """The control: resumes with a fresh average, its saved state (found under ``EMAWeights``'s key) ignored."""

    @property
    def state_key(self) -> str:
        return KEY

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


@pytest.mark.parametrize("checkpoint_weights", ["ema", "live"])
def test_a_resumed_run_ends_bit_for_bit_as_the_uninterrupted_one(checkpoint_weights: str, tmp_path: Path) -> None:
    def run(directory: Path, kind: type[EMAWeights] = EMAWeights, **resume: Any) -> tuple[TwoNets, EMAWeights]:
        callback = kind(decay=0.9, module="generator", checkpoint_weights=checkpoint_weights)
        save = ModelCheckpoint(directory, filename="{epoch}", save_top_k=-1)
        trained, _ = fit(directory, callback, save, epochs=3, **resume)
        return trained, callback

    straight, averaged = run(tmp_path / "straight")
    resumed, again = run(tmp_path / "resumed", ckpt_path=tmp_path / "straight" / "epoch=0.ckpt")
    assert averaged.ema is not None and again.ema is not None
    assert same(resumed.state_dict(), straight.state_dict()) and same(again.ema.shadow, averaged.ema.shadow)
    assert (again.ema.step, again.ema.num_updates) == (averaged.ema.step, averaged.ema.num_updates) == (24, 24)
    forgot, fresh = run(tmp_path / "control", Forgetful, ckpt_path=tmp_path / "straight" / "epoch=0.ckpt")
    assert fresh.ema is not None and not same(fresh.ema.shadow, averaged.ema.shadow)
    assert same(forgot.state_dict(), straight.state_dict())  # the control loses the average, not the weights


def test_ema_weights_at_end_writes_the_generator_alone(tmp_path: Path) -> None:
    callback = EMAWeights(decay=0.9, module="generator", ema_weights_at_end=True)
    ended, _ = fit(tmp_path / "end", callback)
    kept, _ = fit(tmp_path / "kept", EMAWeights(decay=0.9, module="generator"))
    assert callback.ema is not None
    assert same(part(ended.state_dict(), "generator."), callback.ema.shadow)
    assert not same(part(kept.state_dict(), "generator."), callback.ema.shadow)  # the control: without the flag
    assert same(part(ended.state_dict(), "critic."), part(kept.state_dict(), "critic."))


def test_a_copy_of_the_callback_evaluates_the_same_generator_average(tmp_path: Path) -> None:
    callback = EMAWeights(decay=0.9, module="generator")
    trained, t = fit(tmp_path, callback)
    (original,) = t.validate(trained, loader(64), verbose=False)
    for copied in (pickle.loads(pickle.dumps(callback)), copy.deepcopy(callback)):
        trained.averager = copied
        (result,) = trainer(tmp_path, [copied]).validate(trained, loader(64), verbose=False)
        assert result == original and copied.ema is not None and copied.ema.live_model is trained.generator


@pytest.mark.parametrize("stage", ["fit", "validate"])
def test_a_path_the_module_lacks_fails_at_setup_in_one_line_naming_it(stage: str, tmp_path: Path) -> None:
    t = trainer(tmp_path, [EMAWeights(decay=0.9, module="generator.9")])
    with pytest.raises(ValueError) as raised:
        getattr(t, stage)(TwoNets(), loader(64))
    assert str(raised.value) == (
        "EMAWeights module='generator.9': TwoNets has no such submodule (its children: generator, critic)"
    )
    raised_in = [(entry.name, Path(entry.path).parent.name) for entry in raised.traceback]
    assert ("setup", "lightning") in raised_in and t.global_step == 0  # in the callback's setup, before any step


@pytest.mark.long  # Lightning fits in 2 processes (FSDP2 over gloo)
def test_sharded_checkpoints_hold_the_generators_average_under_its_names_and_resume_bit_for_bit(
    tmp_path: Path,
) -> None:
    """FSDP2 under ``ModelParallelStrategy``, 2 gloo processes (``tests/workers/sharded_ema_module.py``): in a
    distributed checkpoint and in one file, the weights' ``generator.*`` entries are the average, its ``critic.*`` ones
    the live weights, the callback state names the generator's tensors as the LightningModule does; a resumed run ends
    with the shards of the uninterrupted one."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from tests.conftest import run_rank_script

    ranks = run_rank_script("sharded_ema_module.py", tmp_path, timeout=600)
    truth = torch.load(tmp_path / "truth.pt", weights_only=True)
    for kind in ("dcp", "file"):
        for rank in ranks:
            straight, resumed = rank[f"straight-{kind}"], rank[f"resumed-{kind}"]
            assert same(resumed["model"], straight["model"]) and same(resumed["ema"], straight["ema"])
            assert resumed["counters"] == straight["counters"] == (12, 12)  # 4 steps an epoch a rank
            assert rank[f"straight-{kind}"]["ema"]["0.weight"].shape == (8, 8)  # half of (16, 8): its own shard
        path = tmp_path / f"straight-{kind}" / "epoch=2.ckpt"
        if kind == "dcp":
            dcp_to_torch_save(path, tmp_path / "converted.pt")
            checkpoint = {**torch.load(tmp_path / "converted.pt", weights_only=True), **torch.load(path / "meta.pt")}
        else:
            checkpoint = torch.load(path, weights_only=True)
        live, average = truth[kind][checkpoint["global_step"]]
        weights, state = checkpoint["state_dict"], checkpoint["callbacks"][KEY]
        assert same(part(weights, "generator."), average) and not same(part(live, "generator."), average)
        # The critic's live weights; its BatchNorm statistics, which nothing synchronises (FSDP2 never does, and the
        # callback broadcasts only the buffers of what it averages), are rank 0's in a file, any rank's in a directory.
        differ = sorted(k for k, v in part(weights, "critic.").items() if not torch.equal(v, live[f"critic.{k}"]))
        assert differ == ([] if kind == "file" else [name for name in differ if "running" in name]), differ
        assert state["ema"]["layout"]["generator.0.weight"] == "Shard(dim=0) over a mesh of 2 ranks"
        if kind == "dcp":  # the average is the weights' own entry, written once; the live shards under keys of ours
            assert state["ema"]["shadow"]["generator.0.weight"] == "generator.0.weight"
            assert state["live"]["generator.0.weight"] == f"{KEY}/live/generator.0.weight"
            saved_live = {name: weights[key] for name, key in state["live"].items()}
        else:
            assert same(part(state["ema"]["shadow"], "generator."), average)
            saved_live = state["live"]
        assert same(saved_live, {k: v for k, v in live.items() if k.startswith("generator.")})
