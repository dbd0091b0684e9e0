"""``EMAWeights``: keep an ``EMA`` of a LightningModule during ``fit``, evaluate with it, checkpoint it.

Copy contract: the shadow is the ``EMA``'s own tensors (see ``copy_correct.ema``), never a deep copy of the
LightningModule and never in its ``parameters()``; evaluation copies the average into the module and the live values
back, bit for bit, through one backup of the live values held for the pass; nothing the pass writes into the module
reaches the average.

* Updates after every optimizer step (so once per ``accumulate_grad_batches`` batches), from
  ``start_step`` on, every ``update_every`` steps. The step is read once training starts, after Lightning restored a
  resumed run's counters, so a resumed run makes exactly the updates the uninterrupted one makes, with any
  accumulation (``tests/lightning/test_ema_weights.py`` resumes at every step).
* ``module`` names the one submodule to average (``"generator"`` of a GAN), ``None`` the whole LightningModule:
  evaluation swaps, ``ema_weights_at_end`` and the buffer broadcast touch that submodule only, and checkpoints name its
  average as the LightningModule's ``state_dict`` does (``generator.net.0.weight``), in the weights and the EMA state.
* ``evaluate="both"`` (default): each validation (and test) epoch runs twice, first with the EMA weights,
  logging every metric the module logs under its name plus ``suffix`` (``val/acc`` -> ``val/acc_ema``),
  then with the live weights as usual. The EMA pass runs without the other callbacks, so checkpointing,
  early stopping and the progress bar act once, on the live pass, and see both sets of metrics. Both sets go where
  Lightning puts an evaluation's results: ``trainer.validate`` and ``trainer.test`` return them in one dict per
  dataloader and print them in one table, and the loggers get each epoch's in one call (one row of ``CSVLogger``'s
  ``metrics.csv``): the EMA pass's epoch-end metrics are held back and logged with the live pass's. This goes through
  Lightning 2.6's internals (``copy_correct.lightning._lightning_internals``): the evaluation loops' ``run``, wrapped on
  each loop instance, the logger connector's ``log_eval_end_metrics`` and the evaluation loop's ``_print_results``.
  ``setup`` checks that they are there, and each evaluation's start that it runs inside the wrapper: another Lightning
  stops the run with one ``RuntimeError`` line naming what is missing and the version installed, never drops the EMA
  metrics silently (``"ema"`` needs the wrapper only). Metrics logged with ``on_step=True`` still get a row per pass
  and batch.
  ``"ema"``: evaluate with the EMA weights only, under the module's own names. ``"live"``: no EMA evaluation.
* ``checkpoint_weights="ema"`` (default): a checkpoint's weights (``state_dict``) are the average, so
  ``MyModule.load_from_checkpoint(path)`` returns the averaged model, as Lightning's ``EMAWeightAveraging`` does; the
  live weights go into the callback state (``live``) and ``trainer.fit(ckpt_path=...)`` with this callback copies them
  back into the module after Lightning loaded the average, so resuming stays bit-exact. Where the shadow's dtype is
  the weights', ``state_dict`` and the EMA state hold the same tensors, which ``torch.save`` stores once. A
  weights-only save holds the average (the module holds it while Lightning saves). ``"live"``: ``state_dict`` holds the
  live weights and the average is only in the EMA state. Resumed without this callback, a checkpoint of ``"ema"``
  trains on from the average (Lightning warns that the checkpoint's callback is missing).
* Checkpoints hold the EMA state (callback state, tensors and numbers only: loads with
  ``weights_only=True``); resuming restores it, so a resumed run continues the same average.
* ``skip_nonfinite=True`` (opt-in, ``copy_correct.ema`` says what it costs): an update whose live weights or floating
  buffers hold a NaN or an Inf is skipped, the average kept bit for bit; the
  count is logged as ``ema/skipped`` at the end of each training epoch, read once per epoch (on a GPU a sync), never
  per step, and the first epoch that skips warns once (``copy_correct.lightning._skip_log``).
* Whenever a checkpoint is saved, it holds the same thing: a save during an EMA pass (``ModelCheckpoint`` on
  validation end, a mid-epoch validation, a callback or module hook calling ``trainer.save_checkpoint``, weights-only
  ones included) steps out of the pass: the live weights are copied back for the save and the average in after it,
  with every callback present even while the ``"both"`` pass silences them. An exception in a pass, or
  ``KeyboardInterrupt``, restores the live weights before Lightning's ``on_exception`` hooks
  (``OnExceptionCheckpoint``) run. To keep the EMA weights as a model, use ``callback.ema.export()``.
* After ``fit`` (and ``validate``, ``test``), ``teardown`` takes the evaluation wrappers away but leaves the save
  wrapper in the trainer, so ``trainer.save_checkpoint`` then holds what a save during ``fit`` holds: weights-only, the
  average (``"live"``: the live weights); a full checkpoint, what one saved as ``fit`` ended holds (the average as the
  weights, the module's weights as the live ones, the EMA state), from which ``ckpt_path=`` trains on.
* ``ema_weights_at_end=True`` writes the EMA weights into the module when ``fit`` ends; a checkpoint saved after that
  holds the average as the live weights too (the live weights it replaced are kept nowhere).
* ``pickle`` and ``copy.deepcopy`` copy the callback without the trainer, the wrappers ``setup`` installed or an
  evaluation in progress; its EMA is copied as ``copy_correct.ema`` says (the average in new storage, no model), and
  the next ``fit``, ``validate`` or ``test`` gives it the module.
* Under DDP every rank keeps its own EMA. Parameters are identical across ranks after each step, but
  BatchNorm statistics are not (each rank's forward updates its own; DDP copies rank 0's only at the next
  forward), so before each update the callback broadcasts rank 0's floating buffers, as DDP would: the
  shadows are then identical on every rank.
* Sharded (FSDP2, Lightning's ``ModelParallelStrategy``): each rank keeps the shadow of its own shards (see
  ``copy_correct.ema``), updated with no collective. FSDP2 shards parameters only: buffers stay whole on every rank
  and nothing ever synchronises them, so the broadcast above runs here too (the live buffers then agree on every
  rank, which is also what a distributed checkpoint keeps: one copy of a tensor that is not sharded). Checkpoints
  hold the average in the form Lightning gives the weights: with a distributed checkpoint (a directory, the
  default), the shadow's shards are written into it beside the weights' (each rank writes its own; the callback
  state keeps the counters, the layout and each tensor's key there; with ``checkpoint_weights="ema"`` the weights'
  entries are the average and the live shards get keys of their own) and read back from it on resume; with
  ``save_distributed_checkpoint=False`` (one file of full weights), the average is gathered into full tensors for
  it, and each rank takes its own part back on resume. Either way a checkpoint spread otherwise than the model
  (another world size or placement) is refused, naming both (``CheckpointMismatch``, a ``ValueError``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from functools import partial
from inspect import signature
from itertools import zip_longest
from typing import Any

import lightning.pytorch as pl
import torch

from copy_correct._average_settings import ema_settings
from copy_correct._sharding import is_sharded, local, local_part, reshard
from copy_correct.ema import EMA
from copy_correct.errors import CheckpointMismatch
from copy_correct.lightning._averaging_callback import AveragingCallback, distributed, named_as_the_module
from copy_correct.lightning._distributed_state import names_keys, read_into, store_under_keys
from copy_correct.lightning._lightning_internals import (
    EVALUATION_DISPATCH,
    EVALUATION_END_METRICS,
    EVALUATION_RUN,
    RESULTS_TABLE,
    LogMetrics,
    check,
    eval_end_metrics,
    install_run,
    print_results,
    remove_run,
    unsupported,
)
from copy_correct.lightning._skip_log import SkipLog

__all__ = ["EMAWeights"]

_EMA_ARGUMENTS = tuple(signature(ema_settings).parameters)[1:]  # EMA's keywords after decay
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
    ``ema_weights_at_end`` and ``module`` (an attribute path of the LightningModule, ``"generator"``; ``None``: all of
    it)."""

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
        **ema: Any,
    ) -> None:
        if evaluate not in _EVALUATE:
            raise ValueError(f"evaluate must be one of {_EVALUATE}, got {evaluate!r}")
        if checkpoint_weights not in _CHECKPOINT_WEIGHTS:
            raise ValueError(f"checkpoint_weights must be one of {_CHECKPOINT_WEIGHTS}, got {checkpoint_weights!r}")
        if not suffix:
            raise ValueError("suffix must be a non-empty string")
        unknown = sorted(set(ema) - set(_EMA_ARGUMENTS))
        if unknown:
            raise TypeError(
                f"EMAWeights got an unexpected argument {unknown[0]!r}: it takes decay, {', '.join(_EMA_ARGUMENTS)} "
                "(EMA's), evaluate, suffix, checkpoint_weights, ema_weights_at_end and module"
            )
        ema_settings(decay, **ema)  # bad values fail now, in EMA's words; the EMA is built when fit starts
        self._ema_kwargs: dict[str, Any] = {"decay": decay, **ema}
        self.evaluate = evaluate
        self.suffix = suffix
        self.checkpoint_weights = checkpoint_weights
        self.ema_weights_at_end = ema_weights_at_end
        super().__init__(module, SkipLog("ema/skipped", "EMA"))
        self.ema: EMA | None = None
        self._wrapped: list[Any] = []  # the evaluation loops whose run setup wrapped, for teardown
        self._in_run = False  # inside a run setup wrapped: each evaluation's start checks it
        self._pass: _EMAPass | None = None  # the EMA evaluation in progress

    @property
    def state_key(self) -> str:
        return self._key(decay=self._ema_kwargs["decay"])

    @property
    def _averager(self) -> EMA | None:
        return self.ema

    def _ensure_ema(self, pl_module: pl.LightningModule) -> EMA:
        if self.ema is None:
            self.ema = EMA(self._averaged(pl_module), **self._ema_kwargs)
            self._restore_pending(self.ema)
        elif self.ema.live_model is None:  # a copy of this callback: its EMA's copy averages this module from now on
            self.ema.track(self._averaged(pl_module))
        return self.ema

    def __getstate__(self) -> dict[str, Any]:
        """What ``pickle`` and ``copy.deepcopy`` copy: the settings, the step and the EMA (a copy that tracks no model
        until the next ``fit``, ``validate`` or ``test`` gives it the module: ``copy_correct.ema``), not the trainer,
        the wrappers ``setup`` installed in it, nor an evaluation in progress."""
        return {**super().__getstate__(), "_wrapped": [], "_in_run": False, "_pass": None}

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
            if self.evaluate == "ema":
                return self._run_pass(_EMAPass(trainer, pl_module, ema, None), run)
            held: dict[str, Any] = {}
            verbose, loop.verbose = loop.verbose, False  # one table, of both passes, below
            try:
                with eval_end_metrics(trainer, partial(_held_back, held)):
                    averaged = self._run_pass(_EMAPass(trainer, pl_module, ema, self.suffix), run)
                with eval_end_metrics(trainer, partial(_logged_with, held)):
                    live = run()
            finally:
                loop.verbose = verbose
            results = [{**one, **other} for one, other in zip_longest(live, averaged, fillvalue={})]
            if verbose and trainer.is_global_zero:
                print_results(loop, results)
            return results

        return run_with_ema

    def _run_pass(self, ema_pass: _EMAPass, run: Callable[[], list[dict[str, Any]]]) -> list[dict[str, Any]]:
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
        rank its shards), after checking that it is spread as the model is: ``torch.distributed.checkpoint`` would
        reshard silently."""
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
        if name not in targets or tuple(targets[name].shape) != tuple(value.shape):
            found = tuple(targets[name].shape) if name in targets else "nothing"
            raise ValueError(
                f"the checkpoint's live weights do not fit the model: {name!r} {tuple(value.shape)} vs {found}"
            )
    with torch.no_grad():
        for name, value in values.items():
            target = targets[name]
            if is_sharded(target) and not is_sharded(value):
                value = local_part(value, target)
            local(target).copy_(local(value))
    reshard(module)


class _EMAPass:
    """One evaluation run with the EMA weights in the module (``suffix``: also logging under suffixed names, with
    no callback hooks), which a checkpoint save steps out of and back into."""

    def __init__(self, trainer: pl.Trainer, pl_module: pl.LightningModule, ema: EMA, suffix: str | None) -> None:
        self._trainer, self._module, self._ema, self._suffix = trainer, pl_module, ema, suffix
        self._stack = ExitStack()

    def __enter__(self) -> None:
        self._stack = ExitStack()
        self._stack.enter_context(self._ema.average_weights())
        if self._suffix is not None:
            self._stack.enter_context(_suffixed_logging(self._module, self._suffix))
            self._stack.enter_context(_quiet(self._trainer))

    def __exit__(self, *exc_info: Any) -> bool:
        return self._stack.__exit__(*exc_info)

    @contextmanager
    def stepped_out(self) -> Iterator[None]:
        """Live weights in the module, the average in the EMA, every callback back; the pass resumes after."""
        self._stack.close()
        try:
            yield
        finally:
            self.__enter__()


@contextmanager
def _suffixed_logging(pl_module: pl.LightningModule, suffix: str) -> Iterator[None]:
    """Every ``self.log(name, ...)`` of the module (and so ``log_dict``) logs ``name + suffix`` instead."""
    log = pl_module.log

    def log_with_suffix(name: str, *args: Any, **kwargs: Any) -> None:
        log(f"{name}{suffix}", *args, **kwargs)

    pl_module.log = log_with_suffix  # type: ignore[method-assign]
    try:
        yield
    finally:
        del pl_module.log


def _held_back(held: dict[str, Any], log: LogMetrics) -> LogMetrics:
    """The epoch-end metrics of the EMA pass, kept from the loggers: Lightning's call that logs an evaluation epoch's
    metrics (``log``) only collects them into ``held``."""
    return held.update


def _logged_with(held: Mapping[str, Any], log: LogMetrics) -> LogMetrics:
    """The live pass's epoch-end metrics logged with ``held`` beside them, in one call: one row of ``metrics.csv``."""

    def log_both(metrics: Mapping[str, Any]) -> None:
        log({**metrics, **held})

    return log_both


@contextmanager
def _quiet(trainer: pl.Trainer) -> Iterator[None]:
    """No callback hooks (checkpointing, early stopping, progress bars) during the EMA pass."""
    callbacks = trainer.callbacks
    trainer.callbacks = []
    try:
        yield
    finally:
        trainer.callbacks = callbacks
