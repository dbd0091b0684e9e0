"""Shared test helpers: device parametrisation (CUDA cases marked ``gpu`` and skipped without a GPU)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

# The suite runs two workers, each starting processes that train with two OpenMP threads, on as few as 2 cores. GNU
# OpenMP's default threads spin while they wait for each other; sharing cores, they spin on the core the other needs
# (a small training step measured 2.6-3.4 ms with two such processes side by side, 0.9-1.3 ms with passive waits).
# Set before torch loads OpenMP, here and in every process a test starts (they inherit it); a value you set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from tests.ports import free_port  # each multi-process test's rendezvous: a port no other allocation gets

ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = ROOT / "conf"
QUIET = ("trainer.enable_progress_bar=false", "trainer.enable_model_summary=false")
# For tests that are CPU-only by nature (bit-for-bit repeatability and resume, which the manual claims for CPU runs):
# they run on the CPU even where a GPU is present, instead of on the device that `accelerator: auto` picks.
ON_CPU = "trainer=cpu"
# The recipes' copy tests run twice: as configured, and on a folder of 16x16 images (`{images}`, filled in by the test)
# with the convolutional networks, chosen by configuration alone; each test adds what its recipe needs on top.
OWN_IMAGES = (
    "data=images", "data.root={images}", "data.image_size=16", "data.num_workers=0", "model.network=conv",
    "model.conv_width=8",
)  # fmt: skip

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, CUDA]),
]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    """Each test using it runs on CPU, and on CUDA when a GPU is present."""
    return torch.device(request.param)


@pytest.fixture(autouse=True)
def _no_dispatch_mode_outlives_a_test() -> Iterator[None]:
    """CopyAudit and MemoryProbe push dispatch modes; one left active would skew every later test."""
    yield
    assert not _get_current_dispatch_mode_stack(), "a TorchDispatchMode was left active"


def compose_config(*overrides: str, output_dir: Path) -> DictConfig:
    """The config ``train.py`` would build for these overrides, writing into ``output_dir``."""
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=[f"paths.output_dir={output_dir}", *overrides])


def write_images(root: Path, count: int, size: int = 16, channels: int = 3, classes: int = 0) -> Path:
    """``count`` PNG files of ``size`` x ``size`` pixels (RGB, or grey for ``channels=1``) in ``root``: in ``classes``
    subfolders (``class0``, ``class1``...) taken in turn, or directly in ``root`` when ``classes`` is 0. Class ``c``
    is a bright square at a place of its own on noise, so a classifier can tell the classes apart."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for i in range(count):
        label = i % classes if classes else i % 4
        pixels = rng.integers(0, 60, (size, size, channels), dtype=np.uint8)
        corner = (label % 2) * size // 2, (label // 2 % 2) * size // 2
        pixels[corner[0] : corner[0] + size // 2, corner[1] : corner[1] + size // 2] = 220
        folder = root / f"class{label}" if classes else root
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels[:, :, 0] if channels == 1 else pixels).save(folder / f"{i:04d}.png")
    return root


def write_own_images(root: Path, recipe: str, count: int, classes: int = 0) -> Path:
    """``write_images`` for the ``own images`` cases of ``+recipe=RECIPE``: of the size and channels that the
    project's config, as its owner has it, gives that case (``OWN_IMAGES`` over ``conf/``: a starter whose default is
    a grey folder gets grey images), or 16x16 RGB where it leaves them to the files."""
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"+recipe={recipe}", *(o.format(images=root) for o in OWN_IMAGES)])
    size, channels = cfg.data.image_size or 16, cfg.data.channels or 3
    return write_images(root, count, size=size, channels=channels, classes=classes)


def warning_lines(stderr: str) -> list[str]:
    """The Python warnings in a run's stderr (``path.py:LINE: message``), after checking that Lightning's own
    messages reached it (so an empty list means a clean console, not a stderr that was lost)."""
    assert "GPU available" in stderr, stderr[-3000:]
    return re.findall(r"^\S+\.py:\d+: .*$", stderr, re.MULTILINE)


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a child process that imports this checkout first. The rest of ``PYTHONPATH`` is kept: a
    machine may provide packages there (the GPU check installs hydra-core and gymnasium into a directory on it)."""
    kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *kept]), **extra}


def env_without_checkout() -> dict[str, str]:
    """The environment without anything that would put the main repository on the import path (other ``PYTHONPATH``
    entries stay: a machine may provide packages there, as the GPU check does)."""
    kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != ROOT]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, "PYTHONPATH": os.pathsep.join(kept)} if kept else env


def run_rank_script(script: str, out: Path, timeout: int = 300) -> list[dict]:
    """``python tests/workers/SCRIPT OUT`` with a port of its own (``TEST_PORT``); what each rank saved as
    ``OUT/rank{r}.pt``, in rank order."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "workers" / script), str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=child_env(TEST_PORT=free_port()),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return [torch.load(path, weights_only=True) for path in sorted(out.glob("rank*.pt"))]


def run_train(*args: str, timeout: int = 900) -> subprocess.CompletedProcess[str]:
    """``python train.py ARGS`` in a subprocess from the repository root, output captured; a port of its own for the
    rendezvous should it start several processes (``MASTER_PORT``)."""
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
        env=child_env(PYTHONUNBUFFERED="1", MASTER_PORT=free_port()),
    )  # fmt: skip


# The test files that take longest (on 2 cores, 2026-12-01), first: pytest-xdist (`--dist loadfile`) hands whole
# files to its two workers in collection order, so a long file collected last would keep one worker busy while the
# other idles. Files not named keep their order after these. (Paths under tests/ without the suffix: a starter's
# generator reads a string ending in .py as a file the module needs.)
LONGEST_FIRST = (
    "recipes/test_resume", "tools/test_new_project", "lightning/test_atomic_sharded_checkpoint", "recipes/test_train",
    "distributed/test_fsdp", "recipes/test_ema", "tools/test_benchmarks", "distributed/test_ddp",
    "recipes/test_bad_input", "tools/test_figures", "recipes/test_pinned", "lightning/test_ema_weights",
    "distributed/test_sharded_callback", "distributed/test_prefetch_ddp", "distributed/test_sharded",
)  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    tests = Path(__file__).resolve().parent

    def key(item: pytest.Item) -> int:
        path = Path(item.path)
        name = path.relative_to(tests).with_suffix("").as_posix() if path.is_relative_to(tests) else path.stem
        return rank.get(name, len(rank))

    items.sort(key=key)  # stable: a file's tests keep their order


def fit_on_a_uniform_folder(recipe: str, size: int, channels: int, tmp_path: Path, *extra: str) -> Any:
    """``+recipe=RECIPE data=images data.root=DIR`` and no data or network override, on a folder of ``size`` x ``size``
    images with ``channels``: built as ``train.py`` builds it and fitted for 2 steps. Returns the model. The control:
    the size and channels ``conf/data/images.yaml`` used to set (64, RGB) refuse the folder (``ValueError``, a line
    naming a file and the override)."""
    from recipes.build import build

    root = write_images(tmp_path / "images", 12, size=size, channels=channels, classes=2)
    args = [f"+recipe={recipe}", "data=images", f"data.root={root}", ON_CPU, *QUIET, "trainer.max_steps=2"]
    args += ["trainer.max_epochs=-1", "trainer.limit_val_batches=0", *extra]
    trainer, model, datamodule = build(compose_config(*args, output_dir=tmp_path / "run"))
    assert model.hparams.image_shape == [channels, size, size]
    trainer.fit(model, datamodule=datamodule)
    assert trainer.global_step == 2
    with pytest.raises(ValueError, match=r"0000\.png is .*data\.(image_size=64 wants 64x64|channels=3 wants RGB)"):
        build(compose_config(*args, "data.image_size=64", "data.channels=3", output_dir=tmp_path / "old"))
    return model
