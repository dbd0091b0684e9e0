"""What ``train.py`` checks before it builds a run: the ``+recipe=`` argument and the overrides (before Hydra makes a
run directory), and the checkpoint a resumed run starts from; the error type for bad input found once training runs
(``BadInput``); and the run directory a refused run leaves behind (``discard_refused_run_dir``).

Each check answers with one line naming the key and what is allowed, or ``None``; ``train.py`` prints it and exits
with status 2 (``docs/guides/bad-input.md``).
"""

from __future__ import annotations

import difflib
import os
import re
import shutil
from pathlib import Path

from hydra.core.override_parser.types import ValueType
from omegaconf import DictConfig, ListConfig, OmegaConf

__all__ = [
    "CONF_DIR",
    "BadInput",
    "available_recipes",
    "checkpoint_to_resume",
    "discard_refused_run_dir",
    "missing_keys",
    "override_error",
    "recipe_argument_error",
    "remove_empty_files",
]

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
_RECIPE_ARG = re.compile(r"^\+{0,2}recipe=(?P<names>.*)$")
_HELP_FLAGS = {"-h", "--help", "--hydra-help", "--info", "-i"}
_OTHER_CONFIG_FLAGS = ("-cp", "--config-path", "-cn", "--config-name", "-cd", "--config-dir", "--experimental-rerun")


class BadInput(ValueError):
    """Bad input named in one line, found where the input is read, possibly once training runs (an image file that a
    DataLoader worker cannot decode); ``train.py`` prints the line and exits with status 2.

    A DataLoader re-raises a worker's exception in the main process as the same type, made from the worker's whole
    traceback, whose last line is ``recipes.launch.BadInput: <the line>``: the message keeps that line only.
    """

    def __init__(self, message: str) -> None:
        last = message.strip().splitlines()[-1] if message.strip() else message
        super().__init__(last.removeprefix(f"{type(self).__module__}.{type(self).__qualname__}: "))


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
    from copy_correct.lightning import check_checkpoint
    from copy_correct.lightning.resume import DISTRIBUTED_METADATA

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


# What Hydra writes into a run directory before the task starts: the resolved config, and the job's log file.
HYDRA_FILES = ("config.yaml", "hydra.yaml", "overrides.yaml")


def discard_refused_run_dir() -> Path | None:
    """Under ``@hydra.main``: remove this run's directory when it holds only what Hydra wrote before the task started
    (``.hydra/`` and the job's log file), which is what a run refused before training leaves, and its parents below
    the working directory that are then empty; return it, or ``None`` when there is none or it holds anything else
    (an earlier run's files, a checkpoint)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    hydra_cfg = HydraConfig.get()
    run_dir, subdir = Path(hydra_cfg.runtime.output_dir), hydra_cfg.output_subdir
    if not run_dir.is_dir() or {p.name for p in run_dir.iterdir()} - {subdir, f"{hydra_cfg.job.name}.log"}:
        return None
    made = run_dir / subdir if subdir is not None else None
    if made is not None and made.is_dir() and {p.name for p in made.iterdir()} - set(HYDRA_FILES):
        return None
    shutil.rmtree(run_dir)
    # The parents that are empty now (``outputs/RECIPE/`` of a first run), up to the working directory, never above.
    cwd = Path(hydra_cfg.runtime.cwd).resolve()
    for parent in run_dir.resolve().parents:
        if parent == cwd or not parent.is_relative_to(cwd) or any(parent.iterdir()) or parent.is_mount():
            break
        parent.rmdir()
    return run_dir


def remove_empty_files(run_dir: str | os.PathLike[str]) -> list[Path]:
    """Remove the 0-byte files under ``run_dir`` (what writes that found the disk full left: Lightning's
    ``hparams.yaml``, Hydra's job log) and return them; files with bytes, checkpoints among them, stay."""
    removed = []
    for path in sorted(Path(run_dir).rglob("*")):
        if path.is_file() and not path.is_symlink() and path.stat().st_size == 0:
            path.unlink()
            removed.append(path)
    return removed
