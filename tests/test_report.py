"""Pictures and the HTML report: PNGs that draw, a page that needs no server, a screenshot in Chromium."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import autopar
from autopar import Cluster, Plan
from autopar.cost_models.estimate import Estimate, MemoryEstimate
from autopar.plans.op_records import OpAlternative, OpRecord, OpRecords
from autopar.plans.pictures import all_pngs, pipeline_schedule, save_pictures
from autopar.plans.records import SearchRecord
from autopar.plans.report import report_html, write_report
from examples.models import mlp_tiny

ROOT = Path(__file__).resolve().parent.parent
PNG = b"\x89PNG\r\n\x1a\n"


def _plan(pp: int = 1, microbatches: int = 1, model: str = "GPT2LMHeadModel") -> Plan:
    cluster = Cluster.preset("dgx-h100", nodes=1)
    est = Estimate(
        step_time_s=0.5,
        samples_per_s=128.0,
        mfu=0.41,
        memory=MemoryEstimate(
            params=4e9, grads=4e9, optimizer=16e9, activations=20e9, buffers=1e9, peak=44e9
        ),
        memory_limit=80e9,
        compute_s=0.4,
        comm_s=0.15,
        exposed_comm_s=0.05,
        optimizer_s=0.03,
        bubble_s=0.02,
        collectives=[{"kind": "all_reduce", "axis": "dp", "bytes": 25e6, "count": 10, "time_s": 0.01}],
    )
    placements = {
        f"p_h_{i}_w": {
            "op": "placeholder",
            "module": f"h.{i}.mlp",
            "outputs": [["R", "S(0)"]],
            "inputs": [],
            "param": f"h.{i}.mlp.weight",
            "zero": 1,
        }
        for i in range(2)
    }
    placements["mm"] = {
        "op": "aten.mm.default",
        "module": "h.0.mlp",
        "outputs": [["S(0)", "S(1)"]],
        "inputs": [["S(0)", "R"], ["R", "S(1)"]],
        "recompute": "selective",
    }
    ops = OpRecords(
        axes=["dp", "tp"],
        records={
            "mm": OpRecord(
                op="aten.mm.default",
                module="h.0.mlp",
                phase="forward",
                flops=1e12,
                strategies=4,
                alternatives=[
                    OpAlternative("S(0),S(1)", ["S(0),R", "R,S(1)"], compute_s=1e-3, memory=1e6),
                    OpAlternative("S(0),R", ["S(0),R", "R,R"], compute_s=2e-3, memory=2e6),
                ],
                why="cheapest of its 4 allowed strategies",
            )
        },
    )
    return Plan(
        model=model,
        fingerprint="abc",
        num_params=7_000_000_000,
        cluster=cluster.to_dict(),
        cluster_description=cluster.describe(),
        mesh={"dp": 8 // (2 * pp) or 1, "tp": 2, "pp": pp},
        zero=1,
        microbatches=microbatches,
        global_batch_size=64,
        micro_batch_size=64 // microbatches,
        estimate=est,
        placements=placements,
        solver=SearchRecord(status="optimal", gap=0.0, candidates=3, ops=ops),
        warnings=["the fixed configuration needs a lot of memory"],
    )


def test_pictures_are_pngs(tmp_path):
    for pp in (1, 4):
        pngs = all_pngs(_plan(pp=pp, microbatches=8))
        assert set(pngs) == {"memory", "time", "pipeline"}
        assert all(b.startswith(PNG) and len(b) > 3000 for b in pngs.values())
    paths = save_pictures(_plan(), tmp_path / "pics")
    assert sorted(p.name for p in paths.values()) == ["memory.png", "pipeline.png", "time.png"]


def test_pipeline_schedule_is_1f1b():
    p, m = 4, 8
    sched = pipeline_schedule(_plan(pp=p, microbatches=m))
    assert len(sched) == 2 * p * m
    end = {(k, s, i): e for s, k, i, _, e in sched}
    start = {(k, s, i): b for s, k, i, b, _ in sched}
    for s, k, i, b, _ in sched:
        if k == "F" and s > 0:
            assert b >= end[("F", s - 1, i)] - 1e-12
        if k == "B":
            assert b >= end[("F", s, i)] - 1e-12
            if s < p - 1:
                assert b >= end[("B", s + 1, i)] - 1e-12
    # a stage never runs two things at once
    for s in range(p):
        spans = sorted((b, e) for st, _, _, b, e in sched if st == s)
        assert all(e0 <= b1 + 1e-12 for (_, e0), (b1, _) in zip(spans, spans[1:], strict=False))
    # the last stage starts its first backward right after its first forward (1F1B)
    assert start[("B", p - 1, 0)] == pytest.approx(end[("F", p - 1, 0)])
    assert pipeline_schedule(_plan(pp=1)) == []


def test_report_is_self_contained_with_tables_and_images(tmp_path):
    path = write_report(_plan(pp=2, microbatches=4), tmp_path / "sub" / "report.html")
    page = path.read_text()
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    # nothing fetched from anywhere: no http(s) src or href, no script, no external stylesheet
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page, re.I)
    assert "<script" not in page.lower() and "<link" not in page.lower()
    images = re.findall(r'<img [^>]*src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(images) == 3  # memory, time, pipeline (pp > 1)
    for heading in (
        "Configuration",
        "Memory per device",
        "Time per step",
        "Pipeline",
        "Sharding per layer",
        "Search",
    ):
        assert f"<h2>{heading}</h2>" in page, heading
    for needle in ("dp=2 x tp=2 x pp=2", "h.*.mlp.weight", "S(0),S(1)", "selective", "optimal", "all_reduce"):
        assert needle in page, needle
    assert "the fixed configuration needs a lot of memory" in page


def test_report_escapes_names_from_user_code():
    page = report_html(_plan(model="<script>alert(1)</script>"))
    assert "<script>" not in page and "&lt;script&gt;" in page


def test_report_of_a_real_plan_without_records(tmp_path):
    model, batch = mlp_tiny()
    plan = autopar.plan(model, batch, Cluster.local(4), precision="fp32", fixed={"pp": 1})
    page = write_report(plan, tmp_path / "mlp.html").read_text()
    assert "up.weight" in page and page.count("data:image/png;base64,") == 2  # no pipeline picture at pp=1
    assert "No pipeline" in page


@pytest.mark.skipif(
    not any(shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome")),
    reason="no Chromium on PATH (apt-get install -y chromium)",
)
def test_screenshot_in_headless_chromium(tmp_path):
    from matplotlib.image import imread

    plan_path = tmp_path / "plan.json"
    _plan(pp=2, microbatches=4).save(plan_path)
    out, html = tmp_path / "shot.png", tmp_path / "report.html"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "screenshot_report.py"),
            "--plan",
            str(plan_path),
            "--html",
            str(html),
            "--out",
            str(out),
            "--height",
            "1400",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    assert out.read_bytes().startswith(PNG)
    pixels = imread(out)
    assert pixels.shape[0] == 1400 and pixels.shape[1] == 1200
    # not a blank page: text, tables and the charts' colours
    colours = {tuple(px) for px in (pixels[::7, ::7, :3] * 255).astype(int).reshape(-1, 3).tolist()}
    assert len(colours) > 50
