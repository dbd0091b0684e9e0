"""``Selection``: which of a model's ``state_dict`` tensors an average keeps a shadow of. By default every parameter
and buffer (``include_buffers=False``: parameters only); ``trainable_only=True`` keeps the parameters that require
grad when the average is built, and the buffers of the modules that hold one of those (a frozen module's BatchNorm
statistics are not averaged); ``exclude`` leaves out the tensors whose name starts with one of its prefixes, or for
which a function of (name, tensor) returns ``True``.

The choice is made once, at construction, and kept by name (``Chosen``): a parameter frozen or unfrozen later is
still averaged, or still not. A tensor the model gains afterwards is judged by the same rule, so a new trainable head
under ``trainable_only`` is a change of the model (refused by name, as without a selection), a new frozen one is not.

Copy contract: none; reads names, ``requires_grad`` flags and module structure, never a tensor's values. A tensor left
out holds no shadow: no memory, no update; ``average_weights``, ``module`` and ``export`` give its live values.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from copy_correct.core.checks import flag, shown
from copy_correct.core.module_tensors import state_entries

__all__ = ["Chosen", "Exclude", "Selection", "check_exclude"]

Exclude = tuple[str, ...] | Callable[[str, torch.Tensor], bool]
Entries = Iterator[tuple[str, torch.Tensor, tuple | None]]


def check_exclude(exclude: Any) -> Exclude:
    """``exclude`` as given if it is a tuple (or list) of strings or a callable; one string alone is a ``TypeError``
    (``"head"`` is not ``("head",)``)."""
    if callable(exclude):
        return exclude
    if isinstance(exclude, (tuple, list)) and all(isinstance(prefix, str) and prefix for prefix in exclude):
        return tuple(exclude)
    hint = f": one prefix is ({exclude!r},)" if isinstance(exclude, str) else ""
    raise TypeError(
        "exclude must be a tuple of state_dict name prefixes, such as ('head.',), or a function of (name, tensor) "
        f"returning True for the tensors to leave out, got {shown(exclude)}{hint}"
    )


@dataclass(frozen=True)
class Selection:
    """The rule (module docstring): ``include_buffers``, ``trainable_only``, ``exclude``, checked."""

    include_buffers: bool = True
    trainable_only: bool = False
    exclude: Exclude = ()

    @classmethod
    def of(cls, arguments: Any) -> Selection:
        """The rule from an average's arguments by name, each checked in one line naming it."""
        return cls(
            include_buffers=flag("include_buffers", arguments["include_buffers"]),
            trainable_only=flag("trainable_only", arguments["trainable_only"]),
            exclude=check_exclude(arguments["exclude"]),
        )

    @property
    def everything(self) -> bool:
        """Whether the rule keeps every entry ``state_entries`` gives (the default)."""
        return not self.trainable_only and self.exclude == ()

    def keeps(self, model: nn.Module) -> Callable[[str, torch.Tensor, tuple | None], bool]:
        """Whether the rule keeps an entry of ``model`` as it is now: (name, tensor, owner) -> bool."""
        training = set()
        if self.trainable_only:
            training = {id(m) for m in model.modules() if any(p.requires_grad for p in m.parameters(recurse=False))}
        exclude = self.exclude

        def kept(name: str, tensor: torch.Tensor, owner: tuple | None) -> bool:
            if self.trainable_only and not (tensor.requires_grad if owner is None else id(owner[0]) in training):
                return False
            if callable(exclude):
                return not exclude(name, tensor)
            return not name.startswith(exclude)

        return kept

    def choose(self, model: nn.Module) -> Chosen:
        """The choice for ``model`` as it is now, kept by name."""
        if self.everything:
            return Chosen(self, None, frozenset())
        kept = self.keeps(model)
        entries = list(state_entries(model, self.include_buffers))
        names = frozenset(name for name, tensor, owner in entries if kept(name, tensor, owner))
        return Chosen(self, names, frozenset(name for name, _, _ in entries))


@dataclass(frozen=True)
class Chosen:
    """The tensors an average keeps, chosen at its construction: ``names`` (``None``: every entry, the default rule)
    out of ``seen``, the names the model had then."""

    selection: Selection
    names: frozenset[str] | None
    seen: frozenset[str]

    def entries(self, model: nn.Module) -> Entries:
        """The entries of ``model`` that hold a shadow: ``state_entries``, those chosen."""
        entries = state_entries(model, self.selection.include_buffers)
        if self.names is None:
            yield from entries
            return
        yield from (entry for entry in entries if entry[0] in self.names)

    def now(self, model: nn.Module) -> Entries:
        """The entries of ``model`` an average built on it now would keep, the chosen ones as they were chosen: what
        ``model_changes.changes`` compares with the shadows (a name new since, the rule decides)."""
        entries = state_entries(model, self.selection.include_buffers)
        if self.names is None:
            yield from entries
            return
        kept = self.selection.keeps(model)
        for name, tensor, owner in entries:
            if name in self.names or (name not in self.seen and kept(name, tensor, owner)):
                yield name, tensor, owner

    def describe(self) -> str:
        """The rule in words, for a message: ``parameters or buffers``, ``trainable parameters``, ..."""
        rule = self.selection
        what = "parameters (include_buffers=False)" if not rule.include_buffers else "parameters or buffers"
        if rule.trainable_only:
            what = f"trainable {what} (trainable_only=True)"
        if rule.exclude != ():
            what += f" left after exclude={rule.exclude!r}"
        return what
