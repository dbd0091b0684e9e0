"""Recipe `pinned`: the default run learns and reports its loading figures; the prefetcher switch changes where
the copy happens and nothing else; the augmentation never writes the source images. (Bad settings:
tests/recipes/test_bad_input.py.)"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from copy_correct import DeviceDataLoader
from copy_correct.probes import CopyAudit, shares_storage
from recipes.build import build
from recipes.data.digits import load_digits_split
from recipes.data.pinned_digits import AugmentedDigits, PinnedDigitsDataModule, normalize
from recipes.pinned import GridMean
from tests.conftest import CUDA, QUIET, compose_config, run_train, warning_lines


@pytest.mark.slow  # the full default run, about 40 s on 2 cores
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


# The GPU-scale configuration at CPU-test size: the same store, windows and device-side augmentation.
SMALL_STORE = (
    "+pinned=gpu_scale", "data.size=32", "data.batch_size=64", "data.store_size=256", "data.batches_per_epoch=4",
    "data.max_shift=4", "trainer.log_every_n_steps=2",
)  # fmt: skip
SOURCES = {"workers": (), "store": SMALL_STORE}


@pytest.fixture
def deterministic_algorithms_restored() -> Iterator[None]:
    """``trainer.deterministic=true`` switches torch's deterministic algorithms on for the whole process."""
    flags = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    cudnn = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    yield
    torch.use_deterministic_algorithms(flags[0], warn_only=flags[1])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn


def _short_run(tmp_path: Path, *overrides: str) -> dict[str, float]:
    """Two epochs on whatever device the machine has (a GPU when there is one), with deterministic algorithms: on
    a GPU, cuDNN's and the pooling kernels' nondeterministic sums would make any two runs differ."""
    cfg = compose_config(
        "+recipe=pinned", *QUIET, "trainer.max_epochs=2", "data.num_workers=0", "trainer.deterministic=true",
        *overrides, output_dir=tmp_path,
    )  # fmt: skip
    trainer, model, datamodule = build(cfg)
    trainer.fit(model, datamodule=datamodule)
    loader = trainer.train_dataloader
    assert isinstance(loader, DeviceDataLoader) == cfg.data.prefetch
    return {k: float(v) for k, v in trainer.callback_metrics.items() if not k.startswith("perf/")}


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.usefixtures("deterministic_algorithms_restored")
def test_the_prefetch_switch_changes_where_the_copy_happens_and_nothing_else(tmp_path: Path, source: str) -> None:
    with_prefetcher = _short_run(tmp_path / "on", "data.prefetch=true", *SOURCES[source])
    without = _short_run(tmp_path / "off", "data.prefetch=false", *SOURCES[source])
    assert with_prefetcher == without
    # Control: the comparison is sharp enough to see another seed.
    assert _short_run(tmp_path / "seed1", "data.prefetch=true", "seed=1", *SOURCES[source]) != with_prefetcher


def _store_module(tmp_path: Path, *overrides: str) -> PinnedDigitsDataModule:
    cfg = compose_config("+recipe=pinned", *QUIET, "data.prefetch=false", "data.num_workers=0", *overrides,
                         output_dir=tmp_path)  # fmt: skip
    _, _, datamodule = build(cfg)
    return datamodule


def test_store_batches_are_slices_of_one_store_and_cost_the_host_no_copy(tmp_path: Path) -> None:
    datamodule = _store_module(tmp_path, *SMALL_STORE)
    datamodule.setup("fit")
    batches = iter(datamodule.train_dataloader())
    with CopyAudit() as audit:
        images, labels = next(batches)
    assert audit.bytes_allocated == 0, audit.summary()
    assert images.shape == (64, 3, 32, 32) and images.dtype == torch.uint8 and labels.shape == (64,)
    assert shares_storage(images, datamodule.train_set.images) and shares_storage(labels, datamodule.train_set.labels)
    # Control: from the workers' source every batch is made anew, and the loader stacks the items into it.
    workers = iter(_store_module(tmp_path / "workers").train_dataloader())
    with CopyAudit() as made:
        next(workers)
    assert made.bytes_allocated >= 128 * 64 * 64  # at least the uint8 batch itself, once


def test_store_training_order_is_seeded_and_resumable(tmp_path: Path) -> None:
    first, second = (_store_module(tmp_path / name, *SMALL_STORE) for name in ("a", "b"))
    for datamodule in (first, second):
        datamodule.setup("fit")
    assert torch.equal(first.train_set.images, second.train_set.images)  # the same render for the same seed
    list(first.train_dataloader().sampler)  # one epoch drawn
    second.load_state_dict(first.state_dict())
    assert list(first.train_dataloader().sampler) == list(second.train_dataloader().sampler)


@pytest.mark.gpu
@CUDA
def test_on_a_gpu_the_store_is_pinned_once_and_batches_are_pinned_slices_of_it(tmp_path: Path) -> None:
    datamodule = _store_module(tmp_path, *SMALL_STORE)
    datamodule.trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cuda", 0)))
    datamodule.setup("fit")
    store = datamodule.train_set.images
    assert store.is_pinned()
    loader = datamodule.train_dataloader()
    assert loader.pin_memory
    images, _ = next(iter(loader))
    assert images.is_pinned() and shares_storage(images, store)  # pin_memory handed the pinned slice on: no copy


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
    tinted, _ = AugmentedDigits(images, labels, size=32, channels=3)[0]
    assert tinted.shape == (3, 32, 32) and not torch.equal(tinted[0], tinted[1])  # three channels, tinted apart
    assert torch.equal(images, before) and images._version == version
    batch = next(iter(DataLoader(plain, batch_size=8)))
    normalized, _ = normalize(batch)
    assert normalized.dtype == torch.float32 and batch[0].dtype == torch.uint8  # a new tensor; the batch kept


@pytest.mark.parametrize("size", [1, 3, 8, 14, 64])
def test_grid_mean_is_adaptive_average_pooling(size: int) -> None:
    x = torch.randn(2, 3, size, size + 5)
    torch.testing.assert_close(GridMean(4)(x), nn.AdaptiveAvgPool2d(4)(x), rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@CUDA
@pytest.mark.usefixtures("deterministic_algorithms_restored")
def test_grid_mean_backpropagates_under_deterministic_algorithms_where_the_pooling_kernel_cannot() -> None:
    torch.use_deterministic_algorithms(True)
    x = torch.randn(2, 3, 14, 14, device="cuda", requires_grad=True)
    GridMean(4)(x).sum().backward()
    assert x.grad is not None
    with pytest.raises(RuntimeError, match="does not have a deterministic implementation"):  # the control
        nn.AdaptiveAvgPool2d(4)(x).sum().backward()


def test_the_data_module_says_the_shape_of_the_images_it_makes_not_the_digits() -> None:
    data = PinnedDigitsDataModule(size=32, channels=3, max_shift=2, num_workers=0)
    images, _ = data.train_set[0]
    assert data.image_shape == tuple(images.shape) == (3, 32, 32)
