"""The order of a local graph's collectives: when each starts and when it is waited for.

The trace of :func:`autopar.codegen.shard.shard_graph` puts every functional
collective right before its first reader and its wait right after it, which
serialises communication with compute.  These passes move collectives and
waits within an fx graph so communication overlaps the compute around it,
under the limits the runtime needs (one collective in flight per process group,
one ZeRO-2 gradient reduction at a time).  They read only the graph.
"""

from __future__ import annotations

import torch.fx as fx

from autopar.cost_models.compute import is_view

FUNCTIONAL_COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")
"""The ``_c10d_functional`` collectives a local graph runs (by op name)."""


def _is_collective(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "_opname", "") in FUNCTIONAL_COLLECTIVES


def _is_wait(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "_opname", "") == "wait_tensor"


def schedule_collectives(graph: fx.Graph) -> None:
    """Overlap each collective with compute, with one in flight per process group.

    Functional collectives return at once and ``wait_tensor`` blocks; the trace
    puts each wait right after its collective, which serialises communication
    with compute.  Here, per process group:

    * a wait moves to where its value is first read;
    * a collective moves up to where its inputs exist, but a value that is read
      later (a parameter gathered for a layer, a result a replayed op reads in
      the backward) no earlier than the first read of the group's previous
      such value: one value prefetched ahead, as FSDP does, and not every
      gathered parameter of the step alive from its start;
    * a collective whose result only leaves the graph (a gradient's reduction)
      starts as soon as its input exists, as DDP's bucket hooks do;
    * a collective never moves above the group's previous one: ranks pair a
      group's collectives by the order they are issued in, and that order is
      the trace's, the same on every rank, while the positions it moves to
      are not (a rank holding the first part of a partial sum traces no
      ``zeros_like`` where the others do);
    * before a collective starts, the group's previous one is waited for, so at
      most one is in flight per group.  Gloo's CPU collectives corrupted the heap
      with several in flight on one group (a crash every few hundred steps);
      one at a time makes it rare (it is gloo's: README, Pipelines) and still
      overlaps each with the compute around it.
    """
    nodes = list(graph.nodes)
    output = nodes[-1]
    # only waits move here, and no wait reads another: the order of every node a wait's readers are compared
    # by stays the trace's (numbered once, not once a wait: a 32-layer LLaMA's flowing layout traces 34,600
    # nodes and 4,858 waits)
    order = {n: i for i, n in enumerate(nodes)}
    for node in nodes:  # waits to their first reader
        if _is_wait(node) and node.users:
            first = min(node.users, key=lambda u: order[u])
            if first is not output:
                first.prepend(node)
            else:
                output.prepend(node)
    order = {n: i for i, n in enumerate(graph.nodes)}
    waits = {}
    for node in graph.nodes:
        if _is_wait(node) and node.args and _is_collective(node.args[0]):
            waits[node.args[0]] = node

    def leaves(n: fx.Node) -> bool:
        """Only the output reads ``n``, directly or through views (a gradient reshaped to its parameter's shape)."""
        return all(u is output or (is_view(u) and leaves(u)) for u in n.users)

    def first_read(c: fx.Node) -> int | None:
        """Where the collective's result is first read inside the graph; None when only the output reads it."""
        w = waits.get(c)
        users = [u for u in (w.users if w is not None else ()) if not (u is output or (is_view(u) and leaves(u)))]
        return min(order[u] for u in users) if users else None

    by_group: dict[str, list[fx.Node]] = {}
    for c in (n for n in graph.nodes if _is_collective(n)):
        by_group.setdefault(str(c.args[-1]), []).append(c)
    nodes = list(graph.nodes)
    body = next(i for i, n in enumerate(nodes) if n.op != "placeholder")  # nothing moves above the inputs
    for group in by_group.values():
        reads = {c: first_read(c) for c in group}
        read_order = sorted((c for c in group if reads[c] is not None), key=lambda c: (reads[c], order[c]))
        previous_read = {c: reads[p] for p, c in zip(read_order, read_order[1:], strict=False)}
        floor = body  # the group's previous collective sits before nodes[floor]: nothing of the group moves above
        for c in group:
            ready = max((order[a] + 1 for a in c.all_input_nodes), default=body)
            target = max(ready, previous_read.get(c, 0), floor)
            w = waits.get(c)
            if w is not None:
                target = min(target, order[w])
            while _is_collective(nodes[target]):  # anchor on a node that does not move
                target += 1
            if target < order[c] and target >= floor:
                nodes[target].prepend(c)  # nodes[] and order[] are the positions before any move
                floor = target
            else:
                floor = order[c] + 1
    # one in flight per group: wait for the previous collective before the next one starts
    pending: dict[str, fx.Node] = {}
    for node in list(graph.nodes):
        if _is_wait(node) and node.args and _is_collective(node.args[0]):
            group = str(node.args[0].args[-1])
            if pending.get(group) is node.args[0]:
                del pending[group]
        elif _is_collective(node):
            group = str(node.args[-1])
            previous = pending.get(group)
            if previous is not None and previous in waits:
                node.prepend(waits[previous])
            pending[group] = node


def one_chunk_in_flight(graph: fx.Graph, chunk_outputs: list[int]) -> None:
    """ZeRO-2: wait for each gradient's reduce-scatter before the next one starts.

    A collective's input stays alive until its wait, and waits sit where their
    value is first read: for gradient chunks that is the graph's output, so
    every whole gradient would live to the end of the backward, which is the
    memory ZeRO-2 is there to save.  One reduction in flight still overlaps
    each with the backward computing the next gradient.
    """
    output = next(n for n in graph.nodes if n.op == "output")
    results = output.args[0]
    order = {n: i for i, n in enumerate(graph.nodes)}
    pairs = []
    for k in chunk_outputs:
        wait = results[k]
        if (
            isinstance(wait, fx.Node)
            and getattr(wait.target, "_opname", "") == "wait_tensor"
            and getattr(wait.args[0].target, "_opname", "") == "reduce_scatter_tensor"
        ):
            pairs.append((wait.args[0], wait))
    pairs.sort(key=lambda p: order[p[0]])
    for (_, wait), (following, _) in zip(pairs, pairs[1:], strict=False):
        following.prepend(wait)
