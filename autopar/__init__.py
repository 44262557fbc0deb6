"""autopar: automatic parallelization of PyTorch training.

plan = autopar.plan(model, example_inputs, cluster)
print(plan.summary())
"""

from autopar.api import plan
from autopar.cluster import Cluster
from autopar.errors import AutoparError, CaptureError, ClusterError, PlanError, PlanFormatError
from autopar.plan import Estimate, MemoryEstimate, Plan

__all__ = [
    "AutoparError",
    "CaptureError",
    "Cluster",
    "ClusterError",
    "Estimate",
    "MemoryEstimate",
    "Plan",
    "PlanError",
    "PlanFormatError",
    "plan",
]
