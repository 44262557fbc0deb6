"""A checkpoint's round trip through a parallel plan, checked against one device.

One device trains a step and saves; the plan loads that checkpoint on local
processes (into weights drawn otherwise, so the load must replace them), steps
once and saves; one device loads what the plan saved. Each hand-over must be
exact, and the plan's step must be one device's step: the check a placement
that changes how a checkpoint is cut (experts split over a mesh axis, a
sequence split) needs beside the training oracle of :mod:`autopar.verify.oracle`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from autopar.api.parallelizer import parallelize
from autopar.capture.joint import model_loss
from autopar.hardware.cluster import Cluster
from autopar.plans.plan import Plan
from autopar.runtime.checkpoint import load_single, save_single
from autopar.runtime.launch import launch
from autopar.verify.oracle import group_error

Factory = Callable[[], tuple[torch.nn.Module, Any]]


@dataclass
class RoundTrip:
    """What each hand-over of a round trip kept: the plan's load, its step against one device's, one device's load."""

    loaded_exactly: bool  # the plan's weights after loading are what one device saved, bit for bit
    step_error: float  # the relative error of the plan's step against one device's (oracle.group_error)
    worst: str  # the parameter furthest off
    reloaded_exactly: bool  # one device loads what the plan saved, bit for bit


def _resume(factory: Factory, cluster: Cluster, plan: dict, src: str, dst: str) -> tuple | None:
    """On each rank: load ``src`` into the plan, step once, save ``dst``; rank 0 returns (loaded, stepped)."""
    torch.manual_seed(0)
    _, batch = factory()
    torch.manual_seed(1)  # other weights than the checkpoint's: the load must replace them
    model, _ = factory()
    pm = parallelize(model, cluster, batch, plan=Plan.from_dict(plan))
    opt = pm.make_optimizer(torch.optim.AdamW, lr=1e-3)
    pm.load(src, opt)
    loaded = pm.full_state_dict()
    pm.train_step(batch)
    opt.step()
    opt.zero_grad()
    pm.save(dst, opt)
    stepped = pm.full_state_dict()
    return (loaded, stepped) if dist.get_rank() == 0 else None


def check_round_trip(factory: Factory, cluster: Cluster, plan: Plan, directory: str | Path) -> RoundTrip:
    """One device saves after a step of AdamW (lr 1e-3); ``plan`` loads, steps and saves under ``directory``;
    one device loads that. ``factory`` builds the model and its batch from the seed set before it."""
    src, dst = str(Path(directory) / "single"), str(Path(directory) / "plan")
    torch.manual_seed(0)
    _, batch = factory()
    model, _ = factory()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model_loss(model, batch, None).backward()
    opt.step()
    opt.zero_grad()
    save_single(model, src, opt)
    held = {n: t.detach().clone() for n, t in model.named_parameters()}
    model_loss(model, batch, None).backward()
    opt.step()
    after = {n: t.detach().clone() for n, t in model.named_parameters()}

    resume = functools.partial(_resume, factory, cluster)
    loaded, stepped = launch(resume, cluster, plan.to_dict(), src, dst, crash_retries=1)[0]
    err, worst = group_error(stepped, after)
    torch.manual_seed(2)
    fresh, _ = factory()
    load_single(fresh, dst, torch.optim.AdamW(fresh.parameters(), lr=1e-3))
    return RoundTrip(
        loaded_exactly=all(torch.equal(loaded[n], held[n]) for n in held),
        step_error=err,
        worst=worst,
        reloaded_exactly=all(torch.equal(t, stepped[n]) for n, t in fresh.named_parameters()),
    )
