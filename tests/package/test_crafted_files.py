"""Nothing executed: a crafted file, a real ``torch.save`` archive whose pickle creates a marker file when unpickled
(``open(MARKER, "w")``, pickled as ``io.open``: harmless, and visible), handed over on every load path a user feeds
a file to. Each refuses it in one line naming the file, and the marker is never created; the control, each time, is
the same file loaded with ``weights_only=False`` (or by ``pickle``, as ``torch.distributed.checkpoint`` reads
``.metadata``), which creates the marker.

Load paths: ``copy-correct posthoc --checkpoint FILE``, the newest ``*.ckpt`` of a run's ``checkpoints/`` (the
command's default), a snapshot in ``power_ema/`` (``load_snapshot``/``synthesize``), resume's ``check_checkpoint`` (a
file, a distributed checkpoint's ``meta.pt`` and its ``.metadata``), the command's read of a distributed checkpoint,
and ``load_checked``, the docs' load helper. A checkpoint whose hyperparameters are a ``DictConfig`` (what Lightning
pickles for a module that saved one) still loads through the allowlist."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from copy_correct import PowerEMA
from copy_correct.averages.posthoc import load_snapshot, synthesize
from copy_correct.averages.posthoc_command import read_checkpoint
from copy_correct.cli import main
from copy_correct.files.checked_load import hyperparameter_classes, load_checked
from copy_correct.files.shard_digest import write_digests
from copy_correct.lightning import ResumeState, check_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized")


class Payload:
    """Unpickled, it calls ``open(marker, "w")``: the file appears (and nothing else happens)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return open, (str(self.marker), "w")


def crafted(path: Path, marker: Path, **rest: Any) -> Path:
    """A checkpoint-shaped ``torch.save`` archive with the payload among its hyperparameters."""
    torch.save({"state_dict": {"w": torch.ones(2)}, "hyper_parameters": {"lr": Payload(marker)}, **rest}, path)
    return path


def control_runs_it(path: Path, marker: Path) -> None:
    """The control: the same file under ``weights_only=False`` runs the payload."""
    assert not marker.exists()
    torch.load(path, weights_only=False)
    assert marker.exists()
    marker.unlink()


def run_dir(tmp_path: Path) -> Path:
    """A run as ``PostHocEMASnapshots`` and ``ModelCheckpoint`` leave it: ``checkpoints/last.ckpt`` and two snapshots
    in ``checkpoints/power_ema/``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    checkpoints = tmp_path / "run" / "checkpoints"
    ema = PowerEMA(model, (0.05, 0.10), snapshot_every=2, snapshot_dir=checkpoints / "power_ema")
    for _ in range(4):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        ema.update()
    state = {"state_dict": model.state_dict(), "hyper_parameters": {"width": 4}, "epoch": 0}
    torch.save(state, checkpoints / "last.ckpt")
    return tmp_path / "run"


def command(capsys: pytest.CaptureFixture[str], *arguments: Any) -> tuple[int, str]:
    status = main(["posthoc", *map(str, arguments)])
    captured = capsys.readouterr()
    return status, captured.err


def test_the_command_refuses_a_crafted_checkpoint_given_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run, marker = run_dir(tmp_path), tmp_path / "marker"
    evil = crafted(tmp_path / "evil.ckpt", marker)
    status, err = command(capsys, run, "--sigma-rel", "0.08", "--checkpoint", evil)
    assert status == 2 and err.count("\n") == 1, err
    assert err.startswith(f"copy-correct posthoc: error: {evil} names io.open in its pickle")
    assert not marker.exists() and not list(tmp_path.glob("posthoc-ema-*"))
    status, _ = command(capsys, run, "--sigma-rel", "0.08")  # the run's own checkpoint: written
    assert status == 0 and len(list((run / "checkpoints").glob("posthoc-ema-*.ckpt"))) == 1
    control_runs_it(evil, marker)


def test_the_command_refuses_a_crafted_newest_checkpoint_of_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run, marker = run_dir(tmp_path), tmp_path / "marker"
    evil = crafted(run / "checkpoints" / "zz-newest.ckpt", marker)
    newest = max(p.stat().st_mtime for p in (run / "checkpoints").glob("*.ckpt"))
    os.utime(evil, (newest + 60, newest + 60))  # the newest by its time too: written in the same tick, it may tie
    status, err = command(capsys, run, "--sigma-rel", "0.08")
    assert status == 2 and err.count("\n") == 1 and f"error: {evil} names io.open" in err, err
    assert not marker.exists()
    control_runs_it(evil, marker)


def test_a_crafted_snapshot_is_refused_by_load_snapshot_synthesize_and_the_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run, marker = run_dir(tmp_path), tmp_path / "marker"
    (first, *_) = sorted((run / "checkpoints" / "power_ema").glob("*.pt"))
    snapshot = dict(torch.load(first, weights_only=True))
    torch.save({**snapshot, "note": Payload(marker)}, first)
    for load in (lambda: load_snapshot(first), lambda: synthesize(run, 0.08)):
        with pytest.raises(ValueError, match=f"{first} names io.open in its pickle"):
            load()
    status, err = command(capsys, run, "--sigma-rel", "0.08")
    assert status == 2 and err.count("\n") == 1 and str(first) in err, err
    assert not marker.exists()
    control_runs_it(first, marker)


def test_resume_refuses_a_crafted_checkpoint(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    stamp = {"callbacks": {"ResumeState": ResumeState("alpha", 0).state_dict()}}
    evil = crafted(tmp_path / "last.ckpt", marker, **stamp)
    with pytest.raises(ValueError, match=f"{evil} names io.open in its pickle"):
        check_checkpoint(evil, "alpha", 0)
    assert not marker.exists()
    control_runs_it(evil, marker)


def distributed_checkpoint(directory: Path, meta: dict[str, Any]) -> Path:
    """A distributed checkpoint as ``AtomicModelParallelStrategy`` writes it (in one process): shards, ``.metadata``,
    ``meta.pt``, ``digests.json``."""
    dcp.save({"state_dict": {"w": torch.ones(2)}}, checkpoint_id=directory, no_dist=True)
    torch.save(meta, directory / "meta.pt")
    write_digests(directory)
    return directory


def test_a_distributed_checkpoint_with_a_crafted_metadata_or_meta_pt_is_refused_before_anything_reads_it(
    tmp_path: Path,
) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    marker = tmp_path / "marker"
    stamp = {"callbacks": {"ResumeState": ResumeState("alpha", 0).state_dict()}}
    directory = distributed_checkpoint(tmp_path / "last.ckpt", stamp)
    check_checkpoint(directory, "alpha", 0)  # whole and safe: taken
    assert read_checkpoint(directory)["state_dict"]["w"].tolist() == [1.0, 1.0]
    (directory / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    write_digests(directory)  # a forger recomputes the digests: the pickle itself must be refused
    for load in (lambda: check_checkpoint(directory, "alpha", 0), lambda: read_checkpoint(directory)):
        with pytest.raises(ValueError, match=f"{directory / '.metadata'} names io.open in its pickle"):
            load()
    assert not marker.exists()
    FileSystemReader(str(directory)).read_metadata()  # the control: torch.distributed.checkpoint's own read runs it
    assert marker.exists()
    marker.unlink()

    evil = distributed_checkpoint(tmp_path / "other.ckpt", {**stamp, "hyper_parameters": {"lr": Payload(marker)}})
    for load in (lambda: check_checkpoint(evil, "alpha", 0), lambda: read_checkpoint(evil)):
        with pytest.raises(ValueError, match=f"{evil / 'meta.pt'} names io.open in its pickle"):
            load()
    assert not marker.exists()
    control_runs_it(evil / "meta.pt", marker)


def test_the_docs_load_helper_refuses_the_payload_and_takes_dictconfig_hyperparameters(tmp_path: Path) -> None:
    from omegaconf import DictConfig, OmegaConf

    marker = tmp_path / "marker"
    evil = crafted(tmp_path / "evil.ckpt", marker)
    with pytest.raises(ValueError, match=r"names io\.open in its pickle"):
        load_checked(evil, allow=hyperparameter_classes())
    assert not marker.exists()
    control_runs_it(evil, marker)

    config = OmegaConf.create({"lr": 0.1, "net": {"widths": [4, 8], "act": "tanh"}, "seed": "${lr}"})
    torch.save({"state_dict": {}, "hyper_parameters": config, "hparams_type": DictConfig}, tmp_path / "cfg.ckpt")
    loaded = load_checked(tmp_path / "cfg.ckpt", allow=hyperparameter_classes())
    assert loaded["hyper_parameters"] == config and loaded["hparams_type"] is DictConfig
    with pytest.raises(ValueError, match=r"omegaconf\.dictconfig\.DictConfig"):  # the control: without the allowlist
        load_checked(tmp_path / "cfg.ckpt")
