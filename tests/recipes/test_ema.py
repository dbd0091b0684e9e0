"""Recipe `ema`: the default run's EMA beats the live weights; a training step's EMA update allocates
nothing and the loop keeps no memory; the shadow never joins the model or the optimizer.

The step test takes the model and the data from the project's configuration (``conf/recipe/ema.yaml`` composed by
Hydra, as ``train.py`` does): the recipe's own (``as configured``), and a small CNN on a folder of labelled images
(``own images``), chosen by configuration alone. No test here pins a network's size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from copy_correct.lightning import EMAWeights, StepProbe
from copy_correct.probes import shares_storage
from recipes.build import build
from recipes.networks import ConvClassifier
from tests.conftest import (
    OWN_IMAGES,
    QUIET,
    compose_config,
    fit_on_a_uniform_folder,
    run_train,
    warning_lines,
    write_own_images,
)

CONFIGS = [
    pytest.param((), id="as configured"),
    pytest.param((*OWN_IMAGES, "model.lr=0.05"), id="own images"),
]


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Labelled 16x16 images (RGB, or grey where the project's default data is), three classes in subfolders: another
    data set, for another network."""
    return write_own_images(tmp_path_factory.mktemp("labelled"), "ema", 60, classes=3)


def test_default_run_ema_accuracy_at_least_live(tmp_path: Path) -> None:
    result = run_train("+recipe=ema", "trainer.enable_progress_bar=false", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert warning_lines(result.stderr) == []
    summary = json.loads((tmp_path / "summary.json").read_text())
    live, ema = summary["metrics"]["val/acc"], summary["metrics"]["val/acc_ema"]
    print(f"ema recipe: val/acc {live:.4f}, val/acc_ema {ema:.4f} in {summary['wall_s']} s")
    assert summary["recipe"] == "ema"
    assert ema >= live
    assert Path(summary["checkpoints"]["best"]).is_file()  # monitored val/acc_ema


@pytest.mark.parametrize("overrides", CONFIGS)
def test_training_step_ema_update_allocates_nothing_and_memory_stays_flat(
    overrides: tuple[str, ...], image_folder: Path, tmp_path: Path
) -> None:
    args = [o.format(images=image_folder) for o in overrides]
    cfg = compose_config(
        "+recipe=ema", *QUIET, *args, "trainer.max_steps=70", "trainer.max_epochs=-1", "trainer.limit_val_batches=0",
        output_dir=tmp_path,
    )  # fmt: skip
    trainer, model, datamodule = build(cfg)
    probe = StepProbe(start=5, steps=60)
    trainer.callbacks.append(probe)  # after EMAWeights: the audited batch includes the EMA update
    trainer.fit(model, datamodule=datamodule)
    floating = sum(1 for t in model.state_dict().values() if t.is_floating_point())
    assert probe.audit.count("_foreach_lerp_") == floating
    assert probe.growth_bytes <= 64, probe.report()  # a few scalars Lightning keeps; nothing per step
    (ema,) = [c for c in trainer.callbacks if isinstance(c, EMAWeights)]
    assert ema.ema is not None
    optimized = [p for group in trainer.optimizers[0].param_groups for p in group["params"]]
    for shadow in ema.ema.shadow.values():
        assert not shadow.requires_grad
        assert not any(shares_storage(shadow, t) for t in [*model.parameters(), *model.buffers(), *optimized])
    assert {id(p) for p in model.parameters()} == {id(p) for p in optimized}  # the optimiser has the model's, no more


@pytest.mark.parametrize(("size", "channels"), [(32, 1), (48, 3)])
def test_a_uniform_folder_trains_with_data_root_alone(size: int, channels: int, tmp_path: Path) -> None:
    """Size and channels from the files, the CNN for 32 and 48 pixels; control in ``fit_on_a_uniform_folder``."""
    assert isinstance(fit_on_a_uniform_folder("ema", size, channels, tmp_path).net, ConvClassifier)
