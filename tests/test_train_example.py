"""examples/train.py under torchrun: a saved plan trains, checkpoints, and resumes where it stopped.

Slow: two ``torchrun --standalone --nproc-per-node=2`` jobs of the README's
command (bf16-mixed, dp 2, ZeRO-1, each rank fed its part of the batch by a
DistributedSampler) on the tiny MLP, which its ranks build and capture in a
few seconds (GPT-2's processes would import transformers first).  The first trains 4 steps and saves after steps 2
and 4; the second resumes from the step-2 checkpoint and trains steps 3 and 4
again.  A resumed run must be the run that was not interrupted: the same losses
and, bit for bit, the same weights and optimizer state in its last checkpoint.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import autopar
from autopar.runtime.checkpoint import load_single
from examples.models import mlp_tiny

ROOT = Path(__file__).resolve().parent.parent


def _torchrun(plan: Path, checkpoint: Path, *extra: str) -> dict[int, str]:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        str(ROOT / "examples" / "train.py"), "--plan", str(plan), "--model", "examples.models:mlp_tiny",
        "--steps", "4", "--samples", "64", "--checkpoint", str(checkpoint), "--save-every", "2", *extra,
    ]  # fmt: skip
    before = set(checkpoint.iterdir()) if checkpoint.exists() else set()
    for attempt in range(2):
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
        # a rank killed by a signal runs the job once more, from the checkpoints it started with, as
        # autopar.launch(crash_retries=1) does for its own jobs: torch's gloo backend on rare occasions aborts a
        # process (scripts/gloo_inflight_repro.py)
        if done.returncode == 0 or attempt or not re.search(r"\(SIG(ABRT|SEGV|BUS)\)", done.stderr):
            break
        warnings.warn(f"a rank was killed by a signal; running the job again: {done.stderr[-600:]}", stacklevel=2)
        for written in set(checkpoint.iterdir()) - before if checkpoint.exists() else ():
            shutil.rmtree(written)
    assert done.returncode == 0, done.stderr[-3000:]
    return {int(s): loss for s, loss in re.findall(r"step (\d+) loss (\S+)", done.stdout + done.stderr)}


def _saved(path: Path) -> dict[str, torch.Tensor]:
    model, _ = mlp_tiny()
    opt = torch.optim.AdamW(model.parameters())
    load_single(model, path, opt)
    state = {f"optim.{k}": v for k, v in opt.state_dict()["state"].items()}
    return {**model.state_dict(), **{f"{k}.{n}": t for k, s in state.items() for n, t in s.items()}}


@pytest.mark.slow
def test_torchrun_trains_a_saved_plan_and_resumes_from_its_checkpoint(tmp_path):
    model, batch = mlp_tiny()
    plan = autopar.plan(model, batch, autopar.Cluster.local(2), fixed={"dp": 2, "zero": 1}, precision="bf16-mixed")
    plan.save(tmp_path / "plan.json")
    whole = _torchrun(tmp_path / "plan.json", tmp_path / "whole")
    assert sorted(whole) == [1, 2, 3, 4] and len(set(whole.values())) == 4
    (tmp_path / "resumed").mkdir()
    shutil.copytree(tmp_path / "whole" / "step-000002", tmp_path / "resumed" / "step-000002")
    resumed = _torchrun(tmp_path / "plan.json", tmp_path / "resumed", "--resume")
    assert resumed == {3: whole[3], 4: whole[4]}
    a, b = _saved(tmp_path / "whole" / "step-000004"), _saved(tmp_path / "resumed" / "step-000004")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
