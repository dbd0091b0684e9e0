"""The end of a multi-process run (``trainer=ddp``, ``trainer=fsdp``): ``end_process_group()``, which ``train.py``
calls on every rank once ``fit`` has returned and the trainer and model are out of its reach. It waits for every rank
(a barrier: this rank's collectives are finished, and no rank leaves while another still needs it), destroys the
default process group and collects the garbage that still holds it (the trainer and the model, FSDP2's state among
them, in reference cycles), so that its backend is freed and gloo's threads are joined while the interpreter is whole.
Without a process group (one process) it does nothing.

Why: Lightning makes the group when a multi-process fit starts and destroys an NCCL one at exit, never a gloo one,
so gloo's threads outlived ``main``. A run-loop thread that destroys a finished collective's work frees tensors
whose Python objects it must release under the GIL; when the interpreter has begun finalizing by then, Python ends
the thread inside that C++ destructor, and the process aborts (SIGABRT, exit -6, "terminate called without an active
exception") after training succeeded. ``destroy_process_group`` alone does not join the threads: they live as long
as anything holds the group.

A run that fails does not come here: a rank that raised may have left the others inside a collective, where a barrier
would wait for them until the group's timeout. Such a run exits non-zero with its own message, as before.
"""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist

__all__ = ["end_process_group"]


def end_process_group() -> None:
    """Once every rank gets here, destroy the default process group and free it (its threads joined); nothing where
    no group was made. Call it with nothing left that holds the trainer or the model."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_backend() == "nccl":  # told the device, NCCL's barrier does not guess one (and warn)
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()
    dist.destroy_process_group()
    gc.collect()
