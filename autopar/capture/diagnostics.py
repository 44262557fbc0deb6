"""Capture's failures as one line that names the cause, the module and the fix.

Export errors arrive as deep torch tracebacks; a user needs to know which of their
modules failed and what to change. This module tracks the running module during
export, mutes torch's own tracebacks, and turns an exception into a
:class:`~autopar.core.errors.CaptureError`; it also catches the dtype mismatches
fake tensors let through.
"""

from __future__ import annotations

import functools
import io
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from autopar.capture.graph import node_module, node_phase
from autopar.capture.inputs import NoLoss, strip_wrapper
from autopar.core.errors import CaptureError

aten = torch.ops.aten

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


def describe_module(model: nn.Module, path: str) -> str:
    """ "block.2 (Gate)": a module's qualified name and class, for error messages."""
    mod = model.get_submodule(path)
    return f"{path} ({type(mod).__name__})" if path else f"the top-level module ({type(mod).__name__})"


@contextmanager
def track_modules(model: nn.Module, stack: list[str]) -> Iterator[None]:
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


def one_line(exc: BaseException) -> str:
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


def export_error(exc: Exception, model: nn.Module, stack: list[str]) -> CaptureError:
    """Turn an export failure into a one-line CaptureError that names cause and fix."""
    cls, where = type(model).__name__, describe_module(model, stack[-1] if stack else "")
    for e in _chain(exc):
        if isinstance(e, NoLoss):
            return CaptureError(str(e))
    data_dep = (GuardOnDataDependentSymNode, DataDependentOutputException)
    if any(isinstance(e, data_dep) or "data-dependent" in str(e) for e in _chain(exc)):
        # where a model computes its loss (HuggingFace's heads): the fix a user can make without editing it
        loss = "" if stack and stack[-1] else "; if it is in the loss, return the logits and pass loss_fn="
        return CaptureError(
            f"data-dependent control flow in {where}: a Python branch on a tensor value cannot be "
            f"captured; replace it with torch.where or torch.cond{loss}"
        )
    dynamic = next((e for e in _chain(exc) if isinstance(e, DynamicOutputShapeException)), None)
    if dynamic is not None:  # torch's fake tensors have no shape for its output (``ctc_loss``): no fix in the inputs
        op = one_line(dynamic)
        return CaptureError(
            f"could not capture {cls}: {op} in {where} gives an output whose shape depends on its inputs' values, "
            "which torch.export cannot trace; the op cannot be part of a captured model or loss_fn"
        )
    if isinstance(exc, (TypeError, ValueError, IndexError, RuntimeError)) and not isinstance(
        exc, NotImplementedError
    ):
        return CaptureError(f"example inputs do not fit {cls}: {one_line(exc)} (in module {where})")
    return CaptureError(f"could not export {cls}: {one_line(exc)} (in module {where})")


# ops that read a tensor's value into Python (``.item()``, ``.tolist()``): export keeps their results as unbacked
# sizes, but the backward traced on fake tensors has no value to give them
_VALUE_READS = (aten.item.default, aten._local_scalar_dense.default)


def joint_error(exc: Exception, exported: fx.Graph, model: nn.Module) -> CaptureError:
    """Turn a failure to trace the joint forward + backward of an exported graph into a one-line CaptureError.

    The usual cause is a forward that turns tensor values into Python numbers (a mixture of experts that
    counts its tokens per expert with ``.tolist()``): the shapes after it depend on the data. The message
    names the module that reads them, from the exported node's module stack.
    """
    cls = type(model).__name__
    if any(isinstance(e, (GuardOnDataDependentSymNode, DataDependentOutputException)) for e in _chain(exc)):
        reads = [n for n in exported.nodes if n.op == "call_function" and n.target in _VALUE_READS]
        stack = reads[0].meta.get("nn_module_stack") if reads else None
        path = strip_wrapper(list(stack.values())[-1][0]) if stack else ""
        where = describe_module(model, path) if reads else "its forward"
        return CaptureError(
            f"could not trace the backward of {cls}: {where} reads tensor values into Python numbers (`.item()`, "
            "`.tolist()`), so the shapes after it depend on the data; write that step with shapes that do not "
            "(HuggingFace's experts modules route with fixed shapes, and autopar captures them as one op)"
        )
    return CaptureError(f"could not trace the backward of {cls}: {one_line(exc)}")


@contextmanager
def quiet_torch_logs(names: tuple[str, ...] = _NOISY_LOGGERS) -> Iterator[None]:
    """Mute what torch prints for failures capture reports as one line itself.

    Its loggers' tracebacks, and the partial graph ``torch.export`` prints to
    stderr before it raises (``partial_fx_graph``): the rest of what reaches
    stderr meanwhile (a warning) is passed on when the block ends.
    """
    saved = {n: logging.getLogger(n).level for n in names}
    held = io.StringIO()
    try:
        for n in names:
            logging.getLogger(n).setLevel(logging.CRITICAL)
        with redirect_stderr(held):
            yield
    except BaseException as exc:
        partial = getattr(exc, "partial_fx_graph", None)
        if partial:
            held = io.StringIO(held.getvalue().replace(f"{partial}\n", ""))
        raise
    finally:
        for n, level in saved.items():
            logging.getLogger(n).setLevel(level)
        sys.stderr.write(held.getvalue())


def check_dtypes(gm: fx.GraphModule, model: nn.Module) -> None:
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
                    f"operands of different dtypes ({', '.join(dtypes)}) (in module {describe_module(model, node_module(n))})"
                )
