"""Calibrate the cost model's efficiency factors against published training throughputs.

    PYTHONPATH=. .venv/bin/python benchmarks/calibrate.py            fit, then predict every run
    PYTHONPATH=. .venv/bin/python benchmarks/calibrate.py --no-fit   predict with the library's factors
    PYTHONPATH=. .venv/bin/python benchmarks/calibrate.py --fold 1   fit on another third of the runs

Every run is planned by ``autopar.plan`` with its published configuration pinned
in ``fixed`` (dp, tp, pp, ZeRO stage, micro-batches, schedule, recompute), on
the model's real shape built on the meta device; the per-op sharding inside
the mesh is the planner's own. The predicted throughput is the plan's
``estimate.step_time_s``: the same cost model every path of the planner uses.

Three factors are fitted on a third of the runs: every third run of ``RUNS``
in its order (the sources in turn, each by size), so that the fitted runs span
every source, both GPUs, tp from 1 to 8, pipelines, recompute settings and 32
to 3,072 GPUs (a fit on the smallest runs alone, quick to plan, followed their
errors down: README, Calibration); the other two thirds are held out.
``--fold 1`` and ``--fold 2`` fit on the other two thirds in turn (fold 0 is the
library's): whether the factors depend on which runs were fitted. The factors:
the fraction of a kernel's measured FLOP/s compute-bound ops reach in training
(``ComputeEfficiency.matmul``: the devices hold what a dense matmul and
FlashAttention-2 reach on their best shapes, ``DeviceSpec.matmul_fraction`` and
``attention_fraction``), the fraction of HBM bandwidth memory-bound ops reach
(``ComputeEfficiency.memory``) and the fraction of a link's line rate a
collective's bus bandwidth reaches (``comm.LINK_EFFICIENCY``). The step time of
a pinned plan is, to first order, ``D + A/e_matmul + B/e_memory + C/e_link``;
the fit plans each fit run at a reference point and at one perturbation of each
factor, reads A, B, C and D off the four step times, and minimises the squared
log error of the fit runs over a grid of the three factors; a second round
linearises again at the first round's answer (``--rounds``). Every run is then
planned again at the fitted factors and printed beside what was published; the
runs not fitted are held out. Copy the fitted figures into
``autopar/cost_models/compute.py`` (``DEFAULT_EFFICIENCY``) and
``autopar/cost_models/comm.py`` (``LINK_EFFICIENCY``) and rerun with
``--no-fit`` to check.

What a run's model and runtime do that the estimate must know is modelled,
not fitted per run: each model is built in bf16, the dtype it computed in, so
that its trace holds the fp32 copies its code makes (the loss's logits, a
norm's intermediates); attention is the kernels the run ran (flash kernels
skip the masked half of a causal square); and each run is costed with the
runtime it used (:mod:`autopar.cost_models.overlap`): autopar's own for the
rest, Megatron-Core's for B.

Published runs (each figure read at its source; what the source leaves open is
an assumption, named per run)
------------------------------------------------------------------------------

A. Megatron-LM (Narayanan et al., SC'21), GPT weak scaling on Selene (DGX A100
   80 GB, 8 x HDR 200 Gb/s per node): NVIDIA/Megatron-LM README at commit
   50a4b5fa0280a160cc1b03a1c15faddbc1b1da9a (2021-04-08), table
   ``images/cases_april2021.png``: hidden size, layers, model-parallel size,
   GPUs, batch size and achieved TFLOP/s per GPU; vocabulary 51,200, sequence
   2,048 (README text). The split of the model-parallel size into tp x pp
   (tp = min(MP, 8), pp = MP / 8) and the head counts (hidden / 96 up to 3.6B,
   / 128 up to 310B, / 160 above) are the paper's Table 1; attention FLOPs do
   not depend on the head count. The model is ``examples/megatron.py``'s GPT
   with Megatron-LM's 2021 kernels: separate q, k, v projections (a column
   split is a head split, as Megatron-LM lays its fused projection out per
   head), the GeLU one kernel (its fused bias-GeLU), unfused attention (the
   scores matmul, one softmax kernel with the scale and the causal mask inside,
   as its fused ``scaled_upper_triang_masked_softmax``, dropout, the second
   matmul), the loss over fp32 logits (its ``output.float()``). Full activation
   recompute; the TFLOP/s count the recompute forward: 96·B·s·l·h²·(1 + s/6h +
   V/16lh) FLOPs per step (paper, eq. 3). Assumed: micro-batch 1, the 1F1B
   schedule (the README does not name either; the paper's interleaved schedule
   would only make the prediction faster), no distributed optimizer (ZeRO 0,
   2021), dropout 0.1. autopar's sharding cannot split a batched matmul whose
   batch merges the batch and head dims over both dp and tp (DTensor's strided
   shard, which autopar's placements do not have): its plans of these unfused
   attentions gather q and k over tp, traffic Megatron-LM does not have.

B. Megatron-Core r0.8.0 weak scaling on H100 (DGX H100, 8 x NDR 400 Gb/s per
   node): NVIDIA/Megatron-LM README at commit
   d98e8a64ddf34856e74b24714e3bedb2f5a39553, ``images/model_table.png``:
   heads, hidden, layers, tp, pp, dp, GPUs, batch, TFLOP/s per GPU and MFU;
   vocabulary 131,072, sequence 4,096, "fine-grained overlapping with DP
   (--overlap-grad-reduce, --overlap-param-gather), TP (--tp-comm-overlap), and
   PP" (README text; hence the distributed optimizer, ZeRO 1). Costed with
   Megatron-Core's runtime (``MEGATRON_CORE``): the tensor-parallel collectives
   pipelined with the GEMMs next to them, the parameter gather under the next
   step's forward, its buckets of max(40M, 1M x dp) parameters
   (``megatron/core/distributed/distributed_data_parallel.py`` at core_r0.8.0,
   baf94af3c667248865f23df73b9fb8e2395e6fd0), and Transformer Engine's cuDNN
   attention (below). MFU = TFLOP/s / 989, so the TFLOP/s are model FLOPs,
   taken as 72·B·s·l·h²·(1 + s/6h + V/12lh) per step. The model is
   ``examples/megatron.py``'s GPT with flash attention (one causal kernel).
   Gradients held, accumulated and reduced in fp32: with ``--bf16``
   Megatron-LM sets ``accumulate_allreduce_grads_in_fp32`` ("bfloat16 requires
   gradient accumulation and all-reduce to be done in fp32",
   ``megatron/training/arguments.py`` at core_r0.8.0), which becomes the DDP's
   ``grad_reduce_in_fp32`` (``megatron/training/training.py``): one fp32 gradient
   buffer a parameter, the micro-batches' gradients added into it
   (``distributed_data_parallel.py``, ``grad_dtype = torch.float``), its buckets of
   fp32. The pipelined runs (pp > 1) are costed with the interleaved schedule:
   the README overlaps "pipeline-parallel communication (enabled by default)",
   which is ``--overlap-p2p-communication``, on by default, and which
   Megatron-LM keeps only under the interleaved schedule (``arguments.py`` at
   core_r0.8.0: "Overlap P2P communication is disabled if not using the
   interleaved schedule"; ``schedules.py``'s non-interleaved 1F1B refuses it).
   The number of virtual stages is not stated; autopar's interleaved schedule
   deals two chunks to a rank (more would only shorten the bubble). Assumed: no
   activation recompute, micro-batch 1, Megatron-LM's default dropout 0.1.

C. torchtitan, FSDP2 (ZeRO 3), bf16, eager; HuggingFace's LLaMA with
   scaled-dot-product attention told the mask is causal, as torchtitan's
   LLaMA calls it (``llama(..., attention="causal")``):
   * pytorch/torchtitan ``benchmarks/llama3_h100_202412_torchtitan.md`` at
     commit b5bcd76c66d0acb1a08b176d9639425bc55e0b2a, Tables 1 and 3, row
     "FSDP": Llama 3.1 8B on 8 and on 128 H100 (Grand Teton: 96 GB HBM2e at
     2.4 TB/s, 500 W, 400 Gb/s per GPU between hosts; its footnote 2: the peak
     FLOP/s at 500 W lie between the SXM's and the NVL's, so 912 TFLOP/s bf16,
     their middle, is taken), local batch 2, selective
     (per-op) activation checkpointing: 5,762 and 5,605 tokens/s/GPU, 82.4 and
     67.0 GiB (the caching allocator's peak reserved bytes, torchtitan's
     ``max_reserved_gib``). Sequence 8,192 (torchtitan's Llama 3 8B training
     config, ``train_configs/llama3_8b.toml`` at torchtitan 9dec370, the
     benchmark's commit). Per-op checkpointing is costed as it ran:
     ``fixed={"recompute": "op-sac"}`` carries out torchtitan's policy
     (``parallelize_llama.py`` at 9dec370: the attention kernel's outputs and
     every other ``aten.mm``'s kept, the rest of each layer replayed), except
     that torchtitan also keeps the MLP down projection's output, which no
     backward op reads (one hidden-size activation a layer, 4.3 GB at local
     batch 2), and autopar frees it.
   * pytorch/torchtitan ``docs/performance.md`` at commit
     1ea476e9f24be439eda358aa864f45c1c37a8a88 (and unchanged at 4d88a8a),
     "Llama 3 performance numbers", 64 A100 80 GB, local batch 1, sequence
     8,192: Llama 3 8B with per-op checkpointing, 2,973 tokens/s/GPU (its
     config at that commit, ``train_configs/llama3_8b.toml``: ``compile =
     false``, ``norm_type = "fused_rmsnorm"``, a Triton kernel a pass, costed
     as LayerNorm's one ATen kernel of the same bytes); Llama 3 70B with full
     activation checkpointing, 331 tokens/s/GPU (``norm_type = "rmsnorm"``).

Every torchtitan run reduces its gradients in fp32, as autopar's runtime does by
default: FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``
(``torchtitan/parallelisms/parallelize_llama.py`` at 1ea476e; at 9dec370
``--training.mixed_precision_reduce``, default and only choice "float32",
``torchtitan/config_manager.py``).

The kernel figures the devices hold (``autopar/hardware/devices.py``): a dense
matmul's best, stas00/ml-engineering's "Maximum Achievable Matmul FLOPS";
attention, FlashAttention-2's benchmark plots (Dao-AILab/flash-attention). The
cuDNN attention of B: on Hopper Transformer Engine prefers its FusedAttention
(cuDNN) backend over FlashAttention (``transformer_engine/pytorch/attention.py``,
``get_attention_backend``, at NVIDIA/TransformerEngine 6792eca), 518 TFLOP/s
against FlashAttention-2's 319 (forward, causal, head dimension 128, sequence
4k, H100; Dao-AILab/flash-attention ``assets/flash3_fp16_fwd.png`` at
7ef24848cf2f855077cef88fe122775b727dcd74).

Runs left out. Llama 3 405B pre-training (Meta, "The Llama 3 Herd of Models",
arXiv:2407.21783v3, §3.3.2 and Table 4): 8,192 H100 with TP 8, CP 1, PP 16,
DP 64, sequence 8,192, 32 sequences per DP group, 430 TFLOP/s per GPU; 16,384
with DP 128, 16 per group, 400 TFLOP/s (not 400 at 8K). Planned as published
(ZeRO 2, as its FSDP "shards optimizer states and gradients" and keeps the
parameters whole; no activation checkpointing; interleaved 1F1B), autopar
predicts 0.77 and 0.64 of the published throughput and 193 / 139 GB a GPU: the
configuration is not one autopar can pin. Its interleaved schedule has V = 8
stages a rank (126 layers, the embedding and the head dealt one to a chunk over
16 ranks: "the first model chunk on the first stage has only the embedding, and
the last model chunk on the last stage has only output projection and loss"),
so a bubble of 15 / (8·M), with a tunable number N of micro-batches in a row
that sets how many are in flight; autopar's interleaved schedule deals 2 chunks
to a rank and ``fixed`` has no key for more (at 8K, the predicted step is 15.7 s
against the published 12.6, and its bubble of 2.6 s would be 0.7 s with 8
chunks: two thirds of the gap); the memory it fits in 80 GB without checkpointing
rests on freeing each stage's inputs and outputs as soon as they are sent
("proactively deallocated"), which autopar's runtime does not do. Its attention
(with a document mask) and tensor-parallel overlap are not named.
torchtitan's 2D, 3D and 4D H100 runs (Tables 2, 4, 5, 6 of the
2024-12 benchmark) train in Float8, and autopar has no fp8 peak. Its Llama 3.1
405B on 128 H100 (``docs/performance.md``, 109 tokens/s/GPU, FSDP 16 x TP 8):
the 405B config it ran (``train_configs/llama3_405b.toml`` when the row was
written, 3faaa1a) compiles the model, whose element-wise fusions autopar's
cost model does not have. Llama 3 405B at 128K context (Table 4's third row)
trains with context parallelism (CP 16), which ``fixed`` can pin since autopar plans
it; it is left out with the other two: its PP 16 runs the same interleaved schedule
of 8 chunks a rank, which autopar's cannot pin.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import autopar  # noqa: E402
from autopar.cost_models import comm, compute, overlap  # noqa: E402
from autopar.cost_models.compute import ComputeEfficiency  # noqa: E402
from autopar.hardware.cluster import DEVICES  # noqa: E402
from examples.megatron import megatron_gpt  # noqa: E402
from examples.models import llama  # noqa: E402

# torchtitan's H100s (section C): 96 GB of HBM2e at 2.4 TB/s, run at 500 W; its benchmark page says their
# peak "is between SXM and NVL" (989 and 835 TFLOP/s bf16 dense): taken as the middle of the two.
H100_GRAND_TETON = dataclasses.replace(
    DEVICES["H100-80GB"],
    name="H100-96GB-HBM2e-500W",
    memory_bytes=96 * 10**9,
    hbm_bandwidth=2.4e12,
    peak_flops={**DEVICES["H100-80GB"].peak_flops, "bf16": 912e12, "fp16": 912e12},
)


# Megatron-Core's runtime (section B): tensor-parallel collectives overlapped with the GEMMs, the distributed
# optimizer's parameter gather overlapped with the next step's forward (the README's --tp-comm-overlap and
# --overlap-param-gather), and Transformer Engine's attention, which on Hopper is cuDNN's fused kernel (transformer_engine/pytorch/attention.py,
# get_attention_backend: "give FusedAttention preference on Hopper+", NVIDIA/TransformerEngine 6792eca):
# 518 TFLOP/s against FlashAttention-2's 319 forward, causal, head dimension 128, sequence 4k, on an H100
# (Dao-AILab/flash-attention, assets/flash3_fp16_fwd.png at 7ef24848cf2f855077cef88fe122775b727dcd74).
# Its data-parallel buckets hold max(40M, 1M x dp) parameters (megatron/core/distributed/
# distributed_data_parallel.py at core_r0.8.0, baf94af3c667248865f23df73b9fb8e2395e6fd0), of fp32 gradients:
# with --bf16 Megatron-LM sets accumulate_allreduce_grads_in_fp32, hence grad_reduce_in_fp32 (section B).
# The same buckets gather bf16 parameters, half these bytes: only the first bucket's share, a few percent of
# the gather, depends on it.
# Each micro-batch's weight gradients are added into that fp32 buffer (param.main_grad) as the backward makes
# them: held once over the step, not beside a running sum (autopar.cost_models.overlap).
MEGATRON_CORE = overlap.Runtime(
    tp_comm_overlap=True,
    param_gather_overlap=True,
    attention_speedup=518 / 319,
    bucket_bytes=40e6 * 4,
    bucket_bytes_per_rank=1e6 * 4,
    grads_accumulate_in_place=True,
)


@dataclass
class Run:
    """One published run: the model, the cluster, the configuration as the source states it, the figure."""

    name: str
    model: tuple  # ("gpt", layers, hidden, heads, vocab, seq) or ("llama", layers, hidden, heads, inter, vocab, seq, kv)
    cluster: Any
    batch: int  # global batch, sequences
    fixed: dict
    tokens_per_gpu_s: float  # published throughput
    fit: bool = False  # in the fit (mark_fit), not held out
    attention: str = "flash"  # the GPT's attention (examples/megatron.py): "flash" (one kernel) or "unfused" (2021)
    # what the run's runtime overlaps beyond autopar's own (its source names it): Megatron-Core's TP overlap
    runtime: overlap.Runtime = overlap.AUTOPAR_RUNTIME
    memory_gib: float | None = None  # published peak memory per GPU (the allocator's reserved bytes), if any
    fused_norm: bool = False  # the LLaMA's RMSNorm one kernel a pass (torchtitan's fused_rmsnorm), not PyTorch's ops
    # the dtype its gradients were reduced in: fp32 for every run here (Megatron-LM's bf16 forces it, torchtitan's
    # FSDP2 policy asks it; the docstring's sources), not the bf16 they were computed in
    reduce_dtype: str = "fp32"
    peak_bytes: float = 0.0  # the estimate's peak memory per device, set when the run is planned

    @property
    def seq(self) -> int:
        return self.model[-1] if self.model[0] == "gpt" else self.model[6]

    def build(self):
        """The model on the meta device in bf16, the dtype the run computed in: its trace holds the fp32 copies
        the model's code makes (a norm's, the loss's logits), as the run did."""
        if self.model[0] == "gpt":
            _, layers, hidden, heads, vocab, seq = self.model
            model, inputs = megatron_gpt(layers, hidden, heads, vocab=vocab, seq=seq, batch=1, attention=self.attention)
        else:
            _, layers, hidden, heads, inter, vocab, seq, kv = self.model
            model, inputs = llama(
                layers, hidden, heads, inter, vocab=vocab, seq=seq, batch=1, kv_heads=kv, attention="causal"
            )
            if self.fused_norm:
                _fuse_norms(model, hidden)
        return model.to(torch.bfloat16), inputs


def _fuse_norms(model, hidden: int) -> None:
    """Each RMSNorm as one kernel a pass, as torchtitan's Triton ``fused_rmsnorm``: costed as LayerNorm's single
    ATen kernel, which reads and writes the same bytes (PyTorch's RMSNorm is six element-wise kernels)."""
    for name, module in list(model.named_modules()):
        if type(module).__name__ == "LlamaRMSNorm":
            parent, _, child = name.rpartition(".")
            norm = torch.nn.LayerNorm(hidden, bias=False, device="meta")
            setattr(model.get_submodule(parent) if parent else model, child, norm)


def _megatron_2021(size, hidden, layers, heads, mp, gpus, batch, tflops) -> Run:
    """Section A: TFLOP/s per GPU that count the recompute forward, converted to tokens/s/GPU."""
    tp, pp = min(mp, 8), max(1, mp // 8)
    seq, vocab = 2048, 51200
    flops_per_token = 96 * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))
    dp = gpus // mp
    fixed = {"dp": dp, "tp": tp, "pp": pp, "zero": 0, "recompute": "full", "microbatches": batch // dp}
    if pp > 1:
        fixed["schedule"] = "1F1B"
    return Run(
        f"Megatron GPT {size} A100",
        ("gpt", layers, hidden, heads, vocab, seq),
        autopar.Cluster.preset("dgx-a100", nodes=gpus // 8),
        batch,
        fixed,
        tflops * 1e12 / flops_per_token,
        attention="unfused",
    )


def _megatron_core_h100(size, heads, hidden, layers, tp, pp, dp, gpus, batch, tflops) -> Run:
    """Section B: model TFLOP/s per GPU converted to tokens/s/GPU."""
    seq, vocab = 4096, 131072
    flops_per_token = 72 * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (12 * layers * hidden))
    fixed = {"dp": dp, "tp": tp, "pp": pp, "zero": 1, "recompute": "none", "microbatches": batch // dp}
    if pp > 1:  # the pipeline-parallel overlap the README names exists only in the interleaved schedule
        fixed["schedule"] = "interleaved"
    assert dp * tp * pp == gpus
    return Run(
        f"Megatron-Core GPT {size} H100",
        ("gpt", layers, hidden, heads, vocab, seq),
        autopar.Cluster.preset("dgx-h100", nodes=gpus // 8),
        batch,
        fixed,
        tflops * 1e12 / flops_per_token,
        runtime=MEGATRON_CORE,
    )


LLAMA3_8B = ("llama", 32, 4096, 32, 14336, 128256, 8192, 8)
LLAMA3_70B = ("llama", 80, 8192, 64, 28672, 128256, 8192, 8)


RUNS: list[Run] = [
    _megatron_2021("1.7B", 2304, 24, 24, 1, 32, 512, 137),
    _megatron_2021("3.6B", 3072, 30, 32, 2, 64, 512, 138),
    _megatron_2021("7.5B", 4096, 36, 32, 4, 128, 512, 142),
    _megatron_2021("18B", 6144, 40, 48, 8, 256, 1024, 135),
    _megatron_2021("39B", 8192, 48, 64, 16, 512, 1536, 138),
    _megatron_2021("76B", 10240, 60, 80, 32, 1024, 1792, 140),
    _megatron_2021("145B", 12288, 80, 96, 64, 1536, 2304, 148),
    _megatron_2021("530B", 20480, 105, 128, 280, 2520, 2520, 163),
    _megatron_core_h100("1.7B", 16, 2048, 24, 1, 1, 48, 48, 192, 408.8),
    _megatron_core_h100("7.1B", 32, 4096, 30, 2, 1, 48, 96, 192, 465.9),
    _megatron_core_h100("16B", 48, 6144, 32, 4, 1, 48, 192, 192, 489.1),
    _megatron_core_h100("32B", 56, 7168, 48, 8, 1, 48, 384, 192, 459.6),
    _megatron_core_h100("70B", 64, 8192, 84, 8, 2, 48, 768, 384, 419.7),
    _megatron_core_h100("119B", 80, 10240, 92, 8, 4, 48, 1536, 768, 420.5),
    _megatron_core_h100("177B", 96, 12288, 96, 8, 6, 48, 2304, 1152, 432.8),
    _megatron_core_h100("314B", 128, 16384, 96, 8, 8, 48, 3072, 1536, 474.4),
    _megatron_core_h100("462B", 144, 18432, 112, 8, 16, 48, 6144, 3072, 459.9),
    Run(
        "torchtitan Llama3.1 8B 8xH100 FSDP",
        LLAMA3_8B,
        autopar.Cluster(nodes=1, gpus_per_node=8, device=H100_GRAND_TETON),
        16,
        {"dp": 8, "tp": 1, "pp": 1, "zero": 3, "recompute": "op-sac", "microbatches": 1},
        5762,
        memory_gib=82.4,
    ),
    Run(
        "torchtitan Llama3.1 8B 128xH100 FSDP",
        LLAMA3_8B,
        autopar.Cluster(nodes=16, gpus_per_node=8, device=H100_GRAND_TETON, inter_node_bandwidth=50e9),
        256,
        {"dp": 128, "tp": 1, "pp": 1, "zero": 3, "recompute": "op-sac", "microbatches": 1},
        5605,
        memory_gib=67.0,
    ),
    Run(
        "torchtitan Llama3 8B 64xA100 FSDP",
        LLAMA3_8B,
        autopar.Cluster.preset("dgx-a100", nodes=8),
        64,
        {"dp": 64, "tp": 1, "pp": 1, "zero": 3, "recompute": "op-sac", "microbatches": 1},
        2973,
        fused_norm=True,
    ),
    Run(
        "torchtitan Llama3 70B 64xA100 FSDP",
        LLAMA3_70B,
        autopar.Cluster.preset("dgx-a100", nodes=8),
        64,
        {"dp": 64, "tp": 1, "pp": 1, "zero": 3, "recompute": "full", "microbatches": 1},
        331,
    ),
]

FOLDS = 3  # the fit takes every FOLDS-th run: a third of them


def mark_fit(runs: list[Run], fold: int = 0) -> None:
    """Fit on every third run from ``fold`` (0, 1 or 2) in the table's order; hold the others out."""
    for i, run in enumerate(runs):
        run.fit = i % FOLDS == fold


REFERENCE = (0.8, 0.5, 0.8)  # (matmul, memory, link): where the fit's linearisation is taken
PERTURB = 0.8  # each factor is multiplied by this in turn to read its term


def set_factors(matmul: float, memory: float, link: float) -> None:
    """Point the library's factors (read at call time) at these values."""
    compute.DEFAULT_EFFICIENCY = ComputeEfficiency(matmul=matmul, memory=memory)
    comm.LINK_EFFICIENCY = link


def step_time(run: Run, model, inputs) -> float:
    """The planner's step time for the run's pinned configuration at the factors currently set,
    costed with the runtime the run used."""
    overlap.RUNTIME = run.runtime
    try:
        plan = autopar.plan(
            model,
            inputs,
            run.cluster,
            global_batch_size=run.batch,
            fixed=run.fixed,
            reduce_dtype=run.reduce_dtype,
            time_limit_s=30,
        )
    finally:
        overlap.RUNTIME = overlap.AUTOPAR_RUNTIME
    run.peak_bytes = plan.estimate.memory.peak
    return plan.estimate.step_time_s


def tokens_per_gpu(run: Run, step: float) -> float:
    return run.batch * run.seq / step / run.cluster.world_size


def terms(run: Run, base: tuple[float, float, float]) -> tuple[float, float, float, float]:
    """(A, B, C, D) of step ≈ D + A/e_matmul + B/e_memory + C/e_link around ``base``, from four plans."""
    model, inputs = run.build()
    set_factors(*base)
    t0 = step_time(run, model, inputs)
    coeffs = []
    for k in range(3):
        point = list(base)
        point[k] *= PERTURB
        set_factors(*point)
        t = step_time(run, model, inputs)
        # t - t0 = coeff * (1/(e·PERTURB) - 1/e)
        coeffs.append((t - t0) / (1 / point[k] - 1 / base[k]))
    d = t0 - sum(c / e for c, e in zip(coeffs, base, strict=True))
    return (*coeffs, d)


def fit(runs: list[Run], rounds: int = 2) -> tuple[float, float, float]:
    """The three factors minimising Σ log(predicted / published)² over the fit runs (a grid search).

    Each round linearises the step times (:func:`terms`) at the previous round's answer, the first at
    REFERENCE: the linearisation is exact only where it is taken.
    """
    point = REFERENCE
    for r in range(rounds):
        linear = {}
        for run in runs:
            start = time.perf_counter()
            linear[run.name] = terms(run, point)
            print(f"  round {r + 1}: terms of {run.name}: {time.perf_counter() - start:.0f} s", flush=True)
        point = _grid_fit(runs, linear)
        print(f"  round {r + 1}: matmul {point[0]:.2f}, memory {point[1]:.2f}, link {point[2]:.2f}", flush=True)
    return point


def _grid_fit(runs: list[Run], linear: dict[str, tuple[float, float, float, float]]) -> tuple[float, float, float]:
    def loss(e: tuple[float, float, float]) -> float:
        total = 0.0
        for run in runs:
            a, b, c, d = linear[run.name]
            step = d + a / e[0] + b / e[1] + c / e[2]
            if step <= 0:
                return math.inf
            total += math.log(tokens_per_gpu(run, step) / run.tokens_per_gpu_s) ** 2
        return total

    grid = itertools.product(
        [x / 100 for x in range(40, 101)], [x / 100 for x in range(20, 101, 2)], [x / 100 for x in range(30, 101, 2)]
    )
    return min(grid, key=loss)


def report(rows: list[tuple[Run, float]]) -> None:
    """The table of every run, the held-out errors, and the error against tp, pp and GPU count."""
    print(
        f"\n{'run':<38} {'GPUs':>5} {'tp':>3} {'pp':>3} {'recompute':>9} {'in fit':>6} "
        f"{'published tok/s/GPU':>20} {'predicted':>10} {'pred/pub':>8}  {'memory GB: estimate / device':>28}"
    )
    held = []
    for run, pred in rows:
        ratio = pred / run.tokens_per_gpu_s
        f = run.fixed
        device = run.cluster.device_spec.memory_bytes
        memory = f"{run.peak_bytes / 1e9:6.1f} / {device / 1e9:3.0f}" + ("" if run.peak_bytes <= device else " over")
        if run.memory_gib is not None:
            memory += f" (published {run.memory_gib * 2**30 / 1e9:.1f})"
        print(
            f"{run.name:<38} {run.cluster.world_size:>5} {f['tp']:>3} {f['pp']:>3} {f['recompute']:>9} "
            f"{'yes' if run.fit else 'no':>6} {run.tokens_per_gpu_s:>20,.0f} {pred:>10,.0f} {ratio:>8.3f}  {memory}"
        )
        if not run.fit:
            held.append((run, ratio - 1))
    if not held:
        return
    errs = [abs(e) for _, e in held]
    print(
        f"\nheld out ({len(held)} runs): median |error| {100 * statistics.median(errs):.1f}%, "
        f"worst {100 * max(errs):.1f}%, mean signed {100 * statistics.mean(e for _, e in held):+.1f}%"
    )
    for label, key in (
        ("tp", lambda r: r.fixed["tp"]),
        ("pp", lambda r: r.fixed["pp"]),
        ("GPUs", lambda r: 2 ** round(math.log2(r.cluster.world_size))),
    ):
        groups: dict[int, list[float]] = {}
        for run, e in held:
            groups.setdefault(key(run), []).append(e)
        cells = ", ".join(
            f"{k}: {100 * statistics.mean(v):+.1f}% (n={len(v)})" for k, v in sorted(groups.items())
        )
        print(f"held-out mean signed error by {label:<4} {cells}; {_slope(held, key)}")


def _slope(held: list[tuple[Run, float]], key) -> str:
    """The least-squares slope of the signed error against log2 of ``key``: the trend, per doubling."""
    xs = [math.log2(key(run)) for run, _ in held]
    if len(set(xs)) < 2:
        return "no spread"
    slope = statistics.linear_regression(xs, [e for _, e in held]).slope
    return f"trend {100 * slope:+.1f}% per doubling"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-fit", action="store_true", help="predict with the library's current factors")
    parser.add_argument("--only", default="", help="only the runs whose name contains one of these (comma-separated)")
    parser.add_argument("--rounds", type=int, default=2, help="linearise-and-fit rounds (each at the last answer)")
    parser.add_argument(
        "--fold", type=int, default=0, choices=range(FOLDS), help="fit on every third run from this one (0, 1, 2)"
    )
    args = parser.parse_args()
    mark_fit(RUNS, args.fold)
    runs = [r for r in RUNS if any(part in r.name for part in args.only.split(","))]
    fitted = [r for r in runs if r.fit]
    assert len([r for r in RUNS if r.fit]) <= len(RUNS) / 3, "fit on a third of the runs at most"
    if args.no_fit:
        factors = (compute.DEFAULT_EFFICIENCY.matmul, compute.DEFAULT_EFFICIENCY.memory, comm.LINK_EFFICIENCY)
        print("library factors:", end=" ")
    else:
        factors = fit(fitted, args.rounds)
        print("fitted factors:", end=" ")
    print(f"matmul {factors[0]:.2f} of peak FLOP/s, memory {factors[1]:.2f} of HBM bandwidth, "
          f"link {factors[2]:.2f} of line rate", flush=True)
    set_factors(*factors)
    rows = []
    for run in runs:
        model, inputs = run.build()
        rows.append((run, tokens_per_gpu(run, step_time(run, model, inputs))))
        print(f"  {run.name}: {rows[-1][1]:,.0f} tok/s/GPU", flush=True)
    report(rows)


if __name__ == "__main__":
    main()
