"""The joint trace: the exported forward replayed under ``make_fx``, then its backward.

The exported graph is replayed op by op with the few rewrites the later passes
need (functional dropout, fused dropout attention, SyncBatchNorm-style batch norm,
mean class losses as a sum over a total weight), ``autograd.grad`` of the loss is
traced into the same graph, and, functionalized, in-place buffer updates become
graph results.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch.export.graph_signature import OutputKind
from torch.fx.experimental.proxy_tensor import make_fx

from autopar.capture import restrides
from autopar.core.errors import CaptureError
from autopar.ops import batch_norm, dropout_attention

aten = torch.ops.aten

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


def trace_joint(
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


def is_mutating(node: fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable


def needs_functionalization(ep: torch.export.ExportedProgram) -> bool:
    """Whether the joint trace will hold in-place ops (functionalizing costs ~50% more trace time).

    In-place ops in the exported graph do (attention with dropout is written as one functional op).
    """
    return any(is_mutating(n) for n in ep.graph.nodes)
