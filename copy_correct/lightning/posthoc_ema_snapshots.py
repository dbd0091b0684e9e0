"""``PostHocEMASnapshots``: ``PowerEMA`` profiles of a LightningModule, or of one submodule (``module="generator"``),
during ``fit``, snapshotted into the run's checkpoint directory (``power_ema/``) for post-hoc EMA:
``copy-correct posthoc RUN_DIR --sigma-rel 0.08`` writes checkpoints of the synthesized weights beside the run's,
which ``load_from_checkpoint`` reads; ``synthesize(RUN_DIR, sigma_rel=0.08)`` gives the averaged entries of the
``state_dict`` in Python. The gan page (``docs/recipes/gan.md``) and the resume guide are the full account.

Copy contract:

* Shared with the module: nothing. The profiles are the ``PowerEMA``'s own tensors
  (``copy_correct.averages.power_ema``), never a deep copy of the module nor in its ``parameters()``; the module's
  weights are only read (a sharded model's floating buffers excepted: rank 0's are copied into every rank before each
  update, as ``EMAWeights`` does, since FSDP2 never synchronises them). Checkpoints keep the live weights as Lightning
  saves them, and the ``PowerEMA`` state in the callback state (tensors and numbers only), so ``fit(ckpt_path=...)``
  continues the profiles and the snapshots bit for bit.
* New storage: each snapshot, written atomically by global rank 0 (by every rank, of its shards, when sharded) every
  ``snapshot_every`` optimizer steps and once more when ``fit`` ends off that schedule (``"final": True``, removed by
  a resumed run once it writes a later one). Names are the LightningModule's (``generator.net.0.weight``), and a
  snapshot of a submodule says which (``module``). A run resumed into another directory first carries the earlier
  snapshots of its history over, as hard links where the filesystem allows (``copy_correct.files.link_or_copy``), so its
  directory stands alone; each snapshot names the one before it (``previous``), so that a gap can be found.
* Autograd sees nothing: the update runs after each optimizer step (``update_every`` and ``snapshot_every`` count
  them, from the step Lightning restored), in place, with no allocation and no host read.
* Sharded (FSDP2): the profiles of each rank's shards, updated with no collective; checkpoints hold them as Lightning
  holds the weights (a distributed checkpoint's directory, or one file, gathered), and a fit resumes them at another
  world size (``torch.distributed.checkpoint`` reshards them into the new spread). The snapshot files then change
  spread at the resume (``rank{r}of{W}``); the earlier ones are carried over by the new ranks (old rank ``r`` by new
  rank ``r % W``), and ``copy-correct posthoc`` joins each step's files by its own world size.
* ``skip_nonfinite=True`` (opt-in) skips an update from non-finite weights, counted in ``posthoc_ema/skipped`` once
  per epoch; refused when sharded, as ``PowerEMA`` refuses it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from copy_correct.averages.posthoc import load_snapshot, snapshot_paths
from copy_correct.averages.posthoc_command import SHARD_FILE
from copy_correct.averages.power_ema import PowerEMA, snapshot_name
from copy_correct.averages.settings import defaults, power_ema_settings
from copy_correct.averages.shadow import gathered
from copy_correct.core.sharding import is_sharded, layout
from copy_correct.files.atomic_save import atomic_save
from copy_correct.files.link_or_copy import link_or_copy
from copy_correct.lightning._averaging_callback import AveragingCallback, average_arguments, distributed
from copy_correct.lightning._distributed_state import read_into, store_under_keys
from copy_correct.lightning._skip_log import SkipLog

__all__ = ["PostHocEMASnapshots"]

_POWER_EMA_DEFAULTS = defaults(PowerEMA)  # PowerEMA's arguments but the model and their defaults, read once
_OWN = (
    "module",
)  # beside PowerEMA's names, snapshot_every and snapshot_dir among them (with this callback's defaults)


class PostHocEMASnapshots(AveragingCallback):
    """Args: ``sigma_rels`` and, as keywords, the other arguments of ``PowerEMA`` (``update_every``,
    ``include_buffers``, ``shadow_dtype``, ``skip_nonfinite``: ``power_ema``, checked here as ``PowerEMA`` checks them,
    without building one); ``snapshot_every``: every this many optimizer steps, 1000 by default where ``PowerEMA``'s is
    ``None`` (deliberately: this callback exists to write the snapshots that post-hoc EMA is made from, so it always
    schedules them); ``snapshot_dir``: where they go, ``power_ema/`` in the checkpoint directory by default;
    ``module``: the submodule to average (an attribute path of the LightningModule, ``"generator"``), ``None`` for all
    of it."""

    _owner, _state_name = "PostHocEMASnapshots", "power_ema"

    def __init__(
        self,
        sigma_rels: tuple[float, ...] = (0.05, 0.10),
        *,
        snapshot_every: int = 1000,
        snapshot_dir: str | Path | None = None,
        module: str | None = None,
        **power_ema: Any,
    ) -> None:
        given = {"sigma_rels": sigma_rels, **power_ema}
        arguments = average_arguments("PostHocEMASnapshots", given, "PowerEMA", _POWER_EMA_DEFAULTS, _OWN)
        # Bad values fail now, in PowerEMA's words; the PowerEMA is built when fit starts. The directory stands in for
        # the one fit picks, so that snapshot_every is checked against update_every.
        checked = power_ema_settings(arguments | {"snapshot_every": snapshot_every, "snapshot_dir": "."})
        self._kwargs: dict[str, Any] = {"sigma_rels": checked.sigma_rels, **power_ema}  # it writes the snapshots itself
        self.snapshot_every = snapshot_every
        self.snapshot_dir = Path(snapshot_dir) if snapshot_dir is not None else None
        super().__init__(module, SkipLog("posthoc_ema/skipped", "PowerEMA"), {"sigma_rels": checked.sigma_rels})
        self._directory: Path | None = None  # where this rank writes snapshots; None: it writes none (rank > 0)
        self.power_ema: PowerEMA | None = None
        self._fit_start_step = 0  # the profiles' step when this fit started training
        self._written: Path | None = None  # this fit's last snapshot
        self._stale: list[Path] = []  # the final snapshot of the fit this one resumed, removed at the next one
        self._previous: int | None = 0  # the step of the history's last scheduled snapshot; None: unknown (old state)
        self.carried: list[tuple[Path, str]] = []  # what this fit carried over from the run it resumed: path, how

    @property
    def writes(self) -> bool:
        """Whether this process writes snapshots (global rank 0; every rank of a sharded model), once ``fit``
        started."""
        return self._directory is not None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.power_ema is not None:
            if self.power_ema.live_model is None:  # a copy (pickle, copy.deepcopy) of a callback: it gets the module
                self.power_ema.track(self._averaged(pl_module))
            return
        # The callback writes the snapshots itself (on_train_batch_end), named as the LightningModule's state_dict.
        power_ema = PowerEMA(self._averaged(pl_module), **self._kwargs)
        directory = self.snapshot_dir or _checkpoint_dir(trainer) / "power_ema"
        self._directory = directory if power_ema.sharded or trainer.global_rank == 0 else None
        self._restore_pending(power_ema)
        self.power_ema = power_ema

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._written, self._stale = None, []
        self.carried = []
        if self.power_ema is not None and self._directory is not None:
            self._fit_start_step = self.power_ema.step
            if self.power_ema.step > 0 and trainer.ckpt_path is not None and self.snapshot_dir is None:
                self.carried = self._carry(Path(trainer.ckpt_path).parent / "power_ema", self.power_ema.applied_step)
            if self.power_ema.step > 0:  # the resumed fit's final snapshot, of whatever spread it was written at
                at = self.power_ema.applied_step
                self._stale = [
                    path for path in self._owned(self._directory)
                    if int(path.name[10:19]) == at and load_snapshot(path).get("final", False)
                ]  # fmt: skip

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The final snapshot: when this fit updated the profiles since its last snapshot (module docstring)."""
        ema = self.power_ema
        if ema is None or self._directory is None or ema.step == self._fit_start_step:
            return
        if self._written is None or self._written.name != self._snapshot_name(ema.applied_step):
            self.save_snapshot(self._directory, final=True)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.power_ema is not None and self._stepped(trainer):
            if self.power_ema.sharded:  # every rank snapshots its own: the same buffers on all (DDP: rank 0 writes)
                self._sync_buffers(trainer, self.power_ema)
            self.power_ema.update()
            if self._directory is not None and self.power_ema.step % self.snapshot_every == 0:
                self.save_snapshot(self._directory)

    def save_snapshot(self, directory: str | Path, *, final: bool = False) -> Path:
        """Write the profiles as they are now to ``directory / snapshot_name(step)`` atomically (what the schedule
        does); the path. Names as in the LightningModule's ``state_dict``; with ``module``, the snapshot says which;
        ``final``: the snapshot taken when ``fit`` ends. Removes the resumed fit's final snapshot (module docstring)
        once this one is written elsewhere."""
        if self.power_ema is None:
            raise RuntimeError("PostHocEMASnapshots.save_snapshot before fit started: there are no profiles yet")
        state = self.power_ema.snapshot()
        if self.module is not None:
            prefix = f"{self.module}."
            state["module"] = self.module
            state["profiles"] = [{prefix + name: t for name, t in profile.items()} for profile in state["profiles"]]
            if "layout" in state:
                state["layout"] = {prefix + name: spread for name, spread in state["layout"].items()}
        if final:
            state["final"] = True
        if self._previous is not None:
            state["previous"] = self._previous
        path = atomic_save(
            state, Path(directory) / snapshot_name(state["step"], state.get("rank"), state.get("world_size"))
        )
        if not final and self._directory is not None and Path(directory) == self._directory:
            self._previous = int(state["step"])  # the next snapshot of this history follows this one
        if self._stale and path not in self._stale:
            for stale in self._stale:
                stale.unlink(missing_ok=True)
            self._stale = []
        self._written = path
        return path

    def _carry(self, source: Path, step: int) -> list[tuple[Path, str]]:
        """Link (or copy) into this rank's snapshot directory the snapshots of ``source`` that belong to the history
        up to ``step``: this rank's files of steps up to ``step``, a final one only at ``step`` (module docstring)."""
        assert self._directory is not None and self.power_ema is not None
        if not source.is_dir() or (self._directory.is_dir() and source.samefile(self._directory)):
            return []
        carried = []
        for path in self._owned(source):
            state = load_snapshot(path)  # memory-mapped: only the metadata is read
            at = int(state["step"])
            if at > step or (at < step and state.get("final", False)) or (self._directory / path.name).exists():
                continue
            carried.append((self._directory / path.name, link_or_copy(path, self._directory / path.name)))
        return carried

    def _owned(self, directory: Path) -> list[Path]:
        """The snapshot files in ``directory`` that this rank carries over and removes: of any world size's rank ``r``,
        those with ``r % world == rank`` (at this world size its own; an unsharded model's files: rank 0's)."""
        rank, world = 0, 1
        if self.power_ema is not None and self.power_ema.sharded:
            import torch.distributed as dist

            rank, world = dist.get_rank(), dist.get_world_size()
        owned = snapshot_paths(directory) if rank == 0 else []
        for path in sorted(directory.glob("power-ema-?????????-rank*of*.pt")):
            match = SHARD_FILE.fullmatch(path.name)
            if match is not None and int(match[2]) % world == rank:  # at this world size: its own
                owned.append(path)
        return sorted(owned)

    def _snapshot_name(self, step: int) -> str:
        """This rank's file name for a snapshot of ``step`` (``snapshot_name``, with the rank when sharded)."""
        if self.power_ema is None or not self.power_ema.sharded:
            return snapshot_name(step)
        import torch.distributed as dist

        return snapshot_name(step, dist.get_rank(), dist.get_world_size())

    # -- checkpoints ----------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if state and self._previous is not None:
            state["previous_snapshot"] = self._previous
        return state

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """A sharded model's profiles go where Lightning puts the sharded weights: their shards into the distributed
        checkpoint, each under a key the callback state names; or, for one file of full weights, gathered."""
        state = checkpoint.get("callbacks", {}).get(self.state_key, {}).get("power_ema")
        if self.power_ema is None or state is None or not self.power_ema.sharded:
            return
        profiles = self.power_ema.profiles
        state["layout"] = {name: layout(t) for name, t in profiles[0].items()}
        weights = checkpoint["state_dict"]
        if distributed(weights):  # every rank writes its shards
            # Buffers, whole on every rank and not synchronised by FSDP2, stay in the callback state: rank 0's.
            state["profiles"] = [
                profile | store_under_keys(weights, {n: t for n, t in profile.items() if is_sharded(t)},
                                           f"{self.state_key}/power_ema/profile{k}")
                for k, profile in enumerate(profiles)
            ]  # fmt: skip
        else:  # one file, written by rank 0 (the others' weights are empty here): every rank joins the gathers
            state["profiles"] = [gathered(profile) for profile in profiles]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "power_ema" in state_dict:
            self._previous = state_dict.get("previous_snapshot")  # None from a checkpoint written before it was kept
        super().load_state_dict(state_dict)

    def _read(self, power_ema: PowerEMA, state: Mapping[str, Any]) -> Mapping[str, Any]:
        """The state, its profiles read from the distributed checkpoint being restored where it names keys there (every
        rank its shards, into tensors spread as the model is now: ``torch.distributed.checkpoint`` reshards a
        checkpoint saved at another world size), after checking names and shapes."""
        if not any(isinstance(v, str) for saved in state["profiles"] for v in saved.values()):
            return state
        read = [
            {name: torch.empty_like(profile[name]) if name in profile else None for name, v in saved.items()
             if isinstance(v, str)}
            for profile, saved in zip(power_ema.profiles, state["profiles"], strict=False)
        ]  # fmt: skip
        profiles = [saved | holders for saved, holders in zip(state["profiles"], read, strict=False)]
        power_ema.check_state({**state, "profiles": profiles})  # before reading: names and spreads agree
        for holders, saved in zip(read, state["profiles"], strict=True):
            read_into(holders, {name: saved[name] for name in holders}, self._ckpt_path)
        return {**state, "profiles": profiles}


def _checkpoint_dir(trainer: pl.Trainer) -> Path:
    callback = trainer.checkpoint_callback
    dirpath = getattr(callback, "dirpath", None)
    return Path(dirpath) if dirpath else Path(trainer.default_root_dir)
