"""What the training runtime does that the graph does not say: the collectives it overlaps, its attention kernel.

autopar's own runtime (:mod:`autopar.runtime`) runs each collective where
DTensor's redistribution puts it and waits for it before the op that reads it:
a tensor-parallel all-gather, reduce-scatter or all-reduce of activations is on
the critical path, and the estimate of a plan autopar runs keeps it there.

Other runtimes hide them (and the data-parallel gather of the stepped parameters, below). Megatron-Core's ``--tp-comm-overlap`` (with sequence
parallelism, on Transformer Engine's userbuffers) splits the all-gather before
a column-parallel GEMM and the reduce-scatter after a row-parallel GEMM into
``tp`` chunks and pipelines them with the GEMM's own chunks; torchtitan's async
TP does the same with symmetric memory. What stays exposed is the part of the
collectives that outlasts the compute of the pass they run in, and at least one
chunk of the ``tp``: the first chunk's GEMM waits for its data (an all-gather),
the last chunk's reduction waits for its GEMM (a reduce-scatter).

ZeRO-1 and 2 gather the parameter shards each rank stepped after the
optimizer. autopar's runtime does it right there, nothing left to hide it
under; Megatron-Core's distributed optimizer with ``--overlap-param-gather``
issues the gathers with the next step's forward and waits for each bucket
just before its layer runs: what stays exposed is the part that outlasts one
micro-batch's forward, and at least the first bucket
(:func:`autopar.cost_models.step.param_gather_exposed`).

Data-parallel collectives go in buckets, each paying the collective's latency
and the last one left exposed after the backward: autopar's runtime (and the
estimate's default) uses DDP's 25 MB; Megatron-Core sizes its buckets with the
data-parallel group, ``max(40M, 1M × dp)`` parameters (of fp32 gradients under bf16:
it reduces in fp32, ``grad_reduce_in_fp32``), so that each rank's chunk
of a bucket stays bandwidth-bound (:func:`bucket_bytes`).

A runtime also decides where a micro-batch's gradients go. autopar's own
returns each micro-batch's gradients from the graph, in the reduce dtype, and
adds them into the optimizer's fp32 gradients once the graph has run: with
several micro-batches both are held at the end of each backward. Megatron-Core
keeps one gradient buffer a parameter (``param.main_grad``, fp32 under bf16:
``grad_reduce_in_fp32``) and adds each micro-batch's weight gradient into it as
the backward makes it (its fused weight-gradient GEMM writes into it; without
the fusion a hook adds the bf16 ``.grad`` and frees it): the gradients are held
once, in the buffer's dtype, over the whole step
(``megatron/core/distributed/distributed_data_parallel.py`` at core_r0.8.0).

A runtime also picks the attention kernel: autopar's runs PyTorch's
scaled-dot-product attention, whose flash backend is FlashAttention-2, the
kernel whose measured speed the device figures hold
(:func:`autopar.cost_models.compute.kernel_flops`); Transformer Engine
(Megatron-Core) runs cuDNN's fused attention on Hopper, faster there.

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
    # ZeRO-1/2's gather of the stepped parameter shards hidden under the next step's forward, bucket by bucket
    # (Megatron-Core's --overlap-param-gather); autopar's runtime gathers them after the optimizer step
    param_gather_overlap: bool = False
    # the FLOP/s of its fused attention kernel against FlashAttention-2's on the same device
    attention_speedup: float = 1.0
    # data-parallel buckets (gradients reduced, ZeRO's shards gathered): max(bucket_bytes, per rank × dp ranks)
    # (bytes of the gradients as the runtime reduces them)
    bucket_bytes: float = 25e6
    bucket_bytes_per_rank: float = 0.0
    # each micro-batch's gradients added into one buffer as the backward makes them (Megatron-Core's main_grad),
    # not returned beside the running sum (autopar's runtime)
    grads_accumulate_in_place: bool = False


AUTOPAR_RUNTIME = Runtime()
"""autopar's own runtime: tensor-parallel collectives on the critical path, PyTorch's FlashAttention-2."""

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


def bucket_bytes(ranks: int) -> float:
    """Bytes of one data-parallel bucket of the runtime, on a data-parallel group of ``ranks``."""
    return max(RUNTIME.bucket_bytes, RUNTIME.bucket_bytes_per_rank * ranks)
