"""Clusters, links and mesh shapes: the hardware side of a plan (devices are in devices.py).

A plan is costed for a cluster the user may not have yet, so everything here
is plain data with cited figures, never a probe of local hardware. The solver
side imports this module, so it must stay free of torch.

Units: FLOP/s, bytes, bytes/s and seconds throughout. "GB" means 1e9 bytes,
both for bandwidth (450 GB/s = 450e9 bytes/s) and for device memory
(80 GB = 80e9 bytes). Vendors quote HBM capacity in GB of 1e9 bytes and the
ZeRO paper counts per-device memory the same way, so worked examples from
either can be checked against this module without a 1.074 fudge factor.

Rank layout is Megatron-LM's: tensor parallel innermost (stride 1), then data
parallel (stride tp), then pipeline parallel outermost (stride tp·dp). Keeping
tp innermost puts a tensor-parallel group, which talks on every layer, inside
one NVLink domain whenever it fits.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Any

from autopar.core.errors import ClusterError
from autopar.core.mesh import MESH_AXES
from autopar.hardware.devices import (  # noqa: F401  (re-exported: cluster is where users look for devices)
    DEVICES,
    GB,
    DeviceSpec,
    _alias_key,
    _positive_int,
    _positive_number,
    get_device,
)

logger = logging.getLogger(__name__)

BACKENDS = ("nccl", "gloo")
"""Collective backends a cluster may name."""

NCCL_BASE_LATENCY_S = 8.4e-6
"""What NCCL's tuning model charges once per ring collective with its Simple protocol, the one large
messages take (``baseLatencies``, Ring/Simple, in src/graph/tuning.cc of NVIDIA/nccl at
5067397c2676d5aed50042fc39e5c8ee96eb0027); its per-hop latencies are the devices' link latencies."""

# --------------------------------------------------------------------------- links and meshes


@dataclass(frozen=True)
class Link:
    """What one mesh axis's collectives run over.

    ``bandwidth`` is bytes/s per GPU per direction, the figure the ring
    formulas in ``cost_models.comm`` divide by. An axis of size 1 gets an
    infinite, zero-latency link named "local", so its collectives cost 0.

    A ring's latency is paid per hop: ``latency_s`` a hop on this link. A group
    that spans nodes has ``ranks_per_node`` of its ranks in each node, and the
    hops between those run inside the node at ``intra_latency_s`` (None: every hop
    at ``latency_s``); ``base_latency_s`` is paid once per collective (NCCL's
    launch and setup).
    """

    bandwidth: float
    latency_s: float
    name: str
    """"nvlink", "infiniband", "gloo", or "local" for an axis of size 1."""
    intra_node: bool
    base_latency_s: float = 0.0
    intra_latency_s: float | None = None
    ranks_per_node: int = 1
    intra_bandwidth: float | None = None


LOCAL_LINK = Link(bandwidth=math.inf, latency_s=0.0, name="local", intra_node=True)
"""The link of an axis of size 1: nothing to send."""



@dataclass(frozen=True)
class MeshShape:
    """Sizes of the data-, tensor- and pipeline-parallel axes; dp·tp·pp devices in all."""

    dp: int
    tp: int
    pp: int

    def __post_init__(self) -> None:
        for axis in MESH_AXES:
            _positive_int(getattr(self, axis), axis)

    @property
    def size(self) -> int:
        """Number of devices the mesh spans."""
        return self.dp * self.tp * self.pp

    def axis_size(self, axis: str) -> int:
        """Size of ``axis`` ("dp", "tp" or "pp")."""
        _check_axis(axis)
        return getattr(self, axis)

    def stride(self, axis: str) -> int:
        """Rank distance between neighbours on ``axis`` in Megatron's layout (tp innermost, pp outermost)."""
        _check_axis(axis)
        return {"tp": 1, "dp": self.tp, "pp": self.tp * self.dp}[axis]

    def to_dict(self) -> dict[str, int]:
        """Plain dict for plan files."""
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp}

    def __str__(self) -> str:
        return f"dp={self.dp} x tp={self.tp} x pp={self.pp}"


def _check_axis(axis: str) -> None:
    if axis not in MESH_AXES:
        raise ClusterError(f"unknown mesh axis {axis!r}; use one of {', '.join(MESH_AXES)}")


def _divisors(n: int) -> list[int]:
    """Divisors of ``n`` in increasing order (trial division: n is a device count)."""
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


# --------------------------------------------------------------------------- cluster

_PRESETS: dict[str, str] = {
    "dgx-v100": "V100-32GB",
    "dgx-a100": "A100-80GB",
    "dgx-a100-80gb": "A100-80GB",
    "dgx-a100-40gb": "A100-40GB",
    "dgx-h100": "H100-80GB",
    "dgx-h200": "H200-141GB",
    "h200": "H200-141GB",
    "dgx-b200": "B200",
    "b200": "B200",
}
PRESETS: tuple[str, ...] = tuple(_PRESETS)
"""Names :meth:`Cluster.preset` accepts; each is 8 GPUs per node."""


@dataclass
class Cluster:
    """A homogeneous cluster: ``nodes`` x ``gpus_per_node`` devices of one kind.

    Links and memory left as None are filled from the device table when the
    cluster is built, so ``to_dict`` records the figures a plan was costed
    with even if the table changes later. Build a new Cluster (rather than
    ``dataclasses.replace(..., device=...)``) to change the device, or the
    old device's figures stay.
    """

    nodes: int = 1
    gpus_per_node: int = 8
    device: str | DeviceSpec = "A100-80GB"
    intra_node_bandwidth: float | None = None
    inter_node_bandwidth: float | None = None
    memory_bytes: int | None = None
    backend: str | None = None
    """"nccl" or "gloo"; None picks gloo for the "cpu" device and nccl otherwise."""
    _spec: DeviceSpec = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _positive_int(self.nodes, "nodes")
        _positive_int(self.gpus_per_node, "gpus_per_node")
        spec = get_device(self.device)
        self._spec = spec
        # Canonical name for built-ins so "h100" and "H100-80GB" compare equal.
        if isinstance(self.device, str):
            self.device = spec.name
        if self.intra_node_bandwidth is None:
            self.intra_node_bandwidth = spec.intra_node_bandwidth
        self.intra_node_bandwidth = _positive_number(self.intra_node_bandwidth, "intra_node_bandwidth")
        if self.inter_node_bandwidth is None:
            self.inter_node_bandwidth = spec.inter_node_bandwidth
        self.inter_node_bandwidth = _positive_number(self.inter_node_bandwidth, "inter_node_bandwidth")
        if self.memory_bytes is None:
            self.memory_bytes = spec.memory_bytes
        if isinstance(self.memory_bytes, float) and self.memory_bytes.is_integer():
            self.memory_bytes = int(self.memory_bytes)
        _positive_int(self.memory_bytes, "memory_bytes")
        if self.backend is None:
            self.backend = "gloo" if spec.name == "cpu" else "nccl"
        if self.backend not in BACKENDS:
            raise ClusterError(f"unknown backend {self.backend!r}; use one of {', '.join(BACKENDS)}")
        if spec.name == "cpu" and self.backend != "gloo":
            raise ClusterError(
                "device 'cpu' cannot use backend 'nccl'; pass backend='gloo' (or leave it None)"
            )

    @property
    def device_type(self) -> str:
        """The torch device type a rank's tensors live on: "cuda" under NCCL, "cpu" under gloo.

        The one place the runtime's device comes from (:func:`autopar.runtime.device.rank_device`).
        """
        return "cuda" if self.backend == "nccl" else "cpu"

    # ---- construction

    @classmethod
    def preset(cls, name: str, nodes: int = 1) -> Cluster:
        """A DGX-style cluster: ``nodes`` nodes of 8 GPUs, NVLink inside, InfiniBand between."""
        device = _PRESETS.get(_alias_key(name)) if isinstance(name, str) else None
        if device is None:
            raise ClusterError(f"unknown cluster preset {name!r}; use one of {', '.join(PRESETS)}")
        return cls(nodes=nodes, gpus_per_node=8, device=device)

    @classmethod
    def local(cls, n: int) -> Cluster:
        """``n`` CPU processes on one machine over gloo: what tests and dry runs launch."""
        _positive_int(n, "n")
        return cls(nodes=1, gpus_per_node=n, device="cpu", backend="gloo")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict; ``Cluster.from_dict(c.to_dict()) == c``."""
        device = self.device.to_dict() if isinstance(self.device, DeviceSpec) else self.device
        return {
            "nodes": self.nodes,
            "gpus_per_node": self.gpus_per_node,
            "device": device,
            "intra_node_bandwidth": self.intra_node_bandwidth,
            "inter_node_bandwidth": self.inter_node_bandwidth,
            "memory_bytes": self.memory_bytes,
            "backend": self.backend,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Cluster:
        """Inverse of :meth:`to_dict`; a dict ``device`` is a custom DeviceSpec."""
        if not isinstance(d, dict):
            raise ClusterError(
                f"cluster description must be a dict, got {type(d).__name__}; pass Cluster.to_dict()"
            )
        known = {
            "nodes",
            "gpus_per_node",
            "device",
            "intra_node_bandwidth",
            "inter_node_bandwidth",
            "memory_bytes",
            "backend",
        }
        extra = sorted(set(d) - known)
        if extra:
            raise ClusterError(
                f"unknown cluster keys {', '.join(extra)}; use only {', '.join(sorted(known))}"
            )
        kwargs = dict(d)
        if isinstance(kwargs.get("device"), dict):
            kwargs["device"] = DeviceSpec.from_dict(kwargs["device"])
        return cls(**kwargs)

    # ---- figures

    @property
    def world_size(self) -> int:
        """Number of devices (ranks) in the cluster."""
        return self.nodes * self.gpus_per_node

    @property
    def device_spec(self) -> DeviceSpec:
        """The device's peak figures (the cluster's own link and memory overrides are on the Cluster)."""
        return self._spec

    @property
    def intra_node_link(self) -> Link:
        """Link between two ranks of one node."""
        if self.backend == "gloo":
            return Link(self.intra_node_bandwidth, self._spec.intra_node_latency_s, "gloo", True)
        return Link(
            self.intra_node_bandwidth, self._spec.intra_node_latency_s, "nvlink", True, NCCL_BASE_LATENCY_S
        )

    @property
    def inter_node_link(self) -> Link:
        """Link between ranks of different nodes (every hop of a group across nodes at the inter-node latency)."""
        if self.backend == "gloo":
            return Link(self.inter_node_bandwidth, self._spec.inter_node_latency_s, "gloo", False)
        return Link(
            self.inter_node_bandwidth, self._spec.inter_node_latency_s, "infiniband", False, NCCL_BASE_LATENCY_S
        )

    def describe(self) -> str:
        """One line a person reads, e.g. "8 nodes x 8 H100-80GB (64 devices), NVLink 450 GB/s in a node, 50 GB/s between"."""
        nodes = f"{self.nodes} node{'s' if self.nodes != 1 else ''}"
        link = "gloo" if self.backend == "gloo" else "NVLink"
        text = (
            f"{nodes} x {self.gpus_per_node} {self._spec.name} ({self.world_size} devices), "
            f"{link} {self.intra_node_bandwidth / GB:g} GB/s in a node"
        )
        if self.nodes > 1:
            text += f", {self.inter_node_bandwidth / GB:g} GB/s between"
        return text

    # ---- meshes

    def mesh_shapes(self, max_tp: int | None = None, max_pp: int | None = None) -> list[MeshShape]:
        """Every (dp, tp, pp) with dp·tp·pp == world_size, ordered by pp then tp.

        The planner's outer loop walks this list, so it is exhaustive; bounds
        prune shapes a user rules out (e.g. tp beyond one node).
        """
        if max_tp is not None:
            _positive_int(max_tp, "max_tp")
        if max_pp is not None:
            _positive_int(max_pp, "max_pp")
        world = self.world_size
        shapes = []
        for pp in _divisors(world):
            if max_pp is not None and pp > max_pp:
                continue
            for tp in _divisors(world // pp):
                if max_tp is not None and tp > max_tp:
                    continue
                shapes.append(MeshShape(dp=world // (pp * tp), tp=tp, pp=pp))
        return shapes

    def check_mesh(self, dp: int | None = None, tp: int = 1, pp: int = 1) -> MeshShape:
        """Validate a mesh for this cluster; ``dp=None`` takes whatever tp and pp leave."""
        tp = _positive_int(tp, "tp")
        pp = _positive_int(pp, "pp")
        world = self.world_size
        if dp is None:
            if world % (tp * pp) != 0:
                raise ClusterError(
                    f"mesh tp={tp} x pp={pp} = {tp * pp} devices does not divide the cluster's {world} devices; "
                    f"choose tp and pp whose product divides {world}"
                )
            dp = world // (tp * pp)
        dp = _positive_int(dp, "dp")
        if dp * tp * pp != world:
            raise ClusterError(
                f"mesh dp={dp} x tp={tp} x pp={pp} = {dp * tp * pp} devices does not match the cluster's "
                f"{world} devices; choose sizes whose product is {world}"
            )
        return MeshShape(dp=dp, tp=tp, pp=pp)

    def axis_within_node(self, mesh: MeshShape, axis: str) -> bool:
        """True when every group along ``axis`` lies inside one node.

        Groups are ranks r0 + k·stride (k < size); rank r lives on node
        r // gpus_per_node, which only grows with r, so a group stays in one
        node iff its first and last rank do.
        """
        self._check_mesh_size(mesh)
        n = mesh.axis_size(axis)
        s = mesh.stride(axis)
        g = self.gpus_per_node
        if n == 1 or self.nodes == 1:
            return True
        for r0 in range(self.world_size):
            if (r0 // s) % n != 0:
                continue  # not the first rank of its group
            if r0 // g != (r0 + (n - 1) * s) // g:
                return False
        return True

    def axis_link(self, mesh: MeshShape, axis: str) -> Link:
        """The link collectives on ``axis`` run over: NVLink if every group fits in a node, else InfiniBand.

        A group that spans nodes gets the inter-node bandwidth per GPU (each GPU's
        own NIC); with several of its ranks in a node, the collectives run one ring
        per NIC (:func:`autopar.cost_models.comm.ring_bandwidth`), capped by the
        NVLink hops they share (``Link.intra_bandwidth``). Its latency is paid hop by
        hop, the hops between its ranks in one node at NVLink's (``Link.ranks_per_node``).
        """
        self._check_mesh_size(mesh)
        if mesh.axis_size(axis) == 1:
            return LOCAL_LINK
        if self.axis_within_node(mesh, axis):
            return self.intra_node_link
        n, stride = mesh.axis_size(axis), mesh.stride(axis)
        per_node = max(1, min(n, self.gpus_per_node // stride)) if stride < self.gpus_per_node else 1
        return dataclasses.replace(
            self.inter_node_link,
            intra_latency_s=self.intra_node_link.latency_s,
            ranks_per_node=per_node,
            intra_bandwidth=self.intra_node_link.bandwidth,
        )

    def _check_mesh_size(self, mesh: MeshShape) -> None:
        if not isinstance(mesh, MeshShape):
            raise ClusterError(
                f"expected a MeshShape, got {type(mesh).__name__}; build one with Cluster.check_mesh"
            )
        if mesh.size != self.world_size:
            raise ClusterError(
                f"mesh {mesh} = {mesh.size} devices does not match the cluster's {self.world_size} devices; "
                f"choose sizes whose product is {self.world_size}"
            )
