"""``Priorities``: proportional prioritized sampling (Schaul et al. 2016) over a buffer's rows, as OpenAI baselines'
``PrioritizedReplayBuffer`` defines it: row ``i`` is drawn with probability ``P(i) = p_i^alpha / sum_k p_k^alpha``, its
importance weight is ``(N P(i))^-beta`` divided by the largest weight of the buffer (that of its smallest priority),
so ``(p_i^alpha / min_k p_k^alpha)^-beta`` (``N`` cancels). A new row gets the largest priority given so far (1.0
before any); a row that holds no transition that can be drawn has none (0: never drawn, not in the minimum).

The tree: each row's ``p^alpha`` (float64) in a leaf; the leaves in groups of ``FANOUT``, and the groups in runs of
``FANOUT``; the running sum of each group's leaves, and the running sum over all groups' totals (the top), kept
whole, and the running sum over the runs' totals. A draw costs a fixed handful of numpy calls for a whole batch,
whatever the capacity: it finds each mass's run among the runs' running sums (one ``np.searchsorted`` over a few
thousand numbers at most: a million rows make 977 runs), its group among the run's 32 running sums in the top, and
its row among the group's 32 (each a compare of a ``(batch, FANOUT)`` gather and its ``argmin``: the first whose
running sum exceeds the mass). Writes only set leaves and note their groups; before the next draw, weight or state
(``_flush``) the written groups' running sums and minimums are recomputed from their leaves (``np.cumsum``), the
running sums within the runs that hold them, the runs' running sum, and the top as the sum of a run's running sum
before it and its own, one vector add over all groups (a plain ``np.cumsum`` over the 31,250 groups of a million
rows waits on each add before the next, several times slower). So every sum is a function of the leaves alone: a
tree rebuilt from saved leaves is the same, bit for bit, and draws what the original would.

Most draws skip the tree: rejection sampling (``_rejected``) takes rows uniformly below the last group holding a
priority (``_high``) and keeps each with probability ``p_i / max p``, which gives row ``i`` with probability ``P(i)``
exactly, in about five numpy calls for a batch, where the tree's descent takes ten. It needs the largest priority
(each group's and run's, kept as the minimums are) and pays in candidates: ``1 / kept`` of them per row kept, ``kept``
being ``total / (_high * max p)``; below ``MIN_KEPT`` (a priority far above the rest) the tree draws. ``_high`` and the
largest are functions of the leaves too, so the choice and the draws survive a save and load.

Copy contract: the tree is new host memory, allocated at construction (about 17.3 bytes a row); ``state`` shares the
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

FANOUT = 32  # leaves in a group and groups in a run: a draw compares a (batch, 32) gather, twice
MAX_NOTED = 1024  # writes noted one by one between two reads; past them, the next read recomputes every group
MIN_KEPT = 0.15  # rejection sampling while at least this share of uniform candidates is kept; below it, the tree


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
        runs = -(-rows // FANOUT**2)
        groups = runs * FANOUT  # every group of a run exists (of sum 0 past the rows), and one more of none
        self._leaves = np.zeros((groups + 1) * FANOUT)  # p^alpha per row; 0: not drawable
        self._groups = self._leaves.reshape(groups + 1, FANOUT)
        self._sums = np.zeros((groups + 1, FANOUT))  # each group's running sums, its total as inf; the last: 0s
        self._sums[:, -1] = math.inf  # so that a compare finds a child past any mass: the last
        self._totals = np.zeros((runs, FANOUT))  # each group's total, by run
        self._mins = np.full((runs, FANOUT), math.inf)  # each group's smallest priority, by run
        self._run_mins = np.full(runs, math.inf)  # each run's smallest
        self._maxs = np.zeros((runs, FANOUT))  # each group's largest priority, by run
        self._run_maxs = np.zeros(runs)  # each run's largest
        self._runs = np.zeros((runs, FANOUT))  # the running sums of the groups' totals within each run
        self._run_sums = np.zeros(runs + 1)  # 0, then the running sum of the runs' totals: the whole, last
        self._top = np.zeros(1 + (runs + 1) * FANOUT)  # 0, then the running sum of every group's total, by run:
        self._ends = self._top[1:].reshape(runs + 1, FANOUT)  # a run's group's, its total included; then one of inf
        self._ends[-1] = math.inf  # (the run past the last: a mass rounded up to the whole lands in the group of none)
        self._min = math.inf  # the smallest priority of a drawable row
        self._max = 0.0  # the largest
        self._high = 0  # the rows below this hold every priority: past the last group of any (a function of them)
        self._changed: list[Any] = []  # groups of leaves written since the last _flush
        self._all_changed = False  # so many writes since the last _flush that every group is recomputed
        self._new = 1.0  # max_priority ** alpha

    @property
    def nbytes(self) -> int:
        sums = (self._sums, self._totals, self._mins, self._run_mins, self._maxs, self._run_maxs, self._runs,
                self._run_sums, self._top)  # fmt: skip
        return self._leaves.nbytes + sum(a.nbytes for a in sums)

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
        """``batch_size`` rows drawn with replacement, each with probability ``P(i)``, from ``generator`` on the CPU:
        by rejection where a row taken uniformly is kept often enough (``_rejected``), else by the tree: masses
        uniform in [0, total), each one's run, group and row found in turn (module docstring: never one of priority
        0). A mass that rounding carries past a group's last row with a priority (rare: the group past the last, of
        none, takes a mass rounded up to the whole) is drawn again, with the next numbers."""
        self._flush()
        kept = self._run_sums[-1] / (self._high * self._max) if self._max > 0 else 0.0
        if kept >= MIN_KEPT:
            return self._rejected(batch_size, generator, kept)
        rows = self._descend(self._masses(batch_size, generator))
        while not self._leaves.take(rows).all():
            empty = self._leaves.take(rows) == 0
            rows[empty] = self._descend(self._masses(int(empty.sum()), generator))
        return rows

    def _rejected(self, batch_size: int, generator: torch.Generator | None, kept: float) -> np.ndarray:
        """Rejection sampling: rows ``i`` uniform below ``_high`` each kept with probability ``p_i / max p`` (a
        uniform ``u`` with ``u * max p < p_i``: never one of priority 0), so a kept row is ``i`` with probability
        ``P(i)``, independently; enough candidates that a batch is almost always filled at once (``kept``: the share
        kept, ``total / (rows * max p)``), and more drawn for the rest when not. Each round is one ``torch.rand`` of
        float64 from ``generator``: the candidates, then their ``u``."""
        rows: list[np.ndarray] = []
        need = batch_size
        while need:
            count = int(need / kept * 1.25) + 8
            numbers = torch.rand(2 * count, dtype=torch.float64, generator=generator).numpy()
            candidates = (numbers[:count] * self._high).astype(np.int64)  # row _high (rounding up) has no priority
            chosen = candidates[np.flatnonzero(numbers[count:] * self._max < self._leaves.take(candidates))[:need]]
            rows.append(chosen)
            need -= len(chosen)
        return rows[0] if len(rows) == 1 else np.concatenate(rows)

    def _masses(self, count: int, generator: torch.Generator | None) -> np.ndarray:
        """``count`` masses uniform in [0, total): torch's ``uniform_`` in float64, from ``generator``."""
        total = self._run_sums[-1]
        return torch.empty(count, dtype=torch.float64).uniform_(0, total, generator=generator).numpy()

    def _descend(self, mass: np.ndarray) -> np.ndarray:
        run = self._run_sums[1:].searchsorted(mass, side="right")  # the first whose running sum exceeds the mass
        group = (self._ends.take(run, axis=0) <= mass[:, None]).argmin(1)  # in it, the first whose running sum does
        run *= FANOUT
        group += run
        mass -= self._top.take(group)
        row = (self._sums.take(group, axis=0) <= mass[:, None]).argmin(1)  # the first past it; the last at most
        group *= FANOUT
        row += group
        return row

    def weights(self, rows: np.ndarray, beta: float) -> np.ndarray:
        """``(P(i) / P_min)^-beta`` for each of ``rows`` as float32: 1 for the rows of the smallest priority."""
        self._flush()
        return ((self._leaves.take(rows) / self._min) ** -beta).astype(np.float32)

    def _flush(self) -> None:
        """Recompute the running sums and minimums of the groups written since the last call, the runs of the top
        they are in, and the top (module docstring)."""
        if self._all_changed:
            groups = np.arange(self._mins.size)
        elif self._changed:
            groups = np.unique(np.concatenate([np.atleast_1d(g) for g in self._changed]))
        else:
            return
        self._changed.clear()
        self._all_changed = False
        leaves = self._groups[groups]
        sums = np.cumsum(leaves, axis=1)
        self._sums[groups, :-1] = sums[:, :-1]
        self._totals.reshape(-1)[groups] = sums[:, -1]
        self._mins.reshape(-1)[groups] = np.where(leaves > 0, leaves, math.inf).min(1)  # a 0 is not the smallest
        self._maxs.reshape(-1)[groups] = leaves.max(1)
        self._high = _past_last(self._totals.reshape(-1), groups, self._high // FANOUT)
        runs = np.unique(groups // FANOUT)
        self._runs[runs] = np.cumsum(self._totals[runs], axis=1)
        self._run_mins[runs] = self._mins[runs].min(1)
        self._run_maxs[runs] = self._maxs[runs].max(1)
        np.cumsum(self._runs[:, -1], out=self._run_sums[1:])  # exact: one add at a time, as the top's last of a run
        np.add(self._run_sums[:-1, None], self._runs, out=self._ends[:-1])
        self._min = float(self._run_mins.min())
        self._max = float(self._run_maxs.max())

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


def _past_last(totals: np.ndarray, groups: np.ndarray, past: int) -> int:
    """The first row past the last group whose total is not 0, after ``groups`` (sorted) were recomputed, ``past``
    the group past the last one before: a group written above it is the new last where it holds a priority; the last
    emptied, the one below it that is not (a scan, rare: a whole group of 32 rows cleared at the top)."""
    held = groups[totals.take(groups) > 0]
    if held.size and held[-1] >= past:
        return (int(held[-1]) + 1) * FANOUT
    if past and totals[past - 1] == 0:
        nonzero = np.flatnonzero(totals[: past - 1])
        return (int(nonzero[-1]) + 1) * FANOUT if nonzero.size else 0
    return past * FANOUT
