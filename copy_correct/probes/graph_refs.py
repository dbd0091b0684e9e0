"""``find_graph_refs``: where in an object an autograd graph is being kept alive; ``graph_bytes``: how much it keeps.

Copy contract: both read only; they copy nothing and keep no reference after returning. (One exception: on torch
without ``SavedTensor.data``, ``graph_bytes`` can read saved tensors only through their unpack hooks, which may copy.)

A tensor with ``grad_fn`` set keeps its whole backward graph alive: every activation saved for
backward, often megabytes per step. Stored in a list, a metric state or an attribute, it keeps that
graph until the container is cleared. So does a view made under ``no_grad`` of such a tensor: it has
no ``grad_fn`` itself, but its ``._base`` is the graph-carrying tensor (torchmetrics' ``update`` runs
under ``no_grad`` and stores exactly such views when fed an undetached tensor); it is reported as
``path._base``. This walks an object and names every such tensor by the path a
person would type to reach it::

    >>> find_graph_refs({"loss": loss.detach(), "aux": logits}, name="outputs")
    ["outputs['aux']"]

``graph_bytes(tensor)`` weighs such a graph: the storage of the tensors its nodes saved for backward, each storage
once, which is what ``.detach()`` would let go. Parameters and the tensor's own storage are not part of it (they stay
alive either way), and ``backward()`` frees what the nodes saved: a loss kept after its backward weighs 0 B, though
its nodes stay alive::

    samples.append(netG(noise))   # no no_grad, never backpropagated
    graph_bytes(samples[-1])      # every activation netG saved for backward, and `noise`: what MemoryProbe sees kept
"""

from __future__ import annotations

import warnings
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Mapping
from types import BuiltinFunctionType, FunctionType, MethodType, ModuleType
from typing import Any

import torch
from torch.autograd.function import BackwardCFunction

from copy_correct.core.torch_internals import READS_PACKED, saved_value

__all__ = ["find_graph_refs", "graph_bytes"]

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
    found, _ = _search({name: obj}, max_depth, max_nodes, skip_types, skip_attrs)
    return [path for path, _ in found]


def _search(
    roots: Mapping[str, Any],
    max_depth: int = 12,
    max_nodes: int = 200_000,
    skip_types: tuple[type, ...] = (),
    skip_attrs: Iterable[str] = (),
) -> tuple[list[tuple[str, torch.Tensor]], list[torch.Tensor]]:
    """``find_graph_refs`` over several roots at once (each tensor reported once, by its shortest path from any),
    returning ``(path, graph-carrying tensor)`` pairs and every tensor the search reached, graph or not.

    For ``GraphRetentionGuard``: the tensors the searched objects hold are what a graph does not keep alive alone.
    """
    if max_depth < 0 or max_nodes < 1:
        raise ValueError(f"max_depth must be >= 0 and max_nodes >= 1, got {max_depth} and {max_nodes}")
    skip = frozenset(skip_attrs)
    found: list[tuple[str, torch.Tensor]] = []
    reached: list[torch.Tensor] = []
    seen: set[int] = set()
    queue: deque[tuple[Any, str, int]] = deque((obj, name, 0) for name, obj in roots.items())
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
                stacklevel=3,
            )
            break
        if isinstance(value, torch.Tensor):
            reached.append(value)
            if value.grad_fn is not None:
                found.append((path, value))
            elif value._base is not None:
                queue.append((value._base, f"{path}._base", depth + 1))
            continue
        if depth >= max_depth or isinstance(value, (*_LEAF_TYPES, *skip_types)):
            continue
        for child, form, key in _children(value, skip):
            if id(child) in seen or isinstance(child, _LEAF_TYPES) or (type(child) in _CONTAINERS and not child):
                continue
            queue.append((child, form.format(path, key), depth + 1))
    return found, reached


def graph_bytes(tensor: torch.Tensor, *, exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of storage that ``tensor``'s autograd graph keeps alive: what dropping the graph (``.detach()``) frees.

    Walks ``grad_fn`` and ``next_functions`` without recursion (a graph of any depth), and adds up the storages of
    the tensors the nodes saved for backward (for a custom ``autograd.Function``, also tensors set on ``ctx``), each
    storage once, at its full ``nbytes`` (a saved slice keeps all of its storage), on whichever device. A ``no_grad``
    view of a graph-carrying tensor counts its base's graph.

    Saved-tensor hooks: where torch has ``SavedTensor.data``, saved tensors are read as stored, and no unpack hook
    runs. Under ``saved_tensors_hooks`` it counts the tensors the pack hook returned (alone or in a tuple, as
    ``save_on_cpu``'s host copy), and ``torch.utils.checkpoint`` recomputes nothing (what its hooks keep reachable,
    the segment's inputs, is not counted). Older torch offers only the unpacked tensors: the unpack hooks run, and a
    checkpointed segment is recomputed.

    Not counted, because they stay alive without the graph:

    * ``tensor``'s own storage (``.detach()`` keeps it);
    * leaf tensors that require grad (parameters), and every view of their storage;
    * the storages of ``exclude`` (buffers such as BatchNorm's running statistics, a fixed input: tensors that
      something else holds).

    What a node saved is freed by ``backward()`` (unless ``retain_graph=True``), though not what a custom Function
    set on ``ctx``: a loss kept after its backward counts 0, although its nodes stay alive. Sparse tensors (no single
    storage) count 0.
    """
    skip = {storage[0] for storage in map(_storage, exclude) if storage is not None}
    return sum(_graph_storages(tensor, skip).values())


def _graph_storages(tensor: torch.Tensor, skip: set[int]) -> dict[int, int]:
    """{storage key: nbytes} of what ``tensor``'s graph saved, less parameters, ``tensor``'s own and ``skip``."""
    root = tensor.grad_fn if tensor.grad_fn is not None or tensor._base is None else tensor._base.grad_fn
    leaves = set(skip)
    own = _storage(tensor)
    if own is not None:
        leaves.add(own[0])
    saved: dict[int, int] = {}
    nodes: dict[int, Any] = {}  # holds every node visited, so no id() is reused during the walk
    stack = [] if root is None else [root]
    while stack:
        node = stack.pop()
        if id(node) in nodes:  # reached by two paths before either was taken
            continue
        nodes[id(node)] = node
        variable = getattr(node, "variable", None)  # AccumulateGrad: the leaf it accumulates into
        leaf = _storage(variable) if isinstance(variable, torch.Tensor) else None
        if leaf is not None:
            leaves.add(leaf[0])
        for t in _saved_tensors(node):
            storage = _storage(t)
            if storage is None:
                continue
            if t.is_leaf and t.requires_grad:
                leaves.add(storage[0])
            else:
                saved[storage[0]] = storage[1]
        for child, _ in node.next_functions:
            if child is not None and id(child) not in nodes:
                stack.append(child)
    return {key: nbytes for key, nbytes in saved.items() if key not in leaves}


_SAVED_NAMES: dict[type, tuple[str, ...]] = {}  # per node type, the attributes holding what it saved
# Newer torch reads what a saved tensor holds (``SavedTensor.data``) without running its unpack hook; older torch
# offers only the unpacked tensor (``_saved_*``, a custom Function's ``saved_tensors``): see _torch_internals.
_READS_PACKED = READS_PACKED


def _saved_tensors(node: Any) -> Iterator[torch.Tensor]:
    """The tensors ``node`` holds for backward."""
    names = _SAVED_NAMES.get(type(node))
    if names is None:
        names = _SAVED_NAMES[type(node)] = tuple(a for a in dir(node) if a.startswith("_raw_saved_"))
    custom = isinstance(node, BackwardCFunction)
    values: list[Any] = []
    for raw in names:
        attr = raw if _READS_PACKED else "saved_tensors" if custom else raw.replace("_raw", "", 1)
        try:
            value = getattr(node, attr)
        except RuntimeError:  # freed by backward (a built-in node's SavedTensor reads as None instead)
            continue
        values.extend(value if isinstance(value, (list, tuple)) else [value])
    values = [saved_value(value) for value in values]
    if custom:
        values.extend(vars(node).values())  # tensors set on a custom Function's ctx: backward does not free them
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):  # what a pack hook returned: save_on_cpu's (device, tensor)
            yield from (v for v in value if isinstance(v, torch.Tensor))


def _storage(t: torch.Tensor) -> tuple[int, int] | None:
    """(key, nbytes) of ``t``'s storage; None for layouts without a single storage (sparse, nested)."""
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return storage._cdata, storage.nbytes()


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
