"""Using a trained model: each recipe page's "Use the trained model" block, run exactly as the page shows it against
a checkpoint a short run made, and the class names and input format a classifier's checkpoint keeps
(``load_image`` itself: ``test_inference.py``); the gan page's post-hoc blocks, after its command, against the same
run's snapshots."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from copy_correct import synthesize
from copy_correct.cli import main
from copy_correct.files.checked_load import hyperparameter_classes, load_checked
from recipes.build import build, ignore_expected_warnings
from recipes.ema import NoisyClassifier
from recipes.inference import classify
from tests.conftest import ON_CPU, QUIET, compose_config

ROOT = Path(__file__).resolve().parents[2]
SECTION = "\n## Use the trained model\n"
POSTHOC = "\n## Post-hoc EMA: choose the average after training\n"
CLASSES = {"cat": 40, "dog": 200}  # the page's folder: dark cats, light dogs (the pixels' mean), 24 of each


def section_blocks(recipe: str, heading: str) -> list[str]:
    """The Python blocks of ``docs/recipes/RECIPE.md``'s section ``heading``, as the page shows them."""
    text = (ROOT / "docs" / "recipes" / f"{recipe}.md").read_text()
    assert text.count(heading) == 1, f"{recipe}.md needs one section {heading.strip()!r}"
    return re.findall(r"```python\n(.*?)```", text.split(heading)[1].split("\n## ")[0], re.DOTALL)


def page_block(recipe: str) -> str:
    """The Python block of ``docs/recipes/RECIPE.md``'s last section, "Use the trained model", as the page shows it."""
    text = (ROOT / "docs" / "recipes" / f"{recipe}.md").read_text()
    assert text.count(SECTION) == 1, f"{recipe}.md needs one section {SECTION.strip()!r}"
    section = text.split(SECTION)[1]
    assert "\n## " not in section, f"{SECTION.strip()!r} must be the last section of {recipe}.md"
    blocks = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    assert len(blocks) == 1, f"{recipe}.md's {SECTION.strip()!r} needs one python block"
    return blocks[0]


def run_page_block(
    recipe: str, cwd: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> tuple[str, dict[str, Any]]:
    """Run the page's block in ``cwd`` (which holds ``outputs/RECIPE/...``), in fresh objects: what it printed, and
    the names it left."""
    capsys.readouterr()  # drop what training printed
    monkeypatch.chdir(cwd)
    names: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(page_block(recipe), f"docs/recipes/{recipe}.md", "exec"), names)
    return capsys.readouterr().out, names


def train(recipe: str, cwd: Path, *overrides: str) -> None:
    """A short run of ``recipe`` whose run directory is ``cwd/outputs/RECIPE/run``, as ``train.py`` builds it."""
    cfg = compose_config(f"+recipe={recipe}", ON_CPU, *QUIET, *overrides, output_dir=cwd / "outputs" / recipe / "run")
    trainer, model, datamodule = build(cfg)
    ignore_expected_warnings(model)  # as train.py does
    trainer.fit(model, datamodule=datamodule)


@pytest.fixture(scope="module")
def ema_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder ``my_images/{cat,dog}/`` as the ema page names it, and a short ``ema`` run on it, in one directory."""
    cwd = tmp_path_factory.mktemp("ema_use")
    rng = np.random.default_rng(0)
    for name, level in CLASSES.items():
        (cwd / "my_images" / name).mkdir(parents=True)
        for i in range(24):
            pixels = np.clip(rng.normal(level, 30, (16, 16, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(cwd / "my_images" / name / f"{i:04d}.png")
    overrides = ("data=images", f"data.root={cwd / 'my_images'}", "data.image_size=16", "data.num_workers=0")
    train("ema", cwd, *overrides, "trainer.max_epochs=2")
    return cwd


def best_checkpoint(cwd: Path, recipe: str) -> Path:
    (best,) = [p for p in (cwd / "outputs" / recipe / "run" / "checkpoints").glob("*.ckpt") if p.name != "last.ckpt"]
    return best


def test_the_ema_page_names_the_class_of_a_file_from_the_best_checkpoint(
    ema_run: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    printed, _ = run_page_block("ema", ema_run, monkeypatch, capsys)
    assert printed.splitlines() == ["['cat', 'dog']", "cat"]


def test_a_classifier_checkpoint_keeps_class_names_and_input_format_and_without_them_names_no_class(
    ema_run: Path, tmp_path: Path
) -> None:
    best = best_checkpoint(ema_run, "ema")
    saved = torch.load(best, weights_only=True)  # how train.py loads checkpoints: plain values only
    assert saved["hyper_parameters"]["classes"] == ["cat", "dog"]
    assert saved["hyper_parameters"]["input_format"] == {
        "image_shape": [3, 16, 16],
        "mean": 0.0,
        "std": 1.0,
        "flat": False,
    }
    model = NoisyClassifier.load_from_checkpoint(best)
    files = sorted((ema_run / "my_images").glob("*/*.png"))
    assert [classify(model, f) for f in files] == [f.parent.name for f in files]  # every file, its folder's name
    assert model.training  # classify evaluates in eval mode and leaves the mode as it was
    # Control: the same checkpoint without the class names (as written before they travelled) names no class.
    del saved["hyper_parameters"]["classes"]
    torch.save(saved, tmp_path / "without_classes.ckpt")
    bare = NoisyClassifier.load_from_checkpoint(tmp_path / "without_classes.ckpt")
    with pytest.raises(ValueError, match="the model's hparams hold no classes"):
        classify(bare, files[0])


def test_the_metrics_page_names_the_digit_in_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    train("metrics", tmp_path, "trainer.max_epochs=2")
    printed, _ = run_page_block("metrics", tmp_path, monkeypatch, capsys)
    assert printed.splitlines() == ["0"]


def test_the_pinned_page_names_the_digit_in_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    train("pinned", tmp_path, "data.size=16", "data.max_shift=2", "data.num_workers=0", "model.width=16",
          "trainer.max_epochs=2")  # fmt: skip
    printed, _ = run_page_block("pinned", tmp_path, monkeypatch, capsys)
    assert printed.splitlines() == ["0"]


@pytest.fixture(scope="module")
def gan_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A short ``gan`` run (its generator's post-hoc snapshots on, as by default) in ``outputs/gan/run``."""
    cwd = tmp_path_factory.mktemp("gan_use")
    train("gan", cwd, "model.judge_epochs=1", "model.eval_samples=100", "trainer.max_epochs=1",
          "trainer.check_val_every_n_epoch=1", "trainer.limit_train_batches=4",
          "trainer.log_every_n_steps=1")  # fmt: skip
    return cwd


def test_the_gan_page_samples_a_grid_from_the_ema_generator(
    gan_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    shutil.copytree(gan_run, tmp_path, dirs_exist_ok=True)
    _, names = run_page_block("gan", tmp_path, monkeypatch, capsys)
    with Image.open(tmp_path / "my_samples.png") as grid:
        assert grid.mode == "L" and grid.size == (400, 400)  # 8x8 digits, 8 to a row, a pixel around each, scaled x5
    callbacks = torch.load(best_checkpoint(tmp_path, "gan"), weights_only=True)["callbacks"]
    average = callbacks["EMAWeights{'decay': 0.999, 'module': 'generator'}"]["ema"]["shadow"]  # the GAN's names
    sampled = names["model"].state_dict()
    assert all(torch.equal(sampled[name], value) for name, value in average.items())  # the EMA generator's samples


def test_the_gan_pages_posthoc_blocks_load_the_synthesized_generator(
    gan_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """After the page's command, each block of the post-hoc section loads a GAN whose generator is ``synthesize``'s
    average of the run's snapshots and whose other weights are the run's last checkpoint's. The control: that
    checkpoint's own generator is not the average."""
    shutil.copytree(gan_run, tmp_path, dirs_exist_ok=True)
    run = tmp_path / "outputs" / "gan" / "run"
    assert main(["posthoc", str(run), "--sigma-rel", "0.08"]) == 0  # the page's command, at the last snapshot
    capsys.readouterr()
    average = synthesize(run, sigma_rel=0.08)
    last = load_checked(run / "checkpoints" / "last.ckpt", allow=hyperparameter_classes())["state_dict"]
    blocks = section_blocks("gan", POSTHOC)
    assert len(blocks) == 2
    monkeypatch.chdir(tmp_path)
    for block in blocks:
        names: dict[str, Any] = {"__name__": "__main__"}
        exec(compile(block, "docs/recipes/gan.md", "exec"), names)
        loaded = names["gan"].state_dict()
        assert average and all(torch.equal(loaded[name], value) for name, value in average.items())
        assert all(torch.equal(loaded[name], value) for name, value in last.items() if name not in average)
    assert not all(torch.equal(last[name], value) for name, value in average.items())


def test_the_dqn_page_plays_a_greedy_episode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    train("dqn", tmp_path, "model.total_env_steps=1024", "model.learning_starts=256", "model.eval_every=512",
          "model.eval_episodes=2", "model.gradient_steps=16", "model.target_update_every=16", "model.hidden=32",
          "model.buffer_size=2048")  # fmt: skip
    printed, _ = run_page_block("dqn", tmp_path, monkeypatch, capsys)
    (line,) = printed.splitlines()
    assert re.fullmatch(r"return \d+\.0", line), line  # CartPole: +1 per step
