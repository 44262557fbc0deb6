"""Accelerators: peak figures as their vendors publish them, with sources.

Units: FLOP/s, bytes, bytes/s and seconds. "GB" means 1e9 bytes, both for
bandwidth (450 GB/s = 450e9 bytes/s) and for device memory (80 GB = 80e9
bytes), the way vendors and the ZeRO paper count. Pure Python: the solver
side imports it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from autopar.core.errors import ClusterError

logger = logging.getLogger(__name__)

GB = 1e9
"""Bytes in a GB, for both bandwidth and memory (see the module docstring)."""

DTYPES = ("bf16", "fp16", "fp32", "tf32")
"""Keys every ``DeviceSpec.peak_flops`` must have."""

_DTYPE_ALIASES = {
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "tf32": "tf32",
}


def _positive_int(value: Any, what: str) -> int:
    """Return ``value`` as an int, or raise: sizes of clusters and meshes are counts."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ClusterError(f"{what} must be a positive integer, got {value!r}; pass e.g. {what}=1")
    return value


def _positive_number(value: Any, what: str) -> float:
    """Return ``value`` as a float, or raise: a zero or negative figure would make costs meaningless."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ClusterError(f"{what} must be a positive number, got {value!r}; pass a figure in SI units")
    return float(value)


# --------------------------------------------------------------------------- devices


@dataclass(frozen=True)
class DeviceSpec:
    """Peak figures of one accelerator, as its vendor publishes them (dense, no sparsity).

    Peaks, not achieved rates: the cost models apply calibrated efficiency
    factors on top, so the table stays checkable against datasheets.
    ``peak_flops`` holds a dict, so a DeviceSpec compares by value but is not
    hashable; key caches by ``name``.
    """

    name: str
    peak_flops: dict[str, float]
    """FLOP/s per dtype: keys "bf16", "fp16", "fp32", "tf32"."""
    memory_bytes: int
    hbm_bandwidth: float
    """Device memory bandwidth, bytes/s."""
    intra_node_bandwidth: float
    """Bytes/s per GPU per direction to peers in the same node (NVLink)."""
    inter_node_bandwidth: float
    """Bytes/s per GPU per direction to other nodes (its share of the node's NICs)."""
    intra_node_latency_s: float
    inter_node_latency_s: float
    source: str
    """Where the figures come from, so a reader can check them."""
    matmul_fraction: float = 1.0
    """Of the bf16 peak, what a dense matmul reaches on its best shapes (measured; 1.0 where unmeasured)."""
    attention_fraction: float | None = None
    """Of the bf16 peak, what FlashAttention-2's forward + backward reaches (measured, causal FLOPs counted as
    half); None where unmeasured: attention then runs at the matmul's rate."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ClusterError(f"device name must be a non-empty string, got {self.name!r}; name the device")
        if not isinstance(self.peak_flops, dict):
            raise ClusterError(
                f"device {self.name}: peak_flops must be a dict of dtype -> FLOP/s; pass keys {', '.join(DTYPES)}"
            )
        missing = [k for k in DTYPES if k not in self.peak_flops]
        if missing:
            raise ClusterError(
                f"device {self.name}: peak_flops lacks {', '.join(missing)}; give FLOP/s for {', '.join(DTYPES)}"
            )
        for key, value in self.peak_flops.items():
            _positive_number(value, f"device {self.name} peak_flops[{key!r}]")
        _positive_int(self.memory_bytes, f"device {self.name} memory_bytes")
        for attr in ("hbm_bandwidth", "intra_node_bandwidth", "inter_node_bandwidth"):
            _positive_number(getattr(self, attr), f"device {self.name} {attr}")
        for attr in ("matmul_fraction", "attention_fraction"):
            value = getattr(self, attr)
            if value is None and attr == "attention_fraction":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise ClusterError(
                    f"device {self.name}: {attr} must be a fraction of the peak in (0, 1], got {value!r}"
                )
        for attr in ("intra_node_latency_s", "inter_node_latency_s"):
            value = getattr(self, attr)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ClusterError(
                    f"device {self.name}: {attr} must be >= 0 seconds, got {value!r}; fix the figure"
                )

    def flops(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype``; accepts "bf16", "bfloat16", "torch.float32" and the like.

        The compute model names dtypes the way torch prints them, the table
        the way datasheets do; this is the one place that maps between them.
        """
        key = str(dtype).lower().removeprefix("torch.")
        canonical = _DTYPE_ALIASES.get(key)
        if canonical is None or canonical not in self.peak_flops:
            raise ClusterError(
                f"device {self.name} has no peak FLOP/s for dtype {dtype!r}; use one of {', '.join(self.peak_flops)}"
            )
        return self.peak_flops[canonical]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict, so a custom device can travel inside a plan file."""
        return {
            "name": self.name,
            "peak_flops": dict(self.peak_flops),
            "memory_bytes": self.memory_bytes,
            "hbm_bandwidth": self.hbm_bandwidth,
            "intra_node_bandwidth": self.intra_node_bandwidth,
            "inter_node_bandwidth": self.inter_node_bandwidth,
            "intra_node_latency_s": self.intra_node_latency_s,
            "inter_node_latency_s": self.inter_node_latency_s,
            "source": self.source,
            "matmul_fraction": self.matmul_fraction,
            "attention_fraction": self.attention_fraction,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DeviceSpec:
        """Inverse of :meth:`to_dict`."""
        try:
            return cls(**{**d, "peak_flops": dict(d["peak_flops"])})
        except (KeyError, TypeError) as err:
            raise ClusterError(
                f"device description is malformed ({err}); pass the keys DeviceSpec.to_dict() writes"
            ) from err


# Measured kernel speeds, as fractions of the bf16 peak (DeviceSpec.matmul_fraction, .attention_fraction):
# - dense matmul: the "Maximum Achievable Matmul FLOPS" table of stas00/ml-engineering
#   (compute/accelerator/README.md at b9e29720eebd4aa946fa9678975385efbc90a777): A100 SXM 271.2 of 312
#   TFLOP/s, H100 SXM 794.5 of 989 (torch 2.6 / 2.7, cuBLAS, the best of a sweep of shapes);
# - attention: FlashAttention-2's forward + backward, causal, head dimension 128, sequence 8k, in the
#   benchmark plots of Dao-AILab/flash-attention (assets/flash2_a100_fwd_bwd_benchmark.png and
#   flash2_h100_fwd_bwd_benchmark.png at 4f285b354796fb17df8636485b9a04df3ebbb7dc): 182 TFLOP/s on an
#   A100 80GB SXM4, 308 on an H100 80GB SXM5, causal FLOPs counted as half of the square's.
# The H200 has the H100's chip and clocks: its figures are taken as the H100's.
_A100_KERNELS = {"matmul_fraction": 271.2 / 312, "attention_fraction": 182 / 312}
_H100_KERNELS = {"matmul_fraction": 794.5 / 989, "attention_fraction": 308 / 989}

_INTRA_LATENCY_S = 3.4e-6
_INTER_LATENCY_S = 14e-6
# A ring hop's latency as NCCL's own tuning model has it for its Simple protocol, which large messages
# take: 3.4 us over NVLink, 14 us over the network (``hwLatencies``, Ring/Simple, src/graph/tuning.cc of
# NVIDIA/nccl at 5067397c2676d5aed50042fc39e5c8ee96eb0027); it also charges 8.4 us once a collective
# (autopar.hardware.cluster.NCCL_BASE_LATENCY_S).

DEVICES: dict[str, DeviceSpec] = {
    "V100-32GB": DeviceSpec(
        name="V100-32GB",
        peak_flops={"bf16": 125e12, "fp16": 125e12, "fp32": 15.7e12, "tf32": 15.7e12},
        memory_bytes=32_000_000_000,
        hbm_bandwidth=0.9e12,
        intra_node_bandwidth=150 * GB,
        inter_node_bandwidth=12.5 * GB,
        intra_node_latency_s=_INTRA_LATENCY_S,
        inter_node_latency_s=_INTER_LATENCY_S,
        source=(
            "NVIDIA V100 SXM2 datasheet: 125 TFLOP/s fp16 tensor, 15.7 fp32, 900 GB/s HBM2, NVLink2 "
            "150 GB/s per direction. Volta has no bf16 or tf32 tensor cores: bf16 is listed at the fp16 "
            "peak (optimistic) and tf32 at the fp32 peak. Inter-node 12.5 GB/s assumes one 100 Gb/s "
            "EDR adapter per GPU; a stock DGX-1V (4 per 8 GPUs) gives 6.25 GB/s"
        ),
    ),
    "A100-40GB": DeviceSpec(
        name="A100-40GB",
        peak_flops={"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12, "tf32": 156e12},
        memory_bytes=40_000_000_000,
        hbm_bandwidth=1.6e12,
        intra_node_bandwidth=300 * GB,
        inter_node_bandwidth=25 * GB,
        intra_node_latency_s=_INTRA_LATENCY_S,
        inter_node_latency_s=_INTER_LATENCY_S,
        source=(
            "NVIDIA A100 datasheet (SXM4 40GB): 312 TFLOP/s bf16/fp16 dense, 156 tf32, 19.5 fp32, "
            "1.6 TB/s HBM2 (1,555 GB/s), NVLink3 300 GB/s per direction; DGX A100: 8 x HDR 200 Gb/s "
            "InfiniBand = 25 GB/s per GPU"
        ),
        **_A100_KERNELS,
    ),
    "A100-80GB": DeviceSpec(
        name="A100-80GB",
        peak_flops={"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12, "tf32": 156e12},
        memory_bytes=80_000_000_000,
        hbm_bandwidth=2.0e12,
        intra_node_bandwidth=300 * GB,
        inter_node_bandwidth=25 * GB,
        intra_node_latency_s=_INTRA_LATENCY_S,
        inter_node_latency_s=_INTER_LATENCY_S,
        source=(
            "NVIDIA A100 datasheet (SXM4 80GB): 312 TFLOP/s bf16/fp16 dense, 156 tf32, 19.5 fp32, "
            "2.0 TB/s HBM2e (2,039 GB/s), NVLink3 300 GB/s per direction; DGX A100: 8 x HDR 200 Gb/s "
            "InfiniBand = 25 GB/s per GPU"
        ),
        **_A100_KERNELS,
    ),
    "H100-80GB": DeviceSpec(
        name="H100-80GB",
        peak_flops={"bf16": 989e12, "fp16": 989e12, "fp32": 67e12, "tf32": 494e12},
        memory_bytes=80_000_000_000,
        hbm_bandwidth=3.35e12,
        intra_node_bandwidth=450 * GB,
        inter_node_bandwidth=50 * GB,
        intra_node_latency_s=_INTRA_LATENCY_S,
        inter_node_latency_s=_INTER_LATENCY_S,
        source=(
            "NVIDIA H100 datasheet (SXM5): 989 TFLOP/s bf16/fp16 dense, 494 tf32, 67 fp32, 3.35 TB/s "
            "HBM3, NVLink4 450 GB/s per direction; DGX H100: 8 x NDR 400 Gb/s InfiniBand = 50 GB/s per GPU"
        ),
        **_H100_KERNELS,
    ),
    "H200-141GB": DeviceSpec(
        name="H200-141GB",
        peak_flops={"bf16": 989e12, "fp16": 989e12, "fp32": 67e12, "tf32": 494e12},
        memory_bytes=141_000_000_000,
        hbm_bandwidth=4.8e12,
        intra_node_bandwidth=450 * GB,
        inter_node_bandwidth=50 * GB,
        intra_node_latency_s=_INTRA_LATENCY_S,
        inter_node_latency_s=_INTER_LATENCY_S,
        source=(
            "NVIDIA H200 datasheet (SXM): same compute as H100 SXM (989 TFLOP/s bf16 dense, 494 tf32, "
            "67 fp32), 141 GB HBM3e at 4.8 TB/s, NVLink4 450 GB/s per direction; DGX H200: 8 x NDR "
            "400 Gb/s = 50 GB/s per GPU"
        ),
        **_H100_KERNELS,
    ),
    "B200": DeviceSpec(
        name="B200",
        peak_flops={"bf16": 2250e12, "fp16": 2250e12, "fp32": 80e12, "tf32": 1100e12},
        memory_bytes=180_000_000_000,
        hbm_bandwidth=8.0e12,
        intra_node_bandwidth=900 * GB,
        inter_node_bandwidth=50 * GB,
        intra_node_latency_s=_INTRA_LATENCY_S,
        inter_node_latency_s=_INTER_LATENCY_S,
        source=(
            "NVIDIA DGX B200 datasheet: 2.25 PFLOP/s bf16/fp16 dense per GPU, tf32 about 1.1 PFLOP/s "
            "dense (half the 2.2 sparse figure), fp32 80 TFLOP/s, 180 GB HBM3e at 8 TB/s, NVLink5 "
            "900 GB/s per direction, ConnectX-7 400 Gb/s per GPU = 50 GB/s"
        ),
    ),
    "cpu": DeviceSpec(
        name="cpu",
        peak_flops={"bf16": 1e11, "fp16": 1e11, "fp32": 1e11, "tf32": 1e11},
        memory_bytes=16_000_000_000,
        hbm_bandwidth=20 * GB,
        intra_node_bandwidth=10 * GB,
        inter_node_bandwidth=10 * GB,
        intra_node_latency_s=50e-6,
        inter_node_latency_s=50e-6,
        source=(
            "nominal: a modest CPU process over gloo (1e11 FLOP/s, 20 GB/s memory, 10 GB/s and 50 us "
            "per collective hop, 16 GB); only for local dry runs and tests, not a measured figure"
        ),
    ),
}
"""Built-in devices keyed by canonical name."""

_DEVICE_ALIASES: dict[str, str] = {
    **{name.lower(): name for name in DEVICES},
    "v100": "V100-32GB",
    "v100-sxm2": "V100-32GB",
    "a100": "A100-80GB",
    "a100-sxm": "A100-80GB",
    "a100-40": "A100-40GB",
    "a100-80": "A100-80GB",
    "h100": "H100-80GB",
    "h100-sxm": "H100-80GB",
    "h100-sxm5": "H100-80GB",
    "h200": "H200-141GB",
    "h200-sxm": "H200-141GB",
    "b200-180gb": "B200",
}


def _alias_key(name: str) -> str:
    """Normalise a device or preset name: case, spaces and underscores do not matter to users."""
    return name.strip().lower().replace("_", "-").replace(" ", "-")


def get_device(name: str | DeviceSpec) -> DeviceSpec:
    """Look a device up by canonical name or common alias ("h100", "a100" -> A100-80GB), case-insensitively."""
    if isinstance(name, DeviceSpec):
        return name
    canonical = _DEVICE_ALIASES.get(_alias_key(name)) if isinstance(name, str) else None
    if canonical is None:
        raise ClusterError(f"unknown device {name!r}; use one of {', '.join(DEVICES)} or pass a DeviceSpec")
    return DEVICES[canonical]
