"""The device a rank's tensors live on comes from the cluster, and every tensor goes there.

This machine has no GPU, so the device-independent logic is checked on the
CPU: the device each cluster names, the one-line refusal of NCCL without CUDA,
and, on torch's fake process group, that a rank's parameters, buffers, ZeRO
chunks, inputs, gradients, optimizer state and loss all follow the rank's
device wherever it is: the meta device stands in for ``cuda:LOCAL_RANK``
(it holds no data, so the weights are not broadcast).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import autopar
from autopar.api import parallelizer
from autopar.runtime.device import on_device, rank_device
from autopar.verify.oracle import plan_with_pipeline
from examples.models import mlp_deep, mlp_tiny

GPUS = autopar.Cluster(nodes=1, gpus_per_node=2, device="A100-80GB")  # NCCL


def test_the_cluster_names_the_device_type():
    assert GPUS.backend == "nccl" and GPUS.device_type == "cuda"
    assert autopar.Cluster.local(2).device_type == "cpu"
    assert autopar.Cluster(nodes=1, gpus_per_node=2, device="A100-80GB", backend="gloo").device_type == "cpu"


def test_a_rank_under_nccl_takes_the_gpu_of_its_local_rank(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert rank_device(GPUS) == torch.device("cuda", 3)
    assert rank_device(autopar.Cluster.local(4)) == torch.device("cpu")


def test_nccl_without_cuda_fails_at_once_in_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model, batch = mlp_tiny()
    plan = autopar.plan(model, batch, GPUS, precision="fp32", fixed={"dp": 2})
    with pytest.raises(autopar.RuntimeMismatchError) as err:
        autopar.parallelize(model, GPUS, batch, plan=plan)  # no process group, no RANK: the device is checked first
    assert "no CUDA device" in str(err.value) and "\n" not in str(err.value)


def test_on_device_moves_only_what_is_elsewhere():
    t = torch.ones(3)
    assert on_device(t, torch.device("cpu")) is t
    assert on_device(t, torch.device("meta")).device.type == "meta"
    assert on_device(t, torch.device("cpu"), torch.bfloat16).dtype == torch.bfloat16


@pytest.fixture
def meta_ranks(monkeypatch):
    """Rank 0 of a fake 4-rank job whose device is the meta device."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    monkeypatch.setattr(parallelizer, "rank_device", lambda cluster: torch.device("meta"))
    monkeypatch.setattr(parallelizer, "_broadcast_weights", lambda model, device: None)
    yield
    dist.destroy_process_group()


def _off_device(tensors) -> list[str]:
    return [f"{tuple(t.shape)} on {t.device}" for t in tensors if t.device.type != "meta"]


def test_every_tensor_of_a_rank_lives_on_its_device(meta_ranks):
    torch.manual_seed(0)
    model, batch = mlp_deep()
    four = autopar.Cluster.local(4)
    zero1 = autopar.plan(model, batch, four, fixed={"dp": 4, "zero": 1}, precision="bf16-mixed")
    fp16 = autopar.plan(model, batch, four, fixed={"dp": 4}, precision="fp16-mixed")
    pipeline = plan_with_pipeline(fp16, model, batch, four, 2, microbatches=2)
    for plan in (zero1, pipeline):
        pm = autopar.parallelize(model, four, batch, plan=plan)
        opt = pm.make_optimizer(torch.optim.AdamW, lr=1e-3)
        loss = pm.train_step(batch)  # the batch is on the CPU: the rank moves it
        held = [*pm.parameters(), *pm.buffers(), *(pm._zero.chunks if pm._zero is not None else [])]
        stepped = [p for group in opt.param_groups for p in group["params"]]
        assert not _off_device([loss, *held, *(p.grad for p in stepped if p.grad is not None)])
        assert all(p.grad is not None for p in stepped)
        if plan is zero1:
            opt.step()  # fp16's step reads its overflow flag back, which a meta tensor cannot give
            state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim()]
            assert state and not _off_device(state)  # torch keeps AdamW's step counter on the CPU, as on GPUs
        else:
            assert not _off_device(pm._scale_args())  # the loss scale the backward starts from
