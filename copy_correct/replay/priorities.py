"""``Priorities``: proportional prioritized sampling (Schaul et al. 2016) over a buffer's rows, as OpenAI baselines'
``PrioritizedReplayBuffer`` defines it: row ``i`` is drawn with probability ``P(i) = p_i^alpha / sum_k p_k^alpha``, its
importance weight is ``(N P(i))^-beta`` divided by the largest weight of the buffer (that of its smallest priority),
so ``(p_i^alpha / min_k p_k^alpha)^-beta`` (``N`` cancels). A new row gets the largest priority given so far (1.0
before any); a row that holds no transition that can be drawn has none (0: never drawn, not in the minimum).

The tree: each row's ``p^alpha`` (float64) in a leaf, and the leaves in groups of ``FANOUT`` whose running sums
(``np.cumsum`` of the group) are kept, the groups' totals in groups of ``FANOUT`` again, until at most ``TOP`` groups
are left, whose running sum over all of them is one array: a million rows take two levels of groups and a top of
1,024. A draw finds a whole batch's masses in the top (``np.searchsorted``), then descends the groups a level per
step (the child whose running sum first exceeds what is left of the drawn mass), so a batch costs a few numpy calls
per level, not per row. Writes only set leaves and note their groups; the sums and minimums of those groups are
recomputed from the leaves before the next draw, weight or state (``_flush``), each group's sums by one ``np.cumsum``
of its children, and the top by one over the top groups' totals. So every sum is a function of the leaves alone: a
tree rebuilt from saved leaves is the same, bit for bit, and draws what the original would.

Copy contract: the tree is new host memory, allocated at construction (about 16 bytes a row); ``state`` shares the
leaves (not copied), ``load`` copies them in. Nothing is seen by autograd: priorities given as tensors are read
through ``detach()`` and copied to the host (a CUDA tensor: one copy the host waits for).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from copy_correct.core.checks import shown

__all__ = ["FANOUT", "Priorities", "check_alpha", "check_beta"]

FANOUT = 32  # children of a group: a (batch, 32) compare per level of a draw
TOP = 1024  # groups at most in the top, one running sum over them all: a searchsorted per draw
MAX_NOTED = 1024  # writes noted one by one between two reads; past them, the next read recomputes every group


def check_alpha(alpha: Any) -> float:
    """``alpha`` a finite real number >= 0 (0: every drawable row alike)."""
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha < math.inf:
        raise ValueError(f"alpha must be a finite number >= 0, got {shown(alpha)}")
    return float(alpha)


def check_beta(beta: Any) -> float:
    """``beta`` a finite real number >= 0 (0: every weight 1; 1: the full correction)."""
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 <= beta < math.inf:
        raise ValueError(f"beta must be a finite number >= 0, got {shown(beta)}")
    return float(beta)


class Priorities:
    """The priorities of ``rows`` rows (module docstring), for exponent ``alpha``."""

    def __init__(self, rows: int, alpha: float) -> None:
        self.rows, self.alpha = rows, alpha
        self.max_priority = 1.0  # the largest priority given so far: a new row's
        counts = [-(-rows // FANOUT)]  # groups per level, the leaves' first
        while counts[-1] > TOP:
            counts.append(-(-counts[-1] // FANOUT))
        for level in range(len(counts) - 2, -1, -1):  # every child of a group exists (of sum 0 past the rows)
            counts[level] = counts[level + 1] * FANOUT
        self._leaves = np.zeros(counts[0] * FANOUT)  # p^alpha per row; 0: not drawable
        self._values = [self._leaves.reshape(counts[0], FANOUT)]  # each level's children, grouped
        self._sums, self._mins = [], []  # each level: 0 and the running sums of each group's children; its smallest
        for level, count in enumerate(counts):
            self._sums.append(np.zeros((count, FANOUT + 1)))
            self._mins.append(np.full(count, math.inf))
            if level + 1 < len(counts):
                self._values.append(np.zeros((counts[level + 1], FANOUT)))
        self._min_values = [np.full((count, FANOUT), math.inf) for count in counts[1:]]
        self._top = np.zeros(counts[-1] + 1)  # 0, then the running sum of the top groups' totals
        self._min = math.inf  # the smallest priority of a drawable row
        self._changed: list[Any] = []  # groups of leaves written since the last _flush
        self._all_changed = False  # so many writes since the last _flush that every group is recomputed
        self._new = 1.0  # max_priority ** alpha

    @property
    def nbytes(self) -> int:
        arrays = [self._leaves, *self._sums, *self._mins, *self._values[1:], *self._min_values, self._top]
        return sum(a.nbytes for a in arrays)

    # -- writes: leaves only ------------------------------------------------------------------------------------

    def set_new(self, rows: np.ndarray | int) -> None:
        """``rows`` hold new transitions: each gets the largest priority given so far."""
        self._leaves[rows] = self._new
        self._note(rows)

    def clear(self, rows: np.ndarray) -> None:
        """``rows`` hold no transition that can be drawn: never drawn, not in the minimum."""
        self._leaves[rows] = 0.0
        self._note(rows)

    def update(self, rows: np.ndarray, priorities: np.ndarray) -> None:
        """``rows``' priorities (checked: positive, finite) stored as ``p^alpha``; the largest kept for new rows. A row
        given twice keeps its last priority, as baselines' loop does (numpy does not promise which of a repeated
        index's values an assignment keeps: the last of each row is picked first)."""
        if len(rows) > 1:
            last = len(rows) - 1 - np.unique(rows[::-1], return_index=True)[1]
            rows, priorities = rows[last], priorities[last]
        self._leaves[rows] = priorities**self.alpha
        self._note(rows)
        top = float(priorities.max())
        if top > self.max_priority:
            self.max_priority, self._new = top, top**self.alpha

    def _note(self, rows: np.ndarray | int) -> None:
        """The groups of ``rows`` are to be recomputed; past ``MAX_NOTED`` writes (a buffer filled without a read),
        all of them: one pass over the tree instead of a list that grows with every add."""
        if self._all_changed:
            return
        self._changed.append(rows // FANOUT)
        if len(self._changed) > MAX_NOTED:
            self._all_changed = True
            self._changed.clear()

    def drawable(self, rows: np.ndarray) -> np.ndarray:
        """Whether each of ``rows`` holds a priority (a transition that can be drawn)."""
        return self._leaves[rows] > 0

    # -- reads: after the sums are recomputed -------------------------------------------------------------------

    def draw(self, batch_size: int, generator: torch.Generator | None) -> np.ndarray:
        """``batch_size`` rows drawn with replacement, each with probability ``P(i)``: a mass uniform in [0, total)
        from ``torch.rand(..., float64)`` with ``generator`` on the CPU, found in the running sums level by level
        (the first child whose running sum exceeds what is left of it: never one of sum 0). A mass that rounding
        carries past a group's last child with a priority (rare) is drawn again, with the next numbers."""
        self._flush()
        rows = self._descend(torch.rand(batch_size, generator=generator, dtype=torch.float64).numpy())
        empty = self._leaves[rows] == 0
        while empty.any():
            again = torch.rand(int(empty.sum()), generator=generator, dtype=torch.float64).numpy()
            rows[empty] = self._descend(again)
            empty = self._leaves[rows] == 0
        return rows

    def _descend(self, fractions: np.ndarray) -> np.ndarray:
        top, batch = self._top, np.arange(len(fractions))
        mass = fractions * top[-1]
        node = np.searchsorted(top, mass, side="right") - 1  # the top group whose running sum passes the mass
        np.minimum(node, len(top) - 2, out=node)
        mass -= top[node]
        for sums in reversed(self._sums):
            running = sums[node]
            child = (running[:, 1:-1] <= mass[:, None]).sum(1)  # at most the last child, whatever the rounding
            mass -= running[batch, child]
            node = node * FANOUT + child
        return node

    def weights(self, rows: np.ndarray, beta: float) -> np.ndarray:
        """``(P(i) / P_min)^-beta`` for each of ``rows`` as float32: 1 for the rows of the smallest priority."""
        self._flush()
        return ((self._leaves[rows] / self._min) ** -beta).astype(np.float32)

    def _flush(self) -> None:
        """Recompute the running sums and minimums of the groups written since the last call, level by level up."""
        if self._all_changed:
            groups = np.arange(len(self._values[0]))
        elif self._changed:
            groups = np.unique(np.concatenate([np.atleast_1d(g) for g in self._changed]))
        else:
            return
        self._changed.clear()
        self._all_changed = False
        for level, sums in enumerate(self._sums):
            children = self._values[level][groups]
            sums[groups, 1:] = np.cumsum(children, axis=1)
            if level == 0:  # a leaf of 0 holds no transition: not the smallest
                self._mins[0][groups] = np.where(children > 0, children, math.inf).min(1)
            else:
                self._mins[level][groups] = self._min_values[level - 1][groups].min(1)
            if level + 1 == len(self._sums):
                break
            parents, slots = np.divmod(groups, FANOUT)
            self._values[level + 1][parents, slots] = sums[groups, -1]
            self._min_values[level][parents, slots] = self._mins[level][groups]
            groups = np.unique(parents)
        np.cumsum(self._sums[-1][:, -1], out=self._top[1:])
        self._min = float(self._mins[-1].min())

    # -- state --------------------------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """The leaves (``p^alpha`` of each row, sharing this tree's memory), the largest priority given so far and
        ``alpha``."""
        leaves = torch.from_numpy(self._leaves[: self.rows])
        return {"priorities": leaves, "max_priority": self.max_priority, "alpha": self.alpha}

    def check(self, state: Any) -> None:
        """Refuse, in one line, saved priorities that do not fit this tree: another shape or ``alpha``, a leaf that is
        not finite and >= 0, a largest priority that is not finite and > 0."""
        leaves, top, alpha = state["priorities"], state["max_priority"], state["alpha"]
        if not isinstance(leaves, torch.Tensor) or tuple(leaves.shape) != (self.rows,) or leaves.dtype != torch.float64:
            raise ValueError(f"saved priorities are {shown(leaves)}, expected ({self.rows},) float64")
        if alpha != self.alpha:
            raise ValueError(
                f"saved priorities are p**{alpha}, this buffer keeps p**{self.alpha}: build it with that alpha"
            )
        array = leaves.detach().cpu().numpy()
        if not np.isfinite(array).all() or (array < 0).any() or not 0 < float(top) < math.inf:
            raise ValueError("saved priorities must be finite and >= 0, and max_priority finite and > 0")

    def load(self, state: Any) -> None:
        """Copy checked (``check``) saved leaves in and recompute every sum."""
        self._leaves[: self.rows] = state["priorities"].detach().cpu().numpy()
        self.max_priority = float(state["max_priority"])
        self._new = self.max_priority**self.alpha
        self._all_changed = True
        self._flush()
