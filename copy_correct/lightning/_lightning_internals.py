"""Lightning's private surfaces the adapters use, each here and nowhere else, with what it relies on. All were checked
on lightning 2.6.6; the supported range is ``lightning>=2.6.6,<2.7`` (``SUPPORTED``).

Each adapter checks that what it needs is there before it uses it, before training (``check``: one ``RuntimeError``
line naming what is missing and the Lightning installed), rather than failing deep inside a run or, worse, running on
without effect: ``EMAWeights`` in ``setup``, ``ResumeState`` when training starts, ``AtomicModelParallelStrategy``
when it is constructed.

* ``install_run``/``remove_run`` (``EVALUATION_RUN``, ``EVALUATION_DISPATCH``): ``EMAWeights`` wraps an evaluation
  loop's ``run`` by an attribute of the loop instance. Relies on Lightning calling ``loop.run()`` on the instance
  (``Trainer._run_stage``, ``Trainer._run_sanity_check``, ``_TrainingEpochLoop._run_validation``), so that the
  attribute is what runs. Only an evaluation can show that it was: the callback checks at each evaluation's start
  hook that it runs inside its wrapper (a Lightning that calls the class's ``run`` would otherwise log no EMA
  metrics, with no error).
* ``eval_end_metrics`` (``EVALUATION_END_METRICS``): ``trainer._logger_connector.log_eval_end_metrics(metrics)``, the
  one call that gives the loggers an evaluation epoch's metrics (``_EvaluationLoop.on_run_end``), replaced on the
  connector instance for one pass.
* ``print_results`` (``RESULTS_TABLE``): ``_EvaluationLoop._print_results(results, stage)``, the table a ``verbose``
  evaluation prints, with the loop's ``_stage`` (a ``RunningStage``).
* ``data_fetcher`` (``DATA_FETCHER``): ``trainer.fit_loop._data_fetcher``, the training ``_DataFetcher`` that
  ``FitLoop.setup_data`` makes (and starts iterating) before any ``on_train_start`` hook; its ``iterator``, what the
  next fetch reads (``set_fetcher_iterator``), ``combined_loader`` (``fetcher_loader``) and ``batches``, what it
  fetched ahead for loaders without a length (``fetched_ahead``).
* ``batches_fetched`` (``BATCHES_FETCHED``): ``trainer.fit_loop.epoch_loop.batch_progress.current.ready``, the
  batches fetched in the epoch in progress.
* ``saves_distributed_checkpoint`` (``DISTRIBUTED_CHECKPOINT``): ``ModelParallelStrategy._save_distributed_checkpoint``,
  what its constructor's ``save_distributed_checkpoint`` was.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl

__all__ = [
    "BATCHES_FETCHED",
    "DATA_FETCHER",
    "DISTRIBUTED_CHECKPOINT",
    "EVALUATION_DISPATCH",
    "EVALUATION_END_METRICS",
    "EVALUATION_RUN",
    "RESULTS_TABLE",
    "SUPPORTED",
    "Internal",
    "batches_fetched",
    "check",
    "data_fetcher",
    "eval_end_metrics",
    "fetched_ahead",
    "fetcher_loader",
    "install_run",
    "print_results",
    "remove_run",
    "saves_distributed_checkpoint",
    "set_fetcher_iterator",
    "unsupported",
]

SUPPORTED = "lightning>=2.6.6,<2.7"

LogMetrics = Callable[[Mapping[str, Any]], None]
Run = Callable[[], list[dict[str, Any]]]


@dataclass(frozen=True)
class Internal:
    """One private surface: its ``name`` as the error names it, and ``present(owner)`` (the trainer, or the strategy)
    telling whether the Lightning installed has it."""

    name: str
    present: Callable[[Any], bool]


def unsupported(who: str, missing: Iterable[str]) -> RuntimeError:
    """The one-line error of an adapter that needs ``missing`` where the Lightning installed has none of it."""
    return RuntimeError(
        f"{who} needs Lightning's {' and '.join(missing)} (Lightning 2.6), which Lightning {pl.__version__} installed "
        f"does not have: use {SUPPORTED}"
    )


def check(who: str, owner: Any, needs: Iterable[Internal]) -> None:
    """Raise ``unsupported`` naming every one of ``needs`` that ``owner`` lacks; nothing when all are there."""
    missing = [need.name for need in needs if not need.present(owner)]
    if missing:
        raise unsupported(who, missing)


def _path(owner: Any, dotted: str) -> Any:
    for name in dotted.split("."):
        owner = getattr(owner, name, None)
    return owner


def _evaluation_loops(trainer: Any) -> list[Any]:
    return [
        _path(trainer, "fit_loop.epoch_loop.val_loop"),
        _path(trainer, "validate_loop"),
        _path(trainer, "test_loop"),
    ]


# -- evaluation loops (EMAWeights) ---------------------------------------------------------------------------------

EVALUATION_RUN = Internal(
    "evaluation loops' run, set on the loop instance",
    lambda trainer: all(hasattr(loop, "__dict__") and callable(getattr(loop, "run", None))
                        for loop in _evaluation_loops(trainer)),
)  # fmt: skip
EVALUATION_DISPATCH = "evaluation loops' run called through the loop instance"
EVALUATION_END_METRICS = Internal(
    "trainer._logger_connector.log_eval_end_metrics",
    lambda trainer: callable(_path(trainer, "_logger_connector.log_eval_end_metrics")),
)
RESULTS_TABLE = Internal(
    "_EvaluationLoop._print_results and _stage",
    lambda trainer: all(callable(getattr(loop, "_print_results", None)) and isinstance(_path(loop, "_stage.value"), str)
                        for loop in _evaluation_loops(trainer)),
)  # fmt: skip


def install_run(loop: Any, wrap: Callable[[Run], Run]) -> bool:
    """Make ``wrap(loop.run)`` the loop's ``run`` (an attribute of the instance); ``False``, and nothing done, where
    one is installed already."""
    if "run" in vars(loop):
        return False
    loop.run = wrap(loop.run)
    return True


def remove_run(loop: Any) -> None:
    """The loop's ``run`` is its class's again."""
    vars(loop).pop("run", None)


@contextmanager
def eval_end_metrics(trainer: pl.Trainer, replace: Callable[[LogMetrics], LogMetrics]) -> Iterator[None]:
    """Within the block, an evaluation epoch's metrics go to ``replace(log)`` instead of ``log``, Lightning's call
    that gives them to the loggers."""
    connector = trainer._logger_connector
    connector.log_eval_end_metrics = replace(connector.log_eval_end_metrics)
    try:
        yield
    finally:
        del connector.log_eval_end_metrics


def print_results(loop: Any, results: list[dict[str, Any]]) -> None:
    """Print ``results`` in the table Lightning prints after a ``verbose`` evaluation of ``loop``."""
    loop._print_results(results, loop._stage.value)


# -- the training data order (ResumeState) --------------------------------------------------------------------------

DATA_FETCHER = Internal(
    "Trainer.fit_loop._data_fetcher", lambda trainer: hasattr(_path(trainer, "fit_loop"), "_data_fetcher")
)
BATCHES_FETCHED = Internal(
    "fit_loop.epoch_loop.batch_progress.current.ready",
    lambda trainer: isinstance(_path(trainer, "fit_loop.epoch_loop.batch_progress.current.ready"), int),
)


def data_fetcher(trainer: pl.Trainer, who: str) -> Any:
    """The fit's training data fetcher (with its ``iterator``, ``combined_loader`` and ``batches``)."""
    fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
    if fetcher is None or not hasattr(fetcher, "iterator") or not hasattr(fetcher, "combined_loader"):
        raise unsupported(who, [DATA_FETCHER.name])
    return fetcher


def fetched_ahead(fetcher: Any) -> bool:
    """Whether ``fetcher`` holds batches it fetched ahead (Lightning does, from loaders without a length)."""
    return bool(getattr(fetcher, "batches", None))


def fetcher_loader(fetcher: Any) -> Any:
    """The ``CombinedLoader`` ``fetcher`` iterates."""
    return fetcher.combined_loader


def set_fetcher_iterator(fetcher: Any, iterator: Iterator[Any]) -> None:
    """Make ``iterator`` what ``fetcher``'s next fetch reads."""
    fetcher.iterator = iterator


def batches_fetched(trainer: pl.Trainer) -> int:
    """The batches Lightning has fetched in the training epoch in progress."""
    return trainer.fit_loop.epoch_loop.batch_progress.current.ready


# -- sharded checkpoints (AtomicModelParallelStrategy) --------------------------------------------------------------

DISTRIBUTED_CHECKPOINT = Internal(
    "ModelParallelStrategy._save_distributed_checkpoint",
    lambda strategy: isinstance(getattr(strategy, "_save_distributed_checkpoint", None), bool),
)


def saves_distributed_checkpoint(strategy: Any) -> bool:
    """Whether ``strategy`` (a ``ModelParallelStrategy``) saves a directory of shards rather than one file."""
    return strategy._save_distributed_checkpoint
