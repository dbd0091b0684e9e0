"""The Lightning adapters: the tensor parts as callbacks and plugins, and the probes' Lightning halves. The only
modules of the package that import Lightning.

Callbacks are named for what they do, as Lightning's are (``ModelCheckpoint``, ``EarlyStopping``): no ``Callback``
suffix.

Adapters:
    EMAWeights           an EMA of the module, updated per optimizer step, evaluated, checkpointed
    PostHocEMASnapshots  PowerEMA profiles of the module per optimizer step, snapshotted for post-hoc EMA
    ResumeState          every rank's RNG states, recipe and seed in checkpoints; exact resume
    check_checkpoint     raises ``ValueError`` unless a checkpoint was stamped with this recipe and seed
    IsolatedEvaluation   each validation in ``fit`` leaves torch's, NumPy's and Python's generators as it found them
    RunSummary           writes ``summary.json`` (final metrics, recipe, seed)
    NonFiniteStop        stops a run at the first NaN or Inf loss or weight, before a checkpoint holds it
    NonFiniteTraining    what ``NonFiniteStop`` raises: one line naming the step
    LastCheckpoint       the resume point ``last.ckpt``: at every epoch's end, by steps and by time
    StaleTemporaries     at start, removes the temporary files of killed writers in the checkpoint folders
    DataWaitMonitor      samples per second and the share of time spent waiting for batches
    AtomicCheckpointIO   checkpoints streamed to a file beside the target and renamed over it
    AtomicModelParallelStrategy  Lightning's FSDP2 strategy, its checkpoint directories written beside and swapped in

Probes:
    StepProbe            audits one training batch's copies, measures memory growth per batch
    GraphRetentionCheck  ``GraphRetentionGuard`` after every training batch, on the step's outputs and the module
"""

# Lightning is the `lightning` extra, not a requirement of the tensor parts: without it, one line that says what to
# install, not a traceback from the first adapter that imports it.
try:
    import lightning.pytorch  # noqa: F401
except ModuleNotFoundError as missing:
    raise ImportError(
        f"copy_correct.lightning needs Lightning ({missing.name} is missing): pip install 'copy-correct[lightning]'"
    ) from None

from copy_correct.lightning.atomic_checkpoint import AtomicCheckpointIO
from copy_correct.lightning.atomic_sharded_checkpoint import AtomicModelParallelStrategy
from copy_correct.lightning.data_wait import DataWaitMonitor
from copy_correct.lightning.ema_weights import EMAWeights
from copy_correct.lightning.graph_guard import GraphRetentionCheck
from copy_correct.lightning.isolated_evaluation import IsolatedEvaluation
from copy_correct.lightning.last_checkpoint import LastCheckpoint
from copy_correct.lightning.nonfinite_stop import NonFiniteStop, NonFiniteTraining
from copy_correct.lightning.posthoc_ema_snapshots import PostHocEMASnapshots
from copy_correct.lightning.resume import ResumeState, check_checkpoint
from copy_correct.lightning.run_summary import RunSummary
from copy_correct.lightning.stale_temporaries import StaleTemporaries
from copy_correct.lightning.step_probe import StepProbe

__all__ = [
    "AtomicCheckpointIO",
    "AtomicModelParallelStrategy",
    "DataWaitMonitor",
    "EMAWeights",
    "GraphRetentionCheck",
    "IsolatedEvaluation",
    "NonFiniteStop",
    "NonFiniteTraining",
    "LastCheckpoint",
    "PostHocEMASnapshots",
    "ResumeState",
    "RunSummary",
    "StaleTemporaries",
    "StepProbe",
    "check_checkpoint",
]
