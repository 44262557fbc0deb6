"""Tests for autopar.search.sharding.strategies: candidate shardings per node of the joint graph."""

from __future__ import annotations

import functools
import logging
import re
import zlib

import pytest
import torch
import torch.fx as fx
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn import functional as F

from autopar.capture.joint import capture
from autopar.core.placements import PARTIAL as P
from autopar.core.placements import REPLICATE as R
from autopar.core.placements import shard as S
from autopar.search.sharding import strategy_rules
from autopar.search.sharding.node_keys import tensor_inputs
from autopar.search.sharding.node_strategies import NodeStrategies, Strategy
from autopar.search.sharding.placement_sets import divides, tensor_placements
from autopar.search.sharding.strategies import enumerate_strategies
from autopar.verify.localize import graph_values

pytest.importorskip("transformers")

MESH = (2, 4)

# Op families that must never fall back to all-R: the matmuls, attention, norms,
# embeddings, views and the elementwise ops that fill a transformer.
BIG_OPS = (
    "aten.mm",
    "aten.addmm",
    "aten.bmm",
    "attention",
    "layer_norm",
    "aten.embedding",
    "aten.view",
    "aten._unsafe_view",
    "aten.transpose",
    "aten.t.",
    "aten.add.",
    "aten.mul.",
    "aten.sub.",
    "aten.div.",
    "aten.silu",
    "aten.tanh",
    "aten.pow",
    "aten.rsqrt",
    "aten.mean",
    "aten.sum",
    "log_softmax",
    "nll_loss",
)


def _fx(fn, *args: torch.Tensor) -> fx.GraphModule:
    return make_fx(fn, tracing_mode="fake")(*args)


def _by_name(gm: fx.GraphModule) -> dict[str, fx.Node]:
    return {n.name: n for n in gm.graph.nodes}


@pytest.fixture(scope="module")
def gpt_graph() -> fx.GraphModule:
    from examples.models import gpt

    model, inputs = gpt(2, 256, 8, vocab=512, seq=64, batch=4, device="meta")
    return capture(model, inputs).gm


@pytest.fixture(scope="module")
def llama_graph() -> fx.GraphModule:
    from examples.models import llama

    model, inputs = llama(2, 256, 8, 512, vocab=512, seq=64, batch=4, kv_heads=2, device="meta")
    return capture(model, inputs).gm


def test_mm_has_megatron_strategies() -> None:
    gm = _fx(torch.mm, torch.randn(16, 32), torch.randn(32, 64))
    res = enumerate_strategies(gm, MESH, ("dp", "tp"))
    (mm,) = [ns for ns in res.values() if ns.op == "aten.mm.default"]
    assert mm.rule == "dtensor" and len(mm.inputs) == 2
    have = set(mm.strategies)
    column = Strategy(outputs=((R, S(1)),), inputs=((R, R), (R, S(1))))
    row = Strategy(outputs=((R, P),), inputs=((R, S(1)), (R, S(0))))
    batch = Strategy(outputs=((S(0), R),), inputs=((S(0), R), (R, R)))
    both = Strategy(outputs=((S(0), S(1)),), inputs=((S(0), R), (R, S(1))))
    replicated = Strategy(outputs=((R, R),), inputs=((R, R), (R, R)))
    assert {column, row, batch, both, replicated} <= have
    assert len(have) == len(mm.strategies)  # no duplicates


def test_placeholders_only_divisible_placements() -> None:
    gm = _fx(lambda x, w: x * w, torch.randn(6, 8, 1), torch.randn(6, 8, 1))
    res = enumerate_strategies(gm, MESH)
    for ns in res.values():
        if ns.rule != "placeholder":
            continue
        outs = {s.outputs[0] for s in ns.strategies}
        assert all(divides(p, (6, 8, 1), MESH) for p in outs)
        assert not any(P in p for p in outs)
        assert not any(p[d] == S(2) for p in outs for d in range(2))  # a dim of size 1 stays whole
        assert (S(0), R) in outs and (S(0), S(1)) in outs  # 6 splits in 2, 8 in 4
        assert (R, S(0)) not in outs  # 6 does not split in 4
    expected = {(a, b) for a in (R, S(0), S(1)) for b in (R, S(1))}
    assert set(tensor_placements((6, 8, 1), MESH)) == expected
    assert (S(1), S(1)) in expected  # 8 splits in 2 x 4
    assert (S(1), S(1)) not in tensor_placements((6, 4, 1), MESH)  # 4 does not split in 8


def test_size_one_mesh_dims_are_replicated() -> None:
    gm = _fx(torch.mm, torch.randn(16, 32), torch.randn(32, 64))
    res = enumerate_strategies(gm, (8, 1))
    for ns in res.values():
        for s in ns.strategies:
            for p in (*s.outputs, *s.inputs):
                assert p is None or p[1] == R
        assert len(set(ns.strategies)) == len(ns.strategies)
    one_d = enumerate_strategies(gm, (8,))
    assert all(len(p) == 1 for ns in one_d.values() for s in ns.strategies for p in s.outputs if p)


def _check_graph(gm: fx.GraphModule, res: dict[str, NodeStrategies], mesh: tuple[int, ...]) -> None:
    """Every node has strategies; each is well formed and every shard divides."""
    nodes = _by_name(gm)
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        ns = res[node.name]
        assert ns.strategies, node.name
        vals = node.meta["val"]
        vals = tuple(vals) if isinstance(vals, (tuple, list)) else (vals,)
        for s in ns.strategies:
            assert len(s.outputs) == len(vals) and len(s.inputs) == len(ns.inputs), node.name
            for p, v in zip(s.outputs, vals, strict=True):
                if p is not None:
                    assert len(p) == len(mesh) and divides(p, v.shape, mesh), (node.name, p)
            if ns.rule == "follower":
                continue
            for p, name in zip(s.inputs, ns.inputs, strict=True):
                if p is not None:
                    assert divides(p, nodes[name].meta["val"].shape, mesh), (node.name, name, p)
        if ns.rule == "follower":
            (src,) = ns.inputs
            assert len(ns.strategies) == len(res[src].strategies)
            idx = node.args[1]
            assert [s.outputs[0] for s in ns.strategies] == [s.outputs[idx] for s in res[src].strategies]
        else:
            assert len(set(ns.strategies)) == len(ns.strategies), node.name


def _fallbacks(res: dict[str, NodeStrategies]) -> list[str]:
    return [ns.op for ns in res.values() if ns.rule == "replicated-fallback"]


def _heads_sharded(ns: NodeStrategies, n_out: int) -> bool:
    want = (R, S(1))
    return any(
        all(o == want for o in s.outputs[:n_out]) and all(i == want for i in s.inputs[:3])
        for s in ns.strategies
    )


@pytest.mark.parametrize("which", ["gpt", "llama"])
def test_transformers_have_real_strategies(which: str, request: pytest.FixtureRequest, caplog) -> None:
    gm = request.getfixturevalue(f"{which}_graph")
    with caplog.at_level(logging.WARNING, logger="autopar.search.sharding.strategies"):
        res = enumerate_strategies(gm, MESH)
    _check_graph(gm, res, MESH)
    fell = _fallbacks(res)
    assert not [op for op in fell if any(b in op for b in BIG_OPS)], fell
    assert len(fell) == 0, fell  # today nothing in these models needs the fallback
    assert not [r for r in caplog.records if r.name.startswith("autopar") and r.levelno >= logging.WARNING]

    # GPT-2's attention has dropout (HF's default): one fused op (autopar.ops.dropout_attention); LLaMA's none
    attn = [ns for ns in res.values() if "flash_attention_for_cpu" in ns.op or "dropout_attention" in ns.op]
    assert len(attn) == 4  # two layers, forward and backward
    for ns in attn:
        assert ns.rule == "autopar"
        assert _heads_sharded(ns, 3 if "backward" in ns.op else 2), ns.node

    # Megatron pieces survive the pruning: a column- and a row-parallel matmul, batch sharding.
    mms = [ns for ns in res.values() if ns.op in ("aten.mm.default", "aten.addmm.default")]
    assert any(s.outputs[0] == (R, P) for ns in mms for s in ns.strategies)
    assert any(s.outputs[0] == (S(0), R) for ns in mms for s in ns.strategies)
    # the loss can be computed on a batch-sharded input (partial sums of losses and kept labels), no gathered
    # logits; capture writes the mean as sum / total weight, so the shards need not keep equally many labels
    (loss,) = [ns for ns in res.values() if ns.op == "aten.nll_loss_forward.default"]
    assert any(s.outputs[:2] == ((P, R),) * 2 and s.inputs[0] == (S(0), R) for s in loss.strategies)


def test_gpt_addmm_row_parallel_keeps_its_bias(gpt_graph: fx.GraphModule) -> None:
    """The bias of a row-parallel addmm is added once: it is asked for as P, and kept."""
    res = enumerate_strategies(gpt_graph, MESH)
    addmms = [ns for ns in res.values() if ns.op == "aten.addmm.default"]
    assert addmms
    for ns in addmms:
        assert any(
            s.outputs[0] == (R, P) and s.inputs == ((R, P), (R, S(1)), (R, S(0)))
            for s in ns.strategies
        ), ns.node


def test_vocab_parallel_embedding_keeps_indices_whole(gpt_graph: fx.GraphModule) -> None:
    res = enumerate_strategies(gpt_graph, MESH)
    emb = next(ns for ns in res.values() if ns.op == "aten.embedding.default")
    assert Strategy(outputs=((R, P),), inputs=((R, S(0)), (R, R))) in emb.strategies


def test_identical_layers_are_memoized(llama_graph: fx.GraphModule, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="autopar.search.sharding.strategies"):
        enumerate_strategies(llama_graph, MESH)
    (msg,) = [r.getMessage() for r in caplog.records if "memo hits" in r.getMessage()]
    m = re.search(r"(\d+) computed, (\d+) memo hits", msg)
    assert m, msg
    computed, hits = int(m.group(1)), int(m.group(2))
    assert hits > computed


def test_no_process_group_is_created() -> None:
    import torch.distributed as dist

    gm = _fx(torch.mm, torch.randn(16, 32), torch.randn(32, 64))
    enumerate_strategies(gm, (4, 2))
    assert not dist.is_initialized()


class _Cdist(nn.Module):
    """``_cdist_forward`` / ``_cdist_backward`` have no DTensor rule and no decomposition."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.pts = nn.Parameter(torch.randn(4, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return torch.cdist(h, self.pts, compute_mode="donot_use_mm_for_euclid_dist").sum()


def test_op_without_rule_is_replicated_with_one_warning(caplog) -> None:
    cg = capture(_Cdist(), (torch.randn(16, 8),))
    with caplog.at_level(logging.WARNING, logger="autopar.search.sharding.strategies"):
        res = enumerate_strategies(cg.gm, (2, 2))
    _check_graph(cg.gm, res, (2, 2))
    fell = [ns for ns in res.values() if ns.rule == "replicated-fallback"]
    assert {ns.op for ns in fell} == {"aten._cdist_forward.default", "aten._cdist_backward.default"}
    assert sum(ns.op == "aten._cdist_backward.default" for ns in fell) == 2
    for ns in fell:
        assert ns.strategies == [Strategy(outputs=((R, R),), inputs=((R, R),) * len(ns.inputs))]
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and r.name.startswith("autopar.search")
    ]
    assert len(warnings) == 2  # one per op name, not per node
    assert any("_cdist_forward" in w for w in warnings) and any("_cdist_backward" in w for w in warnings)
    # the rest of the graph still has real choices
    assert any(ns.op == "aten.addmm.default" and len(ns.strategies) > 1 for ns in res.values())


class _ShiftedLabels(nn.Module):
    """What functionalization makes of T5's and BART's label shift, and MoE routing's ``//``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        shifted = ids.new_zeros(ids.shape)
        shifted[:, 1:] = ids[:, :-1].clone()  # copy
        shifted[:, 0] = torch.tensor(3)  # a constant (lift_fresh_copy), then fill.Tensor
        return self.emb(shifted // 2).square().mean()  # floor_divide by a Python number


def test_functional_writes_and_constants_have_rules(caplog) -> None:
    """copy: DTensor's rule for its in-place twin copy_; floor_divide(x, 2): DTensor's decomposition, with the
    scalar among the arguments; fill.Tensor: autopar's rule; an op on a model constant: whole on every rank."""
    cg = capture(_ShiftedLabels(), (torch.randint(0, 16, (8, 6)),))
    with caplog.at_level(logging.WARNING, logger="autopar.search.sharding.strategies"):
        res = enumerate_strategies(cg.gm, (2, 2))
    assert "no sharding rule" not in caplog.text
    by_op = {ns.op: ns for ns in res.values()}
    for op in ("aten.copy.default", "aten.floor_divide.default", "aten.fill.Tensor"):
        assert (S(0), R) in {s.outputs[0] for s in by_op[op].strategies}, op
    const = by_op["aten.lift_fresh_copy.default"]
    assert const.rule == "autopar" and [s.outputs[0] for s in const.strategies] == [(R, R)]


class _MobileActivations(nn.Module):
    """MobileNet's activations (ReLU6, hardswish, hardsigmoid) and a log-sigmoid, whose backwards DTensor has
    neither a rule nor a traceable decomposition for."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.hardswish(nn.functional.relu6(self.a(x)))
        return (nn.functional.hardsigmoid(self.b(y)) + nn.functional.logsigmoid(y)).square().mean()


def test_element_wise_backwards_without_a_dtensor_rule_split_like_their_inputs(caplog) -> None:
    cg = capture(_MobileActivations(), (torch.randn(8, 8),))
    with caplog.at_level(logging.WARNING, logger="autopar.search.sharding.strategies"):
        res = enumerate_strategies(cg.gm, (2, 2))
    assert "no sharding rule" not in caplog.text
    by_op = {ns.op: ns for ns in res.values()}
    for op in ("hardtanh_backward", "hardswish_backward", "hardsigmoid_backward", "log_sigmoid_backward"):
        ns = by_op[f"aten.{op}.default"]
        assert ns.rule == "autopar" and (S(0), R) in {s.outputs[0] for s in ns.strategies}, op
        assert all(set(s.inputs) == {s.outputs[0]} for s in ns.strategies)  # every input split as the output


def test_mixture_of_experts_grouped_matmuls_shard() -> None:
    """HuggingFace's experts run as ``transformers::grouped_mm_fallback`` in the trace: column and row parallel.

    Experts capture writes as ``autopar::experts`` (tests/test_experts.py) keep no grouped matmul; an
    activation that op does not compute (GPT-2's "gelu_new") keeps HuggingFace's implementation."""
    import transformers

    from examples import families

    torch.manual_seed(0)
    model, inputs = families._decoder(
        transformers.MixtralConfig, transformers.MixtralForCausalLM, num_local_experts=4, num_experts_per_tok=2,
        hidden_act="gelu_new",
    )
    gm = capture(model, inputs).gm
    res = enumerate_strategies(gm, (2, 2))
    assert not _fallbacks(res), _fallbacks(res)
    forward = [ns for ns in res.values() if ns.op == "transformers.grouped_mm_fallback.default"]
    backward = [ns for ns in res.values() if ns.op == "transformers.grouped_mm_fallback_backward.default"]
    assert len(forward) == len(backward) == 2  # up (gate and up fused) and down projections
    for ns in forward:  # (input, weight (E, K, N), offs): N split, or K split to a partial sum
        outs = {(s.outputs[0], s.inputs[1]) for s in ns.strategies}
        assert ((R, S(1)), (R, S(2))) in outs and ((R, P), (R, S(1))) in outs
        assert all(s.inputs[0][d] != S(0) for s in ns.strategies for d in range(2))  # tokens stay whole
    for ns in backward:
        assert any(s.outputs == ((R, P), (R, S(2))) for s in ns.strategies)


# Ops that take a dim and no sizes (nor decompose into ops that do), so that each rank may run them on its
# shards with the same arguments.
_DIM_OPS = {
    "cumsum": lambda x, d: torch.cumsum(x, d),
    "cumprod": lambda x, d: torch.cumprod(x, d),
    "logcumsumexp": lambda x, d: torch.logcumsumexp(x, d),
    "softmax": lambda x, d: torch.softmax(x, d),
    "log_softmax": lambda x, d: torch.log_softmax(x, d),
    "sum": lambda x, d: x.sum(d),
    "mean": lambda x, d: x.mean(d, keepdim=True),
    "amax": lambda x, d: x.amax(d),
    "prod": lambda x, d: x.prod(d),
    "var": lambda x, d: x.var(d),
    "logsumexp": lambda x, d: x.logsumexp(d),
    "norm2": lambda x, d: torch.linalg.vector_norm(x, dim=d, keepdim=True),
    "norm1": lambda x, d: torch.linalg.vector_norm(x, ord=1, dim=d),
    "norm_inf": lambda x, d: torch.linalg.vector_norm(x, ord=float("inf"), dim=d),
    "flip": lambda x, d: x.flip(d),
    "cat": lambda x, d: torch.cat([x, x.exp()], d),
    "argmax": lambda x, d: x.argmax(d),
    "max": lambda x, d: x.max(d),
    "topk": lambda x, d: x.topk(2, d),
    "sort": lambda x, d: x.sort(d),
    "cummax": lambda x, d: torch.cummax(x, d),
    "std": lambda x, d: x.std(d),
    "var_mean": lambda x, d: torch.var_mean(x, d),
    "amin": lambda x, d: x.amin(d, keepdim=True),
    "softmax_backward": lambda x, d: torch.ops.aten._softmax_backward_data(x, x.softmax(d), d, x.dtype),
    "log_softmax_backward": lambda x, d: torch.ops.aten._log_softmax_backward_data(x, x.log_softmax(d), d, x.dtype),
    "nansum": lambda x, d: x.nansum(d),
    "roll": lambda x, d: x.roll(1, d),
    "glu": lambda x, d: torch.nn.functional.glu(x, d),
    "unbind": lambda x, d: x.unbind(d)[1],
    "diff": lambda x, d: torch.diff(x, dim=d),
    "median": lambda x, d: x.median(d),
    "kthvalue": lambda x, d: x.kthvalue(2, d),
    "count_nonzero": lambda x, d: torch.count_nonzero(x > 1, d),
    "renorm": lambda x, d: x.renorm(2, d, 1.0),
    "unfold": lambda x, d: x.unfold(d, 3, 2),
    "unfold_backward": lambda x, d: torch.ops.aten.unfold_backward(x.unfold(d, 3, 2).exp(), x.shape, d, 3, 2),
    "weight_norm": lambda x, d: torch._weight_norm_interface(x, *_weight_norm_args(x, d)),  # its backward: below
}


def _weight_norm_args(x: torch.Tensor, d: int) -> tuple[torch.Tensor, int]:
    """A gain for ``weight_norm`` over ``d`` (its fused kernel takes the first or the last dim only) and that dim."""
    dim = 0 if d % x.dim() < x.dim() // 2 else x.dim() - 1
    return torch.linalg.vector_norm(x, dim=[k for k in range(x.dim()) if k != dim], keepdim=True) * 2, dim


def _simulated(node: fx.Node, s: Strategy, values: dict[str, torch.Tensor], ranks: int) -> list[torch.Tensor]:
    """``node``'s outputs assembled from ``ranks`` ranks each running it on its shards of ``values`` as ``s``
    places them: a shard is a chunk, a partial sum a random split that adds up to the whole."""

    def part(name: str, p: tuple, r: int) -> torch.Tensor:
        (pl,) = p
        whole = values[name]
        if pl.is_shard():  # contiguous, as DTensor lays a shard out (weight_norm's kernel reads strides wrong)
            return whole.chunk(ranks, pl.dim)[r].contiguous()
        if pl.is_partial():  # the same cuts for every rank's call
            gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            cuts = [torch.rand(whole.shape, generator=gen, dtype=whole.dtype) for _ in range(ranks - 1)]
            return cuts[r] if r < ranks - 1 else whole - sum(cuts)
        return whole

    outs = []
    for r in range(ranks):
        local = {a.name: part(a.name, p, r) for a, p in zip(tensor_inputs(node), s.inputs, strict=True)}
        args = torch.fx.node.map_arg((node.args, dict(node.kwargs)), lambda a, loc=local: loc[a.name])
        if node.target in strategy_rules.LOCAL_ARGUMENTS:  # as the sharding interpreter runs it
            args = strategy_rules.LOCAL_ARGUMENTS[node.target](*args)
        out = node.target(*args[0], **args[1])
        outs.append(out if isinstance(out, (tuple, list)) else (out,))
    whole = []
    for k, placed in enumerate(s.outputs):
        if placed is None:
            continue
        (pl,) = placed
        pieces = [o[k] for o in outs]
        if pl.is_shard():
            whole.append(torch.cat(pieces, pl.dim))
        elif pl.is_partial():
            op = {"sum": torch.sum, "max": torch.amax, "min": torch.amin, "avg": torch.mean, "product": torch.prod}
            op = op[pl.reduce_op]
            whole.append(op(torch.stack(pieces), 0))
        else:
            assert all(torch.equal(p, pieces[0]) for p in pieces), f"{node.target} {s}: replicas differ"
            whole.append(pieces[0])
    return whole


@pytest.mark.parametrize("name", list(_DIM_OPS))
def test_every_strategy_of_an_op_over_a_dim_is_exact_on_shards(name: str) -> None:
    """Each rank runs the op on its shards as the strategy places them; the outputs, assembled, are the op's.

    Written against two faults of DTensor's rules in torch 2.13 that autopar took on trust: the scans'
    (cumsum, cumprod, logcumsumexp) compared shard dims with a negative ``dim`` as written and kept the input
    split along the scanned dim; a p-norm over a split dim is DTensor's ``_NormPartial``, which autopar read as
    a plain partial sum of the shards' norms."""
    fn = _DIM_OPS[name]
    x = torch.randn(4, 6, 8, 10, dtype=torch.float64).abs() + 0.5
    for dim in (-1, -2, 1, 0):
        gm = _fx(functools.partial(lambda d, t: fn(t, d), dim), x)
        strategies = enumerate_strategies(gm, (2,))
        values = graph_values(gm, [x])
        for node in gm.graph.nodes:
            ns = strategies.get(node.name)
            if node.op != "call_function" or ns.rule == "follower":
                continue
            outs = values[node.name] if isinstance(values[node.name], (tuple, list)) else (values[node.name],)
            for s in ns.strategies:
                want = [o for o, p in zip(outs, s.outputs, strict=True) if p is not None]
                for got, w in zip(_simulated(node, s, values, 2), want, strict=True):
                    assert torch.allclose(got, w, rtol=1e-9, atol=1e-9), f"{name} dim {dim}: {node.target} {s}"


def _weight_norm(dim: int):
    return lambda x: torch._weight_norm_interface(x, *_weight_norm_args(x, dim))[0]


# backwards with autopar's rules, each whose incoming gradient may be partial sums: (forward, input shape, op)
_BACKWARDS = {
    "avg_pool2d": (lambda x: F.avg_pool2d(x, 2), (4, 6, 8, 10), "avg_pool2d_backward"),
    "avg_pool2d_padded": (
        lambda x: F.avg_pool2d(x, 3, stride=1, padding=1, count_include_pad=False),
        (4, 6, 8, 10),
        "avg_pool2d_backward",
    ),
    "avg_pool2d_unbatched": (lambda x: F.avg_pool2d(x, 2), (6, 8, 10), "avg_pool2d_backward"),
    "avg_pool3d": (lambda x: F.avg_pool3d(x, 2), (4, 6, 4, 6, 8), "avg_pool3d_backward"),
    "max_pool3d": (lambda x: F.max_pool3d(x, 2), (4, 6, 4, 6, 8), "max_pool3d_with_indices_backward"),
    "adaptive_max_pool2d": (lambda x: F.adaptive_max_pool2d(x, 3), (4, 6, 8, 10), "adaptive_max_pool2d_backward"),
    "adaptive_max_pool3d": (lambda x: F.adaptive_max_pool3d(x, 2), (4, 6, 4, 6, 8), "adaptive_max_pool3d_backward"),
    "adaptive_avg_pool3d": (
        lambda x: F.adaptive_avg_pool3d(x, (2, 3, 3)),
        (4, 6, 4, 6, 8),
        "_adaptive_avg_pool3d_backward",
    ),
    "prelu_channels": (
        lambda x: F.prelu(x - 1, torch.linspace(-0.5, 0.5, 6, dtype=x.dtype)),
        (4, 6, 8, 10),
        "_prelu_kernel_backward",
    ),
    "prelu_one": (lambda x: F.prelu(x - 1, torch.tensor([0.25], dtype=x.dtype)), (4, 6, 8, 10), "_prelu_kernel_backward"),
    "weight_norm_first": (_weight_norm(0), (4, 6, 8, 10), "_weight_norm_interface_backward"),
    "weight_norm_last": (_weight_norm(-1), (4, 6, 8, 10), "_weight_norm_interface_backward"),
}


@pytest.mark.parametrize("name", list(_BACKWARDS))
def test_every_strategy_of_a_backward_is_exact_on_shards(name: str) -> None:
    """A backward with autopar's rule, its incoming gradient a sum (which can hand over partial sums, unlike
    an input), run on its shards as each strategy places them: whole, split on dim 0 (and on the channels,
    or the normalized dim), or partial sums in and out."""
    forward, shape, op = _BACKWARDS[name]
    x = torch.randn(shape, dtype=torch.float64).abs() + 0.5

    def grad(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        x = x.detach().requires_grad_()
        return torch.autograd.grad(forward(x), x, w.sum(0))[0]

    w = torch.randn((2, *forward(x).shape), dtype=torch.float64)
    gm = _fx(grad, x, w)
    strategies = enumerate_strategies(gm, (2,))
    values = graph_values(gm, [x, w])
    kinds = set()
    for node in gm.graph.nodes:
        if getattr(node.target, "__name__", "").split(".")[0] != op:
            continue
        whole = values[node.name] if isinstance(values[node.name], (tuple, list)) else (values[node.name],)
        for s in strategies[node.name].strategies:
            for got, want in zip(_simulated(node, s, values, 2), whole, strict=True):
                assert torch.allclose(got, want, rtol=1e-9, atol=1e-9), f"{name}: {s}"
            kinds.add(str(s.outputs[0][0])[0])
    assert kinds == {"R", "S", "P"}, kinds
