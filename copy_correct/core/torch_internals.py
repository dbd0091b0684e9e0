"""torch's private and version-dependent surfaces, each used here and nowhere else in the package: the tensor parts
(``core.foreach_writes``, ``guards.device``, ``replay``, the updates of ``EMA``, ``PowerEMA`` and ``target``) and the
probes call through this module, which imports only torch. Each entry says what it relies on; all were checked on
torch 2.10.0, 2.13.0 and 2.14.1 (the package's floor is torch>=2.10; ``tools/versions/run.sh``).

* ``increment_versions(tensors)``: every tensor's version counter raised by one, metadata only (no kernel, nothing
  allocated). The public ``torch.autograd.graph.increment_version``, which takes a list in one call since torch 2.5
  (pytorch#132652).
* ``set_grad_enabled(mode)``: ``torch._C._set_grad_enabled``, what ``torch.no_grad()`` calls on entry and exit,
  without the context manager's Python frames, which cost more than a small model's in-place update. Relies on it
  setting the thread's grad mode and nothing else.
* ``TorchDispatchMode`` (``torch.utils._python_dispatch``), ``tree_leaves`` (``torch.utils._pytree``) and
  ``op_schema(func)`` (an ``OpOverload``'s ``_schema``): the probes' mode below autograd. Relies on
  ``__torch_dispatch__(func, types, args, kwargs)`` being called for every ATen op while the mode is entered, and on
  the schema's ``arguments`` (``alias_info.is_write``) and ``is_mutable``. Where a torch lacks the two modules, the
  package still imports, and entering a probe (or constructing one) raises a ``RuntimeError`` in one line naming
  the torch version.
* ``SavedTensor`` (``torch._C._autograd``): what a graph node's ``_raw_saved_*`` attributes hold. ``READS_PACKED``:
  it has ``.data``, which reads what it stores without running an unpack hook; where a torch lacks either,
  ``READS_PACKED`` is false and ``graph_bytes`` reads the unpacked ``_saved_*`` attributes instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.graph import increment_version

__all__ = [
    "READS_PACKED",
    "TorchDispatchMode",
    "increment_versions",
    "op_schema",
    "saved_value",
    "set_grad_enabled",
    "tree_leaves",
]

set_grad_enabled = torch._C._set_grad_enabled


def increment_versions(tensors: Sequence[torch.Tensor]) -> None:
    """Raise the version counter of every tensor in ``tensors`` by one (an inference tensor has none: left alone)."""
    increment_version(tensors)


try:
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
except ImportError:
    _NO_DISPATCH = (
        "copy_correct's probes need torch.utils._python_dispatch.TorchDispatchMode and torch.utils._pytree, which "
        f"torch {torch.__version__} installed does not have: use a torch they were checked on (2.13)"
    )

    class TorchDispatchMode:  # type: ignore[no-redef]
        """Stands in where torch has none: a probe built on it refuses to be constructed or entered, in one line."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise RuntimeError(_NO_DISPATCH)

    def tree_leaves(tree: Any) -> list[Any]:  # type: ignore[misc]
        raise RuntimeError(_NO_DISPATCH)


def op_schema(func: Any) -> Any:
    """The ``torch.FunctionSchema`` of the op ``__torch_dispatch__`` was given."""
    return func._schema


try:
    from torch._C._autograd import SavedTensor
except ImportError:
    SavedTensor = None  # type: ignore[assignment,misc]

READS_PACKED = SavedTensor is not None and hasattr(SavedTensor, "data")


def saved_value(value: Any) -> Any:
    """What ``value`` (an attribute of a graph node) holds: a ``SavedTensor``'s stored value, read as packed
    (``.data``, no unpack hook run); anything else as it is."""
    return value.data if READS_PACKED and isinstance(value, SavedTensor) else value
