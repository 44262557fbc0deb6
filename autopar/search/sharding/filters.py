"""Strategy filters: ``allowed(node name, strategy) -> bool``, the restrictions the search solves a mesh under.

A seed layout, a fixed ZeRO stage and the placements that divide a micro-batch
are each such a filter (:mod:`autopar.search.sharding.seeds`,
:func:`autopar.search.sharding.mesh_solve.zero_filter`,
:mod:`autopar.search.sharding.microbatches`), and
:func:`autopar.search.sharding.derived.restrict` asks one about every strategy of
every node: a million questions on LLaMA-3-405B's 29,591 nodes. The copies of a
repeated layer get the same answers, so a filter may say what its verdicts
depend on besides the strategy: its ``node_key(name)``, a hashable that is equal
for two nodes exactly when the filter treats their strategies alike. Nodes with
the same strategy list and the same key then share one mask.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from autopar.search.sharding.node_strategies import Strategy

Filter = Callable[[str, Strategy], bool]


def keyed(allowed: Filter, node_key: Callable[[str], Hashable]) -> Filter:
    """``allowed`` with its ``node_key``: what, besides the strategy, its verdict on a node depends on."""
    allowed.node_key = node_key  # type: ignore[attr-defined]
    return allowed


def node_key(allowed: Filter) -> Callable[[str], Hashable]:
    """The filter's node key; a filter that states none depends on the node's name."""
    return getattr(allowed, "node_key", _name)


def _name(name: str) -> Hashable:
    return name
