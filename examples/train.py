"""Train a model under a saved plan, one process per device, launched by torchrun.

    autopar plan examples.models:gpt2_tiny --local 2 --precision bf16-mixed --json plan.json
    torchrun --standalone --nproc-per-node=2 examples/train.py --plan plan.json \\
        --model examples.models:gpt2_tiny --steps 20 --checkpoint ckpt --save-every 10
    torchrun --standalone --nproc-per-node=2 examples/train.py --plan plan.json \\
        --model examples.models:gpt2_tiny --steps 30 --checkpoint ckpt --resume

Every rank builds the model from ``--model`` (``module:factory``, where
``factory()`` returns ``(model, example_inputs)``, as ``autopar plan`` takes
it), and ``autopar.parallelize`` turns it into this rank's share of the plan on
the cluster the plan was made for (torchrun's environment names the rank; rank
0's weights are broadcast).  Each data-parallel rank reads only its part of every
batch: a ``DistributedSampler`` over the plan's data-parallel ranks (``pm.dp_size``
and ``pm.dp_rank``; the tensor-parallel and pipeline ranks of one data-parallel
rank read the same samples) feeds ``train_step(..., local_batch=True)``.

The data here are random samples shaped like the example inputs; a real job
puts its own ``Dataset`` in their place.  ``--checkpoint DIR`` saves the weights
and the optimizer state to ``DIR/step-NNNNNN`` every ``--save-every`` steps and
at the end (``pm.save``: each rank writes its shards, readable under any other
plan); ``--resume`` loads the latest of them and carries on from the next step,
the sampler where the interrupted run was.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import importlib
import logging
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import DataLoader, Dataset, DistributedSampler  # noqa: E402

import autopar  # noqa: E402

log = logging.getLogger("train")


class RandomSamples(Dataset):
    """``size`` samples shaped like one row of ``example`` (a tensor, a tuple or a dict of tensors, dim 0 the
    batch): integers below the example's largest (token ids, labels), normal floats; fixed by ``seed``."""

    def __init__(self, example, size: int, seed: int = 0) -> None:
        self.example, self.size, self.seed = example, size, seed

    def __len__(self) -> int:
        return self.size

    def _like(self, t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        if t.is_floating_point():
            return torch.randn(t.shape[1:], generator=gen, dtype=t.dtype)
        return torch.randint(0, int(t.max()) + 1, t.shape[1:], generator=gen, dtype=t.dtype)

    def __getitem__(self, i: int):
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        if isinstance(self.example, dict):
            return {k: self._like(v, gen) for k, v in self.example.items()}
        if isinstance(self.example, (tuple, list)):
            return tuple(self._like(v, gen) for v in self.example)
        return self._like(self.example, gen)


def _factory(spec: str):
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def _latest(checkpoints: Path) -> tuple[int, Path | None]:
    """The step and directory of the newest ``step-NNNNNN`` checkpoint under ``checkpoints`` (0, None: none)."""
    found = sorted(checkpoints.glob("step-*")) if checkpoints.is_dir() else []
    return (int(found[-1].name.removeprefix("step-")), found[-1]) if found else (0, None)


def train(argv: list[str] | None = None) -> None:
    """Parse the command line, build the model under its plan, and train it with its checkpoints."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--plan", required=True, help="plan.json written by `autopar plan --json` or Plan.save()")
    p.add_argument("--model", required=True, help="module:factory returning (model, example_inputs)")
    p.add_argument("--steps", type=int, default=100, help="train until this many optimizer steps in all")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--samples", type=int, default=4096, help="size of the random dataset")
    p.add_argument("--checkpoint", type=Path, help="directory of the step-NNNNNN checkpoints")
    p.add_argument("--save-every", type=int, default=0, help="save every N steps (and at the end)")
    p.add_argument("--resume", action="store_true", help="start from the newest checkpoint under --checkpoint")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    plan = autopar.Plan.load(args.plan)
    cluster = autopar.Cluster.from_dict(plan.cluster)
    torch.manual_seed(args.seed)
    model, example = _factory(args.model)()
    pm = autopar.parallelize(model, cluster, example, plan=plan)  # torchrun's RANK, WORLD_SIZE, LOCAL_RANK, ...
    opt = pm.make_optimizer(torch.optim.AdamW, lr=args.lr)

    start = 0
    if args.resume and args.checkpoint is not None:
        start, path = _latest(args.checkpoint)
        if path is not None:
            pm.load(path, opt)  # weights and optimizer state, whatever plan wrote them
    data = RandomSamples(example, args.samples, args.seed)
    sampler = DistributedSampler(data, num_replicas=pm.dp_size, rank=pm.dp_rank, seed=args.seed, drop_last=True)
    loader = DataLoader(data, batch_size=plan.global_batch_size // pm.dp_size, sampler=sampler, drop_last=True)
    per_epoch = len(loader)

    step = start
    for epoch in range(start // per_epoch, math.ceil(args.steps / per_epoch)):
        sampler.set_epoch(epoch)
        for k, batch in enumerate(loader):
            if epoch * per_epoch + k < start:
                continue  # consumed before the checkpoint: the resumed run reads what the whole run would
            if step == args.steps:
                break
            loss = pm.train_step(batch, local_batch=True)
            opt.step()
            opt.zero_grad()
            step += 1
            if dist.get_rank() == 0:
                log.info("step %d loss %.6f", step, float(loss))
            if args.checkpoint is not None and (step == args.steps or args.save_every and step % args.save_every == 0):
                pm.save(args.checkpoint / f"step-{step:06d}", opt)


def main(argv: list[str] | None = None) -> None:
    faulthandler.enable()  # a rank killed by a signal prints where it was
    train(argv)
    # Every rank's last collective is done before any rank closes its connections, and what the run
    # built is freed while the interpreter is whole, not by its finalization.
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()


if __name__ == "__main__":
    main()
