"""Running a built MILP on HiGHS, SCIP (through MathOpt) or CBC (through pywraplp).

Split from :mod:`autopar.solver.solve`: everything that knows OR-tools' APIs, their
parameters and their quirks (time limits that large models overrun, an interrupter for
HiGHS, hints for SCIP only) lives here, behind :func:`run_solver`, which takes the
arrays of :class:`~autopar.solver.milp.Milp` and returns a status, values and a
dual bound in cost units.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from autopar.solver.milp import Milp

logger = logging.getLogger("autopar.solver.solve")

_MIP_REL_GAP = 1e-9
_BACKENDS = ("highs", "scip", "cbc")
# HiGHS runs without presolve and costly heuristics on models with more nonzeros (run_solver).
_HIGHS_LARGE_NNZ = 200_000
# Above this many nonzeros HiGHS solves only the LP relaxation, which is rounded (see solve_strategies),
# and the neighbourhood search improves on it: on a 32-layer LLaMA's tp = 8 mesh (330,000 nonzeros)
# branch and bound found nothing better than the greedy answer in 5 to 10 s, where the search found
# answers 15% better in the same time.
HIGHS_MIP_MAX_NNZ = 150_000
# Below this much time left, the solver is not started and the greedy answer is returned.
MIN_SOLVER_TIME_S = 0.01


def resolve_backend(backend: str | None) -> str:
    """The backend to use: the forced one (checked), else the first of HiGHS, SCIP, CBC available."""
    if backend is not None and backend.lower() not in _BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {', '.join(_BACKENDS)}")
    for name in [backend.lower()] if backend is not None else list(_BACKENDS):
        if backend_available(name):
            return name
        if backend is not None:
            raise ValueError(f"backend {backend!r} is not available in this OR-tools build")
    raise RuntimeError("no MILP backend (HiGHS, SCIP, CBC) is available in this OR-tools build")


@functools.cache
def backend_available(name: str) -> bool:
    """Whether this OR-tools build has the backend: asked once per process with an empty model."""
    if name == "cbc":
        from ortools.linear_solver import pywraplp

        return pywraplp.Solver.CreateSolver("CBC") is not None
    empty = Milp(
        *(np.zeros(0) for _ in range(6)), np.zeros(1, dtype=np.int64), np.zeros(0, np.int64), np.zeros(0)
    )
    return run_solver(empty, name, 1.0, None).status == "OPTIMAL"


@dataclass
class SolverResult:
    status: str  # OPTIMAL, FEASIBLE, INFEASIBLE, NOT_SOLVED (limit, nothing found) or the backend's word
    values: np.ndarray | None
    bound: float | None  # in cost units, constant included
    wall_s: float


def run_solver(
    milp: Milp,
    backend: str,
    time_limit_s: float,
    hint: np.ndarray | None,
    relax: bool = False,
    presolve: bool = True,
) -> SolverResult:
    """Solve with HiGHS or SCIP through MathOpt, or with CBC through pywraplp.

    MathOpt takes the model as one ``ModelProto`` filled from the arrays, and reports the
    dual bound. (OR-tools 9.15's ModelBuilder/pywraplp route to HiGHS adds rows one call
    at a time, seconds on 10^5 rows, reports the primal value as the bound, and crashes on
    a hint: hints go to SCIP only.) SCIP is given ``os.cpu_count()`` threads; HiGHS takes
    no thread count through MathOpt (its scheduler is process-wide and sizes itself from
    the machine), and its branch and bound is serial anyway. ``presolve=False`` turns
    HiGHS's presolve off (:func:`_solve_parameters`).
    """
    if backend == "cbc":
        return _run_pywraplp(milp, time_limit_s, hint)
    from ortools.math_opt import callback_pb2, parameters_pb2
    from ortools.math_opt.core.python import solver as core_solver

    start = time.perf_counter()
    model = _model_proto(milp, relax)
    # On models with millions of nonzeros the solvers take seconds to notice a stop and
    # return; leave them an allowance in proportion so that the caller's limit holds.
    time_limit_s -= min(0.25 * time_limit_s, 4e-6 * len(milp.data)) + (time.perf_counter() - start)
    params = _solve_parameters(milp, backend, time_limit_s, presolve)
    model_params = _hint_parameters(backend, hint, len(milp.lb))
    kind = parameters_pb2.SOLVER_TYPE_HIGHS if backend == "highs" else parameters_pb2.SOLVER_TYPE_GSCIP
    interrupter, timer = _interrupter(backend, time_limit_s)
    try:
        res = core_solver.solve(
            model,
            kind,
            parameters_pb2.SolverInitializerProto(),
            params,
            model_params,
            None,
            callback_pb2.CallbackRegistrationProto(),
            None,
            interrupter,
        )
    except Exception as err:  # a solver error is reported, and the greedy answer stands
        logger.warning("solve: %s failed: %s", backend, err)
        return SolverResult("ERROR", None, None, time.perf_counter() - start)
    finally:
        if timer is not None:
            timer.cancel()
    return _read_result(res, milp, relax, start)


def _model_proto(milp: Milp, relax: bool) -> Any:
    """The MathOpt ``ModelProto`` of the arrays, filled column by column and row by row in bulk."""
    from ortools.math_opt import model_pb2

    n = len(milp.lb)
    model = model_pb2.ModelProto()
    model.variables.ids.extend(range(n))
    model.variables.lower_bounds.extend(milp.lb.tolist())
    model.variables.upper_bounds.extend(milp.ub.tolist())
    model.variables.integers.extend([False] * n if relax else milp.integer.astype(bool).tolist())
    nz = np.nonzero(milp.obj)[0]
    model.objective.linear_coefficients.ids.extend(nz.tolist())
    model.objective.linear_coefficients.values.extend(milp.obj[nz].tolist())
    model.objective.offset = milp.offset
    m = len(milp.row_lb)
    model.linear_constraints.ids.extend(range(m))
    model.linear_constraints.lower_bounds.extend(milp.row_lb.tolist())
    model.linear_constraints.upper_bounds.extend(milp.row_ub.tolist())
    matrix = model.linear_constraint_matrix
    matrix.row_ids.extend(np.repeat(np.arange(m), np.diff(milp.indptr)).tolist())
    matrix.column_ids.extend(milp.indices.tolist())
    matrix.coefficients.extend(milp.data.tolist())
    return model


def _solve_parameters(milp: Milp, backend: str, time_limit_s: float, presolve: bool = True) -> Any:
    """The time limit, the gap, tight feasibility tolerances, and HiGHS's settings for large models.

    ``presolve=False``: HiGHS without presolve, for the neighbourhood search's sub-problems.
    On some of them OR-tools 9.15's HiGHS presolve corrupts the heap at these tolerances
    (the process aborts, "free(): invalid next size"), and on those small models it costs
    more than it saves (2 s against 0.12 s to optimality on one that did not abort).
    """
    from ortools.math_opt import parameters_pb2

    params = parameters_pb2.SolveParametersProto()
    params.time_limit.FromNanoseconds(int(max(time_limit_s, MIN_SOLVER_TIME_S) * 1e9))
    params.relative_gap_tolerance = _MIP_REL_GAP
    params.absolute_gap_tolerance = 0.0
    # Memory rows are in units of M; hold them to about MEMORY_RTOL rather than the default 1e-6.
    if backend == "highs":
        params.highs.double_options["primal_feasibility_tolerance"] = 1e-9
        params.highs.double_options["mip_feasibility_tolerance"] = 1e-9
    else:
        params.gscip.real_params["numerics/feastol"] = 1e-9
        params.threads = os.cpu_count() or 1
    if backend == "highs" and not presolve:
        params.highs.string_options["presolve"] = "off"
    if backend == "highs" and len(milp.data) > _HIGHS_LARGE_NNZ:
        # On models this size HiGHS's presolve (and the setup after it) and its central
        # rounding heuristic (an interior-point solve) each run for tens of seconds without
        # looking at the clock, so neither the time limit nor the interrupter can stop them;
        # presolve removes little from these problems. Without both, the first incumbent
        # (feasibility jump, randomized rounding) comes in seconds and the time limit holds.
        params.highs.string_options["presolve"] = "off"
        params.highs.double_options["mip_heuristic_effort"] = 0.0
    return params


def _hint_parameters(backend: str, hint: np.ndarray | None, n: int) -> Any:
    """The model parameters: the hint, for SCIP only (HiGHS through OR-tools crashes on one)."""
    from ortools.math_opt import model_parameters_pb2

    model_params = model_parameters_pb2.ModelSolveParametersProto()
    if backend == "scip" and hint is not None:
        h = model_params.solution_hints.add()
        h.variable_values.ids.extend(range(n))
        h.variable_values.values.extend(hint.tolist())
    return model_params


def _interrupter(backend: str, time_limit_s: float) -> tuple[Any, threading.Timer | None]:
    """For HiGHS, an interrupter and the started timer that fires it at the time limit.

    HiGHS checks its own limit only between steps that can take seconds on large models;
    an interrupter fired by a timer stops it sooner. (SCIP keeps to its limit, and with an
    interrupter OR-tools 9.15's SCIP wrapper prints an error from its event handler.)
    """
    if backend != "highs":
        return None, None
    from ortools.util.python.pybind_solve_interrupter import PySolveInterrupter

    interrupter = PySolveInterrupter()
    timer = threading.Timer(max(time_limit_s, MIN_SOLVER_TIME_S), interrupter.interrupt)
    timer.daemon = True
    timer.start()
    return interrupter, timer


def _read_result(res: Any, milp: Milp, relax: bool, start: float) -> SolverResult:
    """Status, values and dual bound (in cost units) from MathOpt's result; wall time since ``start``."""
    from ortools.math_opt import result_pb2

    reason = result_pb2.TerminationReasonProto.Name(res.termination.reason).removeprefix(
        "TERMINATION_REASON_"
    )
    status = {"NO_SOLUTION_FOUND": "NOT_SOLVED"}.get(reason, reason)
    if relax:
        status = "LP_" + status  # the relaxation's status: its optimum bounds the MILP's
    values = None
    if res.solutions and res.solutions[0].HasField("primal_solution"):
        sol = res.solutions[0].primal_solution
        values = np.zeros(len(milp.lb))
        values[np.asarray(sol.variable_values.ids, dtype=np.int64)] = sol.variable_values.values
    bound = res.termination.objective_bounds.dual_bound
    bound = bound / milp.scale if math.isfinite(bound) else None
    return SolverResult(status, values, bound, time.perf_counter() - start)


def _run_pywraplp(milp: Milp, time_limit_s: float, hint: np.ndarray | None) -> SolverResult:
    """CBC is reachable only through pywraplp; slower to build, used when forced or alone.

    No thread count is set: OR-tools' CBC is built without threads and rejects the option.
    """
    from ortools.linear_solver import pywraplp

    solver = pywraplp.Solver.CreateSolver("CBC")
    inf = solver.infinity()
    xs = [
        solver.Var(lo, hi, bool(integral), "")
        for lo, hi, integral in zip(milp.lb.tolist(), milp.ub.tolist(), milp.integer.tolist(), strict=True)
    ]
    objective = solver.Objective()
    for j in np.nonzero(milp.obj)[0].tolist():
        objective.SetCoefficient(xs[j], float(milp.obj[j]))
    objective.SetOffset(milp.offset)
    indices, data = milp.indices.tolist(), milp.data.tolist()
    for r in range(len(milp.row_lb)):
        lo, hi = float(milp.row_lb[r]), float(milp.row_ub[r])
        ct = solver.RowConstraint(max(lo, -inf), min(hi, inf), "")
        for j in range(int(milp.indptr[r]), int(milp.indptr[r + 1])):
            ct.SetCoefficient(xs[indices[j]], data[j])
    if hint is not None:
        solver.SetHint(xs, hint.tolist())
    solver.SetTimeLimit(int(max(time_limit_s, MIN_SOLVER_TIME_S) * 1000))
    params = pywraplp.MPSolverParameters()
    params.SetDoubleParam(params.RELATIVE_MIP_GAP, _MIP_REL_GAP)
    start = time.perf_counter()
    code = solver.Solve(params)
    names = {
        pywraplp.Solver.OPTIMAL: "OPTIMAL",
        pywraplp.Solver.FEASIBLE: "FEASIBLE",
        pywraplp.Solver.INFEASIBLE: "INFEASIBLE",
        pywraplp.Solver.UNBOUNDED: "UNBOUNDED",
        pywraplp.Solver.ABNORMAL: "ABNORMAL",
        pywraplp.Solver.NOT_SOLVED: "NOT_SOLVED",
    }
    status = names.get(code, str(code))
    values = np.array([x.solution_value() for x in xs]) if status in ("OPTIMAL", "FEASIBLE") else None
    bound = objective.BestBound() if status in ("OPTIMAL", "FEASIBLE") else None
    if bound is not None and not math.isfinite(bound):
        bound = None
    return SolverResult(
        status, values, None if bound is None else bound / milp.scale, time.perf_counter() - start
    )


def lp_seconds(nnz: int) -> float:
    """A rough guess of HiGHS's dual simplex time on these relaxations, 2 cores (measured:
    20 s at 6.3e5 nonzeros, over 115 s at 1.9e6): superlinear, as simplex iterations grow
    with the rows."""
    return 20.0 * (nnz / 6.3e5) ** 1.7
