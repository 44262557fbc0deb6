"""The ``autopar`` command line: plan a model for a cluster, show a saved plan.

    autopar plan examples.models:gpt2_small --cluster dgx-h100 --nodes 2 --batch 64
    autopar plan mypkg.models:build --cluster dgx-a100 --nodes 8 --dp 64 --zero 3 --json plan.json
    autopar show plan.json

A model is named as ``module:factory``: ``factory()`` returns
``(model, example_inputs)``, or a dict with keys ``model``,
``example_inputs`` and optionally ``loss_fn`` and ``example_targets``. Bad
input ends with a one-line message and exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Any

from autopar.errors import AutoparError

EXIT_BAD_INPUT = 2


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
    made = factory()
    if isinstance(made, dict) and "model" in made and "example_inputs" in made:
        return made
    if isinstance(made, (tuple, list)) and len(made) == 2:
        return {"model": made[0], "example_inputs": made[1]}
    raise AutoparError(
        f"{spec}() must return (model, example_inputs) or a dict with 'model' and 'example_inputs'"
    )


def _cluster(args):
    from autopar.cluster import Cluster

    if args.local:
        return Cluster.local(args.local)
    if args.device:
        return Cluster(nodes=args.nodes, gpus_per_node=args.gpus_per_node, device=args.device)
    return Cluster.preset(args.cluster, nodes=args.nodes)


def _cmd_plan(args) -> int:
    import autopar

    cluster = _cluster(args)  # cheap checks first, before the model is built
    made = _load_factory(args.model)
    fixed = {k: getattr(args, k) for k in ("dp", "zero", "microbatches") if getattr(args, k) is not None}
    plan = autopar.plan(
        made["model"],
        made["example_inputs"],
        cluster,
        loss_fn=made.get("loss_fn"),
        example_targets=made.get("example_targets"),
        optimizer=args.optimizer,
        precision=args.precision,
        global_batch_size=args.batch,
        memory_limit=args.memory_limit * 1e9 if args.memory_limit else None,
        fixed=fixed or None,
    )
    print(plan.summary())
    if args.json:
        plan.save(args.json)
        print(f"plan written to {args.json}")
    return 0


def _cmd_show(args) -> int:
    from autopar.plan import Plan

    print(Plan.load(args.plan).summary())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autopar",
        description="Plan parallel training of a PyTorch model on a cluster, and inspect saved plans.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log what each pass does")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "plan",
        help="plan a model for a cluster and print the plan",
        description="Capture the model, cost the configurations the cluster allows and print the best plan. "
        "Options such as --dp/--zero fix part of the answer; the rest is searched.",
    )
    p.add_argument("model", help="module:factory; factory() returns (model, example_inputs)")
    where = p.add_argument_group("cluster (a preset, a device, or local CPU processes)")
    where.add_argument("--cluster", default="dgx-h100", help="preset name, e.g. dgx-a100, dgx-h100 (default)")
    where.add_argument("--nodes", type=int, default=1, help="number of nodes (default 1)")
    where.add_argument("--device", help="device name instead of a preset, e.g. A100-80GB")
    where.add_argument("--gpus-per-node", type=int, default=8, help="with --device (default 8)")
    where.add_argument("--local", type=int, metavar="N", help="N local CPU processes over gloo")
    train = p.add_argument_group("training")
    train.add_argument("--batch", type=int, help="global batch size (default: the example batch)")
    train.add_argument("--precision", default="bf16-mixed", help="bf16-mixed (default) or fp32")
    train.add_argument("--optimizer", default="adamw", help="adamw (default), adam, sgd, ...")
    train.add_argument("--memory-limit", type=float, metavar="GB", help="per device (default: device memory)")
    fix = p.add_argument_group("fix part of the plan")
    fix.add_argument("--dp", type=int, help="data-parallel size")
    fix.add_argument("--zero", type=int, choices=(0, 1, 2, 3), help="ZeRO stage")
    fix.add_argument("--microbatches", type=int, help="gradient-accumulation steps per optimizer step")
    p.add_argument("--json", metavar="PATH", help="also save the plan as JSON")
    p.set_defaults(func=_cmd_plan)

    s = sub.add_parser("show", help="print a saved plan", description="Print the summary of a saved plan.")
    s.add_argument("plan", help="plan.json written by `autopar plan --json` or Plan.save()")
    s.set_defaults(func=_cmd_show)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        return args.func(args)
    except AutoparError as err:
        print(f"autopar: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
