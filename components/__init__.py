"""Copy-correct training components and the probes that prove their copy behaviour.

Probes (usable on any PyTorch code):
    CopyAudit          every op that allocates storage or writes in place, with bytes
    CollectiveProbe    the collectives a block issues on this rank (all-gather, reduce-scatter, ...), with bytes
    MemoryProbe        peak / net bytes of the storage a block creates, one ledger on every device
    find_graph_refs    paths of tensors that keep an autograd graph alive
    shares_storage     storage-level aliasing (not ``data_ptr()`` equality)

Training components:
    EMA                shadow weights averaged in place, one foreach call per group; sharded: per rank, no collective
    make_target        a frozen copy of a network (own storage, no grad, eval mode)
    hard_update        target <- online, in place, bit for bit, one foreach call per group
    soft_update        target <- (1 - tau) target + tau online, in place
    ReplayBuffer       preallocated transitions written in place, sampled as independent tensors
    GradientAverager   a parameter list's gradients averaged over processes, one collective per dtype
    frozen             a block in which a module's parameters do not require grad, flags restored after
    DevicePrefetcher   batches on the device, the next one's copy overlapping compute on a side stream
    DeviceDataLoader   a DataLoader whose iterator is a DevicePrefetcher (DDP samplers still injected)
    make_loader        a loader that pins only for an accelerator, with or without the prefetcher

Lightning plugins and callbacks:
    AtomicCheckpointIO   checkpoints streamed to a file beside the target and renamed over it: no torn files
    EMACallback          an EMA of the module: updated per optimizer step, evaluated beside it, checkpointed
    DataWaitMonitor      logs samples per second and the share of time spent waiting for batches
    GraphRetentionGuard  fails a run the step a graph leaks into outputs, attributes or metric states
    ResumeState          every rank's global RNG states, recipe and seed in checkpoints: exact resume, foreign refused
    CheckpointMismatch   raised while restoring a checkpoint that does not fit the run (train.py: one line, exit 2)
    RunSummary           writes ``summary.json`` (final metrics, recipe, seed) into the run directory
    StepProbe            audits one training batch's copies and measures memory growth per batch
"""

from components.atomic_checkpoint import AtomicCheckpointIO
from components.collective_probe import CollectiveProbe
from components.copy_audit import CopyAudit, TensorEvent
from components.data_wait import DataWaitMonitor
from components.device_loader import DeviceDataLoader, make_loader
from components.ema import EMA
from components.ema_callback import EMACallback
from components.freeze import frozen
from components.grad_average import GradientAverager
from components.graph_guard import GraphRetentionError, GraphRetentionGuard
from components.graph_refs import find_graph_refs
from components.memory_probe import MemoryProbe
from components.prefetch import DevicePrefetcher, map_tensors
from components.replay import ReplayBuffer
from components.resume import CheckpointMismatch, ResumeState, check_checkpoint
from components.run_summary import RunSummary
from components.step_probe import StepProbe
from components.storage import shares_storage, storage_key
from components.target import hard_update, make_target, soft_update

__all__ = [
    "EMA",
    "AtomicCheckpointIO",
    "CheckpointMismatch",
    "CollectiveProbe",
    "EMACallback",
    "CopyAudit",
    "DataWaitMonitor",
    "DeviceDataLoader",
    "DevicePrefetcher",
    "GradientAverager",
    "GraphRetentionError",
    "GraphRetentionGuard",
    "MemoryProbe",
    "ReplayBuffer",
    "ResumeState",
    "RunSummary",
    "StepProbe",
    "TensorEvent",
    "check_checkpoint",
    "find_graph_refs",
    "frozen",
    "hard_update",
    "make_loader",
    "make_target",
    "map_tensors",
    "shares_storage",
    "soft_update",
    "storage_key",
]
