"""Where a rank's tensors live: the cluster's device type, this process's device of that type.

The cluster names the collective backend, and the backend the device
(:attr:`autopar.hardware.cluster.Cluster.device_type`): NCCL moves CUDA
tensors, so under NCCL every shard, buffer, optimizer state and input of a
rank lives on ``cuda:LOCAL_RANK`` (torchrun's local rank, the GPU of this
process on its node); under gloo on the CPU.  The runtime moves every tensor it
is handed (the model's weights and buffers, each batch) with :func:`on_device`,
so that the device is decided here and nowhere else.
"""

from __future__ import annotations

import os

import torch

from autopar.core.errors import RuntimeMismatchError
from autopar.hardware.cluster import Cluster


def rank_device(cluster: Cluster) -> torch.device:
    """This rank's device on ``cluster``: ``cuda:LOCAL_RANK`` under NCCL, the CPU under gloo.

    Raises a one-line :class:`RuntimeMismatchError` when the cluster asks for
    CUDA on a machine without it, before any process group is started.
    """
    kind = cluster.device_type
    if kind != "cuda":
        return torch.device(kind)
    if not torch.cuda.is_available():
        raise RuntimeMismatchError(
            f"the cluster runs {cluster.backend}, which needs CUDA, but this machine has no CUDA device "
            "(torch.cuda.is_available() is False); run on the GPUs, "
            "or use Cluster.local(n) for CPU processes over gloo"
        )
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def on_device(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t`` on ``device`` (in ``dtype`` if given): a copy where it was elsewhere, ``t`` itself where it was not."""
    return t.to(device=device, dtype=dtype if dtype is not None else t.dtype)
