"""HuggingFace model families as they ship, built tiny for tests: ``factory() -> (model, inputs)``.

Each factory builds the family's training head (causal LM, masked LM,
sequence or image classification, seq2seq LM) from the family's *default*
config with only the sizes made small: one layer where a second adds no
other op, hidden 32, 4 heads, vocabulary 128, sequences of 16, images of
32 x 32, batch 8 (so that dp 2 x tp 2 divides it). Dropout, stochastic depth,
activation functions, norms and biases stay as the family ships them, so a
model trains here as a user's would. Nothing is downloaded; weights are
random (seed before calling). Module-level functions, so that they pickle
into launched processes.
"""

from __future__ import annotations

import torch

from examples import zoo

BATCH = 8
SEQ = 16
VOCAB = 128
HIDDEN = 32
HEADS = 4
FFN = 64
IMAGE = 32
LABELS = 4


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ))


def _causal_lm(config_cls, model_cls, **sizes):
    """A decoder with its LM head; the labels are the inputs (the model shifts them)."""
    cfg = config_cls(vocab_size=VOCAB, **sizes)
    ids = _tokens()
    return model_cls(cfg), {"input_ids": ids, "labels": ids}


def _decoder(config_cls, model_cls, **extra):
    """LLaMA-like sizes: one layer, hidden 32, 4 heads (2 key/value heads), intermediate 64."""
    sizes = dict(
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=1,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
    )
    return _causal_lm(config_cls, model_cls, **{**sizes, **extra})


def _classified(config_cls, model_cls, **sizes):
    """An encoder with a sequence-classification head."""
    cfg = config_cls(vocab_size=VOCAB, num_labels=LABELS, **sizes)
    return model_cls(cfg), {"input_ids": _tokens(), "labels": torch.randint(0, LABELS, (BATCH,))}


def _masked(config_cls, model_cls, **sizes):
    """An encoder with its masked-LM head: every 4th token is a label, the rest are ignored (-100)."""
    cfg = config_cls(vocab_size=VOCAB, **sizes)
    ids = _tokens()
    labels = torch.full_like(ids, -100)
    labels[:, ::4] = ids[:, ::4]
    return model_cls(cfg), {"input_ids": ids, "labels": labels}


_BERT_SIZES = dict(
    hidden_size=HIDDEN,
    num_hidden_layers=1,
    num_attention_heads=HEADS,
    intermediate_size=FFN,
    max_position_embeddings=SEQ,
)


def _images(config_cls, model_cls, **sizes):
    """An image classifier on 3 x 32 x 32 images."""
    cfg = config_cls(num_labels=LABELS, image_size=IMAGE, num_channels=3, **sizes)
    return model_cls(cfg), {
        "pixel_values": torch.randn(BATCH, 3, IMAGE, IMAGE),
        "labels": torch.randint(0, LABELS, (BATCH,)),
    }


def _seq2seq(config_cls, model_cls, **sizes):
    """An encoder-decoder LM: source and target sequences of 16 (the model shifts the labels in)."""
    cfg = config_cls(vocab_size=VOCAB, **sizes)
    return model_cls(cfg), {"input_ids": _tokens(), "labels": _tokens()}


# ------------------------------------------------------------------ decoders


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return _causal_lm(
        GPT2Config, GPT2LMHeadModel, n_embd=HIDDEN, n_layer=1, n_head=HEADS, n_positions=SEQ,
        bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1,
    )


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return _decoder(LlamaConfig, LlamaForCausalLM)


def mistral():
    from transformers import MistralConfig, MistralForCausalLM

    return _decoder(MistralConfig, MistralForCausalLM)


def qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return _decoder(Qwen2Config, Qwen2ForCausalLM)


def qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return _decoder(Qwen3Config, Qwen3ForCausalLM, head_dim=HIDDEN // HEADS)


def gemma():
    from transformers import GemmaConfig, GemmaForCausalLM

    return _decoder(GemmaConfig, GemmaForCausalLM, head_dim=HIDDEN // HEADS)


def gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return _decoder(Gemma2Config, Gemma2ForCausalLM, head_dim=HIDDEN // HEADS)


def phi3():
    from transformers import Phi3Config, Phi3ForCausalLM

    return _decoder(Phi3Config, Phi3ForCausalLM, eos_token_id=VOCAB - 1, pad_token_id=VOCAB - 1)


def phi():
    from transformers import PhiConfig, PhiForCausalLM

    return _decoder(PhiConfig, PhiForCausalLM)


def opt():
    from transformers import OPTConfig, OPTForCausalLM

    return _causal_lm(
        OPTConfig, OPTForCausalLM, hidden_size=HIDDEN, word_embed_proj_dim=HIDDEN, num_hidden_layers=1,
        num_attention_heads=HEADS, ffn_dim=FFN, max_position_embeddings=SEQ, pad_token_id=1,
    )


def gpt_neox():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    return _causal_lm(
        GPTNeoXConfig, GPTNeoXForCausalLM, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=HEADS,
        intermediate_size=FFN, max_position_embeddings=SEQ,
    )


def bloom():
    from transformers import BloomConfig, BloomForCausalLM

    return _causal_lm(BloomConfig, BloomForCausalLM, hidden_size=HIDDEN, n_layer=1, n_head=HEADS)


def olmo2():
    """OLMo 2: RMSNorm over the whole query and key projections (across heads), norms after each sublayer."""
    from transformers import Olmo2Config, Olmo2ForCausalLM

    return _decoder(Olmo2Config, Olmo2ForCausalLM, eos_token_id=VOCAB - 1, pad_token_id=VOCAB - 1)


def falcon():
    from transformers import FalconConfig, FalconForCausalLM

    return _causal_lm(
        FalconConfig, FalconForCausalLM, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=HEADS,
        max_position_embeddings=SEQ,
    )


# ------------------------------------------------------------------ mixture of experts
# ``output_router_logits=True`` is how HuggingFace trains its mixtures with the router's load-balancing
# loss added to the LM loss (the configs default it off, which drops the loss from training).


def mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    return _decoder(
        MixtralConfig, MixtralForCausalLM, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
    )


def qwen2_moe():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    return _decoder(
        Qwen2MoeConfig, Qwen2MoeForCausalLM, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=FFN,
        shared_expert_intermediate_size=FFN, output_router_logits=True,
    )


def qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return _decoder(
        Qwen3MoeConfig, Qwen3MoeForCausalLM, head_dim=HIDDEN // HEADS, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=FFN, output_router_logits=True,
    )


def deepseek_v3(layers: int = 2, dense: int = 1):
    """DeepSeek-V3's layout shrunk: ``dense`` dense first layers, then layers of 8 routed experts (top-2 within
    the best 2 of 4 groups, sigmoid scores, the bias that balances load without a loss) beside a shared expert;
    multi-head latent attention with low-rank queries and keys/values. HuggingFace has no load-balancing
    loss for it (DeepSeek-V3 balances by the bias)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    return _decoder(
        DeepseekV3Config, DeepseekV3ForCausalLM, num_hidden_layers=layers, first_k_dense_replace=dense,
        num_key_value_heads=HEADS, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
        moe_intermediate_size=FFN // 2, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4,
        v_head_dim=8, eos_token_id=VOCAB - 1,
    )


def olmoe():
    from transformers import OlmoeConfig, OlmoeForCausalLM

    return _decoder(
        OlmoeConfig, OlmoeForCausalLM, num_experts=4, num_experts_per_tok=2, eos_token_id=VOCAB - 1,
        output_router_logits=True,
    )


# ------------------------------------------------------------------ newer architectures
# built by examples.zoo's one rule from their default configs (one layer of each kind the stack has, the sizes
# above): benchmarks/hf_zoo.py trains every causal LM transformers ships; these five keep in the suite an op
# or a layer none of the families above has


def gpt_oss():
    """Attention sinks, sliding and full layers, experts with biases and a clamped SwiGLU."""
    return zoo.causal_lm("GptOss")


def llama4():
    """Chunked attention beside layers without rotary embeddings, a routed expert beside a shared one."""
    return zoo.causal_lm("Llama4")


def mamba():
    """A state-space model: no attention, a selective scan over the sequence."""
    return zoo.causal_lm("Mamba")


def mamba2():
    """Mamba-2: the scan in chunks of the sequence (PyTorch's reference, without the mamba_ssm kernels)."""
    return zoo.causal_lm("Mamba2")


def jamba():
    """Mamba and attention layers in one stack, mixtures of experts among them."""
    return zoo.causal_lm("Jamba")


# ------------------------------------------------------------------ encoders


def bert():
    from transformers import BertConfig, BertForMaskedLM

    return _masked(BertConfig, BertForMaskedLM, **_BERT_SIZES)


def roberta():
    from transformers import RobertaConfig, RobertaForSequenceClassification

    sizes = {**_BERT_SIZES, "max_position_embeddings": SEQ + 2}  # positions start after the padding index
    return _classified(RobertaConfig, RobertaForSequenceClassification, **sizes)


def distilbert():
    from transformers import DistilBertConfig, DistilBertForMaskedLM

    return _masked(
        DistilBertConfig, DistilBertForMaskedLM, dim=HIDDEN, n_layers=1, n_heads=HEADS, hidden_dim=FFN,
        max_position_embeddings=SEQ,
    )


def albert():
    from transformers import AlbertConfig, AlbertForMaskedLM

    return _masked(AlbertConfig, AlbertForMaskedLM, embedding_size=16, **_BERT_SIZES)


def electra():
    from transformers import ElectraConfig, ElectraForSequenceClassification

    return _classified(ElectraConfig, ElectraForSequenceClassification, embedding_size=16, **_BERT_SIZES)


def deberta_v2():
    from transformers import DebertaV2Config, DebertaV2ForMaskedLM

    return _masked(DebertaV2Config, DebertaV2ForMaskedLM, **_BERT_SIZES)


# ------------------------------------------------------------------ encoder-decoder


def t5():
    from transformers import T5Config, T5ForConditionalGeneration

    return _seq2seq(
        T5Config, T5ForConditionalGeneration, d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=FFN, num_layers=1,
        num_decoder_layers=1, num_heads=HEADS, decoder_start_token_id=0,
    )


def bart():
    from transformers import BartConfig, BartForConditionalGeneration

    return _seq2seq(
        BartConfig, BartForConditionalGeneration, d_model=HIDDEN, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=FFN, decoder_ffn_dim=FFN,
        max_position_embeddings=SEQ,
    )


# ------------------------------------------------------------------ vision


def vit():
    from transformers import ViTConfig, ViTForImageClassification

    return _images(
        ViTConfig, ViTForImageClassification, patch_size=8, hidden_size=HIDDEN, num_hidden_layers=1,
        num_attention_heads=HEADS, intermediate_size=FFN,
    )


def deit():
    from transformers import DeiTConfig, DeiTForImageClassification

    return _images(
        DeiTConfig, DeiTForImageClassification, patch_size=8, hidden_size=HIDDEN, num_hidden_layers=1,
        num_attention_heads=HEADS, intermediate_size=FFN,
    )


def swin():
    from transformers import SwinConfig, SwinForImageClassification

    return _images(
        SwinConfig, SwinForImageClassification, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 4],
        window_size=4,
    )


def convnext():
    from transformers import ConvNextConfig, ConvNextForImageClassification

    return _images(
        ConvNextConfig, ConvNextForImageClassification, patch_size=4, hidden_sizes=[16, 32], depths=[1, 1],
        num_stages=2,
    )


FAMILIES = {
    f.__name__: f
    for f in (
        gpt2, llama, mistral, qwen2, qwen3, gemma, gemma2, phi3, phi, olmo2, opt, gpt_neox, bloom, falcon,
        mixtral, qwen2_moe, qwen3_moe, deepseek_v3, olmoe,
        gpt_oss, llama4, mamba, mamba2, jamba,
        bert, roberta, distilbert, albert, electra, deberta_v2,
        t5, bart,
        vit, deit, swin, convnext,
    )
}
