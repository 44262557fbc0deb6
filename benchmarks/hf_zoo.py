"""Every causal LM family of the installed transformers, captured, given sharding rules, and trained.

    PYTHONPATH=. .venv/bin/python benchmarks/hf_zoo.py                 capture and rules, every family
    PYTHONPATH=. .venv/bin/python benchmarks/hf_zoo.py --train         ... and 3 AdamW steps on 2 processes
    PYTHONPATH=. .venv/bin/python benchmarks/hf_zoo.py --only Llama,GptOss --train
    PYTHONPATH=. .venv/bin/python benchmarks/hf_zoo.py --run-rules     every strategy of every op run alone
    PYTHONPATH=. .venv/bin/python benchmarks/hf_zoo.py --run-rules 2x2 --only Llama,Mamba2   ... on 4 processes

Each ``<Family>ForCausalLM`` is built from its default config shrunk by one
rule (:mod:`examples.zoo`), then, in a process of its own (capped at
``--memory-gb`` of address space and ``--timeout`` seconds, so that one family
cannot stop the sweep):

1. capture: the joint forward + backward graph (:func:`autopar.capture.joint.capture`);
2. rules: every op of it has a sharding rule on a 2 x 2 mesh, or is listed;
   with ``--run-rules``, every strategy of every op is also run alone on 2
   gloo processes (or the dp x tp mesh given) and held to one device
   (:mod:`autopar.verify.rule_check`);
3. with ``--train``: a random flowing layout on tp 2 (every op's strategy
   drawn among those it has, as ``tests/test_families.py`` draws them; or, with
   ``--layout random``, each op's drawn without regard to its neighbours') trains 3
   AdamW steps on 2 gloo processes under ``rng="exact"`` and is held to one
   device at 1e-5 (:func:`autopar.verify.oracle.check_plans`); a family that
   differs is then run op by op, and the first node whose value differs is
   printed (:func:`autopar.verify.localize.differences`).

A family whose shrunk config transformers refuses, whose build fails, or
whose eager forward and backward fail before autopar sees the model, is
reported as ``config`` (the rule's, not autopar's); every other failure is
autopar's and prints its one-line message.
"""

from __future__ import annotations

import argparse
import collections
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples import zoo  # noqa: E402


def one(name: str, train: bool, layout: str = "flowing", run_rules: str | None = None) -> dict:
    """The three stages for one family, in this process; the last stage reached and what it found."""
    import logging
    import warnings

    import torch

    import autopar
    from autopar.capture.inputs import model_loss
    from autopar.capture.joint import capture
    from autopar.search.sharding.strategies import enumerate_strategies, unruled_ops
    from autopar.verify.localize import differences
    from autopar.verify.oracle import check_plans, draws_random, factory_layout_plan
    from autopar.verify.rule_check import check_rules

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    row: dict = {"family": name}
    try:
        torch.manual_seed(0)
        model, inputs = zoo.causal_lm(name)
    except Exception as e:  # noqa: BLE001 - the shrunk config's failure, reported as such
        return {**row, "stage": "config", "error": _line(e.__cause__ or e)}
    row["params"] = sum(p.numel() for p in model.parameters())
    try:  # the model as it ships must run its own step: where it does not, the shrunk config is at fault
        model_loss(model, inputs).backward()  # as autopar's reference computes it (no KV cache)
        model.zero_grad(set_to_none=True)
    except Exception as e:  # noqa: BLE001
        return {**row, "stage": "config", "error": "eager step: " + _line(e)}
    try:
        t = time.perf_counter()
        captured = capture(model, inputs)
        row["nodes"], row["capture_s"] = len(captured.gm.graph.nodes), round(time.perf_counter() - t, 1)
        row["unruled"] = sorted(map(str, unruled_ops(enumerate_strategies(captured.gm, (2, 2)))))
    except Exception as e:  # noqa: BLE001
        return {**row, "stage": "capture", "error": _line(e)}
    if run_rules:
        try:
            (ran,) = check_rules([zoo.factory(name)], _mesh(run_rules))
            row["ran"] = [ran.checked, len(ran.wrong), [str(w) for w in ran.wrong[:3]]]
        except Exception as e:  # noqa: BLE001
            row["ran"] = [0, 0, [_line(e)]]
    if not train:
        return {**row, "stage": "rules"}
    try:
        from autopar.runtime import launch

        launch.PRELOAD.append("examples.zoo")
        two = autopar.Cluster.local(2)
        make = zoo.factory(name)
        kind, _, seed = layout.partition(":")
        plan = factory_layout_plan(make, two, 1, 2, kind, seed=int(seed or 0))
        (check,) = check_plans([(make, plan)], two, rng="exact")
        row.update(ok=check.ok(1e-5), errors=[check.loss_error, check.grad_error, check.param_error])
        if not row["ok"] and not draws_random(make):
            try:
                row["floor"] = fp32_floor(make)
            except Exception as e:  # noqa: BLE001 - a model with no fp64 kernel (grouped matmuls) has no floor
                row["floor_error"] = _line(e)
        if not row["ok"]:
            try:
                first = differences(make, two, plan, limit=1)
                row["first"] = str(first[0]) if first else "no node's value differs by 1e-4 of its scale"
            except Exception as e:  # noqa: BLE001 - the check's figures stand whether or not the search for where runs
                row["first"] = "not found: " + _line(e)
        return {**row, "stage": "trained"}
    except Exception as e:  # noqa: BLE001
        return {**row, "stage": "train", "error": _line(e)}


def fp32_floor(make) -> list[float]:
    """How far one device in fp32 is from itself in fp64 over the oracle's 3 AdamW steps: loss, first
    gradients, final parameters, each as the oracle measures them (:func:`autopar.verify.oracle.group_error`).

    A plan as accurate as one device is within this of the truth, so within twice this of one device
    (the triangle inequality): the bar for a model whose own round-off is over the oracle's 1e-5 (a
    gradient that sums terms which nearly cancel; Adam turning round-off into steps of lr).
    """
    import copy

    import torch

    from autopar.capture.inputs import model_loss
    from autopar.verify.oracle import group_error
    from autopar.verify.reference import train

    torch.manual_seed(0)
    model, inputs = make()
    runs = []
    for dtype in (torch.float32, torch.float64):
        m = copy.deepcopy(model).to(dtype)
        feed = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}

        def step(m=m, feed=feed) -> torch.Tensor:
            loss = model_loss(m, feed)
            loss.backward()
            return loss.detach()

        def grads(m=m) -> dict:
            return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

        losses, first = train(m, feed, step, torch.optim.AdamW(m.parameters(), lr=1e-3), 3, grads)
        runs.append((losses, first, {n: p.detach().clone() for n, p in m.named_parameters()}))
    (l32, g32, p32), (l64, g64, p64) = runs
    loss = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(l32, l64, strict=True))
    return [loss, group_error(g32, g64)[0], group_error(p32, p64)[0]]


def _line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300] if text else ''}"


def _limit(memory_gb: float):
    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (int(memory_gb * 2**30),) * 2)

    return cap


def run(
    name: str, train: bool, timeout: float, memory_gb: float, layout: str = "flowing", run_rules: str | None = None
) -> dict:
    """:func:`one` in a process of its own."""
    cmd = [sys.executable, __file__, "--one", name, "--layout", layout]
    cmd += (["--train"] if train else []) + (["--run-rules", run_rules] if run_rules else [])
    t = time.perf_counter()
    try:
        out = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, preexec_fn=_limit(memory_gb), check=False
        )
    except subprocess.TimeoutExpired:
        return {"family": name, "stage": "timeout", "error": f"over {timeout:.0f} s", "s": round(timeout)}
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    row = json.loads(lines[-1]) if lines else {"family": name, "stage": "died", "error": f"exit {out.returncode}"}
    return {**row, "s": round(time.perf_counter() - t, 1)}


def verdict(row: dict) -> str:
    if row["stage"] == "trained":
        worst = max(row["errors"])
        if row["ok"]:
            return f"trains like one device ({worst:.1e})"
        floor = row.get("floor")
        if floor and all(e <= max(1e-5, 2 * f) for e, f in zip(row["errors"], floor, strict=True)):
            return f"trains like one device, within fp32's own error ({worst:.1e}; one device fp32 vs fp64: {max(floor):.1e})"
        notes = [f"one device fp32 vs fp64: {max(floor):.1e}"] if floor else []
        notes += [f"first: {row['first']}"] if row.get("first") else []
        return f"DIFFERS from one device ({'; '.join([f'{worst:.1e}', *notes])})"
    if row["stage"] == "rules":
        return "every op has a rule" if not row["unruled"] else "replicated: " + ", ".join(row["unruled"])
    return f"{row['stage']}: {row.get('error', '')}"


def _mesh(text: str) -> tuple[int, int]:
    """``"2x2"`` as (dp, tp)."""
    dp, _, tp = text.partition("x")
    if not (dp.isdigit() and tp.isdigit() and int(dp) and int(tp)):
        raise argparse.ArgumentTypeError(f"{text!r} is not a dp x tp mesh: write it as 1x2 or 2x2")
    return int(dp), int(tp)


def ran(row: dict) -> str:
    """What running every strategy alone found (``--run-rules``)."""
    if "ran" not in row:
        return ""
    checked, wrong, first = row["ran"]
    if not checked:
        return f"; strategies not run: {first[0]}"
    return f"; {checked} strategies run alone, {wrong} wrong" + (f" (first: {first[0]})" if wrong else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", action="store_true", help="also train each family on 2 processes")
    ap.add_argument("--only", help="comma-separated families (Llama, GptOss, ...)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds a family may take")
    ap.add_argument("--memory-gb", type=float, default=12, help="address space a family's process may take")
    ap.add_argument(
        "--layout", default="flowing", help='the layout trained: "flowing" or "random", with ":seed" (default 0)'
    )
    ap.add_argument(
        "--run-rules",
        nargs="?",
        const="1x2",
        metavar="MESH",
        help="also run every strategy of every op alone on a dp x tp mesh of processes (1x2 unless given)",
    )
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run_rules:
        try:
            _mesh(args.run_rules)
        except argparse.ArgumentTypeError as e:
            ap.error(str(e))
    if args.one:
        print(json.dumps(one(args.one, args.train, args.layout, args.run_rules)), flush=True)
        return
    names = args.only.split(",") if args.only else zoo.causal_lm_names()
    print(f"{'family':<28} {'params':>9} {'nodes':>6} {'capture s':>9} {'s':>6}  result", flush=True)
    rows = []
    for name in names:
        row = run(name, args.train, args.timeout, args.memory_gb, args.layout, args.run_rules)
        rows.append(row)
        print(
            f"{name:<28} {row.get('params', ''):>9} {row.get('nodes', ''):>6} {row.get('capture_s', ''):>9} "
            f"{row['s']:>6}  {verdict(row)}{ran(row)}",
            flush=True,
        )
    outcome = collections.Counter(
        "config" if r["stage"] == "config" else verdict(r).split(" (")[0].split(":")[0] for r in rows
    )
    print(f"\n{len(rows)} families: " + ", ".join(f"{n} {k}" for k, n in outcome.most_common()))


if __name__ == "__main__":
    main()
