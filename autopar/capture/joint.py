"""Capture: a model and example inputs become one joint forward+backward ATen graph.

Every later pass reasons about one functional graph of ATen ops on fake tensors
(shapes and dtypes, no storage), so a 7B model on the meta device is planned on
a laptop.  The route, and why:

1. Non-strict ``torch.export`` runs the user's Python forward on fake tensors; it
   copes with HuggingFace models (a direct AOT trace trips over their masks) and
   records ``nn_module_stack`` per node.
2. ``make_fx`` replays the exported graph through an ``fx.Interpreter`` and calls
   ``torch.autograd.grad`` on the loss, so forward and backward land in one graph.
   ``preserve_node_meta`` carries module stacks onto the new nodes; autograd hooks
   tag backward nodes with the ``seq_nr`` of the forward op they differentiate.
   No core-ATen decomposition table: FLOP formulas and sharding rules are keyed on
   high-level ops (mm, addmm, bmm, native_layer_norm, attention) that must survive.

During capture every parameter and buffer is swapped for a fake twin on one
device (meta becomes CPU), so the graph is the same for a real or a meta model.

This module runs those steps in order. What it returns and how later passes read
it is :mod:`autopar.capture.graph`; the accepted inputs and the loss,
:mod:`autopar.capture.inputs`; the replay and the joint trace,
:mod:`autopar.capture.replay`; one-line failures, :mod:`autopar.capture.diagnostics`.
"""

from __future__ import annotations

import logging
import operator
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.utils import _pytree as pytree

from autopar.capture.diagnostics import (
    check_dtypes,
    export_error,
    joint_error,
    quiet_torch_logs,
    track_modules,
)
from autopar.capture.experts import experts_as_op
from autopar.capture.graph import (
    CapturedGraph,
    TensorInfo,
    ancestors,
    extend_gradient_chain,
    gradient_chain,
    graph_results,
    node_module,
    node_phase,
    tensor_nodes,
)
from autopar.capture.inputs import (
    TARGETS,
    LossWrapper,
    batch_of,
    batched_flags,
    hf_no_cache,
    input_name,
    input_tensors,
    model_loss,
    normalize,
    strip_wrapper,
)
from autopar.capture.replay import (
    REDUCTION_MEAN,
    REDUCTION_SUM,
    bind_args,
    is_mutating,
    needs_functionalization,
    trace_joint,
)
from autopar.capture.unroll import with_canonical_names
from autopar.core.errors import CaptureError

__all__ = [
    "REDUCTION_MEAN",
    "REDUCTION_SUM",
    "CapturedGraph",
    "TensorInfo",
    "ancestors",
    "bind_args",
    "capture",
    "extend_gradient_chain",
    "gradient_chain",
    "graph_results",
    "input_tensors",
    "model_loss",
    "node_module",
    "node_phase",
    "tensor_nodes",
]

log = logging.getLogger(__name__)
aten = torch.ops.aten


@contextmanager
def _swapped_state(model: nn.Module, fake_of: dict[int, torch.Tensor]) -> Iterator[None]:
    """Temporarily replace every parameter and buffer with its fake twin (ties follow by identity)."""
    saved = []
    try:
        for mod in model.modules():
            for store in (mod._parameters, mod._buffers):
                for key, val in store.items():
                    if val is not None and id(val) in fake_of:
                        saved.append((store, key, val))
                        store[key] = fake_of[id(val)]
        yield
    finally:
        for store, key, val in reversed(saved):
            store[key] = val


@contextmanager
def _lean_tracing() -> Iterator[None]:
    """Trace without work that planning never reads: Python code for every graph, stack traces.

    Export's passes and ``make_fx`` regenerate and compile a graph's Python code after each
    change (a second or more on a 7B model); lazy graph modules (as torch.compile uses them)
    generate it only when the module is called or its code read. Each node's ``stack_trace``
    (a captured and symbolized traceback) is read by nothing here.
    """
    saved = fx.config.do_not_emit_stack_traces
    try:
        fx.config.do_not_emit_stack_traces = True
        with _use_lazy_graph_module(True):
            yield
    finally:
        fx.config.do_not_emit_stack_traces = saved


def _pick_device(tensors: list[torch.Tensor]) -> torch.device:
    """The first real device among inputs, then weights; all-meta models are captured as CPU."""
    return next((t.device for t in tensors if t.device.type != "meta"), torch.device("cpu"))


def _constant(value: Any, device: torch.device) -> Any:
    """A tensor constant the graph can hold: real and on ``device`` (meta/fake ones have no data: zeros)."""
    if not isinstance(value, torch.Tensor) or (value.device == device and not isinstance(value, FakeTensor)):
        return value
    if value.device.type == "meta" or isinstance(value, FakeTensor):
        return torch.zeros(value.shape, dtype=value.dtype, device=device)
    return value.to(device)


def _clean(gm: fx.GraphModule) -> None:
    """Drop asserts and dead code; forward ``alias`` nodes to their input."""
    g = gm.graph
    for node in list(g.nodes):
        if node.op != "call_function":
            continue
        if "_assert" in getattr(node.target, "__name__", ""):  # _assert_tensor_metadata, _assert_async, ...
            g.erase_node(node)
        elif node.target is aten.alias.default and isinstance(node.args[0], fx.Node):
            node.replace_all_uses_with(node.args[0])
            g.erase_node(node)
    g.eliminate_dead_code()


def _annotate(gm: fx.GraphModule, owner_of_placeholder: dict[str, str], params: int) -> fx.Node:
    """Fill ``autopar_module`` and ``autopar_phase`` on every node; return the loss node.

    The forward is what the loss and the buffer updates are computed from.
    """
    g = gm.graph
    loss, _, updates = graph_results(gm, params)
    forward = ancestors(loss)
    for u in updates:
        forward |= ancestors(u)
    # Every output of a forward op is forward, even one only the backward reads (saved mean/rstd).
    forward |= {u for n in forward for u in n.users if u.target is operator.getitem}

    fwd_by_seq: dict[int, fx.Node] = {}
    for n in g.nodes:
        if n in forward and n.op == "call_function" and "seq_nr" in n.meta:
            fwd_by_seq.setdefault(n.meta["seq_nr"], n)

    position = {n: i for i, n in enumerate(g.nodes)}

    def inherited(n: fx.Node) -> str:
        return next((node_module(a) for a in n.all_input_nodes if a.op != "placeholder"), "")

    def inherited_backward(n: fx.Node) -> str:
        # the input made last: a gradient sum on the residual stream is the layer's whose
        # gradient it adds, not the layer's above (whose sum is its first input, and so on
        # up to the top of the stack)
        made = [a for a in n.all_input_nodes if a.op != "placeholder"]
        return node_module(max(made, key=position.__getitem__)) if made else ""

    for n in g.nodes:
        if n.op == "placeholder":
            n.meta["autopar_phase"] = "input"
            n.meta["autopar_module"] = owner_of_placeholder.get(n.name, "")
            continue
        stack = n.meta.get("nn_module_stack")
        if n in forward:
            n.meta["autopar_phase"] = "forward"
            mod = strip_wrapper(list(stack.values())[-1][0]) if stack else inherited(n)
        else:
            n.meta["autopar_phase"] = "backward"
            src = fwd_by_seq.get(n.meta.get("seq_nr")) if n.meta.get("autograd_backward") else None
            mod = src.meta["autopar_module"] if src is not None else inherited_backward(n)
        n.meta["autopar_module"] = mod
    return loss


def capture(
    model: nn.Module,
    example_inputs: Any,
    loss_fn: Callable[..., Any] | None = None,
    example_targets: Any = None,
    compute_dtype: torch.dtype | None = None,
    device: torch.device | None = None,
    batched: list[bool] | None = None,
) -> CapturedGraph:
    """Trace ``model`` on ``example_inputs`` into a joint forward+backward ATen graph on fake tensors.

    ``example_inputs`` is a Tensor, a tuple/list of positional arguments or a
    dict of keyword arguments; tensors (and the model's weights) may be real,
    fake or on the meta device.  Without ``loss_fn`` the model must return a
    scalar, an object with ``.loss``, a dict with "loss" or a tuple whose first
    element is a scalar; with it, ``loss = loss_fn(output, *example_targets)``.
    Raises CaptureError with a one-line cause and fix when capture fails.

    ``compute_dtype`` (mixed precision): the model is traced as it runs with
    its floating-point parameters and inputs in that dtype (buffers keep
    theirs), as FSDP2's ``MixedPrecisionPolicy(param_dtype=...)`` and
    Megatron-LM's ``Float16Module`` run it; the model's own casts (an RMSNorm
    or a loss computed in fp32) are then ops of the graph.  ``device``: the
    device the graph's tensors live on (its factory ops name it); by default
    the first real device among the inputs and weights, the CPU for meta ones.

    ``batched``: per input tensor, whether its dim 0 is the batch (``TensorInfo.batched``), for inputs
    cut from examples where that could be told (at a micro-batch of one sample it cannot); by default
    :func:`autopar.capture.inputs.batched_flags` of these inputs.
    """
    t0 = time.perf_counter()
    cls = type(model).__name__
    args, kwargs, targets = normalize(example_inputs, example_targets)
    hf_no_cache(model, kwargs)
    state = _ModelState.of(model)
    fakes = _Fakes(state, args, kwargs, targets, compute_dtype, device)
    ep = _export(model, loss_fn, fakes)
    t1 = time.perf_counter()
    sources = _exported_sources(ep, state, fakes, cls)
    fake_args = fakes.joint_args(state)
    gm, updated = _joint_graph(ep, sources, state, fake_args, fakes.mode, model)
    infos, owners = _name_placeholders(gm, state, fakes, fake_args)
    loss = _annotate(gm, owners, len(state.trainable))
    check_dtypes(gm, model)

    _, grad_nodes, _ = graph_results(gm, len(state.trainable))
    grads = {name: g.name for (name, _), g in zip(state.trainable, grad_nodes, strict=True) if g is not None}
    user = fakes.user_tensors
    batch = batch_of(user) or 1
    flags = batched_flags(user) if batched is None else batched
    infos[len(state.all) :] = [replace(i, batched=b) for i, b in zip(infos[len(state.all) :], flags, strict=True)]
    log.info(
        "captured %s: %d nodes, %d params, export %.1fs, joint %.1fs",
        cls,
        len(gm.graph.nodes),
        len(state.trainable),
        t1 - t0,
        time.perf_counter() - t1,
    )
    n_p, n_s = len(state.trainable), len(state.all)
    c = CapturedGraph(gm, infos[:n_p], infos[n_p:n_s], infos[n_s:], loss.name, grads, batch, cls, updated)
    return with_canonical_names(c)


def whole_arguments(captured: CapturedGraph, model: nn.Module, inputs: Any, targets: Any = None) -> list[torch.Tensor]:
    """The joint graph's arguments, whole, for one batch of ``model``: its parameters, its fixed state, then the
    batch's tensors (the order of the graph's placeholders)."""
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    return [state[i.name].detach() for i in captured.params + captured.buffers] + input_tensors(model, inputs, targets)


def state_infos(model: nn.Module) -> tuple[list[TensorInfo], list[TensorInfo]]:
    """The model's trainable parameters and its fixed state as the joint graph takes them (placeholders unnamed)."""
    state = _ModelState.of(model)
    return (
        [TensorInfo(n, "", tuple(t.shape), t.dtype) for n, t in state.trainable],
        [TensorInfo(n, "", tuple(t.shape), t.dtype) for n, t in state.fixed],
    )


@dataclass
class _ModelState:
    """The model's parameters and buffers in the joint graph's order: trainable parameters, then fixed state.

    Parameters with ``requires_grad=False`` are fixed state, like buffers. ``canon`` maps every
    name of a tensor to its first name, so tied weights appear once.
    """

    canon: dict[str, str]
    trainable: list[tuple[str, torch.Tensor]]
    fixed: list[tuple[str, torch.Tensor]]

    @property
    def all(self) -> list[tuple[str, torch.Tensor]]:
        return self.trainable + self.fixed

    @classmethod
    def of(cls, model: nn.Module) -> _ModelState:
        canon: dict[str, str] = {}
        first: dict[int, str] = {}
        for name, t in [
            *model.named_parameters(remove_duplicate=False),
            *model.named_buffers(remove_duplicate=False),
        ]:
            canon[name] = first.setdefault(id(t), name)
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        fixed = [(n, p) for n, p in model.named_parameters() if not p.requires_grad] + list(model.named_buffers())
        return cls(canon, trainable, fixed)


def frozen_parameter_count(model: nn.Module) -> int:
    """Elements of the model's parameters that do not train (``requires_grad=False``: a fine-tune's frozen base
    weights), each tied tensor once: fixed state to the joint graph, held but never stepped."""
    return sum(p.numel() for _, p in _ModelState.of(model).fixed if isinstance(p, nn.Parameter))


class _Fakes:
    """Fake twins, on one device, of the model's state (for export) and of the example inputs.

    With a ``compute_dtype``, the twins of floating-point parameters and inputs
    have that dtype (see :func:`capture`).
    """

    def __init__(
        self,
        state: _ModelState,
        args: tuple,
        kwargs: dict,
        targets: tuple,
        compute_dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> None:
        # Flattened in the order of CapturedGraph.inputs: positional, keyword, then targets.
        self.leaves, self.in_spec = pytree.tree_flatten_with_path((args, {**kwargs, TARGETS: targets}))
        self.user_tensors = [x for _, x in self.leaves if isinstance(x, torch.Tensor)]
        self.device = device or _pick_device(self.user_tensors + [t for _, t in state.all])
        self.compute_dtype = compute_dtype
        # Non-fake inputs allowed: the model's tensor constants (masks, scalars) stay real graph constants.
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.of_state = {
            id(t): (nn.Parameter(self.fake(t, True), t.requires_grad) if isinstance(t, nn.Parameter) else self.fake(t))
            for _, t in state.all
        }
        self.fake_leaves = [self.fake(x, True) for _, x in self.leaves]

    def fake(self, t: Any, cast: bool = False) -> Any:
        """``t``'s fake twin; ``cast``: in the compute dtype if ``t`` is floating point (parameters, inputs)."""
        if not isinstance(t, torch.Tensor):
            return t
        dtype = self.compute_dtype if cast and self.compute_dtype and t.is_floating_point() else t.dtype
        with self.mode:
            return torch.empty_strided(t.shape, t.stride(), dtype=dtype, device=self.device)

    def joint_args(self, state: _ModelState) -> list[torch.Tensor]:
        """The joint graph's arguments: trainable parameters (needing grad), fixed state, user tensors."""
        return (
            [self.fake(p, True).requires_grad_(True) for _, p in state.trainable]
            + [self.fake(t, isinstance(t, nn.Parameter)) for _, t in state.fixed]
            + [x for x in self.fake_leaves if isinstance(x, torch.Tensor)]
        )


def _export(model: nn.Module, loss_fn: Callable[..., Any] | None, fakes: _Fakes) -> torch.export.ExportedProgram:
    """Non-strict export of the model and its loss, on the fake state and inputs."""
    fargs, fkwargs = pytree.tree_unflatten(fakes.fake_leaves, fakes.in_spec)
    stack: list[str] = []
    try:
        with (
            _swapped_state(model, fakes.of_state),
            track_modules(model, stack),
            quiet_torch_logs(),
            _lean_tracing(),
            experts_as_op(model),
        ):
            return torch.export.export(LossWrapper(model, loss_fn), fargs, fkwargs, strict=False)
    except Exception as exc:  # noqa: BLE001 - every failure becomes one readable line
        log.debug("export of %s failed", type(model).__name__, exc_info=True)
        raise export_error(exc, model, stack) from None


def _exported_sources(ep: torch.export.ExportedProgram, state: _ModelState, fakes: _Fakes, cls: str) -> list[Any]:
    """Where each exported placeholder comes from: an index into the joint's arguments, or a constant."""
    slot = {name: i for i, (name, _) in enumerate(state.all)}
    user_slots = iter(len(state.all) + i for i in range(len(fakes.user_tensors)))
    leaf_sources = iter(next(user_slots) if isinstance(x, torch.Tensor) else x for x in fakes.fake_leaves)
    sources: list[Any] = []
    for spec in ep.graph_signature.input_specs:
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER) and strip_wrapper(spec.target) in state.canon:
            sources.append(slot[state.canon[strip_wrapper(spec.target)]])
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            sources.append(_constant(ep.constants[spec.target], fakes.device))
        elif spec.kind == InputKind.USER_INPUT:
            sources.append(next(leaf_sources))
        else:
            raise CaptureError(
                f"cannot capture {cls}: unsupported exported input {spec.kind.name} {spec.target}"
            )
    if any(spec.kind != OutputKind.USER_OUTPUT for spec in ep.graph_signature.output_specs):
        kinds = sorted({spec.kind.name for spec in ep.graph_signature.output_specs} - {"USER_OUTPUT"})
        raise CaptureError(f"cannot capture {cls}: its export has {', '.join(kinds)} outputs")
    return sources


def _joint_graph(
    ep: torch.export.ExportedProgram,
    sources: list[Any],
    state: _ModelState,
    fake_args: list[torch.Tensor],
    fake_mode: FakeTensorMode,
    model: nn.Module,
) -> tuple[fx.GraphModule, list[int]]:
    """The joint trace, functionalized when it holds in-place ops; the cleaned graph and the updated buffers."""
    cls = type(model).__name__
    n_params = len(state.trainable)
    try:
        with fake_mode, quiet_torch_logs(), _lean_tracing():
            functional = needs_functionalization(ep)
            state_args = range(n_params, len(state.all))
            updated: list[int] = []
            gm = trace_joint(ep, sources, n_params, fake_args, functional, state_args, updated)
            mutating = sorted({str(n.target) for n in gm.graph.nodes if is_mutating(n)})
            if mutating and not functional:
                log.info("joint graph of %s has in-place ops (%s); re-tracing functionalized", cls, mutating)
                updated.clear()
                gm = trace_joint(ep, sources, n_params, fake_args, True, state_args, updated)
    except CaptureError:
        raise
    except Exception as exc:  # noqa: BLE001
        log.debug("joint trace of %s failed", cls, exc_info=True)
        raise joint_error(exc, ep.graph, model) from exc
    _clean(gm)
    bad = sorted({str(n.target) for n in gm.graph.nodes if is_mutating(n)})
    if bad:
        raise CaptureError(f"joint graph of {cls} still mutates tensors after functionalization: {bad}")
    return gm, updated


def _name_placeholders(
    gm: fx.GraphModule, state: _ModelState, fakes: _Fakes, fake_args: list[torch.Tensor]
) -> tuple[list[TensorInfo], dict[str, str]]:
    """Name placeholders after what they hold; their TensorInfo, and the module owning each parameter or buffer."""
    names = [n for n, _ in state.all] + [input_name(p) for p, x in fakes.leaves if isinstance(x, torch.Tensor)]
    prefixes = ["p_"] * len(state.trainable) + ["b_"] * len(state.fixed) + [""] * len(fakes.user_tensors)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    infos, owners = [], {}
    for node, name, prefix, val in zip(placeholders, names, prefixes, fake_args, strict=True):
        node._rename(re.sub(r"\W|^(?=\d)", "_", prefix + name))
        node.target = node.name
        infos.append(TensorInfo(name, node.name, tuple(val.shape), val.dtype))
        if prefix:
            owners[node.name] = name.rpartition(".")[0]
    gm.recompile()
    return infos, owners
