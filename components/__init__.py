"""Copy-correct training parts, and the probes that prove their copy behaviour.

Two groups, and one direction between them: the probes (``components/probes/``) measure; the training parts
(the other modules here) train, and never import a probe, so a project can take a training part without them.
Every name is importable from ``components``, and imported from its module on first use (``components/_lazy.py``):
taking one tensor utility imports its module and what that needs, not Lightning, which only the Lightning callbacks
import.

Probes (``components.probes``, usable on any PyTorch code):
    CopyAudit            every op that allocates storage or writes in place, with bytes
    CollectiveProbe      the collectives a block issues on this rank (all-gather, reduce-scatter, ...), with bytes
    TensorEvent          one tensor an op touched, as ``CopyAudit`` records it: op, alloc or write, bytes, dtype, shape
    MemoryProbe          peak / net bytes of the storage a block creates, one ledger on every device
    find_graph_refs      paths of tensors that keep an autograd graph alive
    graph_bytes          bytes of storage a tensor's autograd graph keeps alive (what ``.detach()`` would free)
    shares_storage       storage-level aliasing (not ``data_ptr()`` equality)
    storage_key          the identity of a tensor's storage, comparable across views
    StepProbe            Lightning callback: audits one training batch's copies, measures memory growth per batch
    GraphRetentionGuard  fails a loop (``check``) or a Lightning run the step a graph leaks, with the bytes it keeps
    GraphRetentionError  what ``GraphRetentionGuard`` raises

Training parts:
    EMA                  shadow weights averaged in place, one foreach call per group; sharded: per rank, no collective
    make_target          a frozen copy of a network (own storage, no grad, eval mode)
    hard_update          target <- online, in place, bit for bit, one foreach call per group
    soft_update          target <- (1 - tau) target + tau online, in place
    ReplayBuffer         preallocated transitions written in place, sampled as independent tensors
    GradientAverager     a parameter list's gradients averaged over processes, one collective per dtype
    frozen               a block in which a module's parameters do not require grad, flags restored after
    DevicePrefetcher     batches on the device, the next one's copy overlapping compute on a side stream
    map_tensors          a function applied to every tensor of a nested batch, the structure kept
    DeviceDataLoader     a DataLoader whose iterator is a DevicePrefetcher (DDP samplers still injected)
    make_loader          a loader that pins only for an accelerator, with or without the prefetcher
    AtomicCheckpointIO   Lightning plugin: checkpoints streamed to a file beside the target and renamed over it
    AtomicModelParallelStrategy  Lightning's FSDP2 strategy, its checkpoint directories written beside and swapped in
    EMACallback          Lightning callback: an EMA of the module, updated per optimizer step, evaluated, checkpointed
    DataWaitMonitor      Lightning callback: samples per second and the share of time spent waiting for batches
    ResumeState          Lightning callback: every rank's RNG states, recipe and seed in checkpoints; exact resume
    check_checkpoint     raises ``ValueError`` unless a checkpoint was stamped with this recipe and seed
    CheckpointMismatch   raised while restoring a checkpoint that does not fit the run (train.py: one line, exit 2)
    RunSummary           Lightning callback: writes ``summary.json`` (final metrics, recipe, seed)
"""

from typing import TYPE_CHECKING

from components._lazy import lazy_exports

if TYPE_CHECKING:  # the exports, each imported from its module on first use (components/_lazy.py)
    from components.atomic_checkpoint import AtomicCheckpointIO
    from components.atomic_sharded_checkpoint import AtomicModelParallelStrategy
    from components.data_wait import DataWaitMonitor
    from components.device_loader import DeviceDataLoader, make_loader
    from components.ema import EMA
    from components.ema_callback import EMACallback
    from components.freeze import frozen
    from components.grad_average import GradientAverager
    from components.prefetch import DevicePrefetcher, map_tensors
    from components.probes.collective_probe import CollectiveProbe
    from components.probes.copy_audit import CopyAudit, TensorEvent
    from components.probes.graph_guard import GraphRetentionError, GraphRetentionGuard
    from components.probes.graph_refs import find_graph_refs, graph_bytes
    from components.probes.memory_probe import MemoryProbe
    from components.probes.step_probe import StepProbe
    from components.probes.storage import shares_storage, storage_key
    from components.replay import ReplayBuffer
    from components.resume import CheckpointMismatch, ResumeState, check_checkpoint
    from components.run_summary import RunSummary
    from components.target import hard_update, make_target, soft_update

__all__ = [
    "EMA",
    "AtomicCheckpointIO",
    "AtomicModelParallelStrategy",
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
    "graph_bytes",
    "frozen",
    "hard_update",
    "make_loader",
    "make_target",
    "map_tensors",
    "shares_storage",
    "soft_update",
    "storage_key",
]

__getattr__, __dir__ = lazy_exports(__name__)
