"""Recipe `pinned`: the default run learns and reports its loading figures; the prefetcher switch changes where
the copy happens and nothing else; the augmentation never writes the source images. (Bad settings:
tests/test_bad_input.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.utils.data import DataLoader

import train
from components import DeviceDataLoader
from recipes.digits import load_digits_split
from recipes.pinned import AugmentedDigits, normalize
from tests.conftest import QUIET, compose_config, run_train, warning_lines


def test_default_run_learns_and_reports_loading_figures(tmp_path: Path) -> None:
    result = run_train("+recipe=pinned", "trainer.enable_progress_bar=false", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert warning_lines(result.stderr) == []
    metrics = json.loads((tmp_path / "summary.json").read_text())["metrics"]
    print(
        f"pinned recipe: val/acc {metrics['val/acc']:.4f}, {metrics['perf/samples_per_s']:.0f} samples/s, "
        f"waiting {metrics['perf/data_wait_fraction']:.1%}"
    )
    assert metrics["val/acc"] >= 0.9
    assert metrics["perf/samples_per_s"] > 0
    assert 0 <= metrics["perf/data_wait_fraction"] < 1


def _short_run(tmp_path: Path, *overrides: str) -> dict[str, float]:
    cfg = compose_config(
        "+recipe=pinned", *QUIET, "trainer.max_epochs=2", "data.num_workers=0", *overrides, output_dir=tmp_path
    )
    trainer, model, datamodule = train.build(cfg)
    trainer.fit(model, datamodule=datamodule)
    loader = trainer.train_dataloader
    assert isinstance(loader, DeviceDataLoader) == cfg.data.prefetch
    return {k: float(v) for k, v in trainer.callback_metrics.items() if not k.startswith("perf/")}


def test_the_prefetch_switch_changes_where_the_copy_happens_and_nothing_else(tmp_path: Path) -> None:
    with_prefetcher = _short_run(tmp_path / "on", "data.prefetch=true")
    without = _short_run(tmp_path / "off", "data.prefetch=false")
    assert with_prefetcher == without
    # Control: the comparison is sharp enough to see another seed.
    assert _short_run(tmp_path / "seed1", "data.prefetch=true", "seed=1") != with_prefetcher


def test_augmented_items_are_new_uint8_images_and_the_source_is_untouched() -> None:
    train_set, _ = load_digits_split()
    images, labels = train_set.tensors
    before, version = images.clone(), images._version
    augmented = AugmentedDigits(images, labels, size=32, max_shift=4)
    plain = AugmentedDigits(images, labels, size=32, augment=False)
    image, label = augmented[0]
    assert image.dtype == torch.uint8 and image.shape == (1, 32, 32) and label == labels[0]
    assert torch.equal(plain[3][0], plain[3][0])  # no augmentation: the same image every time
    torch.manual_seed(0)
    assert not all(torch.equal(augmented[3][0], augmented[3][0]) for _ in range(5))  # augmentation: random
    assert torch.equal(images, before) and images._version == version
    batch = next(iter(DataLoader(plain, batch_size=8)))
    normalized, _ = normalize(batch)
    assert normalized.dtype == torch.float32 and batch[0].dtype == torch.uint8  # a new tensor; the batch kept
