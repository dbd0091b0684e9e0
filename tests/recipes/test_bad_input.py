"""Bad input stops before training: exit status 2, exactly one line on stderr naming the key and what is
allowed, no checkpoint written, no run directory left behind, an earlier run's directory left byte for byte as it was.
A file that breaks only when a DataLoader worker reads it (``data.verify=false``) stops the run the same way.

Every number and flag is checked before anything is built (``recipes/config_values.py``; every key of every recipe in
``tests/recipes/test_config_values.py``); the parts refine the ranges where they use them (constructors raise
``ValueError``), and ``build`` names them by their config key. Those are tested in process, for every recipe; the
subprocess cases prove the path from each kind of error to the one line and exit status. A size that cannot be
allocated names its key and the bytes; a run whose loss turns NaN stops with status 3 naming the step and writes no
NaN checkpoint (the control: without ``NonFiniteStop`` it writes one)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from recipes.build import build
from recipes.launch import available_recipes
from tests.conftest import QUIET, ROOT, compose_config, run_train, write_images

RECIPES = ", ".join(available_recipes())

# (id, arguments, phrases the one line must hold); {earlier} is a finished ema run's directory (seed 0).
REFUSED = [
    ("no recipe", [], ["no recipe given", "+recipe=NAME", RECIPES]),
    ("unknown recipe", ["+recipe=nope"], ["unknown recipe 'nope'", f"recipe must be one of: {RECIPES}"]),
    ("unknown recipe in a sweep", ["-m", "+recipe=metrics,nope"], ["unknown recipe 'nope'", RECIPES]),
    ("misspelled key", ["+recipe=ema", "trainer.max_epoch=3"], [
        "trainer.max_epoch is not a config key", "did you mean trainer.max_epochs?", "max_steps", "+trainer.max_epoch=",
    ]),
    ("misspelled key in a sweep", ["-m", "+recipe=ema", "seed=0,1", "model.hiden=8"], [
        "model.hiden is not a config key", "did you mean model.hidden?",
    ]),
    ("unknown group option", ["+recipe=ema", "trainer=gpuu"], ["trainer must be one of: cpu, ddp, default, fsdp, gpu"]),
    ("decay out of range", ["+recipe=ema", "callbacks.ema.decay=1"], ["callbacks.ema.decay must be in [0, 1), got 1"]),
    ("empty split", ["+recipe=gan", "data.val_fraction=0.001"], [
        "data.val_fraction=0.001 leaves 2 validation and 1795 training digits", "must be in (0.005008, 0.9944]",
    ]),
    ("missing checkpoint", ["+recipe=ema", "ckpt_path={earlier}/none.ckpt"], [
        "ckpt_path must be a checkpoint file or a run directory with checkpoints/last.ckpt", "none.ckpt",
    ]),
    ("not a checkpoint", ["+recipe=ema", "ckpt_path={earlier}/metrics.csv"], [
        "metrics.csv", "is not the zip archive torch.save writes",
    ]),
    ("another recipe's checkpoint", ["+recipe=gan", "ckpt_path={earlier}"], [
        "last.ckpt' cannot resume this run", "holds a run of recipe 'ema', not 'gan'", "resume it with +recipe=ema",
    ]),
    ("another seed's checkpoint", ["+recipe=ema", "seed=1", "ckpt_path={earlier}"], ["seed=0, not seed=1"]),
    ("a required value left ???", ["+recipe=gan", "data=images"], ["data.root has no value", "data.root=..."]),
    ("eval_samples too few for the grid", ["+recipe=gan", "model.eval_samples=50"], [
        "model.eval_samples must be >= 100 (each validation writes a 10x10 grid of samples), got 50",
    ]),
    ("a file that does not decode", ["+recipe=gan", "data=images", "data.root={broken}"], [
        "broken.png does not decode as an image",
    ]),
    ("a folder of grey and RGB images", ["+recipe=ema", "data=images", "data.root={mixed}"], [
        "grey.png is a L image, but 4 of the 5 files are RGB", "set data.channels=3 data.convert=true",
    ]),
    # every number and flag (recipes/config_values.py; tests/recipes/test_config_values.py has them all)
    ("an infinite learning rate", ["+recipe=gan", "model.lr=inf"], ["model.lr must be in (0, inf), got inf"]),
    ("a word for a batch size", ["+recipe=ema", "data.batch_size=abc"], [
        "data.batch_size must be an integer >= 1, got str 'abc'",
    ]),
    ("a word for a seed", ["+recipe=dqn", "seed=abc"], ["seed must be an integer in [0, 4294967295], got str 'abc'"]),
    ("a replay buffer that cannot be allocated", ["+recipe=dqn", "model.buffer_size=1000000000000"], [
        "model.buffer_size=1000000000000 (a ReplayBuffer of CartPole-v1) needs 41.8 TiB (46,000,000,000,000 bytes)",
        "lower model.buffer_size",
    ]),
]  # fmt: skip

OUT_OF_RANGE = [
    ("metrics", "model.lr=-1", "model.lr must be in (0, inf), got -1"),
    ("metrics", "float32_matmul_precision=low", "float32_matmul_precision must be one of highest, high, medium, got"),
    ("metrics", "data.batch_size=0", "data.batch_size must be >= 1, got 0"),
    ("metrics", "data.val_fraction=1.5", "data.val_fraction must be in (0, 1), got 1.5"),
    ("ema", "callbacks.ema.decay=1.5", "callbacks.ema.decay must be in [0, 1), got 1.5"),
    ("ema", "model.lr=0", "model.lr must be in (0, inf), got 0"),
    ("ema", "data.batch_size=0", "data.batch_size must be >= 1, got 0"),
    ("ema", "data.val_fraction=0.999", "data.val_fraction=0.999 leaves 1796 validation and 1 training digits"),
    ("gan", "callbacks.ema.decay=1", "callbacks.ema.decay must be in [0, 1), got 1"),
    ("gan", "model.lr=0", "model.lr must be in (0, inf), got 0"),
    ("gan", "data.batch_size=-2", "data.batch_size must be >= 1, got -2"),
    ("gan", "model.eval_samples=99", "model.eval_samples must be >= 100 (each validation writes a 10x10 grid"),
    ("gan", "model.network=cnn", "model.network must be one of auto, mlp, conv, got 'cnn'"),
    ("gan", "model.network=conv", "model.network=conv needs square images whose side is 4, 5, 6 or 7 times a power"),
    ("ema", "model.num_classes=5", "model.num_classes=5 but the data has 10: leave model.num_classes null"),
    ("ema", "model.image_shape=[1,4,16]", "model.image_shape=[1, 4, 16] but the data has [1, 8, 8]"),
    ("dqn", "model.tau=0", "model.tau must be in (0, 1], got 0"),
    ("dqn", "model.lr=0", "model.lr must be in (0, inf), got 0"),
    ("dqn", "model.batch_size=0", "model.batch_size must be >= 1, got 0"),
    ("pinned", "data.max_shift=64", "data.max_shift must be in [0, data.size=64), got 64"),
    ("pinned", "data.size=4", "data.size must be >= 8, got 4"),
    ("pinned", "data.val_fraction=0.001", "data.val_fraction=0.001 leaves 2 validation and 1795 training digits"),
    ("pinned", "model.lr=0", "model.lr must be in (0, inf), got 0"),
    ("pinned", "model.stem_stride=0", "model.stem_stride must be >= 1, got 0"),
    ("pinned", "data.source=disk", "data.source must be one of workers, store, got 'disk'"),
    ("pinned", "data.channels=2", "data.channels must be 1 or 3, got 2"),
    ("pinned", "data.batches_per_epoch=0", "data.batches_per_epoch must be >= 1, got 0"),
    ("pinned", "+pinned=gpu_scale data.store_size=1024", "data.store_size must be >= data.batch_size=2048, got 1024"),
]


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def earlier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished one-epoch ema run (seed 0): a run directory with a last.ckpt that a bad run must not touch."""
    run_dir = tmp_path_factory.mktemp("earlier") / "ema"
    result = run_train("+recipe=ema", "seed=0", "trainer.max_epochs=1", *QUIET, f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    return run_dir


@pytest.fixture(scope="module")
def broken(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of images, one of which is not an image."""
    folder = write_images(tmp_path_factory.mktemp("broken"), 4)
    (folder / "broken.png").write_bytes(b"not a png")
    return folder


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A labelled folder of four RGB images and one grey one: no one number of channels to take from the files."""
    folder = write_images(tmp_path_factory.mktemp("mixed"), 4, classes=2)
    Image.fromarray(np.zeros((16, 16), np.uint8)).save(folder / "class0" / "grey.png")
    return folder


# One case of each kind of refusal in the default suite (each a process importing Lightning, about 5 s on 2 cores):
# the launcher's, a config key's, a value's, a checkpoint's, a file's, a size's; the rest in CI's long runs.
IN_DEFAULT_SUITE = {
    "no recipe", "misspelled key", "decay out of range", "not a checkpoint", "a file that does not decode",
    "a replay buffer that cannot be allocated",
}  # fmt: skip


@pytest.mark.parametrize(("args", "phrases"), [
    pytest.param(a, p, id=i, marks=() if i in IN_DEFAULT_SUITE else pytest.mark.long) for i, a, p in REFUSED
])  # fmt: skip
def test_bad_input_exits_2_with_one_line_and_writes_nothing(
    args: list[str], phrases: list[str], earlier: Path, broken: Path, mixed: Path, tmp_path: Path
) -> None:
    before = snapshot(earlier)
    run_dir = tmp_path / "run"
    result = run_train(
        *(a.format(earlier=earlier, broken=broken, mixed=mixed) for a in args), f"hydra.run.dir={run_dir}"
    )
    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ")
    for phrase in phrases:
        assert phrase in line, line
    assert not list(tmp_path.rglob("*.ckpt"))
    assert not run_dir.exists()  # refused before Hydra made it, or the directory Hydra made for it removed
    assert snapshot(earlier) == before


def test_a_refused_first_run_leaves_no_empty_outputs_folders_below_the_working_directory(tmp_path: Path) -> None:
    """The default run directory is ``outputs/RECIPE/TIME`` below the working directory: a refused first run takes
    away the folders made for it and nothing that holds anything else (the control: a folder beside it stays)."""
    top = ROOT / f"refused-{tmp_path.name}"  # below the repository, as outputs/ is
    try:
        (top / "kept").mkdir(parents=True)
        result = run_train("+recipe=ema", "callbacks.ema.decay=1", f"hydra.run.dir={top.name}/ema/run")
        assert result.returncode == 2, result.stderr[-3000:]
        assert sorted(p.name for p in top.iterdir()) == ["kept"]  # ema/ went with ema/run; top/ holds kept/
        shutil.rmtree(top / "kept")
        result = run_train("+recipe=ema", "callbacks.ema.decay=1", f"hydra.run.dir={top.name}/ema/run")
        assert result.returncode == 2 and not top.exists() and ROOT.is_dir()  # up to the working directory only
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_a_bad_run_pointed_at_an_earlier_directory_changes_it_and_keeps_it(earlier: Path, tmp_path: Path) -> None:
    """The control for the snapshot and for the removed run directories: Hydra writes its .hydra/ files before any
    check of ours can run (which is why a resumed run gets a directory of its own instead of reusing the crashed
    one), so a refused run would leave the directory Hydra made; one that holds anything else is kept."""
    copy = tmp_path / "copy"
    shutil.copytree(earlier, copy)
    before = snapshot(copy)
    result = run_train("+recipe=ema", "callbacks.ema.decay=1", f"hydra.run.dir={copy}")
    assert result.returncode == 2
    after = snapshot(copy)
    assert after != before and after.keys() == before.keys()
    assert (copy / "checkpoints" / "last.ckpt").is_file()


def test_a_file_that_breaks_in_a_worker_stops_the_run_with_one_line(tmp_path: Path) -> None:
    """``data.verify=false``: no file is decoded before training, and the truncated one is found by the DataLoader
    worker that reads it, after Lightning has started (its messages come first): the last line names the file, no
    traceback, status 2, and the run directory, which holds nothing of the run, is removed."""
    folder = write_images(tmp_path / "images", 8)
    path = folder / "0003.png"
    path.write_bytes(path.read_bytes()[:200])  # a valid header, the pixels cut short
    run_dir = tmp_path / "run"
    result = run_train(
        "+recipe=gan", "data=images", f"data.root={folder}", "data.verify=false", "model.conv_width=8",
        "model.eval_samples=100", "model.judge_epochs=1", *QUIET, f"hydra.run.dir={run_dir}",
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "GPU available" in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {path} does not decode as an image: "), last
    assert [line for line in result.stderr.splitlines() if "error" in line.lower()] == [last]
    assert not run_dir.exists()


@pytest.mark.parametrize(("recipe", "override", "message"), OUT_OF_RANGE)
def test_out_of_range_value_is_refused_by_build_naming_its_key(
    recipe: str, override: str, message: str, tmp_path: Path
) -> None:
    with pytest.raises(ValueError) as refused:
        build(compose_config(f"+recipe={recipe}", *override.split(), output_dir=tmp_path))
    assert str(refused.value).startswith(message)
    build(compose_config(f"+recipe={recipe}", output_dir=tmp_path))  # the control: the defaults build


@pytest.mark.parametrize(
    ("recipe", "folder", "message"),
    [
        (
            "ema",
            "unlabelled",
            "recipe ema classifies, and the data has no labels: put each class's images in a subfolder",
        ),
        ("ema", "one class", "recipe ema classifies, and the data has 1 class"),
    ],
)
def test_a_folder_a_recipe_cannot_use_is_refused_by_build(
    recipe: str, folder: str, message: str, tmp_path: Path
) -> None:
    root = write_images(tmp_path / "images", 6, classes=0 if folder == "unlabelled" else 1)
    overrides = ["data=images", f"data.root={root}", "data.image_size=16", "data.num_workers=0"]
    with pytest.raises(ValueError) as refused:
        build(compose_config(f"+recipe={recipe}", *overrides, output_dir=tmp_path))
    assert str(refused.value).startswith(message)


@pytest.mark.parametrize("image_shape", [None, (8, 8), [1, 8, 8, 1]])
@pytest.mark.parametrize("model", ["ema", "gan"])
def test_a_model_built_by_hand_without_an_image_shape_says_which_key(model: str, image_shape: object) -> None:
    """``train.py`` fills ``model.image_shape`` from the data; a model built in your own code must be given it."""
    from recipes.ema import NoisyClassifier
    from recipes.gan import GAN

    build = {"ema": lambda **kw: NoisyClassifier(num_classes=10, **kw), "gan": GAN}[model]
    with pytest.raises(ValueError, match=r"^model\.image_shape must be \(channels, height, width\), got "):
        build(image_shape=image_shape)
    build(image_shape=[1, 8, 8])  # the control: three sizes, as a list (what a config holds), build


def test_a_model_that_cannot_be_allocated_is_refused_naming_the_bytes(tmp_path: Path) -> None:
    """The allocation fails while ``model`` is instantiated: the line names the node and the bytes (under Hydra, with
    the keys given for it: ``model (with model.hidden=...)``), not torch's allocator."""
    with pytest.raises(ValueError, match=r"^model needs 232\.8 TiB \(256,000,000,000,000 bytes\), which cannot be all"):
        build(compose_config("+recipe=metrics", "model.hidden=1000000000000", output_dir=tmp_path))


def test_a_replay_buffer_larger_than_the_machine_is_refused_where_the_kernel_grants_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A kernel that grants any allocation (``vm.overcommit_memory=1``) maps the buffer lazily and the run would die
    filling it: the buffer's bytes are compared with the machine's memory, here made 1 MB. The control: at the
    machine's own memory the same buffer is built."""
    import recipes.allocation
    from recipes.dqn import DQN

    assert DQN(buffer_size=100_000).buffer.nbytes > 2**20  # the control
    monkeypatch.setattr(recipes.allocation, "machine_memory", lambda: 2**20)
    with pytest.raises(ValueError, match=r"^model.buffer_size=100000 \(a ReplayBuffer of CartPole-v1\) needs 4\.4 MiB"):
        DQN(buffer_size=100_000)


def test_a_size_that_fails_once_fit_sets_up_stops_the_run_with_one_line(tmp_path: Path) -> None:
    """The pinned store is allocated in the data module's ``setup``, once ``fit`` runs (Lightning has printed its
    lines): the last line names the bytes and the size given, status 2, no traceback."""
    run_dir = tmp_path / "run"
    result = run_train(
        "+recipe=pinned", "data.source=store", "data.store_size=100000000000", *QUIET, f"hydra.run.dir={run_dir}"
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: this run (with data.store_size=100000000000) needs 745.1 GiB (800,000,000,000 byt")
    assert last.endswith("lower data.store_size"), last


def test_a_run_whose_loss_turns_nan_stops_naming_the_step_and_writes_no_nan_checkpoint(tmp_path: Path) -> None:
    """``model.lr=1e30`` is a finite learning rate (taken) with which ema's loss is NaN by its second batch:
    ``NonFiniteStop`` (conf/callbacks/default.yaml) stops the run there, status 3, the last line naming the step, no
    checkpoint written. The control, the same run without it, ends with status 0 and NaN weights in last.ckpt."""
    import torch

    args = ["+recipe=ema", "model.lr=1e30", "trainer.max_epochs=2", *QUIET]
    result = run_train(*args, f"hydra.run.dir={tmp_path / 'stopped'}")
    assert result.returncode == 3, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the training loss was NaN or Inf at epoch 0, batch 1 (global step 2)"), last
    assert "Traceback" not in result.stderr and not list(tmp_path.rglob("*.ckpt"))

    result = run_train(*args, "callbacks.nonfinite_stop=null", f"hydra.run.dir={tmp_path / 'control'}")
    assert result.returncode == 0, result.stderr[-3000:]
    weights = torch.load(tmp_path / "control" / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert not all(torch.isfinite(w).all() for w in weights.values())
