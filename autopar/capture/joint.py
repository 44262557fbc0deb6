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
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import operator
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch import nn
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensor, FakeTensorMode
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.utils import _pytree as pytree

from autopar.capture import restrides
from autopar.core.errors import CaptureError
from autopar.ops import batch_norm, dropout_attention

log = logging.getLogger(__name__)
aten = torch.ops.aten

_WRAPPED = "model"  # attribute under which the wrapper holds the user's model
_TARGETS = "_autopar_targets"  # keyword that carries the example targets through export, after user kwargs
# Kernels that reject mixed dtypes in eager but not on fake tensors.
_SAME_DTYPE_OPS = {
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten.baddbmm.default,
    aten.convolution.default,
    aten.mv.default,
    aten.dot.default,
}
_NOISY_LOGGERS = ("torch._subclasses.fake_tensor", "torch.fx.experimental.symbolic_shapes")


@dataclass(frozen=True)
class TensorInfo:
    """One graph input: a parameter, a buffer or a user input."""

    name: str  # params/buffers: qualified name in the user's model; inputs: "input_ids", "arg0", "target0"
    placeholder: str  # node name of its placeholder in the joint graph
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class CapturedGraph:
    """The joint graph and the names needed to read it.

    ``gm(*params, *buffers, *inputs)`` returns ``(loss, *grads, *updates)``:
    one grad slot per entry of ``params`` (``None`` where a parameter gets no
    gradient), then the new value of every buffer the forward mutates in place
    (BatchNorm's running statistics and counter), ``updated[k]`` naming the
    index in ``buffers`` of the k-th.  Whoever runs the graph stores those
    values into the buffers after the call, as the eager forward would have.
    Parameters with ``requires_grad=False`` are listed under ``buffers``: the
    graph treats them as fixed state.
    """

    gm: fx.GraphModule
    params: list[TensorInfo]
    buffers: list[TensorInfo]
    inputs: list[TensorInfo]
    loss: str
    grads: dict[str, str]
    batch_size: int
    model_name: str
    updated: list[int] = field(default_factory=list)


def graph_results(gm: fx.GraphModule | fx.Graph, params: int) -> tuple[Any, list[Any], list[Any]]:
    """The joint graph's loss node, gradient nodes (one per parameter) and buffer-update nodes."""
    g = gm.graph if isinstance(gm, fx.GraphModule) else gm
    out = next(n for n in reversed(g.nodes) if n.op == "output").args[0]
    return out[0], list(out[1 : 1 + params]), list(out[1 + params :])


def node_module(node: fx.Node) -> str:
    """Module path in the user's model that ``node`` came from; "" for top level."""
    return node.meta.get("autopar_module", "")


def node_phase(node: fx.Node) -> str:
    """ "input" for placeholders, "forward" for the loss and its ancestors, else "backward"."""
    return node.meta.get("autopar_phase", "input" if node.op == "placeholder" else "backward")


def ancestors(node: fx.Node) -> set[fx.Node]:
    """``node`` and every node it is computed from."""
    seen: set[fx.Node] = set()
    todo = [node]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return seen


def tensor_nodes(graph: fx.Graph | fx.GraphModule) -> list[fx.Node]:
    """Nodes whose value is a single tensor (placeholders, ops, constants), in graph order."""
    g = graph.graph if isinstance(graph, fx.GraphModule) else graph
    return [n for n in g.nodes if isinstance(n.meta.get("val"), torch.Tensor)]


class _NoLoss(Exception):
    """Raised inside the traced forward when no scalar loss can be found."""


def _is_scalar(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() == 0


def _describe(x: Any) -> str:
    return f"a tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else f"a {type(x).__name__}"


def _pick_loss(out: Any, loss_fn: Callable[..., Any] | None, targets: tuple, cls: str) -> torch.Tensor:
    """The scalar loss from the model output, by the rules documented on ``capture``."""
    if loss_fn is not None:
        loss = loss_fn(out, *targets)
        if not _is_scalar(loss):
            raise _NoLoss(
                f"loss_fn returned {_describe(loss)}, not a scalar tensor: make it reduce to a scalar"
            )
        return loss
    if _is_scalar(out):
        return out
    found = None if isinstance(out, torch.Tensor) else getattr(out, "loss", None)  # HF ModelOutput
    if found is None and isinstance(out, dict):
        found = out.get("loss")
    elif found is None and isinstance(out, (tuple, list)) and out:
        found = out[0]
    if _is_scalar(found):
        return found
    raise _NoLoss(
        f"no loss found in the output of {cls} ({_describe(out)}): pass loss_fn= (and example_targets=) "
        "or make the model return a scalar loss (HuggingFace: pass labels)"
    )


class _LossWrapper(nn.Module):
    """Calls the user's model and returns ``(loss,)`` so export sees one scalar output."""

    def __init__(self, model: nn.Module, loss_fn: Callable[..., Any] | None) -> None:
        super().__init__()
        setattr(self, _WRAPPED, model)
        # Kept out of the module tree: a loss module's submodules would otherwise show up in module paths.
        self.__dict__["_loss_fn"] = loss_fn

    def forward(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor]:
        model = getattr(self, _WRAPPED)
        targets = kwargs.pop(_TARGETS)
        out = model(*args, **kwargs)
        return (_pick_loss(out, self._loss_fn, targets, type(model).__name__),)


def _where(model: nn.Module, path: str) -> str:
    """ "block.2 (Gate)": a module's qualified name and class, for error messages."""
    mod = model.get_submodule(path)
    return f"{path} ({type(mod).__name__})" if path else f"the top-level module ({type(mod).__name__})"


@contextmanager
def _track_modules(model: nn.Module, stack: list[str]) -> Iterator[None]:
    """Keep ``stack`` = qualified names of the modules whose forward is running.

    Non-strict export runs real Python, so forward hooks fire; a module whose
    forward raises is never popped, so ``stack[-1]`` names where an error arose.
    """

    def pop(mod: nn.Module, args: Any, out: Any) -> None:  # a hook's return value would replace the output
        stack.pop()

    handles = []
    try:
        for name, mod in model.named_modules():
            handles.append(
                mod.register_forward_pre_hook(functools.partial(lambda n, m, a: stack.append(n), name))
            )
            handles.append(mod.register_forward_hook(pop))
        yield
    finally:
        for h in handles:
            h.remove()


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


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = text[0].strip() if text else type(exc).__name__
    return line if len(line) <= 200 else line[:197] + "..."


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def _export_error(exc: Exception, model: nn.Module, stack: list[str]) -> CaptureError:
    """Turn an export failure into a one-line CaptureError that names cause and fix."""
    cls, where = type(model).__name__, _where(model, stack[-1] if stack else "")
    for e in _chain(exc):
        if isinstance(e, _NoLoss):
            return CaptureError(str(e))
    data_dep = (GuardOnDataDependentSymNode, DataDependentOutputException)
    if any(isinstance(e, data_dep) or "data-dependent" in str(e) for e in _chain(exc)):
        # where a model computes its loss (HuggingFace's heads): the fix a user can make without editing it
        loss = "" if stack and stack[-1] else "; if it is in the loss, return the logits and pass loss_fn="
        return CaptureError(
            f"data-dependent control flow in {where}: a Python branch on a tensor value cannot be "
            f"captured; replace it with torch.where or torch.cond{loss}"
        )
    if isinstance(exc, (TypeError, ValueError, IndexError, RuntimeError)) and not isinstance(
        exc, NotImplementedError
    ):
        return CaptureError(f"example inputs do not fit {cls}: {_short(exc)} (in module {where})")
    return CaptureError(f"could not export {cls}: {_short(exc)} (in module {where})")


@contextmanager
def _quiet(names: tuple[str, ...] = _NOISY_LOGGERS) -> Iterator[None]:
    """Mute torch loggers that print tracebacks for failures capture reports as one line itself."""
    saved = {n: logging.getLogger(n).level for n in names}
    try:
        for n in names:
            logging.getLogger(n).setLevel(logging.CRITICAL)
        yield
    finally:
        for n, level in saved.items():
            logging.getLogger(n).setLevel(level)


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


def _check_dtypes(gm: fx.GraphModule, model: nn.Module) -> None:
    """Fake tensors skip the dtype checks of matmul kernels; catch what eager would reject."""
    for n in gm.graph.nodes:
        if n.target in _SAME_DTYPE_OPS and node_phase(n) == "forward":
            vals = [a.meta.get("val") for a in n.all_input_nodes]
            dtypes = sorted(
                {str(v.dtype).removeprefix("torch.") for v in vals if isinstance(v, torch.Tensor)}
            )
            if len(dtypes) > 1:
                raise CaptureError(
                    f"example inputs do not fit {type(model).__name__}: {n.target.overloadpacket.__name__} got "
                    f"operands of different dtypes ({', '.join(dtypes)}) (in module {_where(model, node_module(n))})"
                )


def _normalize(example_inputs: Any, example_targets: Any) -> tuple[tuple, dict, tuple]:
    """(positional args, keyword args, targets) from the forms ``capture`` accepts."""
    if isinstance(example_inputs, dict):
        args, kwargs = (), dict(example_inputs)
    elif isinstance(example_inputs, (tuple, list, torch.Tensor)):
        args, kwargs = (
            (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs),
            {},
        )
    else:
        raise CaptureError(
            f"example_inputs must be a Tensor, a tuple of positional arguments or a dict of "
            f"keyword arguments, not {type(example_inputs).__name__}"
        )
    if example_targets is None or isinstance(example_targets, (tuple, list)):
        return args, kwargs, tuple(example_targets or ())
    return args, kwargs, (example_targets,)


def input_tensors(model: nn.Module, inputs: Any, targets: Any = None) -> list[torch.Tensor]:
    """The tensors of one batch in the order of ``CapturedGraph.inputs`` (the joint graph's user placeholders)."""
    args, kwargs, targets = _normalize(inputs, targets)
    _hf_no_cache(model, kwargs)
    leaves = pytree.tree_leaves((args, {**kwargs, _TARGETS: targets}))
    return [x for x in leaves if isinstance(x, torch.Tensor)]


def model_loss(
    model: nn.Module, inputs: Any, loss_fn: Callable[..., Any] | None = None, targets: Any = None
) -> torch.Tensor:
    """The loss the captured graph computes, computed eagerly: the single-device reference."""
    args, kwargs, targets = _normalize(inputs, targets)
    _hf_no_cache(model, kwargs)
    try:
        return _pick_loss(model(*args, **kwargs), loss_fn, targets, type(model).__name__)
    except _NoLoss as exc:
        raise CaptureError(str(exc)) from None


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


def _strip(path: str) -> str:
    """Wrapper path -> path in the user's model ("model.h.0@1" -> "h.0")."""
    path = re.sub(r"@\d+$", "", path)
    return path[len(_WRAPPED) + 1 :] if path.startswith(_WRAPPED + ".") else ""


_CLASS_LOSSES = (aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss_nd.default)
REDUCTION_MEAN, REDUCTION_SUM = 1, 2  # torch's Reduction enum


def _mean_as_sum_over_weight(target: Any, args: Any, kwargs: Any) -> torch.Tensor | None:
    """A mean cross-entropy / NLL over class indices, written ``sum(losses) / total_weight``.

    torch's mean divides inside the kernel by the number (or weight) of targets
    not equal to ``ignore_index``.  Sharded over tokens, each shard divides by its
    own count and the shards' means are averaged, which is the mean only when
    every shard ignores equally many targets.  Written as two sums and a division,
    both sums reduce over the shards first: the loss is exact on any split, and
    the backward is the same ``nll_loss_backward``.  Returns None for forms left
    as they are (label smoothing, class probabilities, inputs other than 2-D).
    """
    bound = bind_args(target, args, kwargs)
    x, labels = bound["self"], bound["target"]
    if bound["reduction"] != REDUCTION_MEAN or bound.get("label_smoothing", 0.0) != 0.0:
        return None
    if x.dim() != 2 or labels.dim() != 1 or labels.is_floating_point():
        return None
    if target is aten.cross_entropy_loss.default:
        x = aten.log_softmax.int(x, 1)
    total, weight = aten.nll_loss_forward.default(x, labels, bound["weight"], REDUCTION_SUM, bound["ignore_index"])
    return total / weight


def _fused_dropout_attention(args: Any, kwargs: Any) -> torch.Tensor | None:
    """``scaled_dot_product_attention`` with dropout as the fused op GPUs run (:mod:`autopar.ops.dropout_attention`).

    None (left to the math path) without dropout, or with a mask that needs a gradient.
    """
    bound = bind_args(aten.scaled_dot_product_attention.default, args, kwargs)
    mask = bound["attn_mask"]
    if not bound["dropout_p"] or (isinstance(mask, torch.Tensor) and mask.requires_grad):
        return None
    return dropout_attention.attention(
        bound["query"],
        bound["key"],
        bound["value"],
        mask,
        bound["dropout_p"],
        bound["is_causal"],
        bound["scale"],
        bound["enable_gqa"],
    )


def bind_args(target: Any, args: Any, kwargs: Any) -> dict[str, Any]:
    """An op's arguments by schema name, defaults filled in."""
    schema = target._schema.arguments
    bound = {a.name: a.default_value for a in schema if a.has_default_value()}
    bound.update(zip((a.name for a in schema), args, strict=False))
    bound.update(kwargs)
    return bound


class _Replay(fx.Interpreter):
    """Replays the exported graph with dropout as ``native_dropout`` (functional: CPU dropout expands to
    in-place bernoulli_/div_; what CUDA runs, and the op cost models know), attention with dropout as
    one fused op (``_fused_dropout_attention``), a training BatchNorm as SyncBatchNorm's sums
    (:mod:`autopar.ops.batch_norm`), and mean class losses as a sum over a total weight
    (see ``_mean_as_sum_over_weight``)."""

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if target is aten.batch_norm.default:
            bound = bind_args(target, args, kwargs)
            if bound["training"] and bound["input"].dim() >= 2:
                return batch_norm.batch_norm(
                    *(bound[k] for k in ("input", "weight", "bias", "running_mean", "running_var")),
                    bound["momentum"],
                    bound["eps"],
                )
        if target is aten.dropout.default:
            x, p, train = args
            return aten.native_dropout.default(x, p, train)[0] if train and p > 0 else x
        if target is aten.scaled_dot_product_attention.default:
            fused = _fused_dropout_attention(args, kwargs)
            if fused is not None:
                return fused
        if target in _CLASS_LOSSES:
            loss = _mean_as_sum_over_weight(target, args, kwargs)
            if loss is not None:
                return loss
        return super().call_function(target, args, kwargs)


def _backward_hooks(loss: torch.Tensor) -> None:
    """Tag nodes traced inside each autograd function with that function's seq_nr (as AOTAutograd does)."""

    def enter(seq_nr: int, grad_outputs: Any) -> None:
        fx_traceback.set_grad_fn_seq_nr(seq_nr)
        fx_traceback.current_meta["autograd_backward"] = True

    def leave(grad_inputs: Any, grad_outputs: Any) -> None:
        fx_traceback.reset_grad_fn_seq_nr()
        fx_traceback.current_meta.pop("autograd_backward", None)

    seen: set[Any] = set()
    todo = [loss.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        fn.register_prehook(functools.partial(enter, fn._sequence_nr()))
        fn.register_hook(leave)
        todo.extend(nxt for nxt, _ in fn.next_functions)


def _trace_joint(
    ep: torch.export.ExportedProgram,
    sources: list[Any],
    n_params: int,
    fake_args: list[torch.Tensor],
    functional: bool,
    state: range,
    updated: list[int],
) -> fx.GraphModule:
    """make_fx of: run the exported graph, then autograd.grad(loss, params); then the mutated state.

    ``sources[i]`` says where the i-th exported placeholder comes from: an int
    (index into the joint's flat arguments) or a constant value.  Functionalized,
    an in-place update of a buffer (BatchNorm's running statistics, a counter)
    becomes a functional op whose result is the buffer's new value; those values
    are appended to the results, and ``updated`` gets the position within
    ``state`` (the joint's arguments that are fixed state) of each.  Any other
    argument mutated in place is refused.
    """
    loss_idx = next(
        i for i, s in enumerate(ep.graph_signature.output_specs) if s.kind == OutputKind.USER_OUTPUT
    )

    def joint(*flat: torch.Tensor) -> tuple[Any, ...]:
        params = list(flat[:n_params])
        exported_args = [flat[s] if isinstance(s, int) else s for s in sources]
        loss = _Replay(ep.graph_module).run(*exported_args)[loss_idx]
        if not params or loss.grad_fn is None:
            raise CaptureError(
                "the loss does not depend on any trainable parameter: nothing to differentiate"
            )
        _backward_hooks(loss)
        return (loss, *torch.autograd.grad(loss, params, allow_unused=True))

    def functional_joint(*flat: torch.Tensor) -> tuple[Any, ...]:
        # The dispatch-level functionalization AOTAutograd uses: it sits below autograd, so
        # requires_grad survives the wrapping (torch.func.functionalize's wrappers lose it).
        with FunctionalTensorMode():
            wrapped = [FunctionalTensor.to_functional(t) for t in flat]
            outs = joint(*wrapped)
            outs = [o.from_functional() if isinstance(o, FunctionalTensor) else o for o in outs]
            for i, w in enumerate(wrapped):
                torch._sync(w)
                if not torch._functionalize_has_data_mutation(w.elem):
                    continue
                if i not in state:
                    raise CaptureError(
                        f"the forward writes in place into {'a parameter' if i < n_params else 'an input'} "
                        f"(argument {i}); only buffers may be updated in place: return a new tensor instead"
                    )
                updated.append(i - state.start)
                outs.append(w.from_functional())
            return tuple(outs)

    with fx_traceback.preserve_node_meta():
        return make_fx(functional_joint if functional else joint, restrides.DECOMPOSITIONS)(*fake_args)


def _is_mutating(node: fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable


def _needs_functionalization(ep: torch.export.ExportedProgram) -> bool:
    """Whether the joint trace will hold in-place ops (functionalizing costs ~50% more trace time).

    In-place ops in the exported graph do (attention with dropout is written as one functional op).
    """
    return any(_is_mutating(n) for n in ep.graph.nodes)


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

    def inherited(n: fx.Node) -> str:
        return next((node_module(a) for a in n.all_input_nodes if a.op != "placeholder"), "")

    for n in g.nodes:
        if n.op == "placeholder":
            n.meta["autopar_phase"] = "input"
            n.meta["autopar_module"] = owner_of_placeholder.get(n.name, "")
            continue
        stack = n.meta.get("nn_module_stack")
        if n in forward:
            n.meta["autopar_phase"] = "forward"
            mod = _strip(list(stack.values())[-1][0]) if stack else inherited(n)
        else:
            n.meta["autopar_phase"] = "backward"
            src = fwd_by_seq.get(n.meta.get("seq_nr")) if n.meta.get("autograd_backward") else None
            mod = src.meta["autopar_module"] if src is not None else inherited(n)
        n.meta["autopar_module"] = mod
    return loss


def _input_name(path: tuple) -> str:
    """Name of a user input from its pytree path in ``(args, {**kwargs, _TARGETS: targets})``."""
    if path[0].idx == 0:
        base, rest = f"arg{path[1].idx}", path[2:]
    elif path[1].key == _TARGETS:
        base, rest = f"target{path[2].idx}", path[3:]
    else:
        base, rest = str(path[1].key), path[2:]
    return base + pytree.keystr(rest)


def _hf_no_cache(model: nn.Module, kwargs: dict) -> None:
    """Training never wants a KV cache, and HF LLaMA's cache breaks export: default use_cache=False."""
    with contextlib.suppress(TypeError, ValueError):  # forward without an inspectable signature
        if "use_cache" in inspect.signature(model.forward).parameters:
            kwargs.setdefault("use_cache", False)


def capture(
    model: nn.Module,
    example_inputs: Any,
    loss_fn: Callable[..., Any] | None = None,
    example_targets: Any = None,
) -> CapturedGraph:
    """Trace ``model`` on ``example_inputs`` into a joint forward+backward ATen graph on fake tensors.

    ``example_inputs`` is a Tensor, a tuple/list of positional arguments or a
    dict of keyword arguments; tensors (and the model's weights) may be real,
    fake or on the meta device.  Without ``loss_fn`` the model must return a
    scalar, an object with ``.loss``, a dict with "loss" or a tuple whose first
    element is a scalar; with it, ``loss = loss_fn(output, *example_targets)``.
    Raises CaptureError with a one-line cause and fix when capture fails.
    """
    t0 = time.perf_counter()
    cls = type(model).__name__
    args, kwargs, targets = _normalize(example_inputs, example_targets)
    _hf_no_cache(model, kwargs)

    # Canonical name = first name of each tensor, so tied weights appear once.  Frozen params are state.
    canon: dict[str, str] = {}
    first: dict[int, str] = {}
    for name, t in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        canon[name] = first.setdefault(id(t), name)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    fixed = [(n, p) for n, p in model.named_parameters() if not p.requires_grad] + list(model.named_buffers())
    state = trainable + fixed

    # Flattened in the order of CapturedGraph.inputs: positional, keyword, then targets.
    leaves, in_spec = pytree.tree_flatten_with_path((args, {**kwargs, _TARGETS: targets}))
    user_tensors = [x for _, x in leaves if isinstance(x, torch.Tensor)]
    device = _pick_device(user_tensors + [t for _, t in state])
    # Non-fake inputs allowed: the model's tensor constants (masks, scalars) stay real graph constants.
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)

    def fake(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        with fake_mode:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)

    fake_of = {
        id(t): nn.Parameter(fake(t), t.requires_grad) if isinstance(t, nn.Parameter) else fake(t)
        for _, t in state
    }
    fake_leaves = [fake(x) for _, x in leaves]
    fargs, fkwargs = pytree.tree_unflatten(fake_leaves, in_spec)
    stack: list[str] = []
    try:
        with _swapped_state(model, fake_of), _track_modules(model, stack), _quiet(), _lean_tracing():
            ep = torch.export.export(_LossWrapper(model, loss_fn), fargs, fkwargs, strict=False)
    except Exception as exc:  # noqa: BLE001 - every failure becomes one readable line
        log.debug("export of %s failed", cls, exc_info=True)
        raise _export_error(exc, model, stack) from None
    t1 = time.perf_counter()

    # Joint arguments: trainable params, fixed state, user tensors.  Map each exported placeholder onto them.
    slot = {name: i for i, (name, _) in enumerate(state)}
    user_slots = iter(len(state) + i for i in range(len(user_tensors)))
    leaf_sources = iter(next(user_slots) if isinstance(x, torch.Tensor) else x for x in fake_leaves)
    sources: list[Any] = []
    for spec in ep.graph_signature.input_specs:
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER) and _strip(spec.target) in canon:
            sources.append(slot[canon[_strip(spec.target)]])
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            sources.append(_constant(ep.constants[spec.target], device))
        elif spec.kind == InputKind.USER_INPUT:
            sources.append(next(leaf_sources))
        else:
            raise CaptureError(
                f"cannot capture {cls}: unsupported exported input {spec.kind.name} {spec.target}"
            )
    if any(spec.kind != OutputKind.USER_OUTPUT for spec in ep.graph_signature.output_specs):
        kinds = sorted({spec.kind.name for spec in ep.graph_signature.output_specs} - {"USER_OUTPUT"})
        raise CaptureError(f"cannot capture {cls}: its export has {', '.join(kinds)} outputs")

    fake_args = (
        [fake(p).requires_grad_(True) for _, p in trainable]
        + [fake(t) for _, t in fixed]
        + [x for x in fake_leaves if isinstance(x, torch.Tensor)]
    )
    try:
        with fake_mode, _quiet(), _lean_tracing():
            functional = _needs_functionalization(ep)
            state_args = range(len(trainable), len(state))
            updated: list[int] = []
            gm = _trace_joint(ep, sources, len(trainable), fake_args, functional, state_args, updated)
            mutating = sorted({str(n.target) for n in gm.graph.nodes if _is_mutating(n)})
            if mutating and not functional:
                log.info("joint graph of %s has in-place ops (%s); re-tracing functionalized", cls, mutating)
                updated.clear()
                gm = _trace_joint(ep, sources, len(trainable), fake_args, True, state_args, updated)
    except CaptureError:
        raise
    except Exception as exc:  # noqa: BLE001
        log.debug("joint trace of %s failed", cls, exc_info=True)
        raise CaptureError(f"could not trace the backward of {cls}: {_short(exc)}") from exc
    _clean(gm)
    bad = sorted({str(n.target) for n in gm.graph.nodes if _is_mutating(n)})
    if bad:
        raise CaptureError(f"joint graph of {cls} still mutates tensors after functionalization: {bad}")

    # Name placeholders after what they hold.
    names = [n for n, _ in state] + [_input_name(p) for p, x in leaves if isinstance(x, torch.Tensor)]
    prefixes = ["p_"] * len(trainable) + ["b_"] * len(fixed) + [""] * len(user_tensors)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    infos, owners = [], {}
    for node, name, prefix, val in zip(placeholders, names, prefixes, fake_args, strict=True):
        node._rename(re.sub(r"\W|^(?=\d)", "_", prefix + name))
        node.target = node.name
        infos.append(TensorInfo(name, node.name, tuple(val.shape), val.dtype))
        if prefix:
            owners[node.name] = name.rpartition(".")[0]
    gm.recompile()
    loss = _annotate(gm, owners, len(trainable))
    _check_dtypes(gm, model)

    _, grad_nodes, _ = graph_results(gm, len(trainable))
    grads = {name: g.name for (name, _), g in zip(trainable, grad_nodes, strict=True) if g is not None}
    batch = int(user_tensors[0].shape[0]) if user_tensors and user_tensors[0].dim() > 0 else 1
    log.info(
        "captured %s: %d nodes, %d params, export %.1fs, joint %.1fs",
        cls,
        len(gm.graph.nodes),
        len(trainable),
        t1 - t0,
        time.perf_counter() - t1,
    )
    n_p, n_s = len(trainable), len(state)
    return CapturedGraph(gm, infos[:n_p], infos[n_p:n_s], infos[n_s:], loss.name, grads, batch, cls, updated)
