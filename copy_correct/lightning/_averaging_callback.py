"""``AveragingCallback``: what ``EMAWeights`` and ``PostHocEMASnapshots`` share. The module they average (``module=``,
an attribute path of the LightningModule, checked at ``setup``), the optimizer step read once training starts,
rank 0's buffers before each update, the skip count per epoch, and the average's state in checkpoints: kept until the
average is built (``_pending``), restored through a subclass's reading of a distributed checkpoint, a mismatch raised
as ``CheckpointMismatch``. What differs (EMA evaluation passes, the checkpoint's weights; snapshots and their files)
stays in each.

Copy contract: nothing here holds or copies a tensor of the average; the renamings of a state build new dicts of the
same tensor objects, and ``RankZeroBuffers`` copies rank 0's buffers into the averaged module in place. ``pickle`` and
``copy.deepcopy`` copy the callback without the trainer and the broadcast's buffers, which refer to one run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch

from copy_correct.core.sharding import is_sharded
from copy_correct.errors import CheckpointMismatch
from copy_correct.guards.device import skipped_updates
from copy_correct.lightning._rank_zero_buffers import RankZeroBuffers
from copy_correct.lightning._skip_log import SkipLog

__all__ = ["AveragingCallback", "average_arguments", "averaged_module", "named_as_the_module", "named_as_the_submodule"]


class AveragingCallback(pl.Callback):
    """A subclass names itself (``_owner``), the key of the average's state in its own (``_state_name``, also the
    attribute that holds the average, ``None`` until built) and that state's mappings by tensor name (``_named``:
    renamed to the LightningModule's names in checkpoints); it passes ``key``, the setting that names its state in a
    checkpoint (its first argument: ``decay``, ``sigma_rels``), and gives ``_read`` (the state with its tensors, read
    from a distributed checkpoint where it names keys there)."""

    _owner: str
    _state_name: str
    _named: tuple[str, ...] = ()

    def __init__(self, module: str | None, skips: SkipLog, key: dict[str, Any]) -> None:
        self.module = module or None
        self._key_settings = key
        self._trainer: pl.Trainer | None = None
        self._broadcast = RankZeroBuffers()
        self._skips = skips
        self._pending: dict[str, Any] | None = None  # a loaded state, until the average is built
        self._last_step = 0

    @property
    def _averager(self) -> Any:
        return getattr(self, self._state_name)

    def _read(self, average: Any, state: Mapping[str, Any]) -> Mapping[str, Any]:
        raise NotImplementedError

    @property
    def state_key(self) -> str:
        """The key of this callback's state in a checkpoint: its first setting, and ``module`` when one is averaged."""
        module = {"module": self.module} if self.module is not None else {}
        return self._generate_state_key(**self._key_settings, **module)

    def _averaged(self, pl_module: pl.LightningModule) -> torch.nn.Module:
        return averaged_module(pl_module, self.module, self._owner)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = trainer
        self._averaged(pl_module)  # a path the module lacks fails here, naming it

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_trainer": None, "_broadcast": RankZeroBuffers()}

    # -- training -------------------------------------------------------------------------------------------

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Not in on_fit_start: Lightning restores the loop counters of a resumed run between the two, and a
        # global_step read before that (0) made the first micro-batch after a resume count as an optimizer step.
        self._last_step = trainer.global_step

    def _stepped(self, trainer: pl.Trainer) -> bool:
        """Whether an optimizer step happened in this batch (so once per ``accumulate_grad_batches`` batches)."""
        if trainer.global_step > self._last_step:
            self._last_step = trainer.global_step
            return True
        return False

    def _sync_buffers(self, trainer: pl.Trainer, average: Any) -> None:
        """Rank 0's floating buffers into every rank's averaged module, when the average includes buffers."""
        if average.include_buffers and average.live_model is not None:
            self._broadcast.sync(trainer, average.live_model)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Log how many updates ``skip_nonfinite`` skipped so far (``SkipLog``: one read of the counter per epoch, one
        warning the first time an epoch skips)."""
        average = self._averager
        if average is not None and average.skip_nonfinite:
            self._skips.epoch_end(pl_module, skipped_updates(average))

    # -- checkpoints ----------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        average = self._averager
        if average is None:
            return {} if self._pending is None else {self._state_name: self._pending}
        return {self._state_name: named_as_the_module(average.state_dict(), self._named, self.module)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self._state_name not in state_dict:
            return
        if self._averager is None:
            self._pending = state_dict[self._state_name]
        else:
            self._load(self._averager, state_dict[self._state_name])

    def _restore_pending(self, average: Any) -> None:
        """Load into ``average``, just built, the state a resume loaded before it existed."""
        if self._pending is not None:
            self._load(average, self._pending)
            self._pending = None

    def _load(self, average: Any, state: Mapping[str, Any]) -> None:
        try:
            state = self._read(average, named_as_the_submodule(state, self._named, self.module))
            average.load_state_dict(state)
            self._skips.resumed(int(state.get("skipped", 0)))
        except ValueError as err:
            raise CheckpointMismatch(str(err)) from err

    @property
    def _ckpt_path(self) -> str | None:
        return self._trainer.ckpt_path if self._trainer is not None else None


def average_arguments(
    owner: str, given: Mapping[str, Any], kind: str, defaults: dict[str, Any], own: tuple[str, ...]
) -> dict[str, Any]:
    """``given``, the arguments a callback takes for its average, with the average's ``defaults`` for the others
    (``copy_correct.averages.settings.defaults``), to be checked as the average ``kind`` checks them; a ``TypeError``
    for a name neither the average nor the callback (``own``) takes, naming what they take."""
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        takes = ", ".join(own[:-1]) + " and " + own[-1] if len(own) > 1 else own[0]
        raise TypeError(
            f"{owner} got an unexpected argument {unknown[0]!r}: it takes {', '.join(defaults)} ({kind}'s), {takes}"
        )
    return defaults | dict(given)


def distributed(weights: Mapping[str, torch.Tensor]) -> bool:
    """Whether a checkpoint's weights are a distributed checkpoint's (sharded tensors, every rank writing its own);
    else one file, or no sharding at all."""
    return any(is_sharded(t) for t in weights.values())


def averaged_module(pl_module: pl.LightningModule, module: str | None, owner: str) -> torch.nn.Module:
    """The submodule ``module`` names (``None``: ``pl_module`` itself); a ``ValueError`` line naming it otherwise."""
    if module is None:
        return pl_module
    try:
        return pl_module.get_submodule(module)
    except AttributeError:
        children = ", ".join(name for name, _ in pl_module.named_children())
        raise ValueError(
            f"{owner} module={module!r}: {type(pl_module).__name__} has no such submodule (its children: {children})"
        ) from None


def named_as_the_module(state: Mapping[str, Any], keys: tuple[str, ...], module: str | None) -> dict[str, Any]:
    """``state`` with the names of its mappings under ``keys`` prefixed by ``module.``: the LightningModule's
    ``state_dict`` names for a submodule's tensors (``net.0.weight`` -> ``generator.net.0.weight``)."""
    if module is None:
        return dict(state)
    prefix = f"{module}."
    return {
        **state,
        **{key: {prefix + n: v for n, v in state[key].items()} for key in keys if isinstance(state.get(key), Mapping)},
    }


def named_as_the_submodule(state: Mapping[str, Any], keys: tuple[str, ...], module: str | None) -> dict[str, Any]:
    """The inverse of ``named_as_the_module``; a name outside ``module`` stays as it is (for the average's own
    ``check_state`` to name)."""
    if module is None:
        return dict(state)
    prefix = f"{module}."
    return {
        **state,
        **{
            key: {n.removeprefix(prefix): v for n, v in state[key].items()}
            for key in keys
            if isinstance(state.get(key), Mapping)
        },
    }
