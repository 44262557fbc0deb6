"""The ``autopar`` command line: plan a model for a cluster, then read, compare, report and export plans.

    autopar plan examples.models:gpt2_small --cluster dgx-h100 --nodes 2 --batch 64 --json plan.json
    autopar plan mypkg.models:build --cluster dgx-a100 --nodes 8 --dp 64 --zero 3 --report plan.html
    autopar show plan.json                          # the summary tables
    autopar show plan.json --explain transformer.h.0.mlp.c_fc.weight
    autopar show plan.json --report plan.html --pictures pictures/
    autopar diff a.json b.json
    autopar export-onnx examples.models:gpt2_tiny --plan plan.json --out model.onnx

A model is named as ``module:factory``: ``factory()`` returns
``(model, example_inputs)``, or a dict with keys ``model``,
``example_inputs`` and optionally ``loss_fn`` and ``example_targets``. Bad
input ends with a one-line message and exit status 2; an unexpected failure
with a one-line message and status 1 (``-v`` shows the traceback).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import autopar
from autopar.core.errors import AutoparError
from autopar.hardware.cluster import Cluster
from autopar.onnx import export_onnx
from autopar.plans.inspection import diff
from autopar.plans.pictures import pipeline_figure, save_pictures, to_png
from autopar.plans.plan import Plan
from autopar.plans.report import write_report

EXIT_BAD_INPUT = 2
EXIT_FAILURE = 1


def _load_factory(spec: str) -> dict[str, Any]:
    if ":" not in spec:
        raise AutoparError(f"model {spec!r} must be given as module:factory, e.g. examples.models:gpt2_small")
    mod_name, fn_name = spec.split(":", 1)
    sys.path.insert(0, ".")
    try:
        module = importlib.import_module(mod_name)
    except ImportError as err:
        raise AutoparError(f"cannot import module {mod_name!r}: {err}") from None
    factory = getattr(module, fn_name, None)
    if not callable(factory):
        raise AutoparError(f"module {mod_name!r} has no callable {fn_name!r}")
    try:
        made = factory()
    except Exception as err:  # the user's code: report it in one line, not as autopar's traceback
        raise AutoparError(f"{spec}() raised {type(err).__name__}: {_first_line(err)}") from None
    if isinstance(made, dict) and "model" in made and "example_inputs" in made:
        return made
    if isinstance(made, (tuple, list)) and len(made) == 2:
        return {"model": made[0], "example_inputs": made[1]}
    raise AutoparError(
        f"{spec}() must return (model, example_inputs) or a dict with 'model' and 'example_inputs'"
    )


def _cluster(args):

    if args.local:
        return Cluster.local(args.local)
    if args.device:
        return Cluster(nodes=args.nodes, gpus_per_node=args.gpus_per_node, device=args.device)
    return Cluster.preset(args.cluster, nodes=args.nodes)


class _StatusHandler(logging.Handler):
    """Shows autopar's latest progress message on the spinner line; prints warnings above it."""

    def __init__(self, status, console) -> None:
        super().__init__(logging.INFO)
        self.status = status
        self.console = console
        self.prefix = ""

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage().splitlines()[0] if record.getMessage() else ""
        if record.levelno >= logging.WARNING:
            self.console.print(f"warning: {msg}", markup=False, highlight=False)
            return
        text = f"{self.prefix}: {msg}" if self.prefix else msg
        room = max(self.console.width - 4, 20)
        self.status.update(text if len(text) <= room else text[: room - 3] + "...")


@contextlib.contextmanager
def _progress(message: str, verbose: bool) -> Iterator[Any]:
    """A spinner on stderr with the latest progress message, while a long step runs.

    Silent when stderr is not a terminal (CI logs, pipes) or with -v (the log says it all).
    Yields a function that sets the phase shown before the latest message. While it
    spins, autopar's log goes through it (warnings printed above the spinner line) and
    the root logger's handlers are muted, so that nothing garbles the line.
    """
    from rich.console import Console

    console = Console(stderr=True)
    if verbose or not console.is_terminal:
        yield lambda phase: None
        return
    logger = logging.getLogger("autopar")
    old_level, old_propagate = logger.level, logger.propagate
    with console.status(message) as status:
        handler = _StatusHandler(status, console)
        logger.addHandler(handler)
        logger.propagate = False
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)

        def phase(text: str) -> None:
            handler.prefix = text
            status.update(text)

        try:
            yield phase
        finally:
            logger.removeHandler(handler)
            logger.setLevel(old_level)
            logger.propagate = old_propagate


def _cmd_plan(args) -> int:

    cluster = _cluster(args)  # cheap checks first, before the model is built
    fixed = {
        k: getattr(args, k)
        for k in ("dp", "tp", "pp", "ep", "cp", "zero", "recompute", "microbatches", "schedule")
        if getattr(args, k) is not None
    }
    with _progress("building the model", args.verbose) as phase:
        made = _load_factory(args.model)
        phase("planning")
        plan = autopar.plan(
            made["model"],
            made["example_inputs"],
            cluster,
            loss_fn=made.get("loss_fn"),
            example_targets=made.get("example_targets"),
            optimizer=args.optimizer,
            precision=args.precision,
            reduce_dtype=args.reduce_dtype,
            global_batch_size=args.batch,
            memory_limit=args.memory_limit * 1e9 if args.memory_limit else None,
            fixed=fixed or None,
            time_limit_s=args.time_limit,
        )
    print(plan.summary())
    if args.json:
        _write(lambda: plan.save(args.json), args.json)
        print(f"plan written to {args.json}")
    if args.report:
        _write_report(plan, args.report)
    if args.show_pipeline:
        _write_pipeline(plan, args.show_pipeline)
    return 0


def _write_pipeline(plan, path: str) -> None:

    _write(lambda: Path(path).write_bytes(to_png(pipeline_figure(plan))), path)
    print(f"pipeline timeline written to {path}")


def _cmd_show(args) -> int:

    plan = Plan.load(args.plan)
    if args.explain:
        print(plan.explain(args.explain))
    else:
        print(plan.summary())
    if args.report:
        _write_report(plan, args.report)
    if args.show_pipeline:
        _write_pipeline(plan, args.show_pipeline)
    if args.pictures:

        paths = _write(lambda: save_pictures(plan, args.pictures), args.pictures)
        print("pictures written: " + ", ".join(str(p) for p in paths.values()))
    return 0


def _cmd_diff(args) -> int:

    a, b = Plan.load(args.a), Plan.load(args.b)
    names = (args.a, args.b) if args.a != args.b else ("a", "b")
    print(diff(a, b, *names))
    return 0


def _cmd_export_onnx(args) -> int:

    plan = Plan.load(args.plan)  # a bad plan file fails before the model is built
    with _progress("building the model", args.verbose) as phase:
        made = _load_factory(args.model)
        phase("exporting")
        written = export_onnx(
            made["model"],
            plan,
            args.out,
            made["example_inputs"],
            loss_fn=made.get("loss_fn"),
            example_targets=made.get("example_targets"),
        )
    print(
        f"wrote {args.out}: {len(written.placements)} tensors annotated on {written.annotated_nodes} nodes, "
        f"{written.num_devices} devices"
    )
    return 0


def _write_report(plan, path: str) -> None:

    _write(lambda: write_report(plan, path), path)
    print(f"report written to {path} (open it in a browser)")


def _write(fn, path: str):
    try:
        return fn()
    except OSError as err:
        raise AutoparError(f"cannot write {path}: {err.strerror or err}") from None


def build_parser() -> argparse.ArgumentParser:
    """The command line: ``plan``, ``show``, ``diff`` and ``export-onnx``, one subcommand a function."""
    parser = argparse.ArgumentParser(
        prog="autopar",
        description="Plan parallel training of a PyTorch model on a cluster, and inspect saved plans. "
        "Start with `autopar plan MODULE:FACTORY --json plan.json`, then `autopar show plan.json`.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log what each pass does")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_plan(sub)
    _add_show(sub)
    _add_diff(sub)
    _add_export_onnx(sub)
    return parser


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="plan a model for a cluster and print the plan",
        description="Capture the model, cost the configurations the cluster allows and print the best plan. "
        "Options such as --dp/--zero fix part of the answer; the rest is searched. "
        "Example: autopar plan examples.models:gpt2_small --cluster dgx-h100 --nodes 2 --json plan.json",
    )
    p.add_argument("model", help="module:factory, where factory() returns (model, example_inputs)")
    _add_cluster_options(p)
    _add_training_options(p)
    _add_fixed_options(p)
    out = p.add_argument_group("output")
    out.add_argument("--json", metavar="PATH", help="save the plan as JSON (for show, diff, export-onnx)")
    out.add_argument("--report", metavar="PATH", help="write a self-contained HTML report of the plan")
    out.add_argument(
        "--show-pipeline", metavar="PNG", help="draw the pipeline schedule's timeline (one row per device)"
    )
    p.set_defaults(func=_cmd_plan)


def _add_cluster_options(p: argparse.ArgumentParser) -> None:
    where = p.add_argument_group("cluster (a preset, a device, or local CPU processes)")
    where.add_argument("--cluster", default="dgx-h100", help="preset name, e.g. dgx-a100, dgx-h100 (default)")
    where.add_argument("--nodes", type=int, default=1, help="number of nodes (default 1)")
    where.add_argument("--device", help="device name instead of a preset, e.g. A100-80GB")
    where.add_argument("--gpus-per-node", type=int, default=8, help="with --device (default 8)")
    where.add_argument("--local", type=int, metavar="N", help="N local CPU processes over gloo")


def _add_training_options(p: argparse.ArgumentParser) -> None:
    train = p.add_argument_group("training")
    train.add_argument("--batch", type=int, help="global batch size (default: the example batch)")
    train.add_argument("--precision", default="bf16-mixed", help="bf16-mixed (default), fp16-mixed or fp32")
    train.add_argument(
        "--reduce-dtype",
        help="dtype of the gradient reductions under mixed precision: fp32 (default) or the compute dtype",
    )
    train.add_argument("--optimizer", default="adamw", help="adamw (default), adam, sgd, ...")
    train.add_argument("--memory-limit", type=float, metavar="GB", help="per device (default: device memory)")
    train.add_argument(
        "--time-limit",
        type=float,
        default=60.0,
        metavar="S",
        help="solver time budget in seconds (default 60)",
    )


def _add_fixed_options(p: argparse.ArgumentParser) -> None:
    fix = p.add_argument_group("fix part of the plan")
    fix.add_argument("--dp", type=int, help="data-parallel size")
    fix.add_argument("--tp", type=int, help="tensor-parallel size")
    fix.add_argument("--pp", type=int, help="pipeline-parallel size: the number of pipeline stages")
    fix.add_argument("--ep", type=int, help="expert-parallel size: the experts split over the ranks of dp or tp")
    fix.add_argument("--cp", type=int, help="context-parallel size: attention's sequence split over the ranks of dp or tp")
    fix.add_argument("--schedule", help="pipeline schedule: 1F1B, GPipe or interleaved")
    fix.add_argument("--zero", type=int, choices=(0, 1, 2, 3), help="ZeRO stage")
    fix.add_argument("--microbatches", type=int, help="gradient-accumulation steps per optimizer step")
    fix.add_argument(
        "--recompute",
        choices=("none", "selective", "full"),
        help="none, selective (Megatron's: every layer's attention core) or full (every layer); default: op by op",
    )


def _add_show(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser(
        "show",
        help="print a saved plan, explain one op or layer, write its report",
        description="Print the summary of a saved plan; with --explain, why the plan does what it does at one "
        "op, parameter or layer (module path; '*' folds the layer number, e.g. transformer.h.*.mlp).",
    )
    s.add_argument("plan", help="plan.json written by `autopar plan --json` or Plan.save()")
    s.add_argument(
        "--explain",
        metavar="NAME",
        help="a node name, a parameter name (transformer.h.0.mlp.c_fc.weight) or a module path",
    )
    s.add_argument("--report", metavar="PATH", help="write a self-contained HTML report of the plan")
    s.add_argument("--pictures", metavar="DIR", help="write memory.png, time.png and pipeline.png into DIR")
    s.add_argument(
        "--show-pipeline", metavar="PNG", help="draw the pipeline schedule's timeline (one row per device)"
    )
    s.set_defaults(func=_cmd_show)


def _add_diff(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser(
        "diff",
        help="compare two saved plans",
        description="What differs between two plans: mesh, ZeRO, recompute, micro-batches, estimated time "
        "and memory by category, collectives, and per-op placements (layers folded).",
    )
    d.add_argument("a", help="the first plan.json")
    d.add_argument("b", help="the second plan.json")
    d.set_defaults(func=_cmd_diff)


def _add_export_onnx(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser(
        "export-onnx",
        help="export a model's inference graph to ONNX, annotated with a plan",
        description="Write the model's forward as ONNX with the plan's shardings in ONNX's multi-device "
        "fields. The model needs real weights (not the meta device) and must be the one the plan was made for.",
    )
    e.add_argument("model", help="module:factory, as given to `autopar plan`")
    e.add_argument("--plan", required=True, metavar="PATH", help="plan.json made for this model")
    e.add_argument("--out", required=True, metavar="PATH", help="where to write the .onnx file")
    e.set_defaults(func=_cmd_export_onnx)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        return args.func(args)
    except AutoparError as err:
        print(f"autopar: error: {_first_line(err)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("autopar: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `autopar show plan.json | head`: the reader left, nothing is wrong
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except Exception as err:
        if args.verbose:
            raise
        print(
            f"autopar: error: {type(err).__name__}: {_first_line(err)} (run with -v for the traceback)",
            file=sys.stderr,
        )
        return EXIT_FAILURE


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


if __name__ == "__main__":
    sys.exit(main())
