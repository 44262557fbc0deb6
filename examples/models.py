"""Model factories for examples, benchmarks and the CLI (``autopar plan examples.models:gpt2_small``).

Every model is built locally from a config: nothing is downloaded. Large
shapes are built on the meta device, which holds no memory: planning needs
shapes, not weights. Each factory returns ``(model, example_inputs)``.
"""

from __future__ import annotations

import torch


def _ids(batch: int, seq: int, vocab: int, device: str = "cpu") -> dict:
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    return {"input_ids": ids, "labels": ids}


def gpt(
    layers: int,
    hidden: int,
    heads: int,
    vocab: int = 51200,
    seq: int = 2048,
    batch: int = 1,
    device: str = "meta",
    dropout: float | None = None,
    activation: str = "gelu_new",
):
    """A GPT-2-style decoder (HuggingFace GPT2LMHeadModel) of the given shape.

    ``dropout`` None keeps HuggingFace's defaults (0.1 on embeddings, attention
    scores and residuals, as GPT-2 and Megatron-LM's GPT train); a number sets all three.
    ``activation`` is HuggingFace's name for the MLP's: GPT-2's "gelu_new" is written
    as eight element-wise ops, "gelu_pytorch_tanh" is the same function as one
    ``aten.gelu`` (what Megatron-LM's fused bias-GeLU kernel computes in one pass).
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    drop = {} if dropout is None else {"resid_pdrop": dropout, "embd_pdrop": dropout, "attn_pdrop": dropout}
    cfg = GPT2Config(
        n_layer=layers,
        n_embd=hidden,
        n_head=heads,
        vocab_size=vocab,
        n_positions=seq,
        bos_token_id=vocab - 1,
        eos_token_id=vocab - 1,
        activation_function=activation,
        **drop,
    )
    with torch.device(device):
        model = GPT2LMHeadModel(cfg)
    return model, _ids(batch, seq, vocab, device)


def llama(
    layers: int,
    hidden: int,
    heads: int,
    intermediate: int,
    vocab: int = 32000,
    seq: int = 2048,
    batch: int = 1,
    kv_heads: int | None = None,
    device: str = "meta",
    attention: str = "sdpa",
):
    """A LLaMA decoder (HuggingFace LlamaForCausalLM) of the given shape.

    ``attention``: HuggingFace's name for it ("sdpa", "eager"), or "causal": scaled-dot-product
    attention told the mask is causal, as torchtitan's LLaMA calls it (traced, HuggingFace's "sdpa"
    passes the causal mask it builds instead, which keeps a flash kernel from skipping the masked half).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    if attention == "causal":
        _register_causal_sdpa()
    cfg = LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads or heads,
        intermediate_size=intermediate,
        vocab_size=vocab,
        max_position_embeddings=seq,
    )
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    if attention != "sdpa":  # HuggingFace's default on this stack
        model.config._attn_implementation = attention
    return model, _ids(batch, seq, vocab, device)


def mixtral(layers: int = 32, seq: int = 4096, batch: int = 1, device: str = "meta"):
    """Mixtral-8x7B's shape (HuggingFace MixtralConfig's defaults: 32 layers, hidden 4096, 32 heads sharing
    8 KV heads, 8 experts of intermediate 14336, top-2, vocab 32000) on sequences of ``seq``."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(num_hidden_layers=layers, max_position_embeddings=seq)
    with torch.device(device):
        model = MixtralForCausalLM(cfg)
    return model, _ids(batch, seq, cfg.vocab_size, device)


def deepseek_v3(layers: int = 61, seq: int = 4096, batch: int = 1, device: str = "meta"):
    """DeepSeek-V3's shape (HuggingFace DeepseekV3Config's defaults: 61 layers, the first 3 dense, hidden
    7168, 128 heads of multi-head latent attention, 256 routed experts of intermediate 2048, top-8 within
    4 of 8 groups, one shared expert, vocab 129280) on sequences of ``seq``; the multi-token prediction
    module is not built (HuggingFace builds none)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(num_hidden_layers=layers, max_position_embeddings=seq)
    with torch.device(device):
        model = DeepseekV3ForCausalLM(cfg)
    return model, _ids(batch, seq, cfg.vocab_size, device)


def _register_causal_sdpa() -> None:
    """HuggingFace attention "causal": its SDPA function without a mask, so that it passes ``is_causal=True``
    (an implementation HuggingFace has no mask function for gets no mask built)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def causal(module, query, key, value, attention_mask, **kwargs):  # noqa: ANN001, ANN202, ARG001
        return sdpa_attention_forward(module, query, key, value, None, **kwargs)

    AttentionInterface.register("causal", causal)


def gpt2_small():
    """GPT-2 small (124M parameters), sequence 1024."""
    return gpt(12, 768, 12, vocab=50257, seq=1024)


def gpt_7_5b():
    """The 7.5B GPT of the ZeRO and Megatron-LM papers: 36 layers, hidden 4096."""
    return gpt(36, 4096, 32)


def llama_7b():
    """LLaMA-7B shape: 32 layers, hidden 4096, intermediate 11008, vocab 32000."""
    return llama(32, 4096, 32, 11008)


# The tiny GPT-2s below train in tests against eager PyTorch on one device, whose dropout draws
# other masks than any parallel run: they are built without dropout.  gpt2_tiny4_dropout keeps
# GPT-2's default dropout; tests/test_rng.py trains it under rng="exact" against one process.


def gpt2_tiny():
    """A GPT-2 small enough to train on CPU processes in tests and the demo (no dropout: see above)."""
    return gpt(2, 64, 4, vocab=128, seq=16, batch=8, device="cpu", dropout=0.0)


def gpt2_mini():
    """A 4-layer GPT-2 (hidden 128, vocab 512, sequence 64, batch 8) the demo trains on local processes,
    with GPT-2's default dropout (the demo checks it under rng="exact")."""
    return gpt(4, 128, 4, vocab=512, seq=64, batch=8, device="cpu")


def gpt2_tiny_long():
    """GPT-2 tiny's 2 layers at hidden 128 (vocab 512) on sequences of 64, batch 8: activations of the
    order of the model states, so that both the ZeRO stage and recompute move the peak memory."""
    return gpt(2, 128, 4, vocab=512, seq=64, batch=8, device="cpu", dropout=0.0)


def llama_tiny():
    return llama(2, 64, 4, 128, vocab=128, seq=16, batch=8, device="cpu")


def _shared_positions(model_inputs):
    """``model_inputs`` with ``position_ids`` of shape (1, T), as user code often passes them: one row every
    sample of the batch shares (HuggingFace broadcasts it), not a batch of rows."""
    model, inputs = model_inputs
    return model, {**inputs, "position_ids": torch.arange(inputs["input_ids"].shape[1]).unsqueeze(0)}


def gpt2_tiny_shared_positions():
    """gpt2_tiny called with ``position_ids`` of shape (1, T) beside the (8, T) ids."""
    return _shared_positions(gpt2_tiny())


def gpt2_tiny4_shared_positions():
    """gpt2_tiny4 called with ``position_ids`` of shape (1, T) beside the (8, T) ids."""
    return _shared_positions(gpt2_tiny4())


def gpt2_tiny4():
    """gpt2_tiny with 4 layers: enough to cut into pipeline stages of whole layers (no dropout)."""
    return gpt(4, 64, 4, vocab=128, seq=16, batch=8, device="cpu", dropout=0.0)


def gpt2_tiny4_dropout():
    """gpt2_tiny4 with GPT-2's default dropout (0.1 on embeddings, attention scores and residuals)."""
    return gpt(4, 64, 4, vocab=128, seq=16, batch=8, device="cpu")


def llama_tiny4():
    """llama_tiny with 4 layers."""
    return llama(4, 64, 4, 128, vocab=128, seq=16, batch=8, device="cpu")


def llama_tiny6():
    """llama_tiny with 6 layers: deep enough that the planner traces four and writes out the rest
    (:mod:`autopar.capture.fold`), while the runtime traces all six."""
    return llama(6, 64, 4, 128, vocab=128, seq=16, batch=8, device="cpu")


def gpt2_tiny4_padded():
    """gpt2_tiny4 on padded sequences: sequence i keeps 16 - 2i labels, the rest are -100 (ignored).

    Splits of this batch (data-parallel ranks, micro-batches, tokens over tensor
    parallelism) hold different numbers of labels, so a loss averaged per split
    differs from the mean over the whole batch.
    """
    model, inputs = gpt2_tiny4()
    labels = inputs["input_ids"].clone()
    for i in range(labels.shape[0]):
        labels[i, labels.shape[1] - 2 * i :] = -100
    return model, {"input_ids": inputs["input_ids"], "labels": labels}


class MLP(torch.nn.Module):
    """Two-layer perceptron whose forward returns its mean-squared-error loss."""

    def __init__(self, width: int = 32, hidden: int = 128) -> None:
        super().__init__()
        self.up = torch.nn.Linear(width, hidden)
        self.down = torch.nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.down(torch.nn.functional.gelu(self.up(x))), target)


def mlp_tiny():
    """An MLP small enough for tests: batch 8, width 32, hidden 128."""
    return MLP(), (torch.randn(8, 32), torch.randn(8, 32))


class ResidualMLPs(torch.nn.Module):
    """``layers`` residual MLP blocks in an ``nn.ModuleList``: a layer stack with few ops per layer."""

    def __init__(self, layers: int = 6, width: int = 32, hidden: int = 64) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(MLPBlock(width, hidden) for _ in range(layers))

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return torch.nn.functional.mse_loss(x, target)


class MLPBlock(torch.nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(width, hidden)
        self.down = torch.nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def mlp_deep():
    """Six residual MLP blocks (batch 8, width 32): deep enough that the planner traces four and writes
    out the rest (:mod:`autopar.capture.fold`) while the runtime traces all six, small enough to run."""
    return ResidualMLPs(), (torch.randn(8, 32), torch.randn(8, 32))


def resnet_tiny():
    """A HuggingFace ResNet (BatchNorm after every convolution) small enough for tests: two stages of one
    basic block, 8 images of 3 x 16 x 16, 4 classes. Its forward updates every BatchNorm's running
    statistics and batch counter in place."""
    from transformers import ResNetConfig, ResNetForImageClassification

    cfg = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=4)
    model = ResNetForImageClassification(cfg)
    return model, {"pixel_values": torch.randn(8, 3, 16, 16), "labels": torch.randint(0, 4, (8,))}
