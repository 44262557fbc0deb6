"""autopar: automatic parallelization of PyTorch training.

plan = autopar.plan(model, example_inputs, cluster)
print(plan.summary())
"""

from autopar.api import plan
from autopar.cluster import Cluster
from autopar.errors import (
    AutoparError,
    CaptureError,
    CheckpointError,
    ClusterError,
    LaunchError,
    PlanError,
    PlanFormatError,
    RuntimeMismatchError,
)
from autopar.inspection import diff
from autopar.onnx import OnnxError, OnnxPlan, export_onnx, read_onnx_plan, validate_onnx_plan
from autopar.plan import Estimate, MemoryEstimate, Plan
from autopar.runtime.launch import launch
from autopar.runtime.parallelize import parallelize

__all__ = [
    "AutoparError",
    "CaptureError",
    "CheckpointError",
    "Cluster",
    "ClusterError",
    "Estimate",
    "LaunchError",
    "MemoryEstimate",
    "OnnxError",
    "OnnxPlan",
    "Plan",
    "PlanError",
    "PlanFormatError",
    "RuntimeMismatchError",
    "diff",
    "export_onnx",
    "launch",
    "parallelize",
    "plan",
    "read_onnx_plan",
    "validate_onnx_plan",
]
