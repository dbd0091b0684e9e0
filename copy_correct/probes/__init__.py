"""Probes: the tools that measure what code copies, allocates and keeps alive. They prove the training parts' copy
contracts in the tests and work on any PyTorch code; no training part imports them. Torch only: their Lightning
halves (``StepProbe``, ``GraphRetentionCheck``) are in ``copy_correct.lightning``.

    CopyAudit            every op that allocates storage or writes in place, with bytes
    CollectiveProbe      the collectives a block issues on this rank (all-gather, reduce-scatter, ...), with bytes
    TensorEvent          one tensor an op touched, as ``CopyAudit`` records it: op, alloc or write, bytes, dtype, shape
    MemoryProbe          peak / net bytes of the storage a block creates, one ledger on every device
    find_graph_refs      paths of tensors that keep an autograd graph alive
    graph_bytes          bytes of storage a tensor's autograd graph keeps alive (what ``.detach()`` would free)
    shares_storage       storage-level aliasing (not ``data_ptr()`` equality)
    storage_key          the identity of a tensor's storage, comparable across views
    GraphRetentionGuard  stops a loop (``check``) the step a graph leaks, naming each path and its bytes
    GraphRetentionError  what ``GraphRetentionGuard`` raises
"""

from copy_correct.probes.collective_probe import CollectiveProbe
from copy_correct.probes.copy_audit import CopyAudit, TensorEvent
from copy_correct.probes.graph_guard import GraphRetentionError, GraphRetentionGuard
from copy_correct.probes.graph_refs import find_graph_refs, graph_bytes
from copy_correct.probes.memory_probe import MemoryProbe
from copy_correct.probes.storage import shares_storage, storage_key

__all__ = [
    "CollectiveProbe",
    "CopyAudit",
    "GraphRetentionError",
    "GraphRetentionGuard",
    "MemoryProbe",
    "TensorEvent",
    "find_graph_refs",
    "graph_bytes",
    "shares_storage",
    "storage_key",
]
