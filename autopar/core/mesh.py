"""Device meshes as shapes: the axis names plans use, and a mesh DTensor's rules can read with no process group."""

from __future__ import annotations

import math

import torch
from torch.distributed.device_mesh import DeviceMesh

MESH_AXES = ("dp", "tp", "pp")
"""A plan's mesh axes, outermost first: data, tensor and pipeline parallel."""

SHARDING_AXES = ("dp", "tp")
"""The mesh axes a per-op placement list covers, in its order (a pipeline stage's mesh)."""

SHARED_AXES = ("ep", "cp")
"""Names a plan's mesh gives to splits over the ranks of its axes, not axes of their own: ``ep``, the
experts' split (over the ranks of dp, or of the second axis beside dp, as DeepSpeed-MoE and Megatron-Core
share them); ``cp``, the sequence's split in attention (context parallelism, over the same ranks).
They add no devices."""


def world_size(mesh: dict[str, int]) -> int:
    """The devices a plan's mesh spans: the product of its axes (:data:`MESH_AXES`), shared names left out."""
    return math.prod(int(mesh.get(a, 1)) for a in MESH_AXES)


def fake_mesh(mesh_shape: tuple[int, ...], mesh_dim_names: tuple[str, ...]) -> DeviceMesh:
    """A DeviceMesh that is only a shape, for DTensor's rules.

    Built with ``_init_backend=False`` and ``_rank=0``: it creates no process group
    and reads none, so it works with no ``torch.distributed`` at all (planning on a
    laptop) and leaves a launched job's real process group alone.  DTensor's
    strategy functions only ask a mesh for its shape.
    """
    n = math.prod(mesh_shape)
    ranks = torch.arange(n, dtype=torch.int).reshape(mesh_shape)
    return DeviceMesh("cpu", ranks, mesh_dim_names=mesh_dim_names, _init_backend=False, _rank=0)
