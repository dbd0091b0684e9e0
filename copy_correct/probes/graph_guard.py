"""``GraphRetentionGuard``: stops a run the step a graph starts to leak, and says how much each one keeps alive.

Copy contract: reads only. It never detaches anything for you: a silent fix would hide the bug, so it
names the path and lets you choose between ``.detach()`` (shares storage, no graph) and
``.detach().clone()`` (own storage, no graph).

In any PyTorch loop, call ``check`` after each step with the objects to search, by name::

    guard = GraphRetentionGuard()
    for i, batch in enumerate(loader):
        ...
        guard.check(i, model=netG, samples=img_list, losses=G_losses)

In Lightning, ``copy_correct.lightning.GraphRetentionCheck`` runs the same check after every training batch, on
what ``training_step`` returned and on the LightningModule.

The search is ``find_graph_refs``'s; each tensor found is weighed with ``graph_bytes``. A failing check raises
``GraphRetentionError`` (``mode="raise"``, the default) or warns (``mode="warn"``) with one message: the step,
each path with the bytes its graph keeps alive, largest first, and their total, each storage counted once.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

from copy_correct.probes._storage_events import human_bytes
from copy_correct.probes.graph_refs import _graph_storages, _search, _storage

__all__ = ["GraphRetentionError", "GraphRetentionGuard"]

# Framework back-references: the trainer (and everything it owns) is not the module's state.
_SKIP_ATTRS = ("_trainer", "_fabric", "_fabric_optimizers", "_compiler_ctx", "_device_mesh")
_SHOWN = 10  # paths named in a message; the rest are counted


class GraphRetentionError(RuntimeError):
    """Raised when a tensor that carries an autograd graph outlives its training step."""


class GraphRetentionGuard:
    """Check named objects for autograd graphs that outlive a training step.

    What a graph keeps alive is weighed with ``graph_bytes``, less the storage the searched objects hold themselves
    (parameters, buffers, a tensor passed by name: dropping the graph would not free it). So the bytes reported for
    a path are what ``.detach()`` there would free, and the total is what detaching all of them would free.

    Args:
        mode: ``"raise"`` (stop with ``GraphRetentionError``) or ``"warn"`` (a ``RuntimeWarning``).
        min_bytes: a graph fails the check only if it keeps at least this many bytes alive; smaller ones are still
            returned by ``check`` and listed, apart, in a failing check's message. The default, 0, fails every
            graph: one that keeps 0 bytes of tensors (a loss kept after its ``backward()``, which freed what the
            graph saved) still keeps all of its nodes alive, host memory that no tensor accounts for, and a list
            that keeps one per step grows by a graph every step. ``min_bytes=1`` fails only graphs that keep tensors.
    """

    def __init__(self, mode: str = "raise", min_bytes: int = 0) -> None:
        if mode not in ("raise", "warn"):
            raise ValueError(f"mode must be 'raise' or 'warn', got {mode!r}")
        if min_bytes < 0:
            raise ValueError(f"min_bytes must be >= 0, got {min_bytes}")
        self.mode = mode
        self.min_bytes = min_bytes

    def find(self, **objects: Any) -> list[str]:
        """Paths of the graph-carrying tensors in ``objects``, as ``check`` would name them; nothing is weighed."""
        found, _ = _search(objects, skip_types=_trainer_types(), skip_attrs=_SKIP_ATTRS)
        return [path for path, _ in found]

    def check(self, step: int | None = None, /, **objects: Any) -> list[tuple[str, int]]:
        """Search ``objects`` for tensors that carry an autograd graph; raise or warn if any keeps ``min_bytes``.

        Each keyword is a root of the search and the first word of its paths: ``check(3, losses=G_losses)`` reports
        ``losses[0]``. A Trainer reached from them is not entered.

        Args:
            step: shown at the start of the message (``"step 3: ..."``); None shows no step.
            objects: what to search (modules, lists, dicts, metrics, any object), by name.

        Returns:
            Every graph found, ``(path, bytes its graph keeps alive)``, largest first, those under ``min_bytes``
            included; empty when there is none.
        """
        found, reached = _search(objects, skip_types=_trainer_types(), skip_attrs=_SKIP_ATTRS)
        if not found:
            return []
        held = {storage[0] for storage in map(_storage, reached) if storage is not None}
        graphs = {path: _graph_storages(tensor, held) for path, tensor in found}
        findings = sorted(((path, sum(g.values())) for path, g in graphs.items()), key=lambda f: -f[1])
        failing = [(path, nbytes) for path, nbytes in findings if nbytes >= self.min_bytes]
        if not failing:
            return findings
        total = sum({key: n for path, _ in failing for key, n in graphs[path].items()}.values())
        message = (
            f"{'' if step is None else f'step {step}: '}{len(failing)} tensor(s) still hold an autograd graph "
            f"after the training step, keeping {human_bytes(total)} alive in all: {_listed(failing)}."
        )
        if failing[-1][1] == 0:
            message += (
                " A graph at 0 B keeps no tensor of its own (backward freed what it saved, or it saved only"
                " parameters), but its nodes stay alive."
            )
        if len(failing) < len(findings):
            message += f" Under min_bytes={self.min_bytes}: {_listed(findings[len(failing) :])}."
        message += " Store or return `.detach()` (or `.detach().clone()` to own the memory)."
        if self.mode == "raise":
            raise GraphRetentionError(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        return findings


def _trainer_types() -> tuple[type, ...]:
    """Lightning's ``Trainer`` classes among the loaded modules: no Trainer exists before Lightning is imported, so
    this module never imports it to recognise one."""
    modules = (sys.modules.get("lightning.pytorch"), sys.modules.get("pytorch_lightning"))
    return tuple(module.Trainer for module in modules if module is not None and hasattr(module, "Trainer"))


def _listed(findings: list[tuple[str, int]]) -> str:
    shown = ", ".join(f"{path} ({human_bytes(nbytes)})" for path, nbytes in findings[:_SHOWN])
    return shown + (f" and {len(findings) - _SHOWN} more" if len(findings) > _SHOWN else "")
