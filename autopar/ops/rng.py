"""Random numbers for sharded programs: what a rank draws, keyed so that the plan decides nothing.

A random op in a parallel program must draw numbers that make sense whatever
the plan: a tensor replicated over a mesh axis must come out the same on every
rank of that axis, and the shards of a sharded one must not repeat each other.
A process-wide generator gives neither (every rank would draw the same mask for
its own shard of the batch, or ranks would drift apart).  Here every draw is a
pure function of a *key*, and the runtime's state says which key:

* ``"fast"`` (the default; Megatron-LM's semantics): one ``torch.Generator``
  per draw, seeded from (seed, step, micro-batch, op, and this rank's
  coordinate on every mesh axis the output is sharded over).  Data-parallel
  ranks hold different rows of the batch, so they draw their own numbers;
  tensor-parallel ranks draw the same numbers for a replicated tensor and
  different ones for the shards of a sharded one.  A draw is a native
  ``torch.rand`` / ``torch.randn``: as fast as the op it replaces.
* ``"exact"``: a counter-based generator (splitmix64 over the element's index,
  as DTensor's offset-based Philox tracker does on CUDA).  Element *i* of a
  random tensor gets the number keyed by (seed, step, op, *i*), *i* counted in
  the tensor of the whole global batch, so every plan (any sharding, data
  parallel size, micro-batch count, pipeline) draws exactly the masks one
  device draws under ``"exact"``.  About ten integer ops per element.

Both modes are deterministic given the key, so an op replayed in the backward
(recompute) draws what it drew in the forward, as Megatron-LM's checkpointing
restores the RNG state for the replay.

The draw is one custom op, ``torch.ops.autopar.random``, so that tracing
records one node with its key (op index, global shape, this shard's offset,
stream) as constants; what varies per call (step, micro-batch, the batch's
row order) is read from :func:`state` when it runs.  The runtime sets that
state around every call of a generated graph (:func:`using`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

MODES = ("fast", "exact")
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


@dataclass(frozen=True)
class RngState:
    """What a draw's key takes from the running program, besides the op's own constants.

    ``batch`` is the rows of one micro-batch (the generated graph's batch) and
    ``microbatches`` how many make the global batch; with ``local_batch`` each
    data-parallel rank was given only its part of the global batch, which
    changes which global row a micro-batch's row is (see :func:`global_rows`).
    """

    mode: str = "fast"
    seed: int = 0
    step: int = 0
    microbatch: int = 0
    microbatches: int = 1
    batch: int = 1
    dp_size: int = 1
    local_batch: bool = False


_state = RngState()


def state() -> RngState:
    """The state draws read now."""
    return _state


@contextlib.contextmanager
def using(new: RngState) -> Iterator[RngState]:
    """Draws inside the block read ``new``; the previous state comes back after it."""
    global _state
    saved, _state = _state, new
    try:
        yield new
    finally:
        _state = saved


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"rng must be one of {', '.join(repr(m) for m in MODES)}, not {mode!r}")
    return mode


# ---------------------------------------------------------------------------- keys


def _splitmix(x: int) -> int:
    z = (x + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * _M1) & _MASK64
    z = ((z ^ (z >> 27)) * _M2) & _MASK64
    return z ^ (z >> 31)


def mix(*values: int) -> int:
    """A 64-bit key from integers (each may be negative), every bit depending on every value."""
    h = 0
    for v in values:
        h = _splitmix(h ^ (v & _MASK64))
    return h


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 values (torch's ``>>`` on int64 is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def counter_bits(key: int, index: torch.Tensor) -> torch.Tensor:
    """splitmix64 of ``key + index * golden``: 64 random bits per element of the int64 ``index``.

    Element-wise and stateless, so any subset of indices can be drawn on any
    rank and agrees with a draw of all of them.  int64 arithmetic wraps.
    """
    z = index * _signed(_GOLDEN) + _signed((key + _GOLDEN) & _MASK64)
    z = (z ^ _shr(z, 30)) * _signed(_M1)
    z = (z ^ _shr(z, 27)) * _signed(_M2)
    return z ^ _shr(z, 31)


def bits_to_uniform(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Numbers in [0, 1) from random bits: the top 24 (float32 and narrower) or 53 (float64) bits."""
    if dtype == torch.float64:
        return _shr(bits, 11).to(torch.float64) * 2.0**-53
    return (_shr(bits, 40).to(torch.float32) * 2.0**-24).to(dtype)


# ---------------------------------------------------------------------------- global element indices


def global_rows(rows: torch.Tensor, st: RngState) -> torch.Tensor:
    """The row of the global batch that row ``rows`` of the current micro-batch's (whole) tensor holds.

    The runtime cuts the global batch into ``microbatches`` consecutive chunks,
    then each chunk over the data-parallel ranks.  With ``local_batch`` each
    rank was given its consecutive part of the global batch and cuts that into
    micro-batches, so micro-batch ``k``'s rows on rank ``r`` are the
    ``k``-th chunk of ``r``'s part.
    """
    k, b = st.microbatch, st.batch
    if not st.local_batch or st.dp_size <= 1 or st.microbatches <= 1:
        return rows + k * b
    q = b // st.dp_size  # rows of one micro-batch on one data-parallel rank
    r, j = rows // q, rows % q
    return r * (q * st.microbatches) + k * q + j


def element_index(
    local_shape: list[int], global_shape: list[int], offset: list[int], st: RngState
) -> torch.Tensor:
    """Each local element's index in the tensor of the whole global batch (int64, ``local_shape``).

    Dim 0 of a tensor whose size is a multiple of the micro-batch's rows is
    taken to be batch-major (the batch its outermost factor, as it is for the
    activations of batch-first models); its rows are renumbered to the global
    batch's with :func:`global_rows`.  Any other tensor is numbered within its
    micro-batch, with the micro-batch's number above.
    """
    idx = torch.zeros((), dtype=torch.int64)
    stride = 1
    for d in reversed(range(len(global_shape))):
        pos = torch.arange(offset[d], offset[d] + local_shape[d], dtype=torch.int64)
        idx = idx + (pos * stride).reshape([-1] + [1] * (len(global_shape) - 1 - d))
        stride *= global_shape[d]
    idx = idx.expand(local_shape) if local_shape else idx
    numel = math.prod(global_shape)
    lead = global_shape[0] if global_shape else 0
    if lead and st.batch and lead % st.batch == 0:
        per_row = numel // st.batch
        return global_rows(idx // per_row, st) * per_row + idx % per_row
    return idx + st.microbatch * numel


# ---------------------------------------------------------------------------- the op


def _fast(
    shape: list[int], dtype: torch.dtype, device: torch.device, op: int, stream: list[int], normal: bool
) -> torch.Tensor:
    st = _state
    gen = torch.Generator(device=device)
    gen.manual_seed(mix(st.seed, st.step, st.microbatch, op, *stream) & ((1 << 63) - 1))
    draw = torch.randn if normal else torch.rand
    return draw(shape, generator=gen, dtype=dtype, device=device)


def _exact(
    shape: list[int],
    dtype: torch.dtype,
    device: torch.device,
    op: int,
    global_shape: list[int],
    offset: list[int],
    normal: bool,
) -> torch.Tensor:
    st = _state
    key = mix(st.seed, st.step, op)
    idx = element_index(shape, global_shape, offset, st).to(device)
    work = torch.float64 if dtype == torch.float64 else torch.float32
    if not normal:
        return bits_to_uniform(counter_bits(key, idx), work).to(dtype)
    # Box-Muller from two numbers per element (counters 2i and 2i + 1); 1 - u keeps the log finite
    u1 = 1.0 - bits_to_uniform(counter_bits(key, 2 * idx), work)
    u2 = bits_to_uniform(counter_bits(key, 2 * idx + 1), work)
    return (torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2 * math.pi * u2)).to(dtype)


@torch.library.custom_op("autopar::random", mutates_args=())
def random_tensor(
    shape: list[int],
    dtype: torch.dtype,
    device: torch.device,
    op: int,
    global_shape: list[int],
    offset: list[int],
    stream: list[int],
    normal: bool,
) -> torch.Tensor:
    """This rank's part of a uniform [0, 1) (or standard normal) tensor of ``global_shape``.

    ``op`` numbers the random op in the captured graph; ``offset`` is where the
    local part starts in the whole tensor; ``stream`` holds this rank's
    coordinate on each mesh axis the tensor is sharded over (-1 where it is
    replicated).  The mode, seed, step and micro-batch come from :func:`state`.
    """
    if _state.mode == "exact":
        return _exact(shape, dtype, device, op, global_shape, offset, normal)
    return _fast(shape, dtype, device, op, stream, normal)


@random_tensor.register_fake
def _(shape, dtype, device, op, global_shape, offset, stream, normal):  # noqa: ANN001, ANN202
    return torch.empty(shape, dtype=dtype, device=device)


def draw(
    shape: list[int],
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    *,
    op: int = 0,
    normal: bool = False,
    global_shape: list[int] | None = None,
    offset: list[int] | None = None,
    stream: list[int] | None = None,
) -> torch.Tensor:
    """``torch.ops.autopar.random`` with the whole tensor's defaults: one rank drawing all of it."""
    shape = [int(s) for s in shape]
    return torch.ops.autopar.random(
        shape,
        dtype,
        torch.device(device),
        op,
        list(global_shape) if global_shape is not None else shape,
        list(offset) if offset is not None else [0] * len(shape),
        list(stream) if stream is not None else [],
        normal,
    )


def with_state(**changes: object) -> RngState:
    """The current state with ``changes``: for the runtime's per-call updates."""
    return replace(_state, **changes)
