"""The averages of a model's weights: ``EMA`` (one shadow), ``PowerEMA`` (EDM2's power-function profiles, snapshotted)
and the post-hoc EMA synthesized from the snapshots (``synthesize``, ``synthesis_coefficients``; the command's work in
``posthoc_command``). Both averages share one machinery (``shadow``: the shadows, their groups, copies, the model
checks, the guard), their settings are checked without a model (``settings``), and the peers' schedules and saved
states come in through ``peer_schedules`` and ``peer_states``.

Copy contract: each shadow is a tensor of its own made once, updated in place under ``no_grad`` by one foreach call
per group, never a parameter, never seen by autograd; a model changed under it (a tensor replaced, reshaped, moved, or
its storage replaced through ``.data``) is refused by name before anything is written. ``average_weights`` swaps the
live weights out and back bit for bit; ``module`` is a module on the shadow's own storage. Each module's docstring
states its part.
"""

from copy_correct.averages.ema import EMA
from copy_correct.averages.posthoc import synthesis_coefficients, synthesize
from copy_correct.averages.power_ema import PowerEMA

__all__ = ["EMA", "PowerEMA", "synthesis_coefficients", "synthesize"]
