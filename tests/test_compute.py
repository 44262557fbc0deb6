"""Compute cost model: FLOPs agree with torch's FlopCounterMode, views are free, the roofline picks the right bound."""

from __future__ import annotations

import operator
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from autopar.cost_models import attention, compute
from autopar.cost_models.compute import (
    DEFAULT_EFFICIENCY,
    ComputeEfficiency,
    ComputeSummary,
    graph_compute,
    is_view,
    node_bytes,
    node_flops,
    node_time,
    roofline_time,
)

aten = torch.ops.aten


@dataclass
class FakeDevice:
    """The two fields the roofline reads; H100-like figures."""

    peak_flops: dict
    hbm_bandwidth: float


H100 = FakeDevice(
    peak_flops={"bf16": 989e12, "fp16": 989e12, "fp32": 67e12, "tf32": 494e12}, hbm_bandwidth=3.35e12
)


def trace(fn, *args):
    return make_fx(fn, tracing_mode="fake")(*args)


def ops(gm, packet):
    return [
        n
        for n in gm.graph.nodes
        if n.op == "call_function" and getattr(n.target, "overloadpacket", None) is packet
    ]


def eager_flops(fn, *args) -> int:
    with FlopCounterMode(display=False) as counter:
        fn(*args)
    return counter.get_total_flops()


def split_at_backward(gm):
    """phase_of for make_fx joint graphs: everything from the loss's ones_like seed on is backward."""
    nodes = list(gm.graph.nodes)
    seed = next(i for i, n in enumerate(nodes) if getattr(n.target, "overloadpacket", None) is aten.ones_like)
    index = {n: i for i, n in enumerate(nodes)}
    return lambda n: "backward" if index[n] >= seed else "forward"


# --------------------------------------------------------------------------- matmuls


def test_mm_addmm_bmm_flops_are_2mnk():
    m, k, n, b = 6, 5, 7, 3
    gm = trace(lambda x, w: x @ w, torch.randn(m, k), torch.randn(k, n))
    (mm,) = ops(gm, aten.mm)
    assert node_flops(mm) == 2 * m * n * k

    gm = trace(
        lambda bias, x, w: torch.addmm(bias, x, w), torch.randn(n), torch.randn(m, k), torch.randn(k, n)
    )
    (addmm,) = ops(gm, aten.addmm)
    assert node_flops(addmm) == 2 * m * n * k

    gm = trace(torch.bmm, torch.randn(b, m, k), torch.randn(b, k, n))
    (bmm,) = ops(gm, aten.bmm)
    assert node_flops(bmm) == 2 * b * m * n * k

    gm = trace(
        lambda c, x, w: torch.baddbmm(c, x, w),
        torch.randn(b, m, n),
        torch.randn(b, m, k),
        torch.randn(b, k, n),
    )
    (baddbmm,) = ops(gm, aten.baddbmm)
    assert node_flops(baddbmm) == 2 * b * m * n * k


def test_mlp_joint_graph_is_three_forwards_minus_first_input_grad():
    batch, d_in, hidden, d_out = 5, 8, 16, 4
    model = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, d_out))
    params = dict(model.named_parameters())

    def step(params, x, y):
        loss = F.mse_loss(functional_call(model, params, (x,)), y)
        return loss, torch.autograd.grad(loss, list(params.values()))

    gm = trace(step, params, torch.randn(batch, d_in), torch.randn(batch, d_out))
    summary = graph_compute(gm, split_at_backward(gm))

    fwd = 2 * batch * d_in * hidden + 2 * batch * hidden * d_out
    # Backward: a weight gradient per layer plus the second layer's input gradient.
    # x does not require grad, so autograd skips the first layer's input gradient.
    first_input_grad = 2 * batch * d_in * hidden
    assert summary.forward_flops == fwd
    assert summary.backward_flops == 2 * fwd - first_input_grad
    assert summary.total_flops == 3 * fwd - first_input_grad
    assert summary.flops_by_phase() == {"forward": fwd, "backward": 2 * fwd - first_input_grad}
    assert summary.total_bytes == sum(b for _, b in summary.per_node.values()) > 0

    # Without phase_of everything counts as forward.
    flat = graph_compute(gm)
    assert flat.forward_flops == flat.total_flops == summary.total_flops and flat.backward_flops == 0


# --------------------------------------------------------------------------- conv and attention vs FlopCounterMode


def test_conv_forward_backward_matches_flop_counter_mode():
    def step(x, w, b):
        out = F.conv2d(x, w, b, stride=2, padding=1)
        return (out,) + torch.autograd.grad(out.square().sum(), (x, w, b))

    args = [torch.randn(2, 3, 16, 16, requires_grad=True), torch.randn(8, 3, 3, 3, requires_grad=True)]
    args.append(torch.randn(8, requires_grad=True))
    gm = trace(step, *args)
    assert ops(gm, aten.convolution) and ops(gm, aten.convolution_backward)
    summary = graph_compute(gm)
    assert summary.total_flops == eager_flops(step, *args) > 0


def _attention_step(q, k, v):
    out = F.scaled_dot_product_attention(q, k, v)
    return (out,) + torch.autograd.grad(out.sum(), (q, k, v))


def _causal_attention_step(q, k, v):
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return (out,) + torch.autograd.grad(out.sum(), (q, k, v))


def _qkv(device="cpu", b=2, h=4, s=16, d=8):
    return [torch.randn(b, h, s, d, device=device, requires_grad=True) for _ in range(3)]


def test_attention_math_path_matches_flop_counter_mode():
    # On the meta device SDPA decomposes to the math path (bmm + softmax), as FlopCounterMode sees it eagerly.
    gm = trace(_attention_step, *_qkv("meta"))
    assert ops(gm, aten.bmm)
    with sdpa_kernel(SDPBackend.MATH):
        expected = eager_flops(_attention_step, *_qkv())
    assert graph_compute(gm).total_flops == expected > 0


def test_attention_fused_cpu_ops_are_costed():
    b, h, s, d = 2, 4, 16, 8
    gm = trace(_attention_step, *_qkv(b=b, h=h, s=s, d=d))
    (fwd,) = ops(gm, aten._scaled_dot_product_flash_attention_for_cpu)
    (bwd,) = ops(gm, aten._scaled_dot_product_flash_attention_for_cpu_backward)

    # q @ kᵀ; every attention matmul has this size when s_q = s_k and d_q = d_v.
    one_bmm = 2 * b * h * s * s * d
    with sdpa_kernel(SDPBackend.MATH):
        q, k, v = _qkv(b=b, h=h, s=s, d=d)
        with FlopCounterMode(display=False) as counter:
            out = F.scaled_dot_product_attention(q, k, v)
        eager_fwd = counter.get_total_flops()
        with FlopCounterMode(display=False) as counter:
            torch.autograd.grad(out.sum(), (q, k, v))
        eager_bwd = counter.get_total_flops()
    assert eager_fwd == 2 * one_bmm and eager_bwd == 4 * one_bmm

    # Forward: the same two matmuls as the math path. Backward: flop_counter's fused-attention
    # convention adds the recomputed q @ kᵀ to the math path's four matmuls.
    assert node_flops(fwd) == eager_fwd
    assert node_flops(bwd) == eager_bwd + one_bmm
    # The fused op reads q, k, v and writes out + logsumexp, all at fp32.
    assert node_bytes(fwd) == 4 * (4 * b * h * s * d) + 4 * b * h * s


def test_flop_formula_failure_counts_zero(caplog):
    gm = trace(lambda x, w: x @ w, torch.randn(4, 3), torch.randn(3, 2))
    (mm,) = ops(gm, aten.mm)
    mm.meta["val"] = None
    mm.args[0].meta["val"] = "not a tensor"
    assert node_flops(mm) == 0
    assert "failed" in caplog.text


# --------------------------------------------------------------------------- bytes


def test_view_ops_move_no_bytes():
    def fn(x, bias):
        y = x.view(4, 6).permute(1, 0).transpose(0, 1).unsqueeze(0).squeeze(0)
        a, b = torch.split(x.reshape(24), 12)
        return y[1:3].select(1, 2), y.t().detach(), a, b, bias.expand(4, 6), x.unsqueeze(-1).expand(2, 12, 3)

    gm = trace(fn, torch.randn(2, 12), torch.randn(6))
    called = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert called
    for n in called:
        assert is_view(n), n.target
        assert node_bytes(n) == 0, n.target
    assert any(n.target is operator.getitem for n in called)


def test_elementwise_bytes_are_inputs_plus_output_and_broadcast_read_once():
    x, y = torch.randn(8, 32), torch.randn(8, 32)
    gm = trace(torch.add, x, y)
    (add,) = ops(gm, aten.add)
    assert node_bytes(add) == 3 * 8 * 32 * 4
    assert not is_view(add)

    gm = trace(lambda x: x * x, x)
    (mul,) = ops(gm, aten.mul)
    assert node_bytes(mul) == 2 * 8 * 32 * 4  # one tensor used twice is read once

    gm = trace(lambda x, b: x + b.expand(8, 32), x, torch.randn(32))
    (add,) = ops(gm, aten.add)
    assert node_bytes(add) == (8 * 32 + 32 + 8 * 32) * 4  # the expanded bias is 32 distinct floats

    gm = trace(lambda x: x.to(torch.bfloat16), x)
    (cast,) = ops(gm, aten._to_copy)
    assert node_bytes(cast) == 8 * 32 * (4 + 2)


# --------------------------------------------------------------------------- roofline


def test_roofline_big_matmul_is_compute_bound():
    n = 4096
    gm = trace(torch.mm, torch.empty(n, n), torch.empty(n, n))
    (mm,) = ops(gm, aten.mm)
    flops, nbytes = node_flops(mm), node_bytes(mm)
    assert flops == 2 * n**3 and nbytes == 3 * n * n * 4
    eff = ComputeEfficiency(matmul=0.5, memory=0.7)
    t = node_time(mm, H100, "bf16", eff)
    assert t == pytest.approx(flops / (989e12 * 0.5))
    assert t > nbytes / (3.35e12 * 0.7)
    # fp32 peak is lower, so the same op takes longer.
    assert node_time(mm, H100, "fp32", eff) == pytest.approx(flops / (67e12 * 0.5))


def test_roofline_big_add_is_memory_bound_and_bytes_scale_applies():
    shape = (4096, 4096)
    gm = trace(torch.add, torch.empty(shape), torch.empty(shape))
    (add,) = ops(gm, aten.add)
    assert node_flops(add) == 0
    nbytes = 3 * 4096 * 4096 * 4
    eff = ComputeEfficiency(matmul=0.5, memory=0.7)
    assert node_time(add, H100, "bf16", eff) == pytest.approx(nbytes / (3.35e12 * 0.7))
    assert node_time(add, H100, "bf16", eff, bytes_scale=0.5) == pytest.approx(nbytes * 0.5 / (3.35e12 * 0.7))


def test_kernels_run_at_the_devices_measured_rates_and_causal_attention_at_half_its_flops():
    """A matmul at the device's measured best (MAMF), attention at FlashAttention-2's, a causal kernel
    running half the FLOPs flop_counter counts; the runtime's attention kernel scales the latter."""
    from autopar.cost_models import overlap
    from autopar.hardware.devices import DEVICES

    h100, eff = DEVICES["H100-80GB"], ComputeEfficiency(matmul=1.0, memory=1.0)
    assert compute.kernel_flops(h100) == pytest.approx(794.5e12)
    assert compute.kernel_flops(h100, attention=1.0) == pytest.approx(308e12)
    assert compute.kernel_flops(H100) == 989e12  # a device without measurements: its peak
    assert roofline_time(1e12, 0, h100, "bf16", eff) == pytest.approx(1e12 / 794.5e12)
    assert roofline_time(1e12, 0, h100, "bf16", eff, attention=0.5) == pytest.approx(0.5e12 / 308e12)
    # the fused attention op of a causal SDPA runs half its FLOPs, forward and backward; others run all
    q, k, v = _qkv(b=2, h=4, s=16, d=8)
    gm = trace(_causal_attention_step, q, k, v)
    causal = [n for n in gm.graph.nodes if attention.attention_work(n)]
    assert len(causal) == 2 and {attention.attention_work(n) for n in causal} == {0.5}
    plain = trace(_attention_step, *_qkv(b=2, h=4, s=16, d=8))
    assert {attention.attention_work(n) for n in plain.graph.nodes if attention.is_attention_kernel(n)} == {1.0}
    (mm,) = ops(trace(torch.mm, torch.empty(8, 8), torch.empty(8, 8)), aten.mm)
    assert attention.attention_work(mm) == 0.0
    # Megatron-Core's cuDNN attention on Hopper: its runtime's kernel is faster than FlashAttention-2
    saved = overlap.RUNTIME
    try:
        overlap.RUNTIME = overlap.Runtime(attention_speedup=1.5)
        assert compute.kernel_flops(h100, attention=1.0) == pytest.approx(1.5 * 308e12)
    finally:
        overlap.RUNTIME = saved


def test_roofline_validation_and_default_read_at_call_time(monkeypatch):
    assert roofline_time(0, 0, H100) == 0.0
    with pytest.raises(ValueError, match="fp8"):
        roofline_time(1e9, 0, H100, "fp8")
    assert roofline_time(1e12, 0, H100, "bfloat16", DEFAULT_EFFICIENCY) == roofline_time(
        1e12, 0, H100, "bf16"
    )
    with pytest.raises(ValueError, match="matmul"):
        ComputeEfficiency(matmul=0.0, memory=0.5)
    monkeypatch.setattr(compute, "DEFAULT_EFFICIENCY", ComputeEfficiency(matmul=1.0, memory=1.0))
    assert roofline_time(989e12, 0, H100, "bf16") == pytest.approx(1.0)


def test_summary_times_by_phase_and_round_trip():
    summary = ComputeSummary(
        per_node={"mm": (2 * 989_000_000_000, 0), "add": (0, 3_350_000_000), "mm_bwd": (989_000_000_000, 0)},
        phase={"mm": "forward", "add": "forward", "mm_bwd": "backward"},
        total_flops=3 * 989_000_000_000,
        forward_flops=2 * 989_000_000_000,
        backward_flops=989_000_000_000,
        total_bytes=3_350_000_000,
    )
    eff = ComputeEfficiency(matmul=1.0, memory=1.0)
    by_phase = summary.time_by_phase(H100, "bf16", eff, 1.0)
    assert by_phase == pytest.approx({"forward": 2e-3 + 1e-3, "backward": 1e-3})
    assert summary.time(H100, "bf16", eff) == pytest.approx(4e-3)
    assert ComputeSummary.from_dict(summary.to_dict()) == summary


def test_symbolic_shapes_use_hints():
    model = nn.Linear(8, 16)
    params = dict(model.named_parameters())

    def step(params, x):
        loss = functional_call(model, params, (x,)).sum()
        return torch.autograd.grad(loss, list(params.values()))

    gm = make_fx(step, tracing_mode="symbolic")(params, torch.randn(5, 8))
    summary = graph_compute(gm)
    # forward addmm + weight-gradient mm, each 2·5·8·16
    assert summary.total_flops == 2 * (2 * 5 * 8 * 16)
    assert all(isinstance(f, int) and isinstance(b, int) for f, b in summary.per_node.values())
