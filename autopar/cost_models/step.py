"""Step time and memory of one data-parallel / ZeRO configuration.

The cost of a configuration is built from plain numbers read once off the
captured graph (``GraphStats``) and the cluster's figures; nothing here
touches torch, so a thousand configurations are costed in milliseconds.

Time per step on one device (m micro-batches, N data-parallel ranks, Ψ
parameters, bucketed gradient communication overlapped with the backward,
as DDP and DeepSpeed do):

    compute    = m · (t_fwd + t_bwd), each op's roofline at the micro-batch: its FLOPs and activation
                 bytes scaled from the captured batch, its parameter and gradient bytes not
    ZeRO 0     all-reduce(G·Ψ) once, hidden behind the last micro-batch's backward
    ZeRO 1     reduce-scatter(G·Ψ) hidden behind the backward, all-gather(P·Ψ) after the step (exposed,
               or under the next forward where the runtime overlaps it: param_gather_exposed)
    ZeRO 2     reduce-scatter(G·Ψ) every micro-batch (hidden), all-gather(P·Ψ) after the step (as ZeRO 1)
    ZeRO 3     per micro-batch: all-gather(P·Ψ) in forward, again in backward (a collective per parameter
               tensor), reduce-scatter(G·Ψ) in buckets; each overlapped with the pass it serves
    buckets    = one collective per tensor of at least a bucket, the smaller ones' bytes in full buckets
    exposed    = Σ max(comm_pass − compute_pass, tail) where tail is the last bucket's share
    optimizer  = bytes the update reads and writes / HBM bandwidth
    step       = compute + exposed + optimizer

That is 2Ψ of traffic for ZeRO 0–2 and 3Ψ for ZeRO 3, as in the ZeRO paper.
Activation and compute figures scale linearly with the micro-batch size
(every op of a network is linear in the batch dimension) except the bytes of
parameters and gradients, read and written once whatever the batch; the graph
is captured once at the example batch size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.cost_models import compute as compute_model
from autopar.cost_models import overlap
from autopar.cost_models.comm import bucketed_time, collective_time
from autopar.cost_models.compute import ComputeEfficiency, ComputeSummary
from autopar.cost_models.estimate import Estimate, MemoryEstimate
from autopar.cost_models.memory import (
    Precision,
    model_state_bytes,
    optimizer_bytes_per_param,
)

# DDP's default gradient bucket, autopar's runtime's; also the granularity of ZeRO's overlapped communication.
# A runtime with other buckets says so (autopar.cost_models.overlap.bucket_bytes, which every path reads).
BUCKET_BYTES = 25e6


@dataclass
class GraphStats:
    """What the cost model needs from a captured graph, as plain numbers."""

    model: str
    fingerprint: str
    num_params: int
    batch_size: int  # the batch the graph was captured at
    compute: ComputeSummary
    saved_float_bytes: float  # saved activations at the captured batch, at the traced float dtype
    saved_other_bytes: float  # integer / boolean saved tensors (indices, masks)
    traced_float_size: int  # bytes per element of the traced floating-point activations
    largest_param_numel: int
    param_groups: int = 1  # modules that own parameters directly: ZeRO-3's unit of gathering
    peak_transient_bytes: float = 0.0  # largest single op's inputs + outputs at the captured batch
    param_names: list[str] = field(default_factory=list)
    param_numels: list[int] = field(default_factory=list)  # each parameter's elements, in the model's order
    # the fixed state (buffers, frozen parameters) at its traced dtypes: held whole on every device, never
    # stepped (a LoRA fine-tune's frozen base weights)
    state_bytes: float = 0.0
    frozen_params: int = 0  # elements of the parameters in it (a part of no ``num_params``)
    _phase_cache: dict = field(default_factory=dict, repr=False, compare=False)

    def phase_times(
        self, device, dtype_name: str, efficiency: ComputeEfficiency, bytes_scale: float, batch_scale: float = 1.0
    ) -> dict:
        """Roofline time per phase at ``batch_scale`` times the captured batch; cached, since every
        configuration asks."""
        key = (device.name, dtype_name, efficiency, bytes_scale, batch_scale, overlap.RUNTIME)
        if key not in self._phase_cache:
            self._phase_cache[key] = self.compute.time_by_phase(
                device, dtype_name, efficiency, bytes_scale, batch_scale
            )
        return self._phase_cache[key]


@dataclass(frozen=True)
class Config:
    """One point of the search space."""

    dp: int
    tp: int = 1
    pp: int = 1
    zero: int = 0
    microbatches: int = 1
    micro_batch_size: int = 1
    recompute: str = "none"
    split_sequences: bool = False  # the dp ranks split each micro-batch's sequences, not its batch (cp over them)

    @property
    def global_batch_size(self) -> int:
        return (1 if self.split_sequences else self.dp) * self.microbatches * self.micro_batch_size


def estimate_config(
    stats: GraphStats,
    cfg: Config,
    cluster,
    precision: Precision,
    optimizer: str,
    memory_limit: float,
    efficiency: ComputeEfficiency | None = None,
) -> Estimate:
    """Cost one configuration: step time, throughput, MFU and memory per device."""
    efficiency = efficiency or compute_model.DEFAULT_EFFICIENCY  # read at call time: calibration sets it
    device = cluster.device_spec
    mesh = cluster.check_mesh(dp=cfg.dp, tp=cfg.tp, pp=cfg.pp)
    mb_scale = cfg.micro_batch_size / stats.batch_size

    # ---- compute ----
    act_scale = precision.activation_bytes / stats.traced_float_size
    by_phase = stats.phase_times(device, precision.compute_dtype, efficiency, act_scale, mb_scale)
    t_fwd = by_phase.get("forward", 0.0)
    t_bwd = by_phase.get("backward", 0.0)
    compute = cfg.microbatches * (t_fwd + t_bwd)

    collectives: list[dict] = []
    comm, exposed = _data_parallel_comm(
        stats, cfg, precision, cluster.axis_link(mesh, "dp"), t_fwd, t_bwd, collectives
    )
    t_opt = _optimizer_time(stats.num_params, cfg, precision, optimizer, device.hbm_bandwidth * efficiency.memory)
    step = compute + exposed + t_opt
    mem = _memory(stats, cfg, precision, optimizer, act_scale, mb_scale)

    gbs = cfg.global_batch_size
    model_flops = stats.compute.total_flops / stats.batch_size * gbs
    peak_flops = device.peak_flops[precision.compute_dtype]
    mfu = model_flops / (step * cluster.world_size * peak_flops) if step > 0 else 0.0
    return Estimate(
        step_time_s=step,
        samples_per_s=gbs / step if step > 0 else 0.0,
        mfu=mfu,
        hfu=mfu,  # this model recomputes nothing: the hardware runs the model's FLOPs
        memory=mem,
        memory_limit=memory_limit,
        fits=mem.peak <= memory_limit,
        compute_s=compute,
        comm_s=comm,
        exposed_comm_s=exposed,
        optimizer_s=t_opt,
        model_flops=model_flops,
        hardware_flops=model_flops,
        collectives=collectives,
    )


def _dp_collective(
    kind: str,
    sizes: list[float],
    count: int,
    n: int,
    link,
    collectives: list[dict],
    per_tensor: bool = False,
) -> float:
    """``count`` rounds of ``kind`` over tensors of ``sizes`` bytes on n dp ranks, recorded in ``collectives``.

    Each round sends each tensor in one collective (``per_tensor``: ZeRO-3's gathers, where an op
    reads the parameter) or the tensors in the runtime's buckets
    (:func:`autopar.cost_models.comm.bucketed_time`).
    """
    nbytes = float(sum(sizes))
    if per_tensor:
        t, pieces = sum(collective_time(kind, b, n, link) for b in sizes), len(sizes)
    else:
        t, pieces = bucketed_time(kind, sizes, n, link, overlap.bucket_bytes(n))
    if n > 1 and count > 0 and pieces:
        collectives.append(
            {
                "kind": kind,
                "axis": "dp",
                "bytes": nbytes / pieces,
                "count": count * pieces,
                "time_s": t * count,
            }
        )
    return t * count


def exposed_part(comm: float, window: float, nbytes: float, ranks: int = 1) -> float:
    """What of ``comm`` seconds, overlapped with ``window`` seconds of compute, stays on the critical path.

    The part that outlasts the window, and at least the last bucket's share (a bucket
    is sent once it is full, so the last one starts when the compute ends); ``ranks``:
    the data-parallel group's size, which some runtimes size their buckets by.
    """
    return max(comm - window, _tail(comm, nbytes, ranks))


def param_gather_exposed(comm: float, forward: float, nbytes: float, ranks: int = 1) -> float:
    """What of ZeRO-1/2's gather of the stepped shards (``comm`` seconds over ``nbytes``) stays on the critical path.

    All of it on autopar's runtime (gathered after the optimizer step); under a runtime that
    overlaps it with the next step's forward (:mod:`autopar.cost_models.overlap`), what outlasts
    ``forward`` (one micro-batch's: the layers after the first wait for their bucket only) and at
    least the first bucket.
    """
    if not overlap.RUNTIME.param_gather_overlap:
        return comm
    return exposed_part(comm, forward, nbytes, ranks)


def _tail(comm: float, nbytes: float, ranks: int = 1) -> float:
    """The last bucket's share of ``comm``: what no overlap with the backward can hide."""
    return comm * min(1.0, overlap.bucket_bytes(ranks) / max(nbytes, 1.0))


def _data_parallel_comm(
    stats: GraphStats,
    cfg: Config,
    precision: Precision,
    dp_link,
    t_fwd: float,
    t_bwd: float,
    collectives: list[dict],
) -> tuple[float, float]:
    """(all, exposed) seconds of the data-parallel collectives of ``cfg``'s ZeRO stage, per step.

    Gradients are reduced in buckets under the backward (ZeRO-2 and 3: each micro-batch);
    ZeRO-3 gathers one module's parameters at a time, forward and backward.
    """
    psi, n, m = stats.num_params, cfg.dp, cfg.microbatches
    grad_bytes = precision.reduce_bytes * psi  # gradients are reduced in the plan's reduce dtype
    param_bytes = precision.param_bytes * psi
    numels = stats.param_numels or [psi]
    grad_sizes = [precision.reduce_bytes * x for x in numels]
    param_sizes = [precision.param_bytes * x for x in numels]

    def coll(kind: str, sizes: list[float], count: int, per_tensor: bool = False) -> float:
        return _dp_collective(kind, sizes, count, n, dp_link, collectives, per_tensor)

    # ZeRO-3 gathers each parameter where an op reads it (autopar's runtime, as the MILP path charges it), and
    # reduces the gradients in buckets
    if cfg.zero == 0:
        c = coll("all_reduce", grad_sizes, 1)
        comm, exposed = c, exposed_part(c, t_bwd, grad_bytes, n)
    elif cfg.zero == 1:
        rs = coll("reduce_scatter", grad_sizes, 1)
        ag = coll("all_gather", param_sizes, 1)
        comm = rs + ag
        exposed = exposed_part(rs, t_bwd, grad_bytes, n) + param_gather_exposed(ag, t_fwd, param_bytes, n)
    elif cfg.zero == 2:
        rs = coll("reduce_scatter", grad_sizes, m)
        ag = coll("all_gather", param_sizes, 1)
        comm = rs + ag
        exposed = m * exposed_part(rs / m, t_bwd, grad_bytes, n) + param_gather_exposed(ag, t_fwd, param_bytes, n)
    else:
        ag = coll("all_gather", param_sizes, 2 * m, per_tensor=True)
        rs = coll("reduce_scatter", grad_sizes, m)
        ag1, rs1 = ag / (2 * m), rs / m
        comm = ag + rs
        exposed = m * (exposed_part(ag1, t_fwd, param_bytes, n) + exposed_part(ag1 + rs1, t_bwd, param_bytes, n))
    if n == 1:
        comm = exposed = 0.0
    return comm, exposed


def _optimizer_time(psi: float, cfg: Config, precision: Precision, optimizer: str, mem_bw: float) -> float:
    """The optimizer step: memory-bound over the local shard of optimizer state."""
    local_opt = psi / (cfg.dp if cfg.zero >= 1 else 1)
    k = optimizer_bytes_per_param(precision, optimizer)
    # reads grads + state + master, writes state + master + the forward copy of the params
    opt_traffic = local_opt * (precision.grad_bytes + 2 * k + precision.param_bytes)
    return opt_traffic / mem_bw


def _memory(
    stats: GraphStats, cfg: Config, precision: Precision, optimizer: str, act_scale: float, mb_scale: float
) -> MemoryEstimate:
    """Per device: model states, one micro-batch's activations and transients, and collective buffers."""
    psi, n = stats.num_params, cfg.dp
    grad_bytes = precision.reduce_bytes * psi  # the buckets hold gradients in the reduce dtype
    states = model_state_bytes(psi, precision, optimizer, cfg.zero, n)
    activations = (stats.saved_float_bytes * act_scale + stats.saved_other_bytes) * mb_scale
    buffers = stats.peak_transient_bytes * act_scale * mb_scale
    if n > 1 and cfg.zero < 3:
        buffers += 2 * min(overlap.bucket_bytes(n), grad_bytes)  # a bucket in flight while the next fills
    if n > 1 and cfg.zero == 3:
        # the gathered parameters of the module in use and of the one prefetched
        groups = max(1, stats.param_groups)
        buffers += 2 * precision.param_bytes * max(stats.largest_param_numel, psi / groups)
    return MemoryEstimate(
        params=states.params + stats.state_bytes,
        grads=states.grads,
        optimizer=states.optimizer,
        activations=activations,
        buffers=buffers,
        peak=states.total + stats.state_bytes + activations + buffers,
    )
