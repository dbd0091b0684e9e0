"""The one entry point: ``python train.py +recipe=NAME [key=value ...]``; add ``-m`` to sweep.

Builds everything from the Hydra config (``conf/config.yaml`` plus ``conf/recipe/NAME.yaml``), trains,
and leaves in the run directory: ``metrics.csv``, ``checkpoints/``, ``summary.json`` and Hydra's
``.hydra/`` (the resolved config). A run over several processes (``trainer=ddp``, ``fsdp``) then ends its process group
on every rank before it exits (``recipes/process_group.py``).

Resume after a crash: the same command again, plus ``ckpt_path=`` the crashed run's directory (its
``checkpoints/last.ckpt``) or a checkpoint file::

    python train.py +recipe=ema seed=1 ckpt_path=outputs/ema/2025-01-31_12-00-00.481516

The run continues in a new run directory and only reads the old one; it ends in the state the
uninterrupted run would have reached, bit for bit on CPU (``tests/recipes/test_resume.py``).

Bad input stops before training, writing no checkpoint and nothing into an earlier run, with exit status 2
and one line that names the key and what is allowed: no or an unknown recipe, a key the config does not
have or an unknown group option (both checked before Hydra makes a run directory), a number or flag of the wrong type,
NaN, infinite or out of range (every one in ``conf/``, checked before anything is built: ``recipes/config_values.py``;
the parts refine the ranges where they use them, named by the config key), a size that cannot be allocated (the
bytes and the key: ``recipes/allocation.py``), a required value left ``???`` (``data.root`` of
``data=images``), a ``ckpt_path`` that is missing, not a checkpoint, or
another recipe's or seed's. Bad input found once training runs (an image file that a DataLoader worker cannot
decode, with ``data.verify=false``) stops the same way. A refused run leaves no run directory: the one Hydra made for
it, holding only ``.hydra/`` and the log file, is removed, with the folders above it that are then empty, up to the
working directory (an earlier run's directory is left as it is).

A run whose training loss or weights turn NaN or Inf (a finite ``model.lr=1e30``) stops with status 3 and one line
naming the step (``NonFiniteStop``, ``callbacks.nonfinite_stop``), before any checkpoint holds them: its
``checkpoints/`` keep the last good state. A full disk stops the run with status 2 and one line naming the path, the
bytes and the space free (``copy_correct.files.disk_full``): the last good checkpoint is kept, the temporary file
removed, and the files that a refused write left empty (Lightning's ``hparams.yaml``, Hydra's log) are removed.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, NoReturn

import hydra
from omegaconf import DictConfig

from recipes.allocation import run_too_big
from recipes.build import build, ignore_expected_warnings
from recipes.launch import (
    BadInput,
    checkpoint_to_resume,
    discard_refused_run_dir,
    override_error,
    recipe_argument_error,
    remove_empty_files,
)
from recipes.process_group import end_process_group


def refuse(message: str, show: bool = True) -> NoReturn:
    """Exit with status 2; where ``show`` (one rank of several shows it), print ``error: MESSAGE`` on stderr and remove
    the run directory Hydra made for this refused run."""
    if show:
        print(f"error: {message}", file=sys.stderr)
        discard_refused_run_dir()
    sys.exit(2)


def train(cfg: DictConfig) -> dict[str, Any]:
    """Check ``ckpt_path``, build, fit, and return the final logged metrics as floats."""
    from hydra.errors import InstantiationException

    ignore_expected_warnings()
    try:
        ckpt_path = checkpoint_to_resume(cfg)
        trainer, model, datamodule = build(cfg)
    except (InstantiationException, ValueError) as err:
        refuse(str(err.__cause__ if isinstance(err, InstantiationException) and err.__cause__ else err))
    ignore_expected_warnings(model)
    from copy_correct import CheckpointMismatch
    from copy_correct.files.disk_full import disk_full_line
    from copy_correct.lightning import NonFiniteTraining

    try:
        trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True)
    except CheckpointMismatch as err:  # found only while restoring it: a sharded EMA spread otherwise than the model
        refuse(f"ckpt_path {ckpt_path!r} cannot resume this run: {err}", show=trainer.is_global_zero)
    except BadInput as err:  # found where it is read: a file a DataLoader worker cannot decode (data.verify=false)
        refuse(str(err))
    except OSError as err:  # a full disk: a checkpoint or snapshot (DiskFull: the last good one kept), or a log file
        line = disk_full_line(err, cfg.paths.output_dir)
        if line is None:
            raise
        if trainer.is_global_zero:
            remove_empty_files(cfg.paths.output_dir)  # hparams.yaml, train.log: begun, nothing written
        refuse(line, show=trainer.is_global_zero)
    except NonFiniteTraining as err:  # NonFiniteStop: a NaN or Inf loss or weight, stopped before a checkpoint held it
        if trainer.is_global_zero:
            print(f"error: {err}", file=sys.stderr)
        sys.exit(3)
    except (MemoryError, RuntimeError) as err:  # a size that cannot be allocated, found by fit's setup: data.store_size
        line = run_too_big(err)
        if line is None:
            raise
        refuse(line, show=trainer.is_global_zero)
    if trainer.is_global_zero:
        print(f"outputs: {cfg.paths.output_dir} (metrics.csv, checkpoints/, summary.json)")
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    # A log record that cannot be written (a full disk) is dropped, not a traceback on stderr for each: the run's own
    # line names the disk.
    logging.raiseExceptions = False
    if cfg.get("recipe") is None:
        refuse(recipe_argument_error([]) or "no recipe given")
    metrics = train(cfg)
    end_process_group()  # here, where nothing holds the trainer or the model any more
    return metrics.get(cfg.recipe.get("monitor") or "")


if __name__ == "__main__":
    problem = recipe_argument_error(sys.argv[1:]) or override_error(sys.argv[1:])
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    main()
