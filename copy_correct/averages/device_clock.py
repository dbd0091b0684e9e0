"""``DeviceClock``: an ``EMA``'s counters and decay kept as tensors on the shadow's device
(``EMA(model, traceable=True)``), so that ``ema.update(model)`` traces into a ``torch.compile``d step as one graph.

Why: every peer's update reads a Python counter and computes the decay as a Python float. Dynamo makes each of them a
constant of the graph, guarded, so a step holding the update compiles again at every call of the warm-up, and after
it whenever the counter is read. Here no Python number changes from one update to the next: the call count, the
averaging updates made and the weight ``1 - decay`` are tensors, written in place by the update itself.

Copy contract: new storage once, at construction: the counters (float64, exact below 2**53), the weight and its
scratch, and one weight per dtype averaged, all on the shadow's device, each of shape ``(1,)`` (inductor drops a write
into a 0-dim CPU input: measured with torch 2.13.0). An update writes each shadow in place,
one op per tensor (``lerp_`` by the weight, ``copy_`` for integer buffers); with ``start_step`` or ``update_every``
the choice between averaging, copying and keeping is a ``torch.where`` of flags on the device, and an eager update
then holds one tensor's temporaries at a time (a compiled one fuses them into the write). Nothing is read back to the
host; reading a counter (``counts``) is a sync, the reader's. The weight is ``DecaySchedule.write_weight``'s: the
host's float64 arithmetic in its order, rounded to the shadow's dtype as ``lerp_`` rounds a Python float, so an eager
update is the host-counted one bit for bit; under inductor, which generates its own ``lerp``, within float32 rounding
(``tests/parts/test_ema_compiled.py`` measures it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from copy_correct.averages.shadow import Group
from copy_correct.decay_schedule import DecaySchedule

__all__ = ["DeviceClock", "clock_for", "traced_values"]


def clock_for(groups: Sequence[Group], sharded: bool, skip_nonfinite: bool) -> DeviceClock:
    """The clock of an ``EMA(traceable=True)`` over ``groups``; refused in one line for a sharded model (each rank's
    update goes through ``DTensor``'s local shards, which does not trace), with ``skip_nonfinite`` (the CPU check
    decides on the host) and for shadows on more than one device (the clock's flags live on one)."""
    if sharded:
        raise ValueError("traceable=True is not supported for a sharded (FSDP2) model: update it outside torch.compile")
    if skip_nonfinite:
        raise ValueError("traceable=True and skip_nonfinite=True do not go together: the skip is decided on the host")
    devices = {shadow.device for group in groups for shadow in group.shadows}
    if len(devices) > 1:
        shown = sorted(map(str, devices))
        raise ValueError(f"traceable=True keeps its counters on one device; the shadows are on {shown}")
    dtypes = {group.shadows[0].dtype for group in groups if group.average}
    return DeviceClock(devices.pop(), sorted(dtypes, key=str))


def traced_values(model: nn.Module, groups: Sequence[Group], kind: str) -> list[list[torch.Tensor]]:
    """The values an update averages, per group, looked up by name in ``model`` as Dynamo traces (the eager checks read
    data pointers, which do not trace): a tensor replaced by one alike is followed, as the compiled step's own forward
    follows it, and one missing, reshaped or of another dtype or device is refused by name as the step is traced
    (Dynamo traces again when a tensor's shape, dtype or device changes). In the shadows' dtype and device."""
    named = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    values = []
    for group in groups:
        lives, alike = [], (group.live_dtype, group.live_device)
        for name, shadow in zip(group.names, group.shadows, strict=True):
            live = named.get(name)
            if live is None or live.shape != shadow.shape or (live.dtype, live.device) != alike:
                raise RuntimeError(
                    f"{kind}: the model's {name!r} is missing, reshaped or moved since the {kind} was built: nothing "
                    "was averaged"
                )
            lives.append(live.to(shadow.device, shadow.dtype) if group.staging else live)
        values.append(lives)
    return values


class DeviceClock:
    """The counters ``calls`` (``update`` calls) and ``made`` (averaging updates) and the weight, on ``device``, for
    shadows of ``dtypes``."""

    def __init__(self, device: torch.device, dtypes: Sequence[torch.dtype]) -> None:
        def zero() -> torch.Tensor:
            return torch.zeros(1, dtype=torch.float64, device=device)

        self.calls, self.made = zero(), zero()
        self._weight, self._scratch, self._one = zero(), zero(), zero().add_(1.0)
        self._weights = {dtype: torch.zeros(1, dtype=dtype, device=device) for dtype in dtypes}

    def counts(self) -> tuple[int, int]:
        """``(calls, made)`` as Python ints: a read of the device (a sync on a GPU)."""
        calls, made = torch.cat([self.calls, self.made]).tolist()
        return int(calls), int(made)

    def set(self, calls: int, made: int) -> None:
        """Set both counters (a checkpoint loaded), in place."""
        self.calls.fill_(calls)
        self.made.fill_(made)

    def update(
        self,
        groups: Sequence[tuple[list[torch.Tensor], list[torch.Tensor], bool]],
        schedule: DecaySchedule,
        start_step: int,
        update_every: int,
    ) -> None:
        """One ``update`` call: for each group (its shadows, the values to average, in the shadows' dtype and device,
        and whether it is averaged or copied), average, copy (before ``start_step``) or keep (a call ``update_every``
        passes over), as ``EMA``'s host-counted update decides on the host. Call it under ``no_grad``."""
        schedule.write_weight(self.made, self._weight, self._scratch, self._one)
        flags = None
        if start_step > 0 or update_every > 1:
            calls = self.calls.view(())  # flags that broadcast to any shadow
            copy = calls < start_step
            flags = (copy, copy | (torch.remainder(calls - start_step, update_every) == 0))  # (copy, due)
        for shadows, values, average in groups:
            weight = self._weight.view(())  # a copied group's: unused
            if average:
                weight = self._weights[shadows[0].dtype]
                weight.copy_(self._weight)  # a double rounded to the shadow's dtype, as lerp_ rounds a Python float
                weight = weight.view(())  # broadcasts to any shadow, a 0-dim one too
            for shadow, value in zip(shadows, values, strict=True):
                if flags is None:
                    shadow.lerp_(value, weight) if average else shadow.copy_(value)
                elif average:
                    averaged = torch.where(flags[1], shadow.lerp(value, weight), shadow)
                    shadow.copy_(torch.where(flags[0], value, averaged))
                else:
                    shadow.copy_(torch.where(flags[1], value, shadow))
        self.made.add_(1.0 if flags is None else flags[1] & ~flags[0])
        self.calls.add_(1.0)
