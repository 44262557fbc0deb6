"""Per-op records of a sharding search, kept in the plan so that ``Plan.explain`` can say why.

The plan holds only what was chosen; the search knew the alternatives. This
pass reads them off a :class:`~autopar.search.sharding.mesh.ShardingResult` while
they still exist and writes compact records (:class:`~autopar.plans.op_records.OpRecords`,
plain data the plan keeps): for each op that
matters (it has FLOPs, is a parameter, or sends or receives a collective),
the strategies it had, what each would cost *with every other node kept as
chosen* (compute, plus the communication on the edges that touch it, plus
the memory it holds), the collectives the chosen one caused, and a sentence
on why the chosen one won.

"Kept as chosen" makes the numbers local and exact: the cost of switching
one node alone is its own cost plus its incident edges' costs, which are
the terms of the MILP objective that change. A cheaper local alternative
that was not taken has a reason the record names: the node is tied to its
copies in repeated layers, the memory limit, a seed layout the search
preferred, or a solver time limit.

Size is bounded: repeated layers are recorded once (the other copies point
at the first through ``same_as``), at most ``alternatives`` strategies are
kept per op, numbers keep four significant digits, and at most ``limit``
records are written, the ops with the most FLOPs and the parameters first.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any

from autopar.capture.joint import CapturedGraph, node_module
from autopar.core.mesh import SHARDING_AXES
from autopar.core.module_paths import layer_key
from autopar.core.placements import Placements, text
from autopar.plans.format import secs_brief, size_brief
from autopar.plans.op_records import ChargedCollective, OpAlternative, OpRecord, OpRecords

if TYPE_CHECKING:
    from autopar.search.sharding.instance import ShardingProblem
    from autopar.search.sharding.mesh_solve import ShardingResult

# the sharding problem marks a forbidden resharding with this cost (seconds): resharding_edges.FORBIDDEN_S
_FORBIDDEN_S = 1e6
# a local saving below this fraction of the chosen cost (or 10 ns) is a tie, not a reason to explain
_TIE_RTOL = 1e-6


def placement_str(p: Placements | None) -> str:
    """One tensor's placement per mesh axis as a short string: ``S(0),R``; ``-`` for a non-tensor."""
    return "-" if p is None else text(p)


def _outputs_str(outputs: Any) -> str:
    return " | ".join(placement_str(p) for p in outputs) or "-"


def _r(x: float) -> float:
    """Four significant digits: enough to compare alternatives, small in JSON."""
    if x == 0 or not math.isfinite(x):
        return 0.0 if x == 0 else x
    return float(f"{x:.4g}")


def explain_records(
    captured: CapturedGraph,
    res: ShardingResult,
    limit: int = 2000,
    alternatives: int = 5,
) -> OpRecords:
    """Compact per-op records of ``res``'s search on ``captured``'s graph, for ``plan.solver.ops``.

    A record (:class:`~autopar.plans.op_records.OpRecord`) holds the op, its module,
    phase and FLOPs (whole batch), the parameter's name, the repeated layers sharing
    the decision, how many strategies it had and how many of those were ruled out
    (forbidden, or needing a resharding from its neighbours' placements that cannot
    be done), the chosen strategy and the cheapest others, its collectives and why.
    """
    sp, choice = res.sp, res.solution.choice
    ops = OpRecords(
        axes=list(SHARDING_AXES),
        mesh={"dp": res.mesh.dp, "tp": res.mesh.tp},
        source=res.source,
        status=res.solution.status,
        memory_limit=_r(sp.problem.memory_limit or 0.0),
        peak=_r(res.estimate.memory.peak),
    )
    if not choice:
        return ops
    by_name = {n.name: n for n in captured.gm.graph.nodes}
    param_of = {t.placeholder: t.name for t in captured.params}
    colls = _collectives_by_node(res)
    rep_of, copies = _group_representatives(sp.problem.groups)
    order, same_as = _nodes_to_record(sp, param_of, colls, rep_of)
    kept = order[:limit]
    kept_names = {sp.nodes[i] for i in kept}
    ops.dropped = len(order) - len(kept)
    ops.same_as = {k: v for k, v in same_as.items() if v in kept_names}
    ctx = _Context(res, choice, _incident_edges(sp), copies)
    for i in sorted(kept):
        name = sp.nodes[i]
        node = by_name.get(name)
        ops.records[name] = replace(
            ctx.record(i, alternatives),
            op=str(node.target) if node is not None and node.op == "call_function" else "placeholder",
            module=node_module(node) if node is not None else "",
            phase=node.meta.get("autopar_phase", "") if node is not None else "",
            flops=_r(sp.flops[i]),
            param=param_of.get(name),
            copies=copies.get(i, 1),
            collectives=colls.get(name, []),
        )
    _fold_identical(ops)
    return ops


def _incident_edges(sp: ShardingProblem) -> list[list[int]]:
    """Per problem node, the edges that touch it."""
    incident: list[list[int]] = [[] for _ in sp.nodes]
    for e, (u, v) in enumerate(sp.problem.edges):
        incident[u].append(e)
        if v != u:
            incident[v].append(e)
    return incident


def _collectives_by_node(res: ShardingResult) -> dict[str, list[ChargedCollective]]:
    """The charged collectives, each under the node it comes from and the node it goes to."""
    colls: dict[str, list[ChargedCollective]] = {}
    for c in res.charged:
        rec = ChargedCollective(c.kind, c.axis, _r(c.bytes), c.src, c.dst, c.reason)
        colls.setdefault(c.src, []).append(rec)
        if c.dst != c.src:
            colls.setdefault(c.dst, []).append(rec)
    return colls


def _group_representatives(groups: list[list[int]] | None) -> tuple[dict[int, int], dict[int, int]]:
    """Repeated layers: one record per group, the first member in graph order speaking for the others.

    Returns each grouped node's representative, and each representative's group size.
    """
    rep_of: dict[int, int] = {}
    copies: dict[int, int] = {}
    for group in groups or []:
        members = sorted(group)
        for m in members:
            rep_of[m] = members[0]
        copies[members[0]] = len(members)
    return rep_of, copies


def _nodes_to_record(
    sp: ShardingProblem, param_of: dict[str, str], colls: dict[str, list], rep_of: dict[int, int]
) -> tuple[list[int], dict[str, str]]:
    """The nodes worth a record, most telling first (parameters, then by FLOPs), and who they speak for.

    A node is worth one when it is a parameter, computes, or communicates (itself or
    a member of its group); a group member is recorded through its representative.
    """

    def matters(i: int) -> bool:
        name = sp.nodes[i]
        return name in param_of or sp.flops[i] > 0 or name in colls

    wanted: dict[int, None] = {}
    same_as: dict[str, str] = {}
    for i, name in enumerate(sp.nodes):
        rep = rep_of.get(i, i)
        if not (matters(i) or (rep != i and matters(rep))):
            continue
        if rep != i:
            same_as[name] = sp.nodes[rep]
        wanted[rep] = None
    order = sorted(wanted, key=lambda i: (sp.nodes[i] not in param_of, -sp.flops[i], i))
    return order, same_as


def _fold_identical(ops: OpRecords) -> None:
    """Alias records that repeat an earlier one up to the layer number (parameters of repeated layers).

    The solver ties only ops it may tie; parameters of identical layers usually get
    identical records anyway, and one copy says all there is to say.
    """
    seen: dict[str, str] = {}
    records, same_as = ops.records, ops.same_as
    for name in list(records):
        rec = records[name]
        folded = replace(
            rec,
            module=_fold(rec.module),
            param=_fold(rec.param or ""),
            collectives=[replace(c, src="", dst="") for c in rec.collectives],
        )
        key = json.dumps(asdict(folded), sort_keys=True)
        first = seen.setdefault(key, name)
        if first != name and _fold(rec.module) != rec.module:
            same_as[name] = first
            del records[name]
    for name, target in same_as.items():
        same_as[name] = same_as.get(target, target)


def _fold(module: str) -> str:
    """The layer number taken out: "transformer.h.3.mlp" -> "transformer.h.*.mlp"."""
    key = layer_key(module)
    return key[0] if key else module


class _Context:
    """What every record reads: the problem, the chosen answer, each node's incident edges."""

    def __init__(self, res: ShardingResult, choice: list[int], incident: list[list[int]], copies) -> None:
        self.res = res
        self.sp = res.sp
        self.p = res.sp.problem
        self.choice = choice
        self.incident = incident
        self.copies = copies

    def local_costs(self, i: int) -> list[tuple[float, float]]:
        """(compute, communication on the edges touching ``i``) per strategy of ``i``, others as chosen."""
        p, choice = self.p, self.choice
        out = []
        for s, c in enumerate(p.node_costs[i]):
            comm = 0.0
            for e in self.incident[i]:
                u, v = p.edges[e]
                sv = len(p.node_costs[v])
                a = s if u == i else choice[u]
                b = s if v == i else choice[v]
                comm += p.edge_costs[e][a * sv + b]
            out.append((c, comm))
        return out

    def record(self, i: int, alternatives: int) -> OpRecord:
        """Node ``i``'s strategies, the chosen one first, and why it won (the caller adds the node's facts)."""
        sp = self.sp
        chosen = self.choice[i]
        costs = self.local_costs(i)
        totals = [c + m for c, m in costs]
        allowed = [
            s for s, (c, m) in enumerate(costs) if math.isfinite(c) and c < _FORBIDDEN_S and m < _FORBIDDEN_S
        ]
        others = sorted((s for s in allowed if s != chosen), key=lambda s: (totals[s], s))
        shown = [chosen, *others[: max(alternatives - 1, 0)]]
        strategies = sp.strategies[i]

        def alt(s: int) -> OpAlternative:
            st = strategies[s]
            c, m = costs[s]
            return OpAlternative(
                outputs=_outputs_str(st.outputs),
                inputs=[placement_str(x) for x in st.inputs],
                compute_s=_r(c),
                comm_s=_r(m),
                memory=_r(self.held(i, s)),
            )

        return OpRecord(
            op="",
            strategies=len(strategies),
            forbidden=len(strategies) - len(set(allowed) | {chosen}),
            alternatives=[alt(s) for s in shown],
            why=self.why(i, chosen, others, costs, strategies),
        )

    def held(self, i: int, s: int) -> float:
        """Bytes node ``i`` holds under strategy ``s``: its output, or a parameter's value, state and gradient."""
        parts = getattr(self.sp, "state_parts", {})
        grad = parts[i][s][1] if i in parts else 0.0
        return self.p.node_memory[i][s] + grad

    def why(self, i: int, chosen: int, others: list[int], costs, strategies) -> str:
        """One or two sentences: why ``chosen`` rather than the locally cheapest alternative."""
        res, p = self.res, self.p
        total = [c + m for c, m in costs]
        here = total[chosen]
        cname = _outputs_str(strategies[chosen].outputs)
        if not others:
            return f"its only allowed strategy ({cname})"
        best = others[0]
        bname = _outputs_str(strategies[best].outputs)
        saving = here - total[best]
        tol = max(abs(here) * _TIE_RTOL, 1e-8)
        if saving <= tol:
            gap = total[best] - here
            if gap <= tol:
                reason = f"ties with {bname}, the cheapest with its neighbours' placements as chosen"
            else:
                reason = (
                    f"cheapest of its {len(others) + 1} allowed strategies with its neighbours' placements "
                    f"as chosen; next best {bname} costs {secs_brief(gap)} more ({_component(costs, chosen, best)})"
                )
            return reason + _vs_replicated(costs, chosen, strategies)
        # a cheaper alternative was left: name why
        lead = f"{bname} would cost {secs_brief(saving)} less here"
        mem_more = self.held(i, best) - self.held(i, chosen)
        limit = p.memory_limit
        if res.source != "milp":
            return (
                f"the {res.source} layout was kept on this mesh (its step estimate beat the unrestricted "
                f"search's); {lead}, outside that layout"
            )
        if mem_more > 0 and limit and res.estimate.memory.peak + mem_more > limit:
            return (
                f"{lead} but needs {size_brief(mem_more)} more per device, and the plan's peak "
                f"{size_brief(res.estimate.memory.peak)} is near the {size_brief(limit)} limit"
            )
        n = self.copies.get(i, 1)
        if n > 1:
            return (
                f"tied to its {n} copies in the repeated layers, which take one decision together: "
                f"{lead} in this copy, not over all of them"
            )
        if mem_more > 0 and limit:
            return f"{lead} but needs {size_brief(mem_more)} more per device while memory is tight elsewhere in its live range"
        if res.solution.status != "optimal":
            return f"{lead}; the solver stopped at its time limit ({res.solution.status})"
        return f"{lead} alone, but the joint optimum over the whole graph keeps {cname}"


def _component(costs, chosen: int, other: int) -> str:
    dc = costs[other][0] - costs[chosen][0]
    dm = costs[other][1] - costs[chosen][1]
    parts = []
    if abs(dc) > 0:
        parts.append(f"compute {'+' if dc > 0 else '-'}{secs_brief(abs(dc))}")
    if abs(dm) > 0:
        parts.append(f"communication {'+' if dm > 0 else '-'}{secs_brief(abs(dm))}")
    return ", ".join(parts) or "same cost"


def _vs_replicated(costs, chosen: int, strategies) -> str:
    """How the chosen strategy compares with running the op replicated, when that was an option."""
    st = strategies[chosen]
    rep = [
        s
        for s, x in enumerate(strategies)
        if all(p is None or all(a.is_replicate() for a in p) for p in (*x.outputs, *x.inputs))
    ]
    if not rep or rep[0] == chosen or all(p is None or all(a.is_replicate() for a in p) for p in st.outputs):
        return ""
    r = rep[0]
    if not (math.isfinite(costs[r][0]) and costs[r][1] < _FORBIDDEN_S):
        return ""
    return (
        f"; replicated it would take compute {secs_brief(costs[r][0])} and communication {secs_brief(costs[r][1])}, "
        f"against {secs_brief(costs[chosen][0])} and {secs_brief(costs[chosen][1])}"
    )
