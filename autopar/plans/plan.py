"""The Plan: what autopar decided, as plain data, with the views a person reads.

The fields and their JSON form are :class:`~autopar.plans.data.PlanData`; this
class adds the summary table, ``explain`` and the HTML report.
"""

from __future__ import annotations

from pathlib import Path

from autopar.plans.data import FORMAT_VERSION, PlanData
from autopar.plans.inspection import explain_plan
from autopar.plans.report import write_report
from autopar.plans.summary import summary_text

__all__ = ["FORMAT_VERSION", "Plan"]


class Plan(PlanData):
    """A parallel training configuration for one model on one cluster."""

    def summary(self, width: int = 100) -> str:
        """A table a person reads: the configuration, time and memory per device."""
        return summary_text(self, width)

    def explain(self, name: str) -> str:
        """Why the plan does what it does at ``name``: a node, a parameter, or a module path (a layer).

        For an op: the strategies it had and what each would cost with every other op
        as chosen, why the chosen one won, the collectives it causes. For a module: its
        parameters, its ops' placements and costs, the collectives into and out of it.
        Raises ``autopar.plans.inspection.UnknownNameError`` (one line naming close matches).
        """
        return explain_plan(self, name)

    def report(self, path: str | Path) -> Path:
        """Write a self-contained HTML report of the plan (tables and charts, no server needed)."""
        return write_report(self, path)

    def __str__(self) -> str:
        return self.summary()
