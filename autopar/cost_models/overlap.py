"""What the training runtime overlaps that the graph's order does not say: tensor-parallel collectives.

autopar's own runtime (:mod:`autopar.runtime`) runs each collective where
DTensor's redistribution puts it and waits for it before the op that reads it:
a tensor-parallel all-gather, reduce-scatter or all-reduce of activations is on
the critical path, and the estimate of a plan autopar runs keeps it there.

Other runtimes hide them. Megatron-Core's ``--tp-comm-overlap`` (with sequence
parallelism, on Transformer Engine's userbuffers) splits the all-gather before
a column-parallel GEMM and the reduce-scatter after a row-parallel GEMM into
``tp`` chunks and pipelines them with the GEMM's own chunks; torchtitan's async
TP does the same with symmetric memory. What stays exposed is the part of the
collectives that outlasts the compute of the pass they run in, and at least one
chunk of the ``tp``: the first chunk's GEMM waits for its data (an all-gather),
the last chunk's reduction waits for its GEMM (a reduce-scatter).

The estimate of a published run is made with the runtime that run used
(``benchmarks/calibrate.py`` sets :data:`RUNTIME` per run, as it pins the run's
configuration): the model then learns the efficiency of the kernels and links,
not the difference between runtimes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Runtime:
    """The runtime an estimate describes: what it overlaps beyond autopar's own runtime."""

    tp_comm_overlap: bool = False  # tensor-parallel collectives pipelined with the GEMMs next to them


AUTOPAR_RUNTIME = Runtime()
"""autopar's own runtime: tensor-parallel collectives on the critical path."""

RUNTIME = AUTOPAR_RUNTIME
"""The runtime estimates describe; read at call time, so calibration can set it."""


def tp_exposed(comm: float, window: float, tp: int) -> float:
    """What of ``comm`` seconds of tensor-parallel collectives stays on the critical path of a pass.

    ``window``: the compute of the pass they run in, on the same devices. Without
    overlap all of ``comm``; with it (see the module docstring) the part that
    outlasts the window, and at least one of the ``tp`` chunks::

        exposed = max(comm − window, comm / tp)
    """
    if not RUNTIME.tp_comm_overlap or tp <= 1:
        return comm
    return max(comm - window, comm / tp)
