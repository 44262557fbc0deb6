"""GPT as Megatron-LM builds it: the kernels and the tensor-parallel layout its published runs used.

HuggingFace's GPT-2 differs from Megatron-LM's GPT in what a cost model sees:
its fused query/key/value projection keeps q, k and v in three contiguous
blocks, so splitting the projection's columns over tensor-parallel ranks gives
rank 0 the queries of every head rather than the q, k and v of its own heads
(Megatron-LM lays the projection out per head, so that a column split is a
head split); and its eager attention scales and masks the scores in kernels of
their own. This model has what Megatron-LM runs: separate q, k and v
projections (a column split of each is a head split, as in Megatron-LM's
per-head layout), learned position embeddings, LayerNorm, a GeLU MLP of 4h
(``aten.gelu``, one kernel, as Megatron-LM's fused bias-GeLU), dropout 0.1 on
embeddings, attention probabilities and residuals, tied input and output
embeddings, and the loss over logits upcast to fp32 (Megatron-LM's
``vocab_parallel_cross_entropy`` upcasts them; built in bf16, the trace then
holds the fp32 copy a bf16 run makes). Attention is one of:

* ``"flash"`` — one fused kernel (``F.scaled_dot_product_attention``, causal),
  as Megatron-Core runs Transformer Engine's flash attention;
* ``"unfused"`` — Megatron-LM's 2021 kernels: the scores batched matmul, one
  softmax kernel, dropout, the probabilities x values batched matmul. Megatron-LM
  scales the scores in the matmul (``baddbmm``'s alpha) and masks them inside
  its fused softmax kernel (``scaled_upper_triang_masked_softmax``); here the
  scale is folded into the query projection and the causal mask is left out, so
  that each of Megatron-LM's kernels is one op of the same bytes and FLOPs. That
  attention is not causal: the model is for costing (it lives on the meta
  device), not for training.

Module names follow HuggingFace's LLaMA (``q_proj`` ... ``down_proj``,
``embed_tokens``, ``lm_head``), which autopar's Megatron seed layout knows.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, attention: str, dropout: float) -> None:
        super().__init__()
        if attention not in ("flash", "unfused"):
            raise ValueError(f"attention must be 'flash' or 'unfused', not {attention!r}")
        self.heads, self.attention, self.dropout = heads, attention, dropout
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.o_proj = nn.Linear(hidden, hidden)
        if attention == "unfused":  # the 1/sqrt(d) of the scores, folded into the query projection
            with torch.no_grad():
                scale = 1 / math.sqrt(hidden // heads)
                self.q_proj.weight.mul_(scale)
                self.q_proj.bias.mul_(scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = (p(x).view(b, s, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        p = self.dropout if self.training else 0.0
        if self.attention == "flash":
            ctx = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            probs = F.dropout(torch.softmax(q @ k.transpose(-1, -2), dim=-1), p, self.training)
            ctx = probs @ v
        return self.o_proj(ctx.transpose(1, 2).reshape(b, s, h))


class _Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, attention: str, dropout: float) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(hidden)
        self.self_attn = _Attention(hidden, heads, attention, dropout)
        self.post_attention_layernorm = nn.LayerNorm(hidden)
        self.mlp = nn.ModuleDict({"up_proj": nn.Linear(hidden, 4 * hidden), "down_proj": nn.Linear(4 * hidden, hidden)})
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + F.dropout(self.self_attn(self.input_layernorm(x)), self.dropout, self.training)
        up = F.gelu(self.mlp["up_proj"](self.post_attention_layernorm(x)), approximate="tanh")
        return x + F.dropout(self.mlp["down_proj"](up), self.dropout, self.training)


class MegatronGPT(nn.Module):
    """A GPT decoder with Megatron-LM's kernels (see the module docstring); ``forward`` returns the loss."""

    def __init__(
        self, layers: int, hidden: int, heads: int, vocab: int, seq: int, attention: str, dropout: float = 0.1
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.embed_positions = nn.Embedding(seq, hidden)
        self.layers = nn.ModuleList(_Layer(hidden, heads, attention, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.lm_head.weight = self.embed_tokens.weight  # tied, as Megatron-LM's GPT by default
        self.dropout = dropout

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = F.dropout(self.embed_tokens(input_ids) + self.embed_positions(positions), self.dropout, self.training)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x))  # the loss in fp32, as Megatron-LM's cross entropy upcasts the logits
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def megatron_gpt(
    layers: int,
    hidden: int,
    heads: int,
    vocab: int = 51200,
    seq: int = 2048,
    batch: int = 1,
    attention: str = "flash",
    device: str = "meta",
):
    """A GPT of the given shape with Megatron-LM's kernels and layout, and an example batch."""
    with torch.device(device):
        model = MegatronGPT(layers, hidden, heads, vocab, seq, attention)
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    return model, {"input_ids": ids, "labels": ids}
