"""What the strategy pass hands on: a node's candidate strategies, as plain data.

:mod:`autopar.search.sharding.strategies` makes these records; the sharding
problem, the solver's answer, seeds, layouts, folding and code generation read
them. They live on their own so that every reader, and the modules the pass
itself calls (:mod:`autopar.search.sharding.strategy_rows`,
:mod:`autopar.search.sharding.balanced_shards`), can name them without importing
the pass and DTensor's machinery behind it.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.core.placements import Placements


@dataclass(frozen=True)
class Strategy:
    """One way to run a node: where its outputs live and where it needs its inputs."""

    outputs: tuple[Placements | None, ...]  # per output tensor; None for a non-tensor output
    inputs: tuple[Placements | None, ...]  # per entry of NodeStrategies.inputs
    # ZeRO stage 1 or 2 of a parameter replicated over dp: its optimizer state (and gradient) split
    # over dp at run time; the placement the graph sees is ``outputs`` all the same (autopar.search.sharding.problem)
    zero: int = 0
    # the output is dropped after its last forward use and computed again before its first backward
    # use (selective recompute); the placements are those of the strategy it varies (autopar.search.sharding.problem)
    recompute: bool = False
    # the micro-batch counts at which alone it holds (a reshape local only once a micro-batch is one sequence,
    # autopar.search.sharding.reshape_shards); empty: every count. The problem forbids it at the others
    # (autopar.search.sharding.problem, ``held``)
    only_at: tuple[int, ...] = ()


@dataclass
class NodeStrategies:
    """The candidate strategies of one fx node.

    ``inputs`` lists the tensor-valued argument nodes in the order the op reads them
    (args then kwargs, lists flattened).  A node read twice (``mul(x, x)``) appears
    twice, because each use may ask for its own placement.  For a follower
    (``getitem``), ``strategies[k]`` belongs with ``strategies[k]`` of its source and
    ``inputs`` names the source; its input placement is that of the selected output.
    """

    node: str
    op: str
    inputs: list[str]
    strategies: list[Strategy]
    rule: str  # "dtensor", "autopar", "follower", "placeholder", "replicated-fallback"
