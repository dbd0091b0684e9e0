"""``find_graph_refs``: where in an object an autograd graph is being kept alive.

Copy contract: reads only; copies nothing and keeps no reference after returning.

A tensor with ``grad_fn`` set keeps its whole backward graph alive: every activation saved for
backward, often megabytes per step. Stored in a list, a metric state or an attribute, it keeps that
graph until the container is cleared. So does a view made under ``no_grad`` of such a tensor: it has
no ``grad_fn`` itself, but its ``._base`` is the graph-carrying tensor (torchmetrics' ``update`` runs
under ``no_grad`` and stores exactly such views when fed an undetached tensor); it is reported as
``path._base``. This walks an object and names every such tensor by the path a
person would type to reach it::

    >>> find_graph_refs({"loss": loss.detach(), "aux": logits}, name="outputs")
    ["outputs['aux']"]
"""

from __future__ import annotations

import warnings
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Mapping
from types import BuiltinFunctionType, FunctionType, MethodType, ModuleType
from typing import Any

import torch

__all__ = ["find_graph_refs"]

_CONTAINERS = frozenset({dict, list, tuple, set, frozenset, deque, OrderedDict})
_MODULE_GROUPS = frozenset({"_parameters", "_buffers", "_modules"})
_LEAF_TYPES = (
    str,
    bytes,
    bytearray,
    int,
    float,
    complex,
    bool,
    type(None),
    type,
    range,
    slice,
    ModuleType,
    FunctionType,
    BuiltinFunctionType,
    MethodType,
    torch.device,
    torch.dtype,
    torch.Size,
    torch.UntypedStorage,
)


def find_graph_refs(
    obj: Any,
    *,
    name: str = "obj",
    max_depth: int = 12,
    max_nodes: int = 200_000,
    skip_types: tuple[type, ...] = (),
    skip_attrs: Iterable[str] = (),
) -> list[str]:
    """Paths of every tensor reachable from ``obj`` that carries an autograd graph (``grad_fn`` set).

    A view without ``grad_fn`` whose base has one is reported as ``path._base``.

    Walks mappings (``name['key']``), sequences and sets (``name[3]``), ``nn.Module`` parameters,
    buffers, submodules and other attributes (``name.fc.weight``), torchmetrics states (plain
    attributes: ``name.auroc.preds[0]``), and the ``__dict__`` / ``__slots__`` of other objects.
    Breadth first, so each tensor is reported once, by its shortest path. Cycle-safe.

    Args:
        obj: what to search.
        name: how the root is written in the returned paths.
        max_depth: containers nested deeper than this are not entered.
        max_nodes: objects visited at most; when reached, a ``RuntimeWarning`` says the result is partial.
        skip_types: instances of these types are not entered (e.g. a Trainer an object points back to).
        skip_attrs: attribute names never followed, at any depth.
    """
    if max_depth < 0 or max_nodes < 1:
        raise ValueError(f"max_depth must be >= 0 and max_nodes >= 1, got {max_depth} and {max_nodes}")
    skip = frozenset(skip_attrs)
    found: list[str] = []
    seen: set[int] = set()
    queue: deque[tuple[Any, str, int]] = deque([(obj, name, 0)])
    visited = 0
    while queue:
        value, path, depth = queue.popleft()
        if id(value) in seen:
            continue
        seen.add(id(value))
        visited += 1
        if visited > max_nodes:
            warnings.warn(
                f"find_graph_refs stopped after {max_nodes} objects; the result is partial "
                "(raise max_nodes or pass skip_types)",
                RuntimeWarning,
                stacklevel=2,
            )
            break
        if isinstance(value, torch.Tensor):
            if value.grad_fn is not None:
                found.append(path)
            elif value._base is not None:
                queue.append((value._base, f"{path}._base", depth + 1))
            continue
        if depth >= max_depth or isinstance(value, (*_LEAF_TYPES, *skip_types)):
            continue
        for child, form, key in _children(value, skip):
            if id(child) in seen or isinstance(child, _LEAF_TYPES) or (type(child) in _CONTAINERS and not child):
                continue
            queue.append((child, form.format(path, key), depth + 1))
    return found


_ITEM, _INDEX, _MEMBER, _ATTR = "{}[{!r}]", "{}[{}]", "{}{{{}}}", "{}.{}"


def _children(value: Any, skip: frozenset[str]) -> Iterator[tuple[Any, str, Any]]:
    """(child, path format, key): the path string is only built for children worth visiting."""
    if isinstance(value, Mapping):
        for key, child in list(value.items()):
            yield child, _ITEM, key
        return
    if isinstance(value, (list, tuple, deque)):
        for i, child in enumerate(list(value)):
            yield child, _INDEX, i
        return
    if isinstance(value, (set, frozenset)):
        for i, child in enumerate(list(value)):
            yield child, _MEMBER, i
        return
    attrs = getattr(value, "__dict__", None)
    if isinstance(attrs, dict):
        if isinstance(value, torch.nn.Module):
            for group in ("_parameters", "_buffers", "_modules"):
                for key, child in attrs.get(group, {}).items():
                    if key not in skip:
                        yield child, _ATTR, key
        for key, child in list(attrs.items()):
            if key not in skip and key not in _MODULE_GROUPS:
                yield child, _ATTR, key
    for cls in type(value).__mro__:
        for slot in getattr(cls, "__slots__", ()):
            own = isinstance(slot, str) and slot not in skip and slot not in ("__dict__", "__weakref__")
            if own and hasattr(value, slot):
                yield getattr(value, slot), _ATTR, slot
