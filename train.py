"""The one entry point: ``python train.py +recipe=NAME [key=value ...]``; add ``-m`` to sweep.

Builds everything from the Hydra config (``conf/config.yaml`` plus ``conf/recipe/NAME.yaml``), trains,
and leaves in the run directory: ``metrics.csv``, ``checkpoints/``, ``summary.json`` and Hydra's
``.hydra/`` (the resolved config).

Resume after a crash: the same command again, plus ``ckpt_path=`` the crashed run's directory (its
``checkpoints/last.ckpt``) or a checkpoint file::

    python train.py +recipe=ema seed=1 ckpt_path=outputs/ema/2025-01-31_12-00-00.481516

The run continues in a new run directory and only reads the old one; it ends in the state the
uninterrupted run would have reached, bit for bit on CPU (``tests/test_resume_recipes.py``).

Bad input stops before training, writing no checkpoint and nothing into an earlier run, with exit status 2
and one line that names the key and what is allowed: no or an unknown recipe, a key the config does not
have or an unknown group option (both checked before Hydra makes a run directory), an out-of-range value
(checked where it is used, named by its config key), a required value left ``???`` (``data.root`` of
``data=images``), a ``ckpt_path`` that is missing, not a checkpoint, or
another recipe's or seed's.
"""

from __future__ import annotations

import difflib
import re
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hydra
from hydra.core.override_parser.types import ValueType
from omegaconf import DictConfig, ListConfig, OmegaConf

if TYPE_CHECKING:
    import lightning.pytorch as pl

CONF_DIR = Path(__file__).resolve().parent / "conf"
_RECIPE_ARG = re.compile(r"^\+{0,2}recipe=(?P<names>.*)$")
_HELP_FLAGS = {"-h", "--help", "--hydra-help", "--info", "-i"}
MATMUL_PRECISIONS = ("highest", "high", "medium")
_OTHER_CONFIG_FLAGS = ("-cp", "--config-path", "-cn", "--config-name", "-cd", "--config-dir", "--experimental-rerun")


def available_recipes() -> list[str]:
    """Recipe names, from ``conf/recipe/*.yaml``."""
    return sorted(path.stem for path in (CONF_DIR / "recipe").glob("*.yaml"))


def recipe_argument_error(argv: list[str]) -> str | None:
    """The one-line complaint about the ``+recipe=`` argument in ``argv``, or None when it is fine."""
    if _HELP_FLAGS.intersection(argv):
        return None
    known = available_recipes()
    listing = ", ".join(known)
    names = [m["names"] for arg in argv if (m := _RECIPE_ARG.match(arg))]
    if not names:
        return f"no recipe given: run `python train.py +recipe=NAME` with NAME one of: {listing}"
    for name in ",".join(names).split(","):
        if name.strip() not in known:
            return f"unknown recipe {name.strip()!r}: recipe must be one of: {listing}"
    return None


def override_error(argv: list[str]) -> str | None:
    """The one-line complaint about an override in ``argv`` that the config cannot take (bad syntax, a key it
    does not have, an unknown group option), or None. A sweep is checked with its first value."""
    if _HELP_FLAGS.intersection(argv) or any(a.split("=")[0] in _OTHER_CONFIG_FLAGS for a in argv):
        return None
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException, MissingConfigException
    from omegaconf.errors import OmegaConfBaseException

    parser, overrides = OverridesParser.create(), []
    for arg in (a for a in argv if not a.startswith("-") and ("=" in a or a.startswith("~"))):  # not flag values
        try:
            (override,) = parser.parse_overrides([arg])
        except HydraException as err:
            return f"cannot read the override {arg!r}: {str(err).splitlines()[0]} (Hydra's override syntax)"
        if not override.is_sweep_override():
            overrides.append(arg)
        elif override.value_type in (ValueType.SIMPLE_CHOICE_SWEEP, ValueType.RANGE_SWEEP):
            overrides.append(f"{override.get_key_element()}={next(override.sweep_string_iterator())}")
    try:
        with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
            cfg = compose("config", overrides=overrides)
    except MissingConfigException as err:
        group = (err.missing_cfg_file or "").rpartition("/")[0]
        if group and err.options:
            return f"no option {err.missing_cfg_file!r}: {group} must be one of: {', '.join(err.options)}"
        return " ".join(str(err).split())
    except HydraException as err:
        cause = err.__cause__
        if isinstance(cause, OmegaConfBaseException) and cause.full_key and cause.parent_node is not None:
            return _unknown_key(cause.full_key, [str(k) for k in cause.parent_node])
        return " ".join(str(err).splitlines()[0].split())
    missing = missing_keys(cfg)
    if missing:
        return f"{missing[0]} has no value (??? in its config file): give it one, {missing[0]}=..."
    return None


def missing_keys(node: DictConfig | ListConfig, prefix: str = "") -> list[str]:
    """The full keys whose value is ``???``, in config order; nothing is resolved (``${hydra:...}`` has no value
    before Hydra runs)."""
    found = []
    for key in node.keys() if isinstance(node, DictConfig) else range(len(node)):
        child = node._get_node(key)
        if OmegaConf.is_missing(node, key):
            found.append(f"{prefix}{key}")
        elif isinstance(child, (DictConfig, ListConfig)):
            found += missing_keys(child, f"{prefix}{key}.")
    return found


def _unknown_key(full_key: str, siblings: list[str]) -> str:
    parent, _, key = full_key.rpartition(".")
    near = difflib.get_close_matches(key, siblings, n=1)
    hint = f" (did you mean {parent + '.' if parent else ''}{near[0]}?)" if near else ""
    where = f"of {parent}" if parent else "at the top"
    return (
        f"{full_key} is not a config key{hint}; the keys {where} are: {', '.join(siblings)}; "
        f"to add a new key, write +{full_key}=..."
    )


def checkpoint_to_resume(cfg: DictConfig) -> str | None:
    """``cfg.ckpt_path`` as a checkpoint this run can resume from (a file, or the directory of a distributed checkpoint;
    a run directory means its ``checkpoints/last.ckpt``), or None; ``ValueError`` naming ``ckpt_path`` when there is no
    such checkpoint, it holds another recipe's or seed's run, or it is a distributed checkpoint and the trainer is not
    ``trainer=fsdp``."""
    value = cfg.get("ckpt_path")
    if value is None:
        return None
    from components import check_checkpoint
    from components.resume import DISTRIBUTED_METADATA

    path = Path(str(value))
    if path.is_dir() and not (path / DISTRIBUTED_METADATA).is_file():  # a run directory
        path = path / "checkpoints" / "last.ckpt"
    if not path.exists():
        raise ValueError(
            "ckpt_path must be a checkpoint file or a run directory with checkpoints/last.ckpt (a file, or under "
            f"trainer=fsdp a distributed checkpoint's directory): {value}"
        )
    strategy = str(OmegaConf.select(cfg, "trainer.strategy._target_", default=""))
    if path.is_dir() and not strategy.endswith("ModelParallelStrategy"):
        raise ValueError(
            f"ckpt_path {str(path)!r} is a distributed checkpoint (a directory of shards): resume it with trainer=fsdp"
        )

    try:
        check_checkpoint(path, cfg.recipe.name, cfg.get("seed"))
    except ValueError as err:
        raise ValueError(f"ckpt_path {str(path)!r} cannot resume this run: {err}") from err
    return str(path)


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
        if not isinstance(cause, ValueError):
            raise
        message = str(cause)
        if message.split(" ", 1)[0] in node:
            message = f"{key}.{message}"
        raise ValueError(message) from cause


# What a data module knows that a model may need: a model config that leaves one of these null gets the data module's.
DATA_FACTS = ("image_shape", "num_classes")


def data_facts(model_cfg: DictConfig, datamodule: object) -> dict[str, Any]:
    """The values of ``DATA_FACTS`` the model config leaves ``null``, from ``datamodule``; ``ValueError`` where the
    config sets one the data contradicts (``model.num_classes=5`` for a folder of 10 class subfolders, say)."""
    given, facts = OmegaConf.to_container(model_cfg, resolve=True), {}
    assert isinstance(given, dict)
    for key in DATA_FACTS:
        if key not in given or not hasattr(datamodule, key):
            continue
        known = getattr(datamodule, key)
        known = list(known) if isinstance(known, tuple) else known  # a list reads plainly in hparams.yaml
        if given[key] is None:
            facts[key] = known
        elif given[key] != known:
            raise ValueError(f"model.{key}={given[key]} but the data has {known}: leave model.{key} null to take it")
    return facts


def build(cfg: DictConfig) -> tuple[pl.Trainer, pl.LightningModule, pl.LightningDataModule | None]:
    """Seed, then instantiate the datamodule, model, callbacks, loggers and trainer named in ``cfg``."""
    import lightning.pytorch as pl
    import torch

    pl.seed_everything(cfg.seed, workers=True, verbose=False)  # the seed is in .hydra/config.yaml and summary.json
    precision = cfg.get("float32_matmul_precision", "highest")
    if precision not in MATMUL_PRECISIONS:
        raise ValueError(f"float32_matmul_precision must be one of {', '.join(MATMUL_PRECISIONS)}, got {precision!r}")
    torch.set_float32_matmul_precision(precision)
    datamodule = _instantiate(cfg, "data") if cfg.get("data") is not None else None
    # _convert_="all": plain lists and dicts, which a checkpoint's hyperparameters can hold (weights_only loads them)
    model = _instantiate(cfg, "model", _convert_="all", **data_facts(cfg.model, datamodule))
    callbacks = [_instantiate(cfg, f"callbacks.{k}") for k, c in (cfg.get("callbacks") or {}).items() if c is not None]
    loggers = [_instantiate(cfg, f"logger.{k}") for k, c in (cfg.get("logger") or {}).items() if c is not None]
    trainer = _instantiate(cfg, "trainer", callbacks=callbacks, logger=loggers or False)
    return trainer, model, datamodule


def ignore_expected_warnings() -> None:
    """Expected, not actionable: Hydra's run directory already holds ``.hydra/`` when the CSV logger opens it;
    Lightning 2.6 calls a torch pytree API that torch 2.13 deprecates; and on a machine with more than three
    cores Lightning advises more DataLoader workers, while each recipe chooses its workers on purpose (the
    digits are in memory, so workers would only add inter-process copies; ``pinned`` has ``data.num_workers``); and
    under ``trainer=fsdp``, ``torch.distributed.checkpoint`` announcing that it rewrites ``last.ckpt``. Set in the
    process that trains, which for a submitit launcher is a job that never runs this module's top
    level."""
    warnings.filterwarnings("ignore", message=r"Experiment logs directory .* exists and is not empty")
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    warnings.filterwarnings("ignore", message=r"The '\w+' does not have many workers which may be a bottleneck")
    # Under trainer=fsdp, torch.distributed.checkpoint announces that it rewrites last.ckpt, which it does on purpose.
    warnings.filterwarnings("ignore", message=r"Detected an existing checkpoint in .*, overwriting since")


def train(cfg: DictConfig) -> dict[str, Any]:
    """Check ``ckpt_path``, build, fit, and return the final logged metrics as floats."""
    from hydra.errors import InstantiationException

    ignore_expected_warnings()

    try:
        ckpt_path = checkpoint_to_resume(cfg)
        trainer, model, datamodule = build(cfg)
    except (InstantiationException, ValueError) as err:
        cause = err.__cause__ if isinstance(err, InstantiationException) and err.__cause__ else err
        print(f"error: {cause}", file=sys.stderr)
        sys.exit(2)
    from components import CheckpointMismatch

    try:
        trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True)
    except CheckpointMismatch as err:  # found only while restoring it: a sharded EMA spread otherwise than the model
        if trainer.is_global_zero:
            print(f"error: ckpt_path {ckpt_path!r} cannot resume this run: {err}", file=sys.stderr)
        sys.exit(2)
    if trainer.is_global_zero:
        print(f"outputs: {cfg.paths.output_dir} (metrics.csv, checkpoints/, summary.json)")
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    if cfg.get("recipe") is None:
        print(recipe_argument_error([]), file=sys.stderr)
        sys.exit(2)
    metrics = train(cfg)
    return metrics.get(cfg.recipe.get("monitor") or "")


if __name__ == "__main__":
    problem = recipe_argument_error(sys.argv[1:]) or override_error(sys.argv[1:])
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    main()
