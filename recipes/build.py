"""How ``train.py`` builds a run from its Hydra config: the seed, then the data module, the model (with what it
needs to know of the data), the callbacks, the loggers and the trainer, each instantiated from its config node.

A ``ValueError`` an object raises about one of its arguments comes out naming the config key (``decay must be ...``
from ``callbacks.ema`` becomes ``callbacks.ema.decay must be ...``), for ``train.py`` to print as one line; so does an
allocation that fails while a node is instantiated, naming the node, the bytes and the keys given for it
(``recipes.allocation``). Every number and flag is checked before anything is built (``recipes.config_values``).
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Sized
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from recipes.allocation import overrides_below, too_big
from recipes.config_values import check_values

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["DATA_FACTS", "build", "data_facts", "ignore_expected_warnings"]

MATMUL_PRECISIONS = ("highest", "high", "medium")


def _instantiate(cfg: DictConfig, key: str, **kwargs: Any) -> Any:
    """``instantiate(cfg[key])``; a ``ValueError`` about one of its arguments is re-raised naming the config key
    (``decay must be ...`` from ``callbacks.ema`` becomes ``callbacks.ema.decay must be ...``)."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    node = OmegaConf.select(cfg, key)
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as err:
        cause = err.__cause__
        given = overrides_below(key)
        what = f"{key} (with {', '.join(given)})" if given else key
        line = too_big(cause, what, " or ".join(o.split("=")[0] for o in given) or f"the sizes of {key}")
        if line is not None:
            raise ValueError(line) from cause
        if not isinstance(cause, ValueError):
            raise
        message = str(cause)
        if message.split(" ", 1)[0] in node:
            message = f"{key}.{message}"
        raise ValueError(message) from cause


# What a data module knows that a model may need: its images' shape, its classes' number and names, and how a batch
# row is made from an image file (``recipes.inference``), so that a checkpoint's hyperparameters can classify a file.
DATA_FACTS = ("image_shape", "num_classes", "classes", "input_format")


def data_facts(model_cfg: DictConfig, datamodule: object) -> dict[str, Any]:
    """The values of ``DATA_FACTS`` from ``datamodule`` that the model config leaves ``null``, or does not name while
    the model's constructor takes them; ``ValueError`` where the config sets one the data contradicts
    (``model.num_classes=5`` for a folder of 10 class subfolders, say)."""
    from hydra.utils import get_object

    given, facts = OmegaConf.to_container(model_cfg, resolve=True), {}
    assert isinstance(given, dict)
    takes = inspect.signature(get_object(given["_target_"])).parameters if "_target_" in given else {}
    for key in DATA_FACTS:
        if not (key in given or key in takes) or not hasattr(datamodule, key):
            continue
        known = getattr(datamodule, key)
        known = list(known) if isinstance(known, tuple) else known  # a list reads plainly in hparams.yaml
        if given.get(key) is None:
            facts[key] = known
        elif given[key] != known:
            raise ValueError(f"model.{key}={given[key]} but the data has {known}: leave model.{key} null to take it")
    return facts


def build(cfg: DictConfig) -> tuple[pl.Trainer, pl.LightningModule, pl.LightningDataModule | None]:
    """Check every number and flag of ``cfg`` (``recipes.config_values``), seed, then instantiate the datamodule,
    model, callbacks, loggers and trainer named in ``cfg``."""
    import lightning.pytorch as pl
    import torch

    check_values(cfg)  # every number and flag, named by its key: before any of them is used
    pl.seed_everything(cfg.seed, workers=True, verbose=False)  # the seed is in .hydra/config.yaml and summary.json
    precision = cfg.get("float32_matmul_precision", "highest")
    if precision not in MATMUL_PRECISIONS:
        raise ValueError(f"float32_matmul_precision must be one of {', '.join(MATMUL_PRECISIONS)}, got {precision!r}")
    torch.set_float32_matmul_precision(precision)
    datamodule = _instantiate(cfg, "data") if cfg.get("data") is not None else None
    # _convert_="all": plain lists and dicts, which a checkpoint's hyperparameters can hold (weights_only loads them)
    model = _instantiate(cfg, "model", _convert_="all", **data_facts(cfg.model, datamodule))
    callbacks = [_instantiate(cfg, f"callbacks.{k}") for k, c in (cfg.get("callbacks") or {}).items() if c is not None]
    callbacks = [c for c in callbacks if c is not None]  # a factory may make none: progress_bar when bars are off
    loggers = [_instantiate(cfg, f"logger.{k}") for k, c in (cfg.get("logger") or {}).items() if c is not None]
    trainer = _instantiate(cfg, "trainer", callbacks=callbacks, logger=loggers or False)
    _log_within_an_epoch(trainer, datamodule)
    return trainer, model, datamodule


def _log_within_an_epoch(trainer: pl.Trainer, datamodule: object) -> None:
    """Lower ``trainer.log_every_n_steps`` to the batches of one epoch where an epoch has fewer: a small folder's
    epoch would otherwise log no training step, and Lightning warns that it will not. A longer epoch keeps the
    configured cadence (the digits' runs log as they did), and so does a data module that cannot tell its training
    set's size and batch size before it is set up."""
    train_set, batch_size = getattr(datamodule, "train_set", None), getattr(datamodule, "batch_size", None)
    if not isinstance(train_set, Sized) or not isinstance(batch_size, int):
        return
    # Per rank, as Lightning counts them: a distributed sampler gives each rank ceil(size / ranks) samples.
    batches = math.ceil(math.ceil(len(train_set) / trainer.world_size) / batch_size)
    limit = trainer.limit_train_batches
    batches = min(batches, limit) if isinstance(limit, int) else int(batches * limit)
    trainer.log_every_n_steps = max(1, min(trainer.log_every_n_steps, batches))


def ignore_expected_warnings(model: object = None) -> None:
    """Expected, not actionable: Hydra's run directory already holds ``.hydra/`` when the CSV logger opens it;
    Lightning 2.6 calls a torch pytree API that torch 2.13 deprecates; and on a machine with more than three
    cores Lightning advises more DataLoader workers, while each recipe chooses its workers on purpose (the
    digits are in memory, so workers would only add inter-process copies; ``pinned`` has ``data.num_workers``); and
    under ``trainer=fsdp``, ``torch.distributed.checkpoint`` announcing that it rewrites ``last.ckpt``. Plus the
    messages ``model`` lists in its ``expected_warnings`` (regular expressions), which it causes on purpose. Set in
    the process that trains, which for a submitit launcher is a job that never runs this module's top level; no
    recipe sets a filter when it is imported."""
    warnings.filterwarnings("ignore", message=r"Experiment logs directory .* exists and is not empty")
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    warnings.filterwarnings("ignore", message=r"The '\w+' does not have many workers which may be a bottleneck")
    # Under trainer=fsdp, torch.distributed.checkpoint announces that it rewrites last.ckpt, which it does on purpose.
    warnings.filterwarnings("ignore", message=r"Detected an existing checkpoint in .*, overwriting since")
    for message in getattr(model, "expected_warnings", ()):
        warnings.filterwarnings("ignore", message=message)
