"""Pictures of a plan: memory per device, the time of a step, the pipeline timeline.

A table gives numbers; a bar shows at a glance whether memory is nearly
full and what a step's time goes to. Figures are built with matplotlib's
object API on the Agg canvas (no pyplot, no display, no global state), so
they draw the same in a test, a server or a notebook, and ``to_png`` turns
one into bytes that an HTML report embeds.
"""

from __future__ import annotations

import io
import logging
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from autopar.cost_models.schedule import schedule_actions
from autopar.plans.data import PlanData

log = logging.getLogger(__name__)

MEMORY_COLORS = {
    "params": "#4C72B0",
    "grads": "#55A868",
    "optimizer": "#C44E52",
    "activations": "#DD8452",
    "buffers": "#8172B3",
}
TIME_COLORS = {
    "compute": "#4C72B0",
    "exposed communication": "#C44E52",
    "optimizer": "#55A868",
    "pipeline bubble": "#BBBBBB",
    "hidden communication": "#F2B5B5",
}
# a limit this many times the peak would squash the bars to nothing: draw it off scale instead
OFF_SCALE = 8.0


def to_png(fig: Figure, dpi: int = 100) -> bytes:
    """The figure as PNG bytes."""
    buf = io.BytesIO()
    FigureCanvasAgg(fig)
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    return buf.getvalue()


def _figure(height: float, width: float = 8.0) -> Figure:
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig


def _byte_unit(x: float) -> tuple[str, float]:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if x >= scale:
            return unit, scale
    return "B", 1.0


def _time_unit(x: float) -> tuple[str, float]:
    if x >= 1:
        return "s", 1.0
    if x >= 1e-3:
        return "ms", 1e-3
    return "us", 1e-6


def memory_figure(plan: PlanData) -> Figure:
    """Memory per device by category (stacked), the estimated peak and the device's limit.

    One bar per pipeline stage when the plan's stages carry their own memory, else one
    bar for every device (all devices hold the same under data and tensor parallelism).
    """
    est = plan.estimate
    bars = _memory_bars(plan)
    peak = max(p for _, _, p in bars) if bars else 0.0
    limit = est.memory_limit
    off_scale = bool(limit) and peak > 0 and limit > OFF_SCALE * peak
    top = max(peak, max(sum(c.values()) for _, c, _ in bars) if bars else 0.0)
    if not off_scale:
        top = max(top, limit)
    unit, scale = _byte_unit(top or 1.0)
    fig = _figure(1.3 + 0.45 * len(bars))
    ax = fig.add_subplot()
    labels = [label for label, _, _ in bars]
    for y, (_, cats, p) in enumerate(bars):
        left = 0.0
        for cat, color in MEMORY_COLORS.items():
            v = cats.get(cat, 0.0) / scale
            ax.barh(y, v, left=left, color=color, height=0.6, label=cat if y == 0 else None)
            left += v
        ax.plot(
            [p / scale] * 2,
            [y - 0.38, y + 0.38],
            color="black",
            linewidth=2,
            label="peak" if y == 0 else None,
        )
        ax.text(p / scale, y + 0.42, f" peak {p / scale:.3g} {unit}", va="bottom", fontsize=8)
    if limit and not off_scale:
        ax.axvline(
            limit / scale,
            color="#D62728",
            linestyle="--",
            linewidth=1.5,
            label=f"limit {limit / scale:.3g} {unit}",
        )
    elif limit:
        lu, ls = _byte_unit(limit)
        ax.set_title(
            f"limit {limit / ls:.3g} {lu} per device (off scale: peak is {peak / limit * 100:.2g}% of it)",
            fontsize=9,
        )
    ax.set_yticks(range(len(bars)), labels)
    ax.set_ylim(-0.7, len(bars) - 0.1)
    ax.set_xlabel(f"memory per device ({unit})")
    ax.set_xlim(0, (top / scale) * 1.15 or 1)
    fits = "fits" if est.fits else "does NOT fit"
    fig.suptitle(f"Memory per device: {fits}", fontsize=11, x=0.01, ha="left")
    ax.legend(
        loc="upper center",
        bbox_to_anchor=(0.5, -0.35 - 0.1 / max(len(bars), 1)),
        ncol=7,
        fontsize=8,
        frameon=False,
    )
    return fig


def _memory_bars(plan: PlanData) -> list[tuple[str, dict[str, float], float]]:
    mem = plan.estimate.memory
    per_stage = []
    for i, st in enumerate(plan.stages):
        m = st.get("memory") if isinstance(st, dict) else None
        if isinstance(m, dict):
            cats = {k: float(m.get(k, 0.0)) for k in MEMORY_COLORS}
            per_stage.append((f"stage {i}", cats, float(m.get("peak", sum(cats.values())))))
    if per_stage:
        return per_stage
    cats = {k: float(getattr(mem, k)) for k in MEMORY_COLORS}
    return [("each device", cats, float(mem.peak or sum(cats.values())))]


def time_figure(plan: PlanData) -> Figure:
    """Where a step's time goes: compute, exposed communication, optimizer, pipeline bubble.

    A second bar shows all communication, split into the part compute hides and the
    part it does not (the exposed part is in the step).
    """
    est = plan.estimate
    parts = {
        "compute": est.compute_s,
        "exposed communication": est.exposed_comm_s,
        "optimizer": est.optimizer_s,
        "pipeline bubble": est.bubble_s,
    }
    step = est.step_time_s or sum(parts.values())
    unit, scale = _time_unit(max(step, est.comm_s) or 1.0)
    fig = _figure(2.4)
    ax = fig.add_subplot()
    left = 0.0
    for name, v in parts.items():
        ax.barh(1, v / scale, left=left, color=TIME_COLORS[name], height=0.6, label=name)
        if step and v / step > 0.08:
            ax.text(
                left + v / scale / 2,
                1,
                f"{v / scale:.3g}",
                ha="center",
                va="center",
                fontsize=8,
                color="white",
            )
        left += v / scale
    hidden = max(est.comm_s - est.exposed_comm_s, 0.0)
    ax.barh(0, est.exposed_comm_s / scale, color=TIME_COLORS["exposed communication"], height=0.6)
    ax.barh(
        0,
        hidden / scale,
        left=est.exposed_comm_s / scale,
        color=TIME_COLORS["hidden communication"],
        height=0.6,
        label="hidden communication",
    )
    ax.set_yticks([0, 1], ["communication", "step"])
    ax.set_xlabel(f"time per step ({unit})")
    ax.set_xlim(0, max(step, est.comm_s) / scale * 1.1 or 1)
    other = sum(parts.values())
    title = (
        f"Step time {step / scale:.3g} {unit}: {est.samples_per_s:,.1f} samples/s, MFU {est.mfu * 100:.1f}%"
    )
    if est.hfu_differs:
        title += f", HFU {est.hfu * 100:.1f}%"
    if step and abs(other - step) > 0.02 * step:
        title += f" (parts sum to {other / scale:.3g} {unit})"
    fig.suptitle(title, fontsize=11, x=0.01, ha="left")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.32), ncol=5, fontsize=8, frameon=False)
    return fig


def pipeline_schedule(plan: PlanData) -> list[tuple[int, str, int, float, float]]:
    """(stage, "F" | "B", micro-batch, start, end) of the plan's schedule; empty without a pipeline.

    The order of work on each device is the one the runtime runs: the actions
    of torch.distributed.pipelining's schedule for the plan's schedule (GPipe,
    1F1B, interleaved 1F1B; :func:`autopar.cost_models.schedule.schedule_actions`).
    A forward waits for the previous stage's forward of its micro-batch, a
    backward for the next stage's backward and its own forward.  Per-stage times
    come from the stages (``forward_s`` / ``backward_s``); a stage without them
    gets an even share of the step's compute, backward twice the forward.
    """
    pp = int(plan.mesh.get("pp", 1))
    if pp <= 1:
        return []
    n = max(len(plan.stages), pp)
    m = max(int(plan.microbatches), 1)
    even = plan.estimate.compute_s / (n * m) if plan.estimate.compute_s else 1.0
    fwd, bwd = [], []
    for s in range(n):
        st = plan.stages[s] if s < len(plan.stages) and isinstance(plan.stages[s], dict) else {}
        fwd.append(float(st.get("forward_s", even / 3)))
        bwd.append(float(st.get("backward_s", 2 * even / 3)))
    actions = schedule_actions(plan.schedule or "1F1B", pp, n, m)
    kinds = {"F": "F", "B": "B"}  # the compute actions: forward, full backward
    orders = [
        [
            (kinds[a.computation_type.value], a.stage_index, a.microbatch_index)
            for a in actions[r]
            if a.computation_type.value in kinds
        ]
        for r in range(pp)
    ]
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * pp
    pos = [0] * pp
    out = []
    progress = True
    while progress:
        progress = False
        for r in range(pp):
            while pos[r] < len(orders[r]):
                kind, s, i = orders[r][pos[r]]
                if kind == "F":
                    dep = done.get(("F", s - 1, i)) if s > 0 else 0.0
                else:
                    later = done.get(("B", s + 1, i)) if s < n - 1 else 0.0
                    dep = None if later is None or ("F", s, i) not in done else max(later, done[("F", s, i)])
                if dep is None:
                    break
                begin = max(free[r], dep)
                stop = begin + (fwd[s] if kind == "F" else bwd[s])
                done[(kind, s, i)] = stop
                free[r] = stop
                out.append((s, kind, i, begin, stop))
                pos[r] += 1
                progress = True
    return out


def pipeline_figure(plan: PlanData) -> Figure:
    """The pipeline timeline: one row per device, a box per stage's forward and backward of a micro-batch.

    Without a pipeline (pp = 1) a placeholder says so.
    """
    sched = pipeline_schedule(plan)
    if not sched:
        fig = _figure(1.2)
        fig.text(
            0.5,
            0.5,
            f"no pipeline (pp=1): every device runs the whole model; {plan.microbatches} micro-batch(es) per step",
            ha="center",
            va="center",
            fontsize=10,
            color="#555555",
        )
        return fig
    pp = int(plan.mesh.get("pp", 1))
    end = max(e for *_, e in sched)
    unit, scale = _time_unit(end)
    fig = _figure(0.9 + 0.4 * pp)
    ax = fig.add_subplot()
    for s, kind, i, start, stop in sched:
        color = "#4C72B0" if kind == "F" else "#DD8452"
        ax.barh(
            s % pp, (stop - start) / scale, left=start / scale, color=color, edgecolor="white", height=0.8
        )
        if (stop - start) / end > 0.02:
            label = str(i) if len(plan.stages) <= pp else f"{i}:{s}"
            ax.text(
                (start + stop) / 2 / scale, s % pp, label, ha="center", va="center", fontsize=7, color="white"
            )
    ax.set_yticks(range(pp), [f"device {d}" for d in range(pp)])
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({unit})")
    busy = sum(stop - start for *_, start, stop in sched)
    bubble = 1 - busy / (pp * end) if end else 0.0
    stages = max(len(plan.stages), pp)
    fig.suptitle(
        f"Pipeline ({plan.schedule or '1F1B'}): {stages} stages on {pp} devices, {plan.microbatches} "
        f"micro-batches, idle {bubble * 100:.0f}%  (blue forward, orange backward; label: micro-batch"
        f"{'' if stages == pp else ':stage'})",
        fontsize=10,
        x=0.01,
        ha="left",
    )
    return fig


def save_pictures(plan: PlanData, directory: str | Path) -> dict[str, Path]:
    """Write memory.png, time.png and pipeline.png into ``directory``; returns their paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, make in (("memory", memory_figure), ("time", time_figure), ("pipeline", pipeline_figure)):
        path = directory / f"{name}.png"
        path.write_bytes(to_png(make(plan)))
        out[name] = path
    log.info("wrote %s", ", ".join(str(p) for p in out.values()))
    return out


def all_pngs(plan: PlanData) -> dict[str, bytes]:
    """The three pictures as PNG bytes, by name (what the HTML report embeds)."""
    return {
        "memory": to_png(memory_figure(plan)),
        "time": to_png(time_figure(plan)),
        "pipeline": to_png(pipeline_figure(plan)),
    }
