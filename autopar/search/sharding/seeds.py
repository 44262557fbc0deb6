"""Hand-set layouts the search must never lose to: pure data parallel, ZeRO-3, Megatron tensor parallel,
and Megatron's tensor parallelism beside ZeRO-3 over the data-parallel axis.

Each is a restriction of the parameters' placements; the solver places
everything else. Solving them beside the unrestricted MILP gives the search
a portfolio: if the MILP stops at its time limit short of the optimum, a
known-good layout of the same cost model still stands, so the chosen plan
is never worse than these baselines. Megatron's layout is recognised by
the usual module names (q/k/v/gate/up and GPT-2's c_attn/c_fc are
column-parallel, o/down/c_proj row-parallel, embeddings and head
vocab-parallel); a model with other names simply gets no Megatron seed.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from autopar.capture.joint import CapturedGraph
from autopar.core.placements import REPLICATE, Placement, shard
from autopar.ops import experts as experts_op
from autopar.search.sharding.context_parallel import cp_filter
from autopar.search.sharding.filters import keyed, node_key
from autopar.search.sharding.node_strategies import Strategy

COLUMN = re.compile(r"(q_proj|k_proj|v_proj|gate_proj|up_proj|c_attn|c_fc)\.(weight|bias)$")
ROW = re.compile(r"(o_proj|down_proj|c_proj)\.weight$")
VOCAB = re.compile(r"(embed_tokens|wte|lm_head)\.weight$")
EXPERTS = re.compile(r"experts\.(gate_up_proj|down_proj)$")  # HuggingFace's routed experts, (E, ., .)


def megatron_tp(name: str, conv1d: bool) -> Placement:
    """The tp placement Megatron-LM gives a parameter; Linear weights are (out, in), GPT-2's Conv1D (in, out)."""
    if COLUMN.search(name):
        if name.endswith("bias"):
            return shard(0)
        return shard(1) if conv1d else shard(0)
    if ROW.search(name):
        return shard(0) if conv1d else shard(1)
    if VOCAB.search(name):
        return shard(0)
    return REPLICATE


def has_megatron_names(param_names: list[str]) -> bool:
    return any(COLUMN.search(n) for n in param_names) and any(ROW.search(n) for n in param_names)


def seed_filter(kind: str, params: dict[str, str], conv1d: bool) -> Callable[[str, Strategy], bool]:
    """Allowed strategies under a seed layout; ``params`` maps placeholder names to parameter names."""

    def allowed(node: str, strategy: Strategy) -> bool:
        if node not in params:
            return True
        out = strategy.outputs[0]
        if kind == "dp":
            return all(p.is_replicate() for p in out) and not strategy.zero  # plain data parallelism: no ZeRO
        if kind == "zero3":
            return out[0].is_shard() and all(p.is_replicate() for p in out[1:])
        if kind == "megatron":
            return out[0].is_replicate() and out[1] == megatron_tp(params[node], conv1d)
        if kind == "megatron_zero3":  # FSDP beside tensor parallelism (torchtitan's 2-D layout)
            # a mixture's experts, most of its states and whole under Megatron's tp ([gate; up] concatenated),
            # are stored split over tp too: Mixtral-8x7B's do not fit 80 GB split over dp 8 alone
            if EXPERTS.search(params[node]):
                return out[0].is_shard() and out[1].is_shard()
            return out[0].is_shard() and out[1] == megatron_tp(params[node], conv1d)
        if kind in CP_LAYOUTS:
            return True  # context parallel: its parameters' placements are set by layout_filter
        if kind == "experts_whole":
            return True  # the parameters free: only the experts ops are held (layout_filter)
        if kind in ("ep", "ep_dp"):
            # expert parallel over the second mesh axis ("ep", beside dp), or over the dp axis (ranks shared)
            axis = 1 if kind == "ep" else 0
            if EXPERTS.search(params[node]):
                return out[axis].is_shard(0) and all(p.is_replicate() for a, p in enumerate(out) if a != axis)
            return all(p.is_replicate() for p in out) and not strategy.zero
        raise ValueError(
            f"unknown seed layout {kind!r}; use dp, zero3, megatron, megatron_zero3, ep, ep_dp, cp, cp_dp or "
            "experts_whole"
        )

    return keyed(allowed, params.get)  # a parameter by its name; every other node alike


def layout_filter(kind: str, captured: CapturedGraph, mesh_shape: tuple[int, ...]) -> Callable[[str, Strategy], bool]:
    """:func:`seed_filter` on ``captured``; the expert-parallel seeds also have the experts ops read the experts
    split (:func:`ep_filter`), not gathered."""
    params = {p.placeholder: p.name for p in captured.params}
    if kind in CP_LAYOUTS:
        return _cp_layout(kind, captured, mesh_shape, params)
    seed = seed_filter(kind, params, captured.model_name.startswith("GPT2"))
    if kind in ("dp", "zero3"):
        # the fixed state (buffers, frozen parameters) whole on every rank, as DDP and FSDP hold buffers and the
        # analytic data-parallel model counts them: left free, a LoRA fine-tune's frozen MLP was split over the
        # dp ranks, Megatron's way, costed as data parallelism
        state = {b.placeholder for b in captured.buffers}
        plain, plain_key = seed, node_key(seed)
        seed = keyed(
            lambda node, s: plain(node, s) and (node not in state or all(p.is_replicate() for p in s.outputs[0])),
            lambda node: (node in state, plain_key(node)),
        )
    if kind not in ("ep", "ep_dp", "experts_whole"):
        return seed
    size = 1 if kind == "experts_whole" else mesh_shape[1 if kind == "ep" else 0]
    by_ep = ep_filter(captured, mesh_shape, size)
    return lambda node, strategy: seed(node, strategy) and by_ep(node, strategy)


CP_LAYOUTS = tuple(f"{k}{o}" for k in ("cp", "cp_dp") for o in ("", "_balanced", "_contiguous"))
"""The context-parallel layouts: the kernels' query split in either order (the solver's choice), or held to
head-tail order (``_balanced``) or to contiguous shards (``_contiguous``)."""


def _cp_layout(
    kind: str, captured: CapturedGraph, mesh_shape: tuple[int, ...], params: dict[str, str]
) -> Callable[[str, Strategy], bool]:
    """Context parallel over the second axis ("cp", data parallel beside it) or over the dp axis's ranks
    ("cp_dp", Megatron's tensor parallelism beside it where the mesh has a tp axis and the model its names):
    the attention kernels' queries split over that axis, the inputs' sequence (dim 1) too (or, in head-tail
    order, whole on it: every rank cuts its chunks from them), the parameters whole on it (their gradients
    reduced over it, as data parallelism's are); the rest solved."""
    base, order = kind, None
    for o in ("balanced", "contiguous"):
        if kind.endswith(f"_{o}"):
            base, order = kind.removesuffix(f"_{o}"), o
    axis = 1 if base == "cp" else 0
    beside = "megatron" if axis == 0 and mesh_shape[1] > 1 and has_megatron_names(list(params.values())) else "dp"
    seed = seed_filter(beside, params, captured.model_name.startswith("GPT2"))
    by_cp = cp_filter(captured, mesh_shape, mesh_shape[axis], axis, order)
    inputs = {i.placeholder for i in captured.inputs}
    by_name = {n.name: n for n in captured.gm.graph.nodes}

    def allowed(node: str, strategy: Strategy) -> bool:
        if node in inputs and by_name[node].meta["val"].dim() >= 2:
            held = strategy.outputs[0][axis]
            if not (held.is_shard(1) or (order == "balanced" and held.is_replicate())):
                return False
        if node in params and not strategy.outputs[0][axis].is_replicate():
            return False
        return seed(node, strategy) and by_cp(node, strategy)

    cp_key = node_key(by_cp)
    return keyed(allowed, lambda node: (node if node in inputs else None, params.get(node), cp_key(node)))


def seeds_for(tp: int, param_names: list[str]) -> list[str]:
    """The seed layouts that make sense on a mesh with this tensor-parallel size.

    A mixture of experts adds expert parallelism: over the dp axis's ranks on a dp-only mesh
    ("ep_dp", as DeepSpeed-MoE shares them), over the second axis beside dp otherwise ("ep"); and
    on every mesh the search with the experts whole on every rank of their layout ("experts_whole",
    every other choice free: the expert-parallel answer the MILP starts from otherwise keeps it there,
    and on a dp-only mesh the ZeRO-3 seed holds every parameter at one stage, where the estimate
    prefers them mixed: Mixtral-8x7B on 64 H100s at 64 sequences, 1.037 s with the experts whole and
    the stages the MILP's against 1.152 s under ZeRO-3 throughout and ep 8's 1.132 s).
    """
    experts = any(EXPERTS.search(n) for n in param_names)
    if tp == 1:
        return ["dp", "zero3"] + (["ep_dp", "experts_whole"] if experts else [])
    megatron = ["megatron"] if has_megatron_names(param_names) else []
    return megatron + (["ep", "experts_whole"] if experts else [])


def fallback_seeds(kinds: list[str]) -> list[str]:
    """The seed layouts the full search of a mesh without a pipeline tries when none of ``kinds`` fits.

    Beside Megatron's, its layout with the parameters also split over dp ("megatron_zero3"): of the
    unrestricted MILP's answers, the fewest micro-batches that fit may need exactly that, and that MILP,
    stopped at its time limit, found none at one micro-batch on Mixtral-8x7B's dp 8 x tp 8 and went on to
    two (7.91 s; ZeRO-3 at one costs 7.02 s); a layout with every parameter's placement set solves in
    seconds. Only where nothing else fits: as one more seed of every mesh it took LLaMA-2-70B's four meshes
    without a pipeline 21 s of seeds where they took 10 s, and LLaMA-7B's plan to 10.8 s. Pipelines, which
    gather ZeRO-3's parameters again for every micro-batch, leave it to their MILP.
    """
    return ["megatron_zero3"] if "megatron" in kinds else []


def ep_seeds(ep: int, dp: int, tp: int) -> set[str]:
    """The seeds that split the experts ``ep`` ways on a dp x tp mesh (1: those that keep them whole)."""
    if ep == 1:
        return {"dp", "zero3", "megatron", "megatron_zero3", "experts_whole"}
    return {kind for kind, size in (("ep_dp", dp), ("ep", tp)) if size == ep}


def cp_seeds(cp: int, dp: int, tp: int, axis: int | None = None) -> list[str]:
    """The seeds that split the sequence ``cp`` ways in attention on a dp x tp mesh: over the dp axis's ranks
    ("cp_dp") or over the second axis ("cp"); only over mesh axis ``axis`` where given."""
    kinds = (("cp_dp", dp, 0), ("cp", tp, 1))
    return [kind for kind, size, a in kinds if size == cp > 1 and axis in (None, a)]


def cp_kinds(kinds: list[str], cp: int, dp: int, tp: int, axis: int | None = None) -> list[str]:
    """The seed layouts a fixed ``cp`` leaves of ``kinds``: past 1, the seeds that split the sequence ``cp`` ways
    (:func:`cp_seeds`) in their place; at 1, those of ``kinds`` that do not split it."""
    return cp_seeds(cp, dp, tp, axis) if cp > 1 else [k for k in kinds if not k.startswith("cp")]


def ep_filter(captured: CapturedGraph, mesh_shape: tuple[int, ...], ep: int) -> Callable[[str, Strategy], bool]:
    """``fixed={"ep": ep}``: the experts ops split the experts over one mesh axis of size ``ep`` (1: not at
    all); other nodes are free."""
    ops = {
        n.name: str(n.target) == experts_op.BACKWARD_NAME
        for n in captured.gm.graph.nodes
        if str(n.target) in experts_op.EXPERT_OP_NAMES
    }

    def allowed(node: str, strategy: Strategy) -> bool:
        if node not in ops:
            return True
        axes = experts_op.ep_axes(strategy.inputs, ops[node])
        if axes is None:
            return False
        return [mesh_shape[a] for a in axes] == ([ep] if ep > 1 else [])

    return allowed
