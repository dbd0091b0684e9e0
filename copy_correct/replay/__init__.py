"""Replay: transitions copied into preallocated storage by ``add`` and sampled into new memory by ``sample``.

* ``ReplayBuffer`` (``buffer``): every field of a transition in its own ring; ``FrameReplayBuffer``
  (``frame_buffer``): each Atari frame stored once per env stream, stacks rebuilt at sample, optionally compressed
  (``frame_store``, ``frame_codec``).
* What both share: one base (``base``: ``add``'s dispatch to its path, ``sample`` from its checks to the batch on its
  device, the one method that draws a batch's rows, uniformly or by priority (``priorities``: ``prioritized=True``,
  OpenAI baselines' definitions), the copy refusal), the fields, dtypes and the one value check
  (``fields``, ``values``), vector envs' autoreset modes (``autoreset``), n-step windows (``n_step``) and the gather
  into new, or pinned, host memory (``host_batch``). Each keeps ``add``'s paths, chosen once per mode (``writes``,
  ``frame_writes``).
* ``SampleAhead`` (``sample_ahead``): a buffer's next batch drawn on a background thread, one sample stale.

Copy contract: ``add`` copies the values given into the buffer's storage (nothing of the caller's kept, no graph);
``sample`` gathers into new memory, shared with nothing; ``state_dict``/``load_state_dict`` copy, and a load shares
nothing with its source.
"""

from copy_correct.replay.buffer import ReplayBuffer
from copy_correct.replay.frame_buffer import FrameReplayBuffer
from copy_correct.replay.sample_ahead import SampleAhead

__all__ = ["FrameReplayBuffer", "ReplayBuffer", "SampleAhead"]
