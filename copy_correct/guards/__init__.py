"""The non-finite guards: an update that a NaN or an Inf in the live values would poison is skipped whole, the average
(or target) left bit for bit, and the skip counted (``skip_nonfinite=True`` of ``EMA``, ``PowerEMA``,
``hard_update``, ``soft_update``).

* ``host``: ``FiniteCheck``, the values checked on the host before anything is written (averages and targets on the
  CPU): one read of the live tensors, a few numbers of scratch allocated once, no staging copy.
* ``device``: ``NonFiniteGuard`` and ``ProfilesGuard``, the finiteness decided on the device with no host sync (an
  average or a target elsewhere): the live values staged into one flat buffer per group, checked, then averaged or
  selected; and ``skipped_updates``, the count read back.
* ``choice``: which of the two an owner gets, chosen there alone for the averages (``copy_correct.averages.shadow``)
  and the target networks (``copy_correct.target``): the host check when every tensor the owner writes is on the CPU,
  else the device guard.

Copy contract: a skipped update writes nothing the user sees; the guard's scratch and staging are its own storage,
allocated once per guard. What autograd sees: nothing (every write under ``no_grad``).
"""

from copy_correct.guards.device import skipped_updates

__all__ = ["skipped_updates"]
