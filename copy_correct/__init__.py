"""copy-correct: training parts whose tensor copies are proven by memory and gradient tests. Three layers: these tensor
parts (torch and numpy only, any PyTorch loop), ``copy_correct.lightning`` (the adapters, the only Lightning importer)
and ``copy_correct.probes`` (what code copies, allocates, keeps alive). The parts live in rooms by concern, each with
its copy contract in its ``__init__`` (``averages``, ``replay``, ``files``, ``guards``, ``loading``; ``core`` below
them all); a concern of one module stays a module here (``target``, ``grad_average``, ``freeze``, ``errors``).

    EMA                  shadow weights averaged in place, one foreach call per group; sharded: per rank, no collective
    PowerEMA             EDM2's power-function EMA profiles, updated in place per step, snapshotted atomically
    synthesize           the EMA of any sigma_rel at a step the snapshots span (the maths: ``averages.power_function``)
    synthesis_coefficients  each snapshot profile's coefficient in that EMA
    make_target          a frozen copy of a network (own storage, no grad, eval mode)
    hard_update          target <- online, in place, bit for bit, one foreach call per group
    soft_update          target <- (1 - tau) target + tau online, in place
    skipped_updates      how many ``skip_nonfinite`` updates a NaN or an Inf skipped
    ReplayBuffer         preallocated transitions written in place, sampled as independent tensors
    FrameReplayBuffer    frame-stacked transitions, each frame stored once per env stream; stacks rebuilt at sample
    SampleAhead          a buffer's next batch drawn on a background thread, one call ahead, the same batches every run
    GradientAverager     a parameter list's gradients averaged over processes, one collective per dtype
    frozen               a block in which a module's parameters do not require grad, flags restored after
    DevicePrefetcher     batches on the device, the next one's copy overlapping compute on a side stream
    map_tensors          a function applied to every tensor of a nested batch, the structure kept
    DeviceDataLoader     a DataLoader whose iterator is a DevicePrefetcher (DDP samplers still injected)
    make_loader          a loader that pins only for an accelerator, with or without the prefetcher
    load_checked         torch.load(weights_only=True) of a file after its digests are checked: nothing in it runs
    verify_checkpoint    a checkpoint file's or sharded directory's digests checked, nothing loaded
    CheckpointMismatch   raised while restoring a checkpoint that does not fit the run (train.py: one line, exit 2)
    DamagedFile          a file whose bytes do not match the digests written with it, or not torch.save's at all
    MissingFile          a file handed over that is not there: a FileNotFoundError and a DamagedFile
    UnsafeFile           a file whose pickle names what a weights_only load refuses (loading it could run code)
"""

from copy_correct.averages.ema import EMA
from copy_correct.averages.posthoc import synthesis_coefficients, synthesize
from copy_correct.averages.power_ema import PowerEMA
from copy_correct.errors import CheckpointMismatch, DamagedFile, MissingFile, UnsafeFile
from copy_correct.files.checked_load import load_checked, verify_checkpoint
from copy_correct.freeze import frozen
from copy_correct.grad_average import GradientAverager
from copy_correct.guards.device import skipped_updates
from copy_correct.loading.device_loader import DeviceDataLoader, make_loader
from copy_correct.loading.prefetch import DevicePrefetcher, map_tensors
from copy_correct.replay.buffer import ReplayBuffer
from copy_correct.replay.frame_buffer import FrameReplayBuffer
from copy_correct.replay.sample_ahead import SampleAhead
from copy_correct.target import hard_update, make_target, soft_update

__all__ = [
    "EMA",
    "CheckpointMismatch",
    "DamagedFile",
    "DeviceDataLoader",
    "DevicePrefetcher",
    "FrameReplayBuffer",
    "GradientAverager",
    "MissingFile",
    "PowerEMA",
    "ReplayBuffer",
    "SampleAhead",
    "UnsafeFile",
    "frozen",
    "hard_update",
    "load_checked",
    "make_loader",
    "make_target",
    "map_tensors",
    "skipped_updates",
    "soft_update",
    "verify_checkpoint",
    "synthesis_coefficients",
    "synthesize",
]
