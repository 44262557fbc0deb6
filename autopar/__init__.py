"""autopar: automatic parallelization of PyTorch training.

plan = autopar.plan(model, example_inputs, cluster)
print(plan.summary())
"""

from autopar.api.parallelizer import parallelize
from autopar.api.planner import plan
from autopar.core.errors import (
    AutoparError,
    CaptureError,
    CheckpointError,
    ClusterError,
    LaunchError,
    PlanError,
    PlanFormatError,
    RuntimeMismatchError,
)
from autopar.cost_models.estimate import Estimate, MemoryEstimate
from autopar.hardware.cluster import Cluster
from autopar.onnx import OnnxError, OnnxPlan, export_onnx, read_onnx_plan, validate_onnx_plan
from autopar.plans.inspection import diff
from autopar.plans.plan import Plan
from autopar.runtime.launch import launch

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
