"""Device meshes as shapes: the axis names plans use, and a mesh DTensor's rules can read with no process group."""

from __future__ import annotations

import math

import torch
from torch.distributed.device_mesh import DeviceMesh

MESH_AXES = ("dp", "tp", "pp")
"""A plan's mesh axes, outermost first: data, tensor and pipeline parallel."""

SHARDING_AXES = ("dp", "tp")
"""The mesh axes a per-op placement list covers, in its order (a pipeline stage's mesh)."""


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
