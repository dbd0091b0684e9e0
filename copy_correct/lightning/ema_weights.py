"""``EMAWeights``: an ``EMA`` of a LightningModule, or of one submodule (``module="generator"``), during ``fit``,
evaluated with and checkpointed. The manual's ema page (``docs/recipes/ema.md``, decisions 3 to 9) is the full
account, each claim with its test; the scale-out guide has the sharded one.

Copy contract:

* Shared with the module: nothing. The shadow is the ``EMA``'s own tensors (``copy_correct.averages.ema``), never a deep
  copy of the LightningModule and never in its ``parameters()``. A checkpoint of ``checkpoint_weights="ema"`` (the
  default, so ``load_from_checkpoint`` returns the average) holds the shadow's own tensors as its weights, so
  ``torch.save`` writes them once for both entries where the dtypes agree; the live weights it replaced go into the
  callback state, from which ``fit(ckpt_path=...)`` copies them back into the module in place. Names are the
  LightningModule's (``generator.net.0.weight``) in the weights and in the EMA state.
* New storage: one backup of the live values for the length of an evaluation with the average (``average_weights``).
* Autograd sees nothing: the update runs after each optimizer step (once per ``accumulate_grad_batches`` batches,
  counted from the step Lightning restored), in place under ``no_grad``. Nothing an evaluation pass writes into the
  module reaches the average, and the live values come back bit for bit, after an exception too, before Lightning's
  ``on_exception`` hooks. A save during an EMA pass (or after ``fit``) steps out of it: it holds what any save holds.
* ``evaluate="both"``: each validation and test epoch runs with the average (metrics suffixed, ``val/acc_ema``, the
  other callbacks silenced), then live; both sets in one result dict and one logger row, through Lightning internals
  that ``setup`` checks (``_lightning_internals``: another Lightning stops the run in one line). ``"ema"``: the
  average alone, under the module's names; ``"live"``: no EMA evaluation.
* DDP and FSDP2: rank 0's floating buffers are broadcast into the averaged module before each update, so every rank
  averages the same ones; a sharded average stays sharded, updated with no collective, and goes where Lightning puts
  the weights (a distributed checkpoint's directory, or one file, gathered), and resumes at another world size (each
  rank reading its own shards of the directory, or cutting them from the file).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import ExitStack
from functools import partial
from itertools import zip_longest
from typing import Any

import lightning.pytorch as pl
import torch

from copy_correct.averages.ema import EMA
from copy_correct.averages.settings import defaults, ema_settings
from copy_correct.averages.shadow import copy_into, misfit
from copy_correct.core.checks import flag, shown
from copy_correct.core.sharding import reshard
from copy_correct.errors import CheckpointMismatch
from copy_correct.lightning._averaging_callback import (
    AveragingCallback,
    average_arguments,
    distributed,
    named_as_the_module,
)
from copy_correct.lightning._distributed_state import names_keys, read_into, store_under_keys
from copy_correct.lightning._ema_pass import EMAPass, held_back, logged_with
from copy_correct.lightning._lightning_internals import (
    EVALUATION_DISPATCH,
    EVALUATION_END_METRICS,
    EVALUATION_RUN,
    RESULTS_TABLE,
    check,
    eval_end_metrics,
    install_run,
    print_results,
    remove_run,
    unsupported,
)
from copy_correct.lightning._rank_zero_buffers import RankZeroBuffers
from copy_correct.lightning._skip_log import SkipLog

__all__ = ["EMAWeights"]

_EMA_DEFAULTS = defaults(EMA)  # EMA's arguments but the model and their defaults, read from its signature once
_OWN = ("evaluate", "suffix", "checkpoint_weights", "ema_weights_at_end", "module", "update_bn")
_EVALUATE = ("both", "ema", "live")
_CHECKPOINT_WEIGHTS = ("ema", "live")
_NEEDS = {  # the Lightning internals each evaluation mode goes through
    "both": (EVALUATION_RUN, EVALUATION_END_METRICS, RESULTS_TABLE),
    "ema": (EVALUATION_RUN,),
    "live": (),
}


class EMAWeights(AveragingCallback):
    """Args: ``decay`` and, as keywords, the other arguments of ``EMA`` (``warmup`` … ``skip_nonfinite``: ``ema``,
    checked here as ``EMA`` checks them, without building one), plus ``evaluate``, ``suffix``, ``checkpoint_weights``,
    ``ema_weights_at_end``, ``module`` (an attribute path of the LightningModule, ``"generator"``; ``None``: all of
    it) and ``update_bn`` (``True``: before each EMA evaluation in ``fit``, the average's BatchNorm statistics are
    recomputed over the fit's train dataloader, ``EMA.update_bn``, and rank 0's given to every rank; ``validate`` and
    ``test`` use them as they stand)."""

    _owner, _state_name = "EMAWeights", "ema"
    _named = ("shadow", "layout")  # the EMA state's mappings by name: the LightningModule's names in checkpoints

    def __init__(
        self,
        decay: float = 0.999,
        *,
        evaluate: str = "both",
        suffix: str = "_ema",
        checkpoint_weights: str = "ema",
        ema_weights_at_end: bool = False,
        module: str | None = None,
        update_bn: bool = False,
        **ema: Any,
    ) -> None:
        if evaluate not in _EVALUATE:
            raise ValueError(f"evaluate must be one of {_EVALUATE}, got {evaluate!r}")
        if checkpoint_weights not in _CHECKPOINT_WEIGHTS:
            raise ValueError(f"checkpoint_weights must be one of {_CHECKPOINT_WEIGHTS}, got {checkpoint_weights!r}")
        if not suffix:
            raise ValueError("suffix must be a non-empty string")
        arguments = average_arguments("EMAWeights", {"decay": decay, **ema}, "EMA", _EMA_DEFAULTS, _OWN)
        ema_settings(arguments)  # bad values fail now, in EMA's words; the EMA is built when fit starts
        self._ema_kwargs: dict[str, Any] = {"decay": decay, **ema}
        self.evaluate = evaluate
        self.suffix = suffix
        self.checkpoint_weights = checkpoint_weights
        self.ema_weights_at_end = ema_weights_at_end
        self.update_bn = flag("update_bn", update_bn)
        self._bn_broadcast = RankZeroBuffers()  # the recomputed statistics, rank 0's to every rank
        super().__init__(module, SkipLog("ema/skipped", "EMA"), {"decay": decay})
        self.ema: EMA | None = None
        self._wrapped: list[Any] = []  # the evaluation loops whose run setup wrapped, for teardown
        self._in_run = False  # inside a run setup wrapped: each evaluation's start checks it
        self._pass: EMAPass | None = None  # the EMA evaluation in progress

    def _ensure_ema(self, pl_module: pl.LightningModule) -> EMA:
        if self.ema is None:
            self.ema = EMA(self._averaged(pl_module), **self._ema_kwargs)
            self._restore_pending(self.ema)
        elif self.ema.live_model is None:  # a copy of this callback: its EMA's copy averages this module from now on
            self.ema.track(self._averaged(pl_module))
        return self.ema

    def __getstate__(self) -> dict[str, Any]:
        """What ``pickle`` and ``copy.deepcopy`` copy: the settings, the step and the EMA (a copy that tracks no model
        until the next ``fit``, ``validate`` or ``test`` gives it the module: ``copy_correct.averages.ema``), not the
        trainer, the wrappers ``setup`` installed in it, nor an evaluation in progress."""
        return {
            **super().__getstate__(), "_wrapped": [], "_in_run": False, "_pass": None,
            "_bn_broadcast": RankZeroBuffers(),
        }  # fmt: skip

    # -- wiring the evaluation passes -------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Check that the Lightning internals ``evaluate`` needs are there (one ``RuntimeError`` line naming what is
        missing and the version installed), then wrap ``trainer.save_checkpoint`` and the evaluation loops' ``run``."""
        check(f"EMAWeights(evaluate={self.evaluate!r})", trainer, _NEEDS[self.evaluate])
        super().setup(trainer, pl_module, stage)
        if "save_checkpoint" not in vars(trainer):  # kept after teardown: saves after fit hold what saves in it hold
            trainer.save_checkpoint = self._save_outside_the_pass(trainer.save_checkpoint)  # type: ignore[method-assign]
        if self.evaluate == "live":
            return
        for loop in (trainer.fit_loop.epoch_loop.val_loop, trainer.validate_loop, trainer.test_loop):
            if install_run(loop, partial(self._wrap_run, trainer, pl_module, loop)):
                self._wrapped.append(loop)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for loop in self._wrapped:
            remove_run(loop)  # back to the class's method
        self._wrapped.clear()

    def _wrap_run(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loop: Any, run: Callable[[], list[dict[str, Any]]]
    ) -> Callable[[], list[dict[str, Any]]]:
        """The loop's ``run`` with the EMA evaluation, noting that it runs (``_check_dispatched``)."""
        run_with_ema = self._evaluate_with_ema(trainer, pl_module, loop, run)

        def run_witnessed() -> list[dict[str, Any]]:
            outer, self._in_run = self._in_run, True
            try:
                return run_with_ema()
            finally:
                self._in_run = outer

        return run_witnessed

    def _check_dispatched(self) -> None:
        """An evaluation that starts outside the wrapped ``run`` would log no EMA metrics: it stops, in one line."""
        if self._wrapped and not self._in_run:
            raise unsupported(f"EMAWeights(evaluate={self.evaluate!r})", [EVALUATION_DISPATCH])

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._check_dispatched()

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._check_dispatched()

    def _evaluate_with_ema(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loop: Any, run: Callable[[], list[dict[str, Any]]]
    ) -> Callable[[], list[dict[str, Any]]]:
        def run_with_ema() -> list[dict[str, Any]]:
            if trainer.sanity_checking:
                return run()
            ema = self._ensure_ema(pl_module)
            if self.update_bn and trainer.state.fn == "fit":
                self._recompute_statistics(trainer, pl_module, ema)
            if self.evaluate == "ema":
                return self._run_pass(EMAPass(trainer, pl_module, ema, None), run)
            held: dict[str, Any] = {}
            verbose, loop.verbose = loop.verbose, False  # one table, of both passes, below
            try:
                with eval_end_metrics(trainer, partial(held_back, held)):
                    averaged = self._run_pass(EMAPass(trainer, pl_module, ema, self.suffix), run)
                with eval_end_metrics(trainer, partial(logged_with, held)):
                    live = run()
            finally:
                loop.verbose = verbose
            results = [{**one, **other} for one, other in zip_longest(live, averaged, fillvalue={})]
            if verbose and trainer.is_global_zero:
                print_results(loop, results)
            return results

        return run_with_ema

    def _recompute_statistics(self, trainer: pl.Trainer, pl_module: pl.LightningModule, ema: EMA) -> None:
        """``update_bn``: the average's BatchNorm statistics over the fit's train dataloader, then rank 0's on every
        rank (each rank's loader holds its own share of the data)."""
        loader = trainer.train_dataloader
        if loader is None or isinstance(loader, (Mapping, list, tuple)):
            raise ValueError(
                f"EMAWeights(update_bn=True) recomputes the statistics over one train dataloader, got {shown(loader)}"
            )
        ema.update_bn(loader, device=pl_module.device)
        self._bn_broadcast.sync(trainer, ema.module)

    def _run_pass(self, ema_pass: EMAPass, run: Callable[[], list[dict[str, Any]]]) -> list[dict[str, Any]]:
        self._pass = ema_pass
        try:
            with ema_pass:
                return run()
        finally:
            self._pass = None

    def _save_outside_the_pass(self, save: Callable[..., None]) -> Callable[..., None]:
        """``trainer.save_checkpoint``, which during an EMA pass saves with the live weights in the module; a
        weights-only save with ``checkpoint_weights="ema"`` saves with the average in it (Lightning calls no callback
        hook for those, and they are for inference), after ``fit`` too: ``teardown`` leaves this wrapper in place."""

        def save_checkpoint(filepath: Any, weights_only: bool | None = None, *args: Any, **kwargs: Any) -> None:
            with ExitStack() as stack:
                if self._pass is not None:
                    stack.enter_context(self._pass.stepped_out())
                if weights_only and self.checkpoint_weights == "ema" and self.ema is not None:
                    stack.enter_context(self.ema.average_weights())
                return save(filepath, weights_only, *args, **kwargs)

        return save_checkpoint

    # -- training ---------------------------------------------------------------------------------------

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._ensure_ema(pl_module)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._stepped(trainer):
            ema = self._ensure_ema(pl_module)
            self._sync_buffers(trainer, ema)  # the same buffers to average on every rank, as DDP would give them
            ema.update()

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.ema_weights_at_end and self.ema is not None:
            self.ema.copy_to()

    # -- checkpoints ------------------------------------------------------------------------------------

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """With ``checkpoint_weights="ema"``, the checkpoint's weights become the average and the live weights go
        into the callback state (``live``). A sharded average goes where Lightning puts the sharded weights: its shards
        into the distributed checkpoint, each under a key the callback state names; or, for one file of full weights,
        gathered."""
        ours = checkpoint.get("callbacks", {}).get(self.state_key, {})
        state = ours.get("ema")
        if self.ema is None or state is None:
            return
        weights = checkpoint["state_dict"]
        in_directory = distributed(weights)
        if self.ema.sharded and not in_directory:  # one file, written by rank 0 (the others' weights are empty here)
            full = {"shadow": self.ema.full_state_dict()}  # every rank joins the gathers
            state["shadow"] = named_as_the_module(full, self._named, self.module)["shadow"]
        if self.checkpoint_weights == "ema" and weights:
            ours["live"] = _average_into_weights(weights, state["shadow"])
        if in_directory:  # every rank writes its shards
            state["shadow"] = store_under_keys(weights, state["shadow"], f"{self.state_key}/ema/shadow")
            if "live" in ours:
                ours["live"] = store_under_keys(weights, ours["live"], f"{self.state_key}/live")

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """A checkpoint whose weights are the average (``checkpoint_weights="ema"``) holds the live weights in the
        callback state: Lightning has loaded the average into the module by now, so they are copied back in, in
        place, and training resumes from the live weights."""
        live = checkpoint.get("callbacks", {}).get(self.state_key, {}).get("live")
        if live is None:
            return
        try:
            if names_keys(live):
                weights = pl_module.state_dict(keep_vars=True)
                missing = sorted(set(live) - set(weights))
                if missing:
                    raise ValueError(
                        f"the checkpoint's live weights name tensors the model does not have: {missing[:5]}"
                    )
                live = read_into({name: torch.empty_like(weights[name]) for name in live}, live, self._ckpt_path)
            _copy_into_module(pl_module, live)
        except ValueError as err:
            raise CheckpointMismatch(str(err)) from err

    def _read(self, ema: EMA, state: Mapping[str, Any]) -> Mapping[str, Any]:
        """The state, its shadow read from the distributed checkpoint being restored where it names keys there (every
        rank its shards, into tensors spread as the model is now: ``torch.distributed.checkpoint`` reshards a checkpoint
        saved at another world size), after checking names and shapes."""
        if not names_keys(state.get("shadow")):
            return state
        keys: Mapping[str, str] = state["shadow"]
        holders = {name: torch.empty_like(ema.shadow[name]) if name in ema.shadow else None for name in keys}
        read = {**state, "shadow": holders}
        ema.check_state(read)
        read_into(holders, keys, self._ckpt_path)
        return read


def _average_into_weights(
    weights: dict[str, torch.Tensor], average: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Put the average into a checkpoint's weights (the shadow's own tensors where the dtypes agree: ``torch.save``
    then stores them once for both entries; a cast copy otherwise); return the live entries they replaced."""
    live = {}
    for name, tensor in average.items():
        if name in weights:
            live[name] = weights[name]
            weights[name] = tensor if tensor.dtype == live[name].dtype else tensor.to(live[name].dtype)
    return live


def _copy_into_module(module: torch.nn.Module, values: Mapping[str, torch.Tensor]) -> None:
    """Copy tensors into a module's parameters and buffers by ``state_dict`` name, in place (a sharded module takes
    ``DTensor``s or full tensors, of which each rank copies its own part), then drop FSDP2's gathered copies."""
    targets = module.state_dict(keep_vars=True)
    for name, value in values.items():
        wrong = misfit(targets, name, value)
        if wrong is not None:
            raise ValueError(f"the checkpoint's live weights do not fit the model: {wrong}")
    copy_into(targets, values)
    reshard(module)
