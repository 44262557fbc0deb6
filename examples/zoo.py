"""Every causal LM family the installed transformers ships, built tiny from its default config.

Where :mod:`examples.families` picks a few dozen families and sizes each by
hand, this builds any ``<Family>ForCausalLM`` class from its config's defaults
with only the sizes made small, by one rule for all: hidden 32, 4 heads (2
key/value heads), head dim 8, vocabulary 128, and one layer of each kind the
default stack has (a hybrid's attention, Mamba and MoE layers alike, read off
its per-layer lists), at least two. What the family ships otherwise (dropout,
norms, activations, routing, attention variants) stays. A config the rule
cannot shrink consistently raises at construction; ``benchmarks/hf_zoo.py``
reports those apart from autopar's own failures.

``causal_lm(name)`` returns ``(model, inputs)`` as the factories of
:mod:`examples.families` do; ``factory(name)`` wraps it in a picklable
callable for launched processes.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

BATCH, SEQ, VOCAB, HIDDEN, HEADS, HEAD_DIM = 8, 16, 128, 32, 4, 8

# config keys set wherever the default config has them
SIZES: dict[str, Any] = dict(
    hidden_size=HIDDEN, d_model=HIDDEN, n_embd=HIDDEN,
    intermediate_size=2 * HIDDEN, ffn_dim=2 * HIDDEN, n_inner=2 * HIDDEN, d_ff=2 * HIDDEN, hidden_dim=2 * HIDDEN,
    num_attention_heads=HEADS, n_head=HEADS, num_heads=HEADS, num_key_value_heads=2, head_dim=HEAD_DIM,
    vocab_size=VOCAB, max_position_embeddings=64, n_positions=64,
    # mixtures of experts: 4 experts, top-2, small experts
    moe_intermediate_size=HIDDEN, num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
    shared_expert_intermediate_size=2 * HIDDEN, n_group=2, topk_group=1,
    # latent attention (DeepSeek): low ranks, rotary and plain halves of a head
    kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=HEAD_DIM,
    # state-space layers: a small state, chunks of the sequence
    state_size=8, mamba_d_state=8, ssm_state_size=8, chunk_size=SEQ, mamba_chunk_size=SEQ,
    sliding_window=8, rotary_dim=4,
    # a stack of layers run in cycles (HRM): one layer a stack
    num_layers_per_stack=1,
)
LAYER_KEYS = ("num_hidden_layers", "num_layers", "n_layer")
MAX_KINDS = 4  # layers kept: one of each kind, at most this many


def causal_lm_names() -> list[str]:
    """The families of the installed transformers with a causal LM head, by name (``Llama`` for ``LlamaForCausalLM``)."""
    import transformers

    suffix = "ForCausalLM"
    return sorted(n[: -len(suffix)] for n in dir(transformers) if n.endswith(suffix) and n != "AutoModel" + suffix)


def _kept_layers(per_layer: dict[str, list], n: int) -> list[int]:
    """The first layer of each kind (a tuple of the layer's entries in every per-layer list), in order; two at least."""
    kinds: dict[tuple, int] = {}
    for i in range(n):
        kinds.setdefault(tuple(str(v[i]) for v in per_layer.values()), i)
    keep = sorted(kinds.values())[:MAX_KINDS]
    return keep if len(keep) >= 2 else list(range(min(2, n)))


def small_config(config_cls: type) -> Any:
    """``config_cls``'s defaults with the sizes of :data:`SIZES` and one layer of each kind."""
    default = config_cls()
    d = default.to_dict()
    # a key the config has, under its own name or as one of its attribute_map's aliases (set by its own name)
    alias = getattr(default, "attribute_map", {})
    over = {alias.get(k, k): v for k, v in SIZES.items() if alias.get(k, k) in d}
    layers_key = next((k for k in LAYER_KEYS if isinstance(d.get(k), int)), None)
    if layers_key is not None:
        n = d[layers_key]
        per_layer = {k: v for k, v in d.items() if isinstance(v, list) and len(v) == n and n > 1}
        keep = _kept_layers(per_layer, n)
        over[layers_key] = len(keep)
        over.update({k: [v[i] for i in keep] for k, v in per_layer.items()})
        for k, v in d.items():  # settings keyed by layer index: those of the kept layers, renumbered
            if isinstance(v, dict) and v and all(str(i).isdigit() for i in v):
                by_index = {int(i): e for i, e in v.items()}
                over[k] = {new: by_index[old] for new, old in enumerate(keep) if old in by_index}
    top_k = getattr(default, "num_experts_per_tok", None)
    if isinstance(top_k, int):  # top-2, or the family's own k where it routes to fewer
        over[alias.get("num_experts_per_tok", "num_experts_per_tok")] = min(2, top_k)
    if "kv_lora_rank" in d:  # latent attention expands its keys and values to every head
        over["num_key_value_heads"] = HEADS
        if "head_dim" in d and "qk_rope_head_dim" in d:  # its head_dim is the rotary part's
            over["head_dim"] = SIZES["qk_rope_head_dim"]
    if "expand" in d and "num_heads" in d and "head_dim" in d:  # Mamba-2: heads x head dim = expand x hidden
        over["num_heads"] = d["expand"] * HIDDEN // HEAD_DIM
    if "mamba_n_heads" in d:
        over["mamba_n_heads"] = HEADS
        if "mamba_d_head" in d:
            over["mamba_d_head"] = d.get("mamba_expand", 2) * HIDDEN // HEADS
        if "mamba_d_ssm" in d:
            over["mamba_d_ssm"] = d.get("mamba_expand", 2) * HIDDEN
    for key, token in (("pad_token_id", 0), ("bos_token_id", 1), ("eos_token_id", VOCAB - 1)):
        if key in d:
            over[key] = token
    return config_cls(**{**d, **over})


def causal_lm(name: str) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """``<name>ForCausalLM`` from its shrunk default config; the labels are the inputs (the model shifts them)."""
    import transformers

    cls = getattr(transformers, name + "ForCausalLM")
    model = cls(small_config(cls.config_class))
    ids = torch.randint(2, VOCAB - 2, (BATCH, SEQ))
    return model, {"input_ids": ids, "labels": ids}


@functools.cache
def factory(name: str) -> functools.partial:
    """A picklable ``() -> (model, inputs)`` for ``name``, the same object on every call (checks key on it)."""
    return functools.partial(causal_lm, name)
