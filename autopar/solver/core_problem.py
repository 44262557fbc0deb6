"""What the exact reductions leave for the later steps: the core problem, or the proof there is none.

The heuristics, the MILP, the bound and the neighbourhood search all work on a
:class:`CoreProblem` (:mod:`autopar.solver.reduce` builds it); it lives apart from
the reductions so those steps depend on the data alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class InfeasibleError(Exception):
    """No assignment satisfies the problem; the message says why in one line."""


@dataclass
class CoreProblem:
    """What is left for the MILP: variables that no reduction could settle.

    Indices here are local (0..n-1); ``var_ids`` maps them back to reducer variables and
    strategy ``s`` of core variable ``i`` is original strategy ``keep[i][s]``.
    """

    var_ids: np.ndarray
    keep: list[np.ndarray]
    costs: list[np.ndarray]
    factors: list[tuple[tuple[int, ...], np.ndarray]]  # (increasing local scope, table over it)
    constant: float  # cost already settled by the reductions
    # Memory: rows that can bind, each with its capacity (limit minus what is live regardless of
    # choices), and items with non-constant memory live in them. coef[t] is an item's memory above
    # its minimum, per local strategy; its range [r0, r1) indexes the binding rows.
    cap: np.ndarray
    row_times: np.ndarray
    item_var: np.ndarray
    item_r0: np.ndarray
    item_r1: np.ndarray
    item_coef: list[np.ndarray]

    @property
    def n(self) -> int:
        return len(self.var_ids)

    @property
    def sizes(self) -> np.ndarray:
        return np.array([len(c) for c in self.costs], dtype=np.int64)
