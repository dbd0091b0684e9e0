"""``TrainDataOrder``: the training data order through a resume (``ResumeState``'s data-order part), for map-style
``DataLoader``s that batch with torch's ``BatchSampler``: the rest of an interrupted epoch, and every later epoch,
hold the items the uninterrupted run's do, in its order.

Why Lightning (2.6) needs it: it makes the first epoch's iterator in ``FitLoop.setup_data``, before any
``on_train_start``, and a resumed fit makes no other for that epoch (the workers' base seed comes from the fresh
process, the order is drawn one draw early); mid-epoch it starts a plain loader's epoch over while counting the
batches done. Its own loader state needs a stateful loader (``StatefulDataLoader``), which would replace the user's.

Copy contract (no tensor of the run is read, copied or seen by autograd):

* Shared: the loaders, samplers and generators are the user's own. The one change is a ``RecordingSampler`` between
  each loader's ``BatchSampler`` and its sampler while ``fit`` runs (taken out at ``teardown``): it yields the
  sampler's indices unchanged and draws nothing, so with ``num_workers=0`` a run sees the order and draws it saw
  without it.
* New storage: per loader, the start record of the epoch in progress (the global generators' states, torch CPU, NumPy
  and ``random``, and the sampler's own generator's, noted when an iteration starts); in each checkpoint, the epoch,
  the batches fetched in it (``batch_progress.current.ready``), the records and the loaders' own generators' states:
  tensors, numbers and tuples, loaded with ``weights_only=True``.
* On resume (``on_train_start``): the loaders' generators put back; mid-epoch, the epoch replayed from its record, the
  consumed batches skipped; the iterator Lightning made is discarded and one made at the first fetch, where the
  uninterrupted run made it, drawing what it drew. A fresh fit with ``num_workers > 0`` is remade alike, so its first
  epoch's order differs from a run without ``ResumeState``.
* What stays inexact (draws inside workers after a mid-epoch resume or with persistent workers; loaders that cannot be
  instrumented, which warn) is in the resume guide. The private ``fit_loop._data_fetcher`` and
  ``batch_progress.current.ready`` are checked at ``on_train_start`` (``_lightning_internals.NEEDS``): one
  ``RuntimeError`` line naming what is missing and the version installed.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import CombinedLoader, rank_zero_warn
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler

from copy_correct.lightning._lightning_internals import (
    BATCHES_FETCHED,
    DATA_FETCHER,
    batches_fetched,
    check,
    data_fetcher,
    fetched_ahead,
    fetcher_loader,
    set_fetcher_iterator,
)
from copy_correct.lightning.rng_state import get_rng_state, set_rng_state

__all__ = ["NEEDS", "RecordingSampler", "TrainDataOrder", "train_loaders", "why_not_instrumented"]

NEEDS = (DATA_FETCHER, BATCHES_FETCHED)  # the Lightning internals the data order goes through

Clock = Callable[[], tuple[int, int]]  # (the epoch, the batches Lightning has fetched in it)


def _own_generator(owner: object) -> torch.Generator | None:
    generator = getattr(owner, "generator", None)
    return generator if isinstance(generator, torch.Generator) else None


def _state_of(generator: torch.Generator | None) -> torch.Tensor | None:
    return None if generator is None else generator.get_state()


class RecordingSampler(Sampler[int]):
    """``sampler``'s indices, unchanged; each iteration's start recorded in ``start``, and replayed once from
    ``replay`` (a start record and the batches of ``batch_size`` indices consumed) when it is set and the next
    iteration starts in its epoch."""

    def __init__(self, sampler: Sampler[int], batch_size: int, clock: Clock) -> None:
        self.sampler = sampler
        self.batch_size = batch_size
        self.clock = clock
        self.start: dict[str, Any] | None = None
        self.replay: tuple[dict[str, Any], int] | None = None

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[int]:
        epoch, fetched = self.clock()
        replay, self.replay = self.replay, None
        if replay is not None and replay[0]["epoch"] == epoch:
            self.start = replay[0]  # its offset still counts the batches fetched in the epoch before the resume
            return self._replayed(*replay)
        generator = _own_generator(self.sampler)
        self.start = {
            "epoch": epoch, "offset": fetched, "rng": get_rng_state(cuda=False), "generator": _state_of(generator),
        }  # fmt: skip
        return iter(self.sampler)

    def _replayed(self, start: dict[str, Any], consumed: int) -> Iterator[int]:
        now = get_rng_state(cuda=False)
        set_rng_state(start["rng"])
        generator = _own_generator(self.sampler)
        if generator is not None and start["generator"] is not None:
            generator.set_state(start["generator"])  # and left where the replay takes it: where the sampler had it
        try:
            indices = iter(self.sampler)
            skip = consumed * self.batch_size
            head = list(itertools.islice(indices, max(skip, 1)))  # one at least: a sampler draws at its first item
        finally:
            set_rng_state(now)
        return itertools.chain(head[skip:], indices)


def train_loaders(trainer: pl.Trainer) -> list[Any]:
    """The fit's training loaders, in the order Lightning iterates them (``CombinedLoader``'s ``flattened``)."""
    loaders = trainer.train_dataloader
    return [] if loaders is None else CombinedLoader(loaders).flattened


def why_not_instrumented(loader: object) -> str | None:
    """Why ``loader``'s order cannot be recorded, or ``None`` where it can."""
    if not isinstance(loader, DataLoader):
        return f"a {type(loader).__name__}, not a DataLoader"
    if isinstance(loader.dataset, IterableDataset):
        return "an IterableDataset"
    if loader.batch_sampler is None:
        return "batch_size=None"
    if type(loader.batch_sampler) is not BatchSampler:
        return f"a custom batch_sampler ({type(loader.batch_sampler).__name__})"
    return None


def _recorder(loader: object) -> RecordingSampler | None:
    sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    return sampler if isinstance(sampler, RecordingSampler) else None


def _sampler_of(loader: object) -> object:
    recorder = _recorder(loader)
    return recorder.sampler if recorder is not None else getattr(loader, "sampler", None)


def _clock(trainer: pl.Trainer) -> Clock:
    def now() -> tuple[int, int]:
        return trainer.current_epoch, batches_fetched(trainer)

    return now


class TrainDataOrder:
    """The data-order part of ``ResumeState``: ``instrument``, ``state_dict``, ``on_train_start`` (with the state to
    resume from, or ``None``) and ``teardown``, called from the callback's hooks of the same names."""

    def __init__(self) -> None:
        self._installed: list[tuple[BatchSampler, Sampler[int]]] = []

    def instrument(self, trainer: pl.Trainer) -> None:
        """Put a ``RecordingSampler`` into every train loader that can take one and has none (loaders reloaded by
        ``reload_dataloaders_every_n_epochs`` included)."""
        for loader in train_loaders(trainer):
            if why_not_instrumented(loader) is not None or _recorder(loader) is not None:
                continue
            batches = loader.batch_sampler
            batches.sampler = RecordingSampler(batches.sampler, batches.batch_size, _clock(trainer))
            self._installed.append((batches, batches.sampler.sampler))

    def teardown(self) -> None:
        """Take the ``RecordingSampler``s out again: the user's loaders are as they were."""
        for batches, sampler in self._installed:
            if isinstance(batches.sampler, RecordingSampler) and batches.sampler.sampler is sampler:
                batches.sampler = sampler
        self._installed = []

    def state_dict(self, trainer: pl.Trainer | None) -> dict[str, Any] | None:
        """This process's data order at a save (``None`` outside a fit with train loaders)."""
        loaders = [] if trainer is None else train_loaders(trainer)
        if not loaders:
            return None
        epoch, fetched = _clock(trainer)()  # type: ignore[arg-type]
        entries = []
        for loader in loaders:
            recorder = _recorder(loader)
            start = recorder.start if recorder is not None else None
            entries.append({
                "loader_generator": _state_of(_own_generator(loader)),
                "sampler_generator": _state_of(_own_generator(_sampler_of(loader))),
                "start": start if start is not None and start["epoch"] == epoch else None,
            })  # fmt: skip
        return {"epoch": epoch, "fetched": fetched, "loaders": entries}

    def on_train_start(self, trainer: pl.Trainer, state: dict[str, Any] | None) -> None:
        """Check the Lightning internals ``NEEDS`` (where there are train loaders); instrument the loaders; resuming
        from ``state``, restore their order; in a fresh fit, restart an iterator whose workers took the first epoch's
        indices unrecorded."""
        if train_loaders(trainer):
            check("ResumeState", trainer, NEEDS)
        self.instrument(trainer)
        loaders = train_loaders(trainer)
        recorded = [loader for loader in loaders if _recorder(loader) is not None]
        if state is None:
            if any(loader.num_workers > 0 for loader in recorded) and not trainer.fit_loop.is_resuming:
                _restart_at_first_fetch(trainer, keep=None)
            return
        if len(state["loaders"]) != len(loaders):
            rank_zero_warn(
                f"the checkpoint holds the data order of {len(state['loaders'])} train loader(s), this run has "
                f"{len(loaders)}: their order is not restored"
            )
            return
        mid_epoch = state["epoch"] == trainer.current_epoch and 0 < state["fetched"] < trainer.num_training_batches
        replaying = self._replay(loaders, state) if mid_epoch else []  # warns for the loaders it cannot replay
        for loader, entry in zip(loaders, state["loaders"], strict=True):
            _set_state(_own_generator(loader), entry["loader_generator"])
            _set_state(_own_generator(_sampler_of(loader)), entry["sampler_generator"])
        if not mid_epoch:
            _restart_at_first_fetch(trainer, keep=None)
            return
        replayed = {id(g) for r in replaying if (g := _own_generator(r.sampler)) is not None}
        owned = [g for loader in loaders for g in (_own_generator(loader), _own_generator(_sampler_of(loader)))]
        keep = {id(g): g for g in owned if g is not None and id(g) not in replayed}
        _restart_at_first_fetch(trainer, keep=list(keep.values()))

    def _replay(self, loaders: Sequence[Any], state: dict[str, Any]) -> list[RecordingSampler]:
        replaying, lost = [], []
        for index, (loader, entry) in enumerate(zip(loaders, state["loaders"], strict=True)):
            recorder, start = _recorder(loader), entry["start"]
            if recorder is not None and start is not None:
                recorder.replay = (start, state["fetched"] - start["offset"])
                replaying.append(recorder)
            else:
                reason = why_not_instrumented(loader) or "its epoch started before ResumeState could record it"
                lost.append(f"{index} ({reason})")
        if lost:
            rank_zero_warn(
                f"train loader {', '.join(lost)}: the rest of the interrupted epoch is not the uninterrupted run's "
                "(its order cannot be restored mid-epoch)"
            )
        return replaying


def _set_state(generator: torch.Generator | None, state: torch.Tensor | None) -> None:
    if generator is not None and state is not None:
        generator.set_state(state)


class _RestartAtFirstFetch(Iterator[Any]):
    """Stands in for the data fetcher's iterator until the first fetch, which creates the epoch's iterator anew (with
    ``keep``: the global generators' and these generators' states put back around its creation)."""

    def __init__(self, fetcher: Any, keep: list[torch.Generator] | None) -> None:
        self.fetcher = fetcher
        self.keep = keep

    def __next__(self) -> Any:
        if self.keep is None:
            iterator = iter(fetcher_loader(self.fetcher))
        else:
            now, kept = get_rng_state(cuda=False), [(g, g.get_state()) for g in self.keep]
            iterator = iter(fetcher_loader(self.fetcher))
            set_rng_state(now)
            for generator, state in kept:
                generator.set_state(state)
        set_fetcher_iterator(self.fetcher, iterator)
        return next(iterator)


def _restart_at_first_fetch(trainer: pl.Trainer, keep: list[torch.Generator] | None) -> None:
    fetcher = data_fetcher(trainer, "ResumeState")
    if fetched_ahead(fetcher):  # an unsized loader: Lightning fetched a batch ahead, from this iterator
        rank_zero_warn("the train loaders have no length, so Lightning fetched a batch already: their order is not "
                       "restored")  # fmt: skip
        return
    set_fetcher_iterator(fetcher, _RestartAtFirstFetch(fetcher, keep))
