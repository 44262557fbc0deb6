"""Write the HTML report of a small plan and take a screenshot of it in headless Chromium.

    .venv/bin/python scripts/screenshot_report.py          # plans a small GPT-2: out/report.html, out/report.png
    .venv/bin/python scripts/screenshot_report.py --plan plan.json --out report.png --html report.html

The report is meant to open in any browser with no server; this script checks
that it does, the way a person would see it: Chromium renders the file from
disk (``file://``) with networking of no use, and the PNG shows whether the
tables and the embedded charts appear.

Chromium is needed on PATH (``chromium``, ``chromium-browser`` or
``google-chrome``). On Debian or Ubuntu, as root::

    apt-get update && apt-get install -y chromium

Without ``--plan`` the script plans ``examples.models:gpt2_tiny`` on
``Cluster.local(4)`` (a few seconds on a CPU) and keeps the search's per-op
records so that the report's ops table is filled. Exit status: 0 when the
screenshot was written, 2 when Chromium is missing or fails.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_browser() -> str | None:
    """The first Chromium-like browser on PATH, or None."""
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


def small_plan():
    """A plan for a small GPT-2 on 4 local processes, with the search's per-op records attached.

    ``autopar.plan`` keeps those records once the API stores them; until then the search's
    best result is caught on its way out so that the report's ops table is filled.
    """
    sys.path.insert(0, str(ROOT))
    import autopar
    import autopar.api.planner as api
    from autopar.search.sharding.explain_records import explain_records
    from examples.models import gpt2_tiny

    caught = {}
    search = api.search_meshes

    def keep(captured, *args, **kwargs):
        best, results = search(captured, *args, **kwargs)
        caught["ops"] = explain_records(captured, best) if best is not None else None
        return best, results

    api.search_meshes = keep
    try:
        model, batch = gpt2_tiny()
        plan = autopar.plan(model, batch, autopar.Cluster.local(4), precision="fp32")
    finally:
        api.search_meshes = search
    if caught.get("ops") is not None and plan.solver.ops is None:
        plan.solver.ops = caught["ops"]
    return plan


def screenshot(
    html: Path, out: Path, width: int = 1200, height: int = 2600, browser: str | None = None
) -> Path:
    """Render ``html`` in headless Chromium and save a PNG of the window at ``out``."""
    browser = browser or find_browser()
    if browser is None:
        raise FileNotFoundError("no Chromium on PATH; install it with: apt-get install -y chromium")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as profile:
        cmd = [
            browser,
            "--headless",
            "--no-sandbox",  # root in a container has no user namespace for the sandbox
            "--disable-gpu",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            f"--window-size={width},{height}",
            f"--screenshot={out.resolve()}",
            html.resolve().as_uri(),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if done.returncode != 0 or not out.exists():
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"{Path(browser).name} exited with {done.returncode}: {tail[0]}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", help="a saved plan.json (default: plan a small GPT-2 now)")
    parser.add_argument(
        "--html", default="out/report.html", help="where to write the report (out/report.html)"
    )
    parser.add_argument(
        "--out", default="out/report.png", help="where to write the screenshot (out/report.png)"
    )
    parser.add_argument("--width", type=int, default=1200)
    parser.add_argument("--height", type=int, default=2600)
    args = parser.parse_args(argv)

    browser = find_browser()
    if browser is None:
        print(
            "screenshot_report: no Chromium on PATH; install it with: apt-get install -y chromium",
            file=sys.stderr,
        )
        return 2
    sys.path.insert(0, str(ROOT))
    from autopar.plans.plan import Plan
    from autopar.plans.report import write_report

    plan = Plan.load(args.plan) if args.plan else small_plan()
    html = write_report(plan, args.html)
    try:
        out = screenshot(html, Path(args.out), args.width, args.height, browser)
    except (RuntimeError, subprocess.TimeoutExpired) as err:
        print(f"screenshot_report: {err}", file=sys.stderr)
        return 2
    print(f"report {html}, screenshot {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
