"""``copy-correct``, the command installed with the package, as a pip user runs it: the console script beside this
interpreter, from a folder outside the clone, with nothing of the checkout on the import path. A user's own small
LightningModule (``USER_CODE``, written to that folder, not one of our recipes) trains with ``PostHocEMASnapshots``
for fewer steps than its ``snapshot_every``; the fit's final snapshot is what ``copy-correct posthoc`` synthesizes
from, and ``Module.load_from_checkpoint`` reads the checkpoint it writes as the synthesized weights (so do the four
lines of Python the callback's docstring gives). ``python -m copy_correct`` is the same command;
``python -m copy_correct.averages.posthoc``, a library module, says which command to run and fails; a folder with no
snapshots and bad arguments stop with status 2 and one line naming the path searched and the file patterns, and a
history with a snapshot missing stops the same way, naming it; so do a ``--step`` past the last snapshot or before the
first (naming both steps), two widths of one file name and a ``--checkpoint`` that does not exist. A width given twice
is written and printed once, and ``--help`` shows none of the docstrings' markup."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

import copy_correct.averages.posthoc_command as posthoc_command
from copy_correct import cli, synthesize
from copy_correct.averages.posthoc import SNAPSHOT_PATTERNS, load_snapshot, snapshot_paths
from copy_correct.cli import main
from tests.conftest import env_without_checkout
from tests.parts.test_snapshot_history import write_history

COMMAND = Path(sys.executable).parent / "copy-correct"
STEPS = 20  # 4 epochs of 5 batches: fewer than the callback's default snapshot_every (1000)

USER_CODE = """
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from copy_correct.lightning import PostHocEMASnapshots


class Mine(pl.LightningModule):
    def __init__(self, width: int = 12) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.body = nn.Sequential(nn.Linear(4, width), nn.LayerNorm(width), nn.Tanh(), nn.Linear(width, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.body(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


if __name__ == "__main__":
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(40, 4), torch.randint(0, 2, (40,)))
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=4, logger=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=sys.argv[1], callbacks=[PostHocEMASnapshots(), ModelCheckpoint(save_last=True)],
    )
    trainer.fit(Mine(width=10), DataLoader(data, batch_size=8))
"""


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env_without_checkout(), capture_output=True, text=True, timeout=300
    )


def user_module(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("my_model", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def user_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The user's folder, outside the clone, after ``python my_model.py run`` (the run's directory: ``run/``)."""
    assert COMMAND.is_file(), f"{COMMAND} is missing: install the package (pip install -e .) to get the command"
    folder = tmp_path_factory.mktemp("user")
    (folder / "my_model.py").write_text(USER_CODE)
    trained = run(sys.executable, "my_model.py", "run", cwd=folder)
    assert trained.returncode == 0, trained.stderr[-3000:]
    return folder


def test_the_installed_command_writes_a_checkpoint_load_from_checkpoint_reads_as_the_synthesized_ema(
    user_run: Path,
) -> None:
    snapshots = snapshot_paths(user_run / "run" / "checkpoints" / "power_ema")
    assert [p.name for p in snapshots] == [f"power-ema-{STEPS:09d}.pt"]  # no scheduled one: the fit's final one
    assert load_snapshot(snapshots[0])["final"]
    result = run(COMMAND, "posthoc", "run", "--sigma-rel", "0.08", "0.15", cwd=user_run)
    assert result.returncode == 0, result.stderr[-3000:]
    written = [user_run / line for line in result.stdout.split()]
    assert [p.name for p in written] == [f"posthoc-ema-sigma{s}-step{STEPS:09d}.ckpt" for s in ("0.080", "0.150")]
    mine = user_module(user_run / "my_model.py").Mine
    for path, sigma_rel in zip(written, (0.08, 0.15), strict=True):
        model = mine.load_from_checkpoint(path)
        expected = synthesize(user_run / "run", sigma_rel)
        assert model.hparams.width == 10 and model.state_dict().keys() == expected.keys()
        assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())
    live = mine.load_from_checkpoint(user_run / "run" / "checkpoints" / "last.ckpt")  # the control: live weights
    assert not torch.equal(live.body[0].weight, mine.load_from_checkpoint(written[0]).body[0].weight)

    # The callback docstring's four lines, for a user of synthesize: the same checkpoint's weights.
    checkpoint = torch.load(user_run / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    checkpoint["state_dict"].update(synthesize(user_run / "run", sigma_rel=0.08))
    torch.save(checkpoint, user_run / "ema.ckpt")
    by_hand, by_command = mine.load_from_checkpoint(user_run / "ema.ckpt"), mine.load_from_checkpoint(written[0])
    assert all(torch.equal(v, by_command.state_dict()[k]) for k, v in by_hand.state_dict().items())


def test_python_dash_m_copy_correct_is_the_same_command(user_run: Path) -> None:
    installed, module = (
        run(*c, "posthoc", "--help", cwd=user_run) for c in ([COMMAND], [sys.executable, "-m", "copy_correct"])
    )
    assert installed.returncode == module.returncode == 0
    assert installed.stdout == module.stdout and installed.stdout.startswith("usage: copy-correct posthoc")


def test_the_library_module_run_as_a_command_fails_naming_the_command(user_run: Path) -> None:
    before = sorted(p.name for p in (user_run / "run" / "checkpoints").iterdir())
    result = run(sys.executable, "-m", "copy_correct.averages.posthoc", "run", "--sigma-rel", "0.08", cwd=user_run)
    assert result.returncode != 0
    # The last line is ours (Python's runpy may warn before it that the package imported the module).
    assert result.stderr.splitlines()[-1] == (
        "copy_correct.averages.posthoc is not a command: run `copy-correct posthoc RUN_DIR --sigma-rel 0.08`"
    )
    assert sorted(p.name for p in (user_run / "run" / "checkpoints").iterdir()) == before  # nothing written


def test_nothing_to_synthesize_from_names_the_path_searched_and_the_file_patterns(tmp_path: Path) -> None:
    (tmp_path / "empty_run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "empty_run" / "checkpoints" / "last.ckpt").touch()
    for given, says in (("empty_run", "or below it"), ("missing", "it does not exist")):
        result = run(COMMAND, "posthoc", given, "--sigma-rel", "0.08", cwd=tmp_path)
        assert result.returncode == 2 and result.stdout == "" and result.stderr.count("\n") == 1, result.stderr
        assert result.stderr.startswith("copy-correct posthoc: error: no PowerEMA snapshots") and says in result.stderr
        assert given in result.stderr and all(pattern in result.stderr for pattern in SNAPSHOT_PATTERNS)


def test_no_arguments_stop_the_installed_command_with_status_2_and_one_line(tmp_path: Path) -> None:
    result = run(COMMAND, cwd=tmp_path)
    assert result.returncode == 2 and result.stderr == (
        "copy-correct: error: the following arguments are required: COMMAND (see copy-correct --help)\n"
    )


@pytest.mark.parametrize(
    ("arguments", "says"),
    [
        (("fit",), "invalid choice: 'fit'"),
        (("posthoc", "run"), "the following arguments are required: --sigma-rel"),
        (("posthoc", "run", "--sigma-rel", "0.5"), "argument --sigma-rel: '0.5' is not a number in (0, 0.2887)"),
        (("posthoc", "run", "--sigma-rel", "x"), "argument --sigma-rel: 'x' is not a number in (0, 0.2887)"),
        (("posthoc", "run", "--sigma-rel", "0.08", "--step", "0"), "argument --step: '0' is not an optimizer step"),
        (("posthoc", "run", "--sigma-rel", "0.08", "--step", "2.5"), "argument --step: '2.5' is not an optimizer step"),
    ],
)
def test_bad_arguments_stop_with_status_2_and_one_line(
    arguments: tuple[str, ...], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stopped:  # main itself, in this process: the command line's parser
        main(list(arguments))
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.count("\n") == 1 and says in err, err


def test_a_history_with_a_snapshot_missing_is_refused_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A resumed run's folder without an earlier snapshot: the command stops with one line naming the missing step,
    where ``synthesize`` alone still solves it into another average (the control, in
    ``tests/parts/test_snapshot_history.py``)."""
    files = write_history(tmp_path / "run" / "checkpoints" / "power_ema", [2, 4, 6, 8], links=True, final=9)
    files[4].unlink()
    assert main(["posthoc", str(tmp_path / "run"), "--sigma-rel", "0.08"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the snapshot of step 4, which power-ema-000000006.pt follows, is missing" in err
    assert not list((tmp_path / "run" / "checkpoints").glob("posthoc-ema-*.ckpt"))  # nothing written


def small_run(tmp_path: Path, steps: list[int]) -> Path:
    """A run's directory as ``PostHocEMASnapshots`` and ``ModelCheckpoint`` leave it: snapshots of a linear layer at
    ``steps`` in ``checkpoints/power_ema/``, and ``checkpoints/last.ckpt`` of that layer."""
    write_history(tmp_path / "run" / "checkpoints" / "power_ema", steps, links=True)
    checkpoint = {"state_dict": torch.nn.Linear(3, 2).state_dict(), "hyper_parameters": {}, "epoch": 0}
    torch.save(checkpoint, tmp_path / "run" / "checkpoints" / "last.ckpt")
    return tmp_path / "run"


def written(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").glob("posthoc-ema-*.ckpt"))


def test_a_step_out_of_the_snapshots_range_is_refused_naming_both_steps_and_nothing_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Snapshots at steps 50 to 200: ``--step 999`` and ``--step 10`` stop with status 2 and one line; a step between
    two snapshots is written (the best fit from those before it)."""
    run_dir = small_run(tmp_path, [50, 100, 150, 200])
    refusals = {
        "999": "step 999 is past the last snapshot, of step 200: no snapshot holds the steps after it (give a step up "
        "to 200)",
        "10": "step 10 is before the first snapshot, of step 50: no snapshot holds the steps up to it (give a step "
        "from 50 to 200)",
    }
    for step, message in refusals.items():
        assert main(["posthoc", str(run_dir), "--sigma-rel", "0.1", "--step", step]) == 2
        assert capsys.readouterr().err == f"copy-correct posthoc: error: {message}\n"
        assert written(run_dir) == []
    assert main(["posthoc", str(run_dir), "--sigma-rel", "0.1", "--step", "120"]) == 0
    assert written(run_dir) == ["posthoc-ema-sigma0.100-step000000120.ckpt"]

    # The control: without the range check, --step 999 wrote a checkpoint saying step 999 from snapshots up to 200.
    monkeypatch.setattr("copy_correct.averages.posthoc_command.target_step", lambda steps, step: step)
    monkeypatch.setattr("copy_correct.averages.posthoc.target_step", lambda steps, step: step or max(steps))
    assert main(["posthoc", str(run_dir), "--sigma-rel", "0.1", "--step", "999"]) == 0
    path = run_dir / "checkpoints" / "posthoc-ema-sigma0.100-step000000999.ckpt"
    assert torch.load(path, weights_only=True)["global_step"] == 999  # the last snapshot is of step 200


def test_a_width_given_twice_is_written_and_printed_once_and_two_of_one_file_name_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = small_run(tmp_path, [2, 4])
    saves: list[Path] = []
    save = posthoc_command.atomic_save
    monkeypatch.setattr(posthoc_command, "atomic_save", lambda state, path: saves.append(path) or save(state, path))
    assert main(["posthoc", str(run_dir), "--sigma-rel", "0.1", "0.08", "0.10"]) == 0
    names = ["posthoc-ema-sigma0.100-step000000004.ckpt", "posthoc-ema-sigma0.080-step000000004.ckpt"]
    assert [Path(line).name for line in capsys.readouterr().out.splitlines()] == names  # in the order given
    assert [p.name for p in saves] == names

    assert main(["posthoc", str(run_dir), "--sigma-rel", "0.08", "0.0801"]) == 2  # would share a file name
    assert capsys.readouterr().err == (
        "copy-correct posthoc: error: sigma_rel 0.08 and 0.0801 would both be written as "
        "posthoc-ema-sigma0.080-...: give widths that differ in the first 3 decimals\n"
    )
    assert len(saves) == 2  # nothing more written

    # The control: a loop over the widths as given writes 0.1's file twice (and prints it twice).
    saves.clear()
    for sigma_rel in (0.1, 0.08, 0.1):
        posthoc_command.posthoc(run_dir, [sigma_rel])
    assert [p.name for p in saves] == [names[0], names[1], names[0]]


def test_help_is_plain_text_where_the_docstrings_have_markup(capsys: pytest.CaptureFixture[str]) -> None:
    shown = {}
    for arguments in (("--help",), ("posthoc", "--help")):
        with pytest.raises(SystemExit) as stopped:
            main(list(arguments))
        shown[arguments] = " ".join(capsys.readouterr().out.split())
        assert stopped.value.code == 0 and "``" not in shown[arguments], shown[arguments]
    assert "The copy-correct command (installed with the package; also python -m copy_correct)" in shown[("--help",)]
    assert "a width given twice is written once" in shown[("posthoc", "--help")]
    assert "from the first snapshot's to the last's" in shown[("posthoc", "--help")]
    assert "``" in cli.__doc__.split("\n\n")[0]  # the control: the text --help shows, as the docstring has it


def test_a_checkpoint_that_does_not_exist_stops_with_status_2_and_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = small_run(tmp_path, [2, 4])
    missing = tmp_path / "elsewhere" / "epoch=3-step=20.ckpt"
    assert main(["posthoc", str(run_dir), "--sigma-rel", "0.1", "--checkpoint", str(missing)]) == 2
    assert capsys.readouterr().err == f"copy-correct posthoc: error: {missing} does not exist\n"
    assert written(run_dir) == []
