"""PostHocEMASnapshots in real Trainers: one update per optimizer step with gradient accumulation (the profiles equal a
PowerEMA fed the weights after each optimizer step), snapshots in the checkpoint directory and a final one when fit
ends off the schedule (which changes nothing in training), exact resume; and ``copy-correct posthoc`` (here as
``python -m copy_correct posthoc``) writing checkpoints that ``load_from_checkpoint`` reads as the synthesized EMA.
tests/package/test_cli.py runs the installed command outside the clone."""

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

from copy_correct import PowerEMA, synthesize
from copy_correct.averages.posthoc import load_snapshot, snapshot_paths
from copy_correct.averages.snapshot_history import check_snapshot_history, snapshot_gaps
from copy_correct.lightning import PostHocEMASnapshots
from tests.conftest import ROOT, child_env, free_port

COMMAND = [sys.executable, "-m", "copy_correct", "posthoc"]  # copy-correct posthoc, from this checkout


class Regressor(pl.LightningModule):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Linear(width, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class Recorder(pl.Callback):
    """The module's state after each optimizer step: what the profiles must average."""

    def __init__(self) -> None:
        self.states: list[dict[str, torch.Tensor]] = []
        self._last = 0

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step > self._last:
            self._last = trainer.global_step
            self.states.append({k: v.detach().clone() for k, v in pl_module.state_dict().items()})


def loader(n: int = 192) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n, 8, generator=generator), torch.randn(n, 1, generator=generator))
    return DataLoader(data, batch_size=16)  # no shuffling: a resumed run sees the same batches


def fit(directory: Path, callbacks: list[pl.Callback], epochs: int, ckpt_path: Path | None = None) -> pl.Trainer:
    """``epochs`` epochs of 12 batches, 6 optimizer steps each (2 batches a step)."""
    torch.manual_seed(0)
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=epochs, accumulate_grad_batches=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=directory, limit_val_batches=0,
        callbacks=[*callbacks, ModelCheckpoint(dirpath=directory / "checkpoints", save_last=True)],
    )  # fmt: skip
    trainer.fit(Regressor(), loader(), ckpt_path=ckpt_path)
    return trainer


def test_updates_once_per_optimizer_step_and_snapshots_into_the_checkpoint_directory(tmp_path: Path) -> None:
    callback, recorder = PostHocEMASnapshots(snapshot_every=4), Recorder()
    trainer = fit(tmp_path, [callback, recorder], epochs=2)
    assert trainer.global_step == 12 and callback.power_ema is not None
    assert callback.power_ema.step == 12  # 24 batches, one optimizer step per 2
    replay = Regressor()
    reference = PowerEMA(replay)
    for state in recorder.states:
        replay.load_state_dict(state)
        reference.update()
    for ours, expected in zip(callback.power_ema.profiles, reference.profiles, strict=True):
        assert all(torch.equal(ours[k], v) for k, v in expected.items())
    paths = snapshot_paths(tmp_path / "checkpoints" / "power_ema")
    assert [p.name for p in paths] == [f"power-ema-{t:09d}.pt" for t in (4, 8, 12)]

    torch.manual_seed(0)
    initial = Regressor().state_dict()  # the control: updated after every batch, as a per-batch hook would
    per_batch = [initial, *(s for state in recorder.states for s in (state, state))][:24]  # accumulation: 2 a step
    control = PowerEMA(replay)
    for state in per_batch:
        replay.load_state_dict(state)
        control.update()
    assert control.step == 24  # steps counted in batches: every snapshot's step and every target step off by 2x
    assert not torch.equal(control.profiles[0]["net.0.weight"], callback.power_ema.profiles[0]["net.0.weight"])


def test_resume_continues_the_profiles_and_snapshots_bit_for_bit(tmp_path: Path) -> None:
    straight = PostHocEMASnapshots(snapshot_every=4)
    fit(tmp_path / "straight", [straight], epochs=2)
    fit(tmp_path / "resumed", [PostHocEMASnapshots(snapshot_every=4)], epochs=1)  # step 6: between two snapshots
    last = tmp_path / "resumed" / "checkpoints" / "last.ckpt"
    stopped = snapshot_paths(tmp_path / "resumed" / "checkpoints" / "power_ema")
    assert [p.name for p in stopped] == ["power-ema-000000004.pt", "power-ema-000000006.pt"]  # 6: the final one
    assert load_snapshot(stopped[1])["final"]
    checkpoint = torch.load(last, weights_only=True)
    assert any("PostHocEMASnapshots" in key for key in checkpoint["callbacks"])
    checkpoint["callbacks"] = {k: v for k, v in checkpoint["callbacks"].items() if "PostHocEMASnapshots" not in k}
    torch.save(checkpoint, tmp_path / "without.ckpt")  # for the control below
    resumed = PostHocEMASnapshots(snapshot_every=4)
    fit(tmp_path / "resumed", [resumed], epochs=2, ckpt_path=last)
    assert resumed.power_ema is not None and straight.power_ema is not None
    for ours, expected in zip(resumed.power_ema.profiles, straight.power_ema.profiles, strict=True):
        assert all(torch.equal(ours[k], v) for k, v in expected.items())
    snapshots = [snapshot_paths(tmp_path / run / "checkpoints" / "power_ema") for run in ("straight", "resumed")]
    assert [p.name for p in snapshots[0]] == [p.name for p in snapshots[1]]  # step 6's final one removed at step 8
    for a, b in zip(*snapshots, strict=True):
        sa, sb = load_snapshot(a), load_snapshot(b)
        assert sa["step"] == sb["step"]
        assert all(torch.equal(sb["profiles"][i][k], v) for i, p in enumerate(sa["profiles"]) for k, v in p.items())

    fresh = PostHocEMASnapshots(snapshot_every=4)  # the control: the same resume without the callback's state
    fit(tmp_path / "fresh", [fresh], epochs=2, ckpt_path=tmp_path / "without.ckpt")
    assert fresh.power_ema is not None and fresh.power_ema.step == 6  # counted from the resume: not the run's 12
    assert not torch.equal(fresh.power_ema.profiles[0]["net.0.weight"], straight.power_ema.profiles[0]["net.0.weight"])


def test_a_run_resumed_into_another_directory_carries_the_earlier_snapshots_over_as_hard_links(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``train.py ... ckpt_path=`` resumes into a new directory: it holds the files of the run that was not stopped
    (step 4 linked from the crashed run, 6's final one carried and removed at 8), the same average, a whole history.
    The control, the resume without the carrying over, holds only its own snapshots: another average, and the gap,
    named."""
    fit(tmp_path / "straight", [PostHocEMASnapshots(snapshot_every=4)], epochs=2)
    fit(tmp_path / "crashed", [PostHocEMASnapshots(snapshot_every=4)], epochs=1)  # step 6: snapshots 4 and 6 (final)
    last = tmp_path / "crashed" / "checkpoints" / "last.ckpt"
    resumed = PostHocEMASnapshots(snapshot_every=4)
    fit(tmp_path / "resumed", [resumed], epochs=2, ckpt_path=last)
    folders = {run: tmp_path / run / "checkpoints" / "power_ema" for run in ("straight", "crashed", "resumed")}
    assert [(p.name, how) for p, how in resumed.carried] == [
        ("power-ema-000000004.pt", "link"), ("power-ema-000000006.pt", "link")
    ]  # fmt: skip
    names = {run: [p.name for p in snapshot_paths(folder)] for run, folder in folders.items()}
    assert names["resumed"] == names["straight"] == [f"power-ema-{t:09d}.pt" for t in (4, 8, 12)]
    assert names["crashed"] == ["power-ema-000000004.pt", "power-ema-000000006.pt"]  # left as it was
    first = [folders[run] / "power-ema-000000004.pt" for run in ("crashed", "resumed")]
    assert first[0].stat().st_ino == first[1].stat().st_ino  # one file, two names
    assert [load_snapshot(p).get("previous") for p in snapshot_paths(folders["resumed"])] == [0, 4, 8]
    expected, ours = synthesize(folders["straight"], 0.08), synthesize(folders["resumed"], 0.08)
    assert all(torch.equal(ours[k], v) for k, v in expected.items())
    assert snapshot_gaps(folders["resumed"]) == []

    monkeypatch.setattr(PostHocEMASnapshots, "_carry", lambda *args: [])  # the control: the callback as it was
    fit(tmp_path / "control", [PostHocEMASnapshots(snapshot_every=4)], epochs=2, ckpt_path=last)
    control = tmp_path / "control" / "checkpoints" / "power_ema"
    assert [p.name for p in snapshot_paths(control)] == ["power-ema-000000008.pt", "power-ema-000000012.pt"]
    assert not torch.equal(synthesize(control, 0.08)["net.0.weight"], expected["net.0.weight"])
    assert snapshot_gaps(control) == [
        f"{control}: the snapshot of step 4, which power-ema-000000008.pt follows, is missing"
    ]  # fmt: skip
    with pytest.raises(ValueError, match=r"the snapshot of step 4, which power-ema-000000008\.pt follows, is missing"):
        check_snapshot_history(control)


class WithoutFinalSnapshot(PostHocEMASnapshots):
    """The control: the callback as it was before it took a final snapshot."""

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pass


def test_a_fit_shorter_than_snapshot_every_ends_with_a_final_snapshot_that_changes_nothing(tmp_path: Path) -> None:
    """The default ``snapshot_every=1000`` and a 12-step fit: one snapshot, of step 12, taken when fit ends, holding
    the profiles as they ended; the run's weights, checkpoint and random generator are those of the run without it,
    which leaves nothing to synthesize from."""
    ended, callbacks = {}, {"final": PostHocEMASnapshots(), "control": WithoutFinalSnapshot()}
    for name, callback in callbacks.items():
        trainer = fit(tmp_path / name, [callback], epochs=2)
        checkpoint = torch.load(tmp_path / name / "checkpoints" / "last.ckpt", weights_only=True)
        ended[name] = (trainer.lightning_module.state_dict(), checkpoint["state_dict"], torch.get_rng_state())
        assert callback.power_ema is not None and callback.power_ema.step == 12
    paths = snapshot_paths(tmp_path / "final" / "checkpoints" / "power_ema")
    assert [p.name for p in paths] == ["power-ema-000000012.pt"]
    final, ema = load_snapshot(paths[0]), callbacks["final"].power_ema
    assert final["step"] == 12 and final["final"] and ema is not None
    for stored, kept in zip(final["profiles"], ema.profiles, strict=True):
        assert all(torch.equal(stored[k], v) for k, v in kept.items())
    for with_final, without in zip(ended["final"], ended["control"], strict=True):
        if isinstance(with_final, dict):
            assert all(torch.equal(with_final[k], without[k]) for k in without)
        else:
            assert torch.equal(with_final, without)
    with pytest.raises(ValueError, match="no PowerEMA snapshots in"):
        synthesize(tmp_path / "control", 0.08)


def test_the_command_writes_checkpoints_load_from_checkpoint_reads_as_the_synthesized_ema(tmp_path: Path) -> None:
    fit(tmp_path, [PostHocEMASnapshots(snapshot_every=2)], epochs=2)
    result = subprocess.run(
        [*COMMAND, str(tmp_path), "--sigma-rel", "0.08", "0.15", "--step", "10"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=child_env(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    written = [Path(line) for line in result.stdout.split()]
    assert [p.name for p in written] == [
        "posthoc-ema-sigma0.080-step000000010.ckpt", "posthoc-ema-sigma0.150-step000000010.ckpt",
    ]  # fmt: skip
    snapshots = snapshot_paths(tmp_path / "checkpoints" / "power_ema")
    for path, sigma_rel in zip(written, (0.08, 0.15), strict=True):
        model = Regressor.load_from_checkpoint(path)
        expected = synthesize(snapshots, sigma_rel, step=10)
        assert all(torch.equal(model.state_dict()[k], v.to(model.state_dict()[k].dtype)) for k, v in expected.items())
    live = Regressor.load_from_checkpoint(tmp_path / "checkpoints" / "last.ckpt")  # the control: the live weights
    assert not torch.equal(live.net[0].weight, Regressor.load_from_checkpoint(written[0]).net[0].weight)

    empty = subprocess.run(
        [*COMMAND, str(tmp_path / "nothing"), "--sigma-rel", "0.08"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=child_env(),
    )  # fmt: skip
    assert empty.returncode == 2 and empty.stderr.count("\n") == 1
    assert f"no PowerEMA snapshots at {tmp_path / 'nothing'}: it does not exist" in empty.stderr


def test_a_submodule_alone_is_averaged_and_the_command_takes_the_rest_from_the_checkpoint(tmp_path: Path) -> None:
    """``module=`` (a GAN's generator): profiles of that submodule only, named as the LightningModule's state_dict;
    the command's checkpoint holds their synthesis and the run's own weights for everything else."""
    callback = PostHocEMASnapshots(snapshot_every=2, module="net.0")
    fit(tmp_path, [callback], epochs=2)
    assert callback.power_ema is not None and list(callback.power_ema.profiles[0]) == ["weight", "bias"]
    snapshots = snapshot_paths(tmp_path / "checkpoints" / "power_ema")
    last = load_snapshot(snapshots[-1])
    assert last["module"] == "net.0" and list(last["profiles"][1]) == ["net.0.weight", "net.0.bias"]
    result = subprocess.run(
        [*COMMAND, str(tmp_path), "--sigma-rel", "0.08"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=child_env(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    model = Regressor.load_from_checkpoint(result.stdout.split()[0])
    run = Regressor.load_from_checkpoint(tmp_path / "checkpoints" / "last.ckpt")
    expected = synthesize(snapshots, 0.08)
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name] if name.startswith("net.0.") else run.state_dict()[name]), name
    assert not torch.equal(model.net[0].weight, run.net[0].weight)  # the control: the average is not the live weight
    # The docstring's four lines for a user of synthesize: the submodule's averaged entries over the run's own.
    checkpoint = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    checkpoint["state_dict"].update(synthesize(tmp_path, sigma_rel=0.08))
    torch.save(checkpoint, tmp_path / "ema.ckpt")
    by_hand = Regressor.load_from_checkpoint(tmp_path / "ema.ckpt")
    assert all(torch.equal(value, by_hand.state_dict()[name]) for name, value in model.state_dict().items())

    with pytest.raises(ValueError, match=r"module='head': Regressor has no such submodule \(its children: net\)"):
        fit(tmp_path / "bad", [PostHocEMASnapshots(module="head")], epochs=1)


def test_bad_arguments_fail_at_construction_which_draws_nothing_from_the_generator() -> None:
    state = torch.get_rng_state()
    PostHocEMASnapshots()
    assert torch.equal(torch.get_rng_state(), state)
    PowerEMA(nn.Linear(1, 1))  # the control: a check on a Linear would have drawn its initial weights
    assert not torch.equal(torch.get_rng_state(), state)
    with pytest.raises(ValueError, match="snapshot_every must be a positive multiple of update_every=3"):
        PostHocEMASnapshots(update_every=3, snapshot_every=10)
    with pytest.raises(ValueError, match="sigma_rel must be a number in"):
        PostHocEMASnapshots(sigma_rels=(0.05, 0.5))


def test_the_callback_takes_power_emas_arguments_and_schedules_snapshots_by_default() -> None:
    """Each of ``PowerEMA``'s arguments, read from its signature (``sigma_rels`` first, with ``PowerEMA``'s default),
    and no other; ``snapshot_every`` is 1000 where ``PowerEMA``'s is ``None``, on purpose (the callback's docstring).
    The control: a name ``PowerEMA`` does not take is refused naming every one it takes."""
    from inspect import signature

    from copy_correct.averages.settings import defaults

    ours, theirs = signature(PostHocEMASnapshots).parameters, signature(PowerEMA).parameters
    assert ours["sigma_rels"].default == theirs["sigma_rels"].default
    assert (ours["snapshot_every"].default, theirs["snapshot_every"].default) == (1000, None)
    for name, value in defaults(PowerEMA).items():
        if name not in ("snapshot_every", "snapshot_dir"):  # the callback's own: it writes the snapshots
            assert PostHocEMASnapshots(**{name: value})._kwargs[name] == value
    takes = ", ".join(defaults(PowerEMA))
    with pytest.raises(TypeError, match=rf"^PostHocEMASnapshots got an unexpected argument 'decay': it takes {takes} "):
        PostHocEMASnapshots(decay=0.9)


@pytest.mark.parametrize(
    "bad",
    [{"sigma_rels": 0.05}, {"sigma_rels": (0.05, 0.05)}, {"update_every": 0}, {"include_buffers": 1},
     {"shadow_dtype": torch.int64}, {"skip_nonfinite": "yes"}],
)  # fmt: skip
def test_the_callback_refuses_a_bad_power_ema_argument_in_its_words_without_building_one(
    bad: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises((TypeError, ValueError)) as by_power_ema:
        PowerEMA(nn.Linear(1, 1), **bad)
    import copy_correct.lightning.posthoc_ema_snapshots as snapshots

    monkeypatch.setattr(snapshots, "PowerEMA", None)  # no PowerEMA to build before fit
    with pytest.raises(by_power_ema.type) as by_callback:
        PostHocEMASnapshots(**bad)
    assert str(by_callback.value) == str(by_power_ema.value)


@pytest.mark.long  # a Lightning fit in 2 processes (gloo)
def test_under_ddp_rank_zero_alone_writes_the_snapshots(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "workers" / "ddp_posthoc_ema.py"), str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=child_env(MASTER_PORT=free_port()),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    assert [r["step"] for r in ranks] == [3, 3]  # 12 batches, 6 a rank, one optimizer step per 2
    assert [r["writes"] for r in ranks] == [True, False]
    written = sorted(p.name for p in (tmp_path / "checkpoints" / "power_ema").iterdir())
    # one file per snapshot step (the last, 3, the final one), no rank's second copy, no temporary
    assert written == ["power-ema-000000002.pt", "power-ema-000000003.pt"]
    snapshot = load_snapshot(tmp_path / "checkpoints" / "power_ema" / written[0])
    assert snapshot["step"] == 2 and snapshot["profiles"][0].keys() == ranks[0]["profiles"][0].keys()
    final = load_snapshot(tmp_path / "checkpoints" / "power_ema" / written[1])
    assert final["step"] == 3 and final["final"] and "final" not in snapshot
    assert all(torch.equal(final["profiles"][1][k], v) for k, v in ranks[0]["profiles"][1].items())


def test_a_state_saved_at_another_spread_loads_its_full_tensors() -> None:
    """A sharded run's checkpoint written as one file holds the profiles gathered: it resumes an unsharded model (world
    size 1), its layout naming the spread it was saved at. The control: a profile of another shape is refused."""
    callback = PostHocEMASnapshots()
    callback.power_ema = PowerEMA(Regressor().net)
    state = callback.power_ema.state_dict()
    names = list(state["profiles"][0])
    moved = [{name: t + 1.0 if t.is_floating_point() else t for name, t in p.items()} for p in state["profiles"]]
    saved = {**state, "profiles": moved, "layout": dict.fromkeys(names, "Shard(dim=0) over a mesh of 4 ranks")}
    callback.load_state_dict({"power_ema": saved})
    assert all(torch.equal(callback.power_ema.profiles[0][n], moved[0][n]) for n in names)
    wrong = [{**p, names[0]: p[names[0]][:1]} for p in moved]
    with pytest.raises(ValueError, match=names[0].replace(".", r"\.")):
        callback.load_state_dict({"power_ema": {**saved, "profiles": wrong}})


def test_the_command_takes_each_steps_rank_files_at_its_own_world_size_and_refuses_a_rank_missing(
    tmp_path: Path,
) -> None:
    """A run resumed at another world size writes its later snapshots at that size: each step is its own set of files.
    The controls: a step with a rank's file missing, and a step written at two world sizes, are refused naming it."""
    from copy_correct.averages.posthoc_command import snapshot_sets

    for name in (
        "power-ema-000000002-rank0of2.pt",
        "power-ema-000000002-rank1of2.pt",
        "power-ema-000000004-rank0of2.pt",
    ):
        (tmp_path / name).touch()
    with pytest.raises(ValueError, match=r"step 4 of ranks \[0\] of 2 only \(rank 1's file is missing"):
        snapshot_sets(tmp_path)
    (tmp_path / "power-ema-000000004-rank1of2.pt").touch()
    for rank in range(4):
        (tmp_path / f"power-ema-000000006-rank{rank}of4.pt").touch()
    (tmp_path / "power-ema-000000008-rank0of1.pt").touch()
    assert [[p.name[10:] for p in paths] for paths in snapshot_sets(tmp_path)] == [
        ["000000002-rank0of2.pt", "000000002-rank1of2.pt"],
        ["000000004-rank0of2.pt", "000000004-rank1of2.pt"],
        [f"000000006-rank{rank}of4.pt" for rank in range(4)],
        ["000000008-rank0of1.pt"],
    ]
    (tmp_path / "power-ema-000000008-rank0of2.pt").touch()
    with pytest.raises(ValueError, match=r"the snapshot of step 8 twice, of world sizes \[1, 2\]"):
        snapshot_sets(tmp_path)
