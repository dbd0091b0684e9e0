"""``TrainDataOrder``: the training data order through a resume, for map-style ``DataLoader``s that batch with torch's
``BatchSampler`` (any ``DataLoader(dataset, batch_size=..., shuffle=..., sampler=..., generator=...)``): the rest of
an interrupted epoch, and every later epoch, hold the items the uninterrupted run's do, in its order. ``ResumeState``
holds one; this module is its data-order part.

Why Lightning (2.6) needs it. An epoch's ``DataLoader`` iterator draws the workers' base seed when it is created
(from ``loader.generator``, else from torch's global CPU generator) and a ``RandomSampler`` draws its order at the
epoch's first batch (from ``sampler.generator``, else a seed from the global generator). Lightning creates the first
epoch's iterator in ``FitLoop.setup_data``, before any ``on_train_start`` hook, and a resumed fit creates no other one
for its first epoch: its base seed comes from the fresh process, the order one draw early. Mid-epoch, Lightning starts
a plain loader's epoch over while counting the batches already done, so the resumed run sees the wrong items.

What is shared and what is new: the loaders, their samplers and generators are the user's own objects; the only
change to them is one ``RecordingSampler`` put between each instrumented loader's ``BatchSampler`` and its sampler
while ``fit`` runs (taken out at ``teardown``). New storage: one start record per loader (the global generators' states:
16 kB in a checkpoint, 21 kB with the sampler's own generator) and, in each checkpoint, the loaders' own generators'
states.

* ``RecordingSampler`` yields its sampler's indices unchanged and draws nothing, so an uninterrupted run with
  ``num_workers=0`` sees exactly the order and the draws it saw without it. When an iteration starts it records the
  epoch, the batches Lightning has fetched in it, the global generators' states (torch CPU, NumPy, ``random``) and the
  sampler's own generator's state: enough to start the same iteration again.
* ``state_dict`` (in every checkpoint): the epoch, the batches Lightning has fetched in it
  (``batch_progress.current.ready``: at ``on_train_batch_end`` the current batch included, at a validation's end and
  at the epoch's end every batch fetched so far), and per train loader the states of its own generators
  (``loader.generator``, ``sampler.generator``) and the start record of the epoch in progress. Tensors, numbers,
  tuples: it loads with ``weights_only=True``.
* ``on_train_start`` of a resumed fit puts the loaders' own generators back to their states at the save. From a
  checkpoint taken mid-epoch, each loader's next iteration in that epoch replays: the recorded states set, the sampler
  started (its draws), the global states put back, the consumed batches' indices skipped. The iterator Lightning made
  before the hook is then discarded and a new one created at the first fetch, where the uninterrupted run created the
  epoch's iterator: at an epoch boundary it draws what that one drew (base seed, order), after every
  ``on_train_epoch_start`` hook; mid-epoch it draws nothing (the global states and the own generators are put back
  around its creation).
* A fresh fit with ``num_workers > 0``: Lightning's first iterator has handed the workers the first epoch's indices
  before any callback could record them, so it is discarded and a recorded one created at the first fetch. That
  fit's first epoch then has another order than without ``ResumeState``, and the generators draw on from there:
  exactly reproducible, across resumes too.

Not exact, and nothing here can make it so: random draws inside worker processes (``num_workers > 0``) after a
mid-epoch resume (the workers never process the skipped items, so their generators stand elsewhere) and, with
``persistent_workers=True``, after any resume (the workers' generators run on across epochs; a resumed run's workers
start afresh); a sampler that draws from the global generators after its first item. Loaders that cannot be
instrumented (an ``IterableDataset``, a custom ``batch_sampler``, ``batch_size=None``) have no order to replay:
resumed mid-epoch, Lightning starts their epoch over and a warning says so in one line (at an epoch boundary their
iterator is made where the uninterrupted run made it, like the others'). Loaders without a length make Lightning fetch
a batch before ``on_train_start``: their iterator is not restarted, and a warning says the order is not restored.
The restart goes through Lightning's private ``Trainer.fit_loop._data_fetcher`` and the clock through
``batch_progress.current.ready`` (2.6: ``copy_correct.lightning._lightning_internals``, ``NEEDS``). ``on_train_start``
checks that they are there before it uses them (where the fit has train loaders): a Lightning without them stops the
fit before its first batch, with one ``RuntimeError`` line naming what is missing and the version installed.

Why not Lightning's own loader state: Lightning 2.6 saves and restores the ``state_dict`` of a train loader that has
one (a stateful ``DataLoader``, such as torchdata's ``StatefulDataLoader``), in ``FitLoop.setup_data`` before it makes
the epoch's iterator. A plain ``DataLoader`` has none, and that is the loader a user gives (and the one Lightning may
re-create to add a ``DistributedSampler``); giving it one would replace the user's loader. It does nothing for a fresh
fit either, whose first iterator is made, and given its workers' indices, before any callback can record them.
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
