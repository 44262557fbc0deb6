"""Models as users write them by hand, built tiny for tests: ``factory() -> (model, inputs)``.

Where :mod:`examples.families` builds HuggingFace's families from their
configs, these are the other half of what users bring: nanoGPT's GPT, Meta's
reference LLaMA (rotary embeddings in complex numbers), PyTorch's own
``nn.TransformerEncoder`` and ``nn.Transformer``, recurrent networks (LSTM,
GRU), a U-Net (GroupNorm, transposed convolutions, interpolation), a
MobileNet-style network (depthwise convolutions, BatchNorm, hardswish,
squeeze-and-excitation) and a DLRM-style click model (``EmbeddingBag``,
binary cross-entropy). Each forward returns its loss; defaults as their
authors ship them (``nn.TransformerEncoderLayer``'s dropout 0.1, nanoGPT's 0.0).
Batch 8, so that dp 2 x tp 2 divides it. Module-level functions, so that they
pickle into launched processes.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

BATCH, SEQ, VOCAB, WIDTH = 8, 16, 128, 32


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ))


# ------------------------------------------------------------------ nanoGPT (karpathy/nanoGPT's model.py, its defaults)
class _NanoAttention(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)
        self.resid_dropout = nn.Dropout(dropout)
        self.heads, self.dropout = heads, dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.c_attn(x).split(c, dim=2))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c)))


class _NanoBlock(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = _NanoAttention(width, heads, dropout)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT's GPT: learned positions, pre-norm blocks, the head tied to the token embedding."""

    def __init__(self, layers: int = 2, width: int = WIDTH, heads: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, width), nn.Embedding(SEQ, width)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(_NanoBlock(width, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, VOCAB, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


def nanogpt():
    ids = _tokens()
    return NanoGPT(), {"idx": ids, "targets": ids}


# ------------------------------------------------------------------ LoRA (low-rank adapters on a frozen model, as PEFT lays them out)
class LoRALinear(nn.Module):
    """``base(x) + B(A(x)) * alpha / r`` with ``base`` frozen: A drawn as ``nn.Linear`` draws it, B zeros (PEFT's
    defaults), so the first step trains B alone."""

    def __init__(self, base: nn.Linear, r: int = 8, alpha: float = 16.0) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_A = nn.Linear(base.in_features, r, bias=False)
        self.lora_B = nn.Linear(r, base.out_features, bias=False)
        nn.init.zeros_(self.lora_B.weight)
        self.scale = alpha / r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(x)) * self.scale


def with_lora(model: nn.Module, targets: tuple[str, ...]) -> nn.Module:
    """``model`` frozen, each ``nn.Linear`` whose name ends in one of ``targets`` wrapped in a LoRALinear."""
    model.requires_grad_(False)
    for name, module in list(model.named_modules()):
        for child, sub in list(module.named_children()):
            if isinstance(sub, nn.Linear) and f"{name}.{child}".endswith(targets):
                setattr(module, child, LoRALinear(sub))
    return model


def nanogpt_lora():
    """nanoGPT of width 128 fine-tuned with LoRA on its attention's projections: 0.4M frozen weights (the
    embedding and head tied) beside 12K trained."""
    ids = _tokens()
    return with_lora(NanoGPT(width=128), ("c_attn", "c_proj")), {"idx": ids, "targets": ids}


def nanogpt_last_block():
    """nanoGPT fine-tuned in its last block and final norm only, the embeddings, the tied head and the blocks
    below frozen, as a fine-tune of the top layers freezes them: nothing below the last block needs a gradient."""
    ids = _tokens()
    model = NanoGPT(layers=2).requires_grad_(False)
    model.h[-1].requires_grad_(True)
    model.ln_f.requires_grad_(True)
    return model, {"idx": ids, "targets": ids}


# ------------------------------------------------------------------ Meta's reference LLaMA (meta-llama/llama's model.py)
def _freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    return torch.polar(torch.ones(end, dim // 2), torch.outer(torch.arange(end).float(), freqs))


def _rotary(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
    return (
        torch.view_as_real(xq_ * freqs_cis).flatten(3).type_as(xq),
        torch.view_as_real(xk_ * freqs_cis).flatten(3).type_as(xk),
    )


class _MetaAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, width // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(width, width, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        xq, xk, xv = (w(x).view(b, t, self.heads, self.head_dim) for w in (self.wq, self.wk, self.wv))
        xq, xk = _rotary(xq, xk, freqs_cis)
        xq, xk, xv = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
        scores = torch.matmul(xq, xk.transpose(2, 3)) / math.sqrt(self.head_dim)
        mask = torch.full((t, t), float("-inf"), device=x.device).triu(1)
        scores = F.softmax((scores + mask).float(), dim=-1).type_as(xq)
        return self.wo(torch.matmul(scores, xv).transpose(1, 2).contiguous().view(b, t, -1))


class _MetaBlock(nn.Module):
    def __init__(self, width: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.attention = _MetaAttention(width, heads)
        self.w1, self.w3 = nn.Linear(width, hidden, bias=False), nn.Linear(width, hidden, bias=False)
        self.w2 = nn.Linear(hidden, width, bias=False)
        self.attention_norm, self.ffn_norm = nn.RMSNorm(width, eps=1e-5), nn.RMSNorm(width, eps=1e-5)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        y = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(y)) * self.w3(y))


class MetaLlama(nn.Module):
    """Meta's reference LLaMA: rotary embeddings as complex numbers, an explicit causal mask, SwiGLU."""

    def __init__(self, width: int = WIDTH, heads: int = 4, layers: int = 2, hidden: int = 64) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, width)
        self.layers = nn.ModuleList(_MetaBlock(width, heads, hidden) for _ in range(layers))
        self.norm = nn.RMSNorm(width, eps=1e-5)
        self.output = nn.Linear(width, VOCAB, bias=False)
        self.register_buffer("freqs_cis", _freqs_cis(width // heads, 2 * SEQ), persistent=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        freqs_cis = self.freqs_cis[: tokens.shape[1]]
        for layer in self.layers:
            h = layer(h, freqs_cis)
        return F.cross_entropy(self.output(self.norm(h)).float().reshape(-1, VOCAB), labels.reshape(-1))


def meta_llama():
    ids = _tokens()
    return MetaLlama(), {"tokens": ids, "labels": ids}


# ------------------------------------------------------------------ PyTorch's own transformer modules
class EncoderClassifier(nn.Module):
    """``nn.TransformerEncoder`` (its defaults: ReLU, post-norm, dropout 0.1) over padded-index embeddings."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH, padding_idx=0)
        layer = nn.TransformerEncoderLayer(WIDTH, 4, dim_feedforward=64, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.enc(self.emb(ids)).mean(1)), labels)


def torch_encoder():
    return EncoderClassifier(), {"ids": _tokens(), "labels": torch.randint(0, 4, (BATCH,))}


class Seq2Seq(nn.Module):
    """``nn.Transformer`` (encoder and decoder, dropout 0.1) with a causal target mask."""

    def __init__(self) -> None:
        super().__init__()
        self.src, self.tgt = nn.Embedding(VOCAB, WIDTH), nn.Embedding(VOCAB, WIDTH)
        self.t = nn.Transformer(WIDTH, 4, 1, 1, 64, batch_first=True)
        self.out = nn.Linear(WIDTH, VOCAB)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        y = self.t(self.src(src), self.tgt(tgt), tgt_mask=mask, tgt_is_causal=True)
        return F.cross_entropy(self.out(y).reshape(-1, VOCAB), labels.reshape(-1))


def torch_seq2seq():
    return Seq2Seq(), {"src": _tokens(), "tgt": _tokens(), "labels": _tokens()}


# ------------------------------------------------------------------ recurrent networks
class LSTMLanguageModel(nn.Module):
    """An embedding, a two-layer ``nn.LSTM`` (its defaults: no dropout between layers) and a linear head.
    On the CPU its layers trace as ``aten.mkldnn_rnn_layer``, which has no sharding rule (replicated) and hands
    its backward a workspace only when grad mode is on."""

    def __init__(self, vocab: int = 64, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.rnn = nn.LSTM(width, width, num_layers=2, batch_first=True)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embed(ids))
        return F.cross_entropy(self.head(out).flatten(0, 1), labels.flatten())


def lstm_tiny():
    """A two-layer LSTM language model on 8 sequences of 12 tokens."""
    ids = torch.randint(0, 64, (8, 12))
    return LSTMLanguageModel(), {"ids": ids, "labels": ids.roll(-1, 1)}


class GRUClassifier(nn.Module):
    """A bidirectional ``nn.GRU`` whose last step is classified."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.rnn = nn.GRU(WIDTH, WIDTH, batch_first=True, bidirectional=True)
        self.out = nn.Linear(2 * WIDTH, 4)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        y, _ = self.rnn(self.emb(ids))
        return F.cross_entropy(self.out(y[:, -1]), labels)


def gru():
    """On 8 sequences of 6 tokens: a GRU traces as a loop of its cell's ops, one copy a step."""
    return GRUClassifier(), {"ids": torch.randint(0, VOCAB, (BATCH, 6)), "labels": torch.randint(0, 4, (BATCH,))}


# ------------------------------------------------------------------ convolutional networks
class _ConvNorm(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv, self.norm = nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(4, cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self.norm(self.conv(x)))


class UNet(nn.Module):
    """Two levels of a U-Net: GroupNorm, max pooling, a transposed convolution, a skip connection, bilinear
    interpolation; a mean-squared-error loss."""

    def __init__(self) -> None:
        super().__init__()
        self.d1, self.d2, self.u1 = _ConvNorm(3, 16), _ConvNorm(16, 32), _ConvNorm(32, 16)
        self.pool = nn.MaxPool2d(2)
        self.up = nn.ConvTranspose2d(32, 16, 2, stride=2)
        self.out = nn.Conv2d(16, 3, 1)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        a = self.d1(x)
        c = self.u1(torch.cat([self.up(self.d2(self.pool(a))), a], 1))
        return F.mse_loss(F.interpolate(self.out(c), scale_factor=0.5, mode="bilinear", align_corners=False), target)


def unet():
    return UNet(), {"x": torch.randn(BATCH, 3, 16, 16), "target": torch.randn(BATCH, 3, 8, 8)}


class _SqueezeExcite(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Conv2d(c, c // 4, 1), nn.Conv2d(c // 4, c, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * F.hardsigmoid(self.fc2(F.relu(self.fc1(F.adaptive_avg_pool2d(x, 1)))))


class MobileNetLike(nn.Module):
    """MobileNetV3's pieces: a strided stem, a depthwise convolution, BatchNorm, hardswish, ReLU6,
    squeeze-and-excitation, a pointwise convolution, dropout before the classifier, label smoothing."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16), nn.Hardswish())
        self.dw = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1, groups=16, bias=False), nn.BatchNorm2d(16), nn.ReLU6())
        self.se = _SqueezeExcite(16)
        self.pw = nn.Sequential(nn.Conv2d(16, 32, 1, bias=False), nn.BatchNorm2d(32), nn.Hardswish())
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.pw(self.se(self.dw(self.stem(x)))))
        return F.cross_entropy(logits, labels, label_smoothing=0.1)


def mobilenet_like():
    return MobileNetLike(), {"x": torch.randn(BATCH, 3, 32, 32), "labels": torch.randint(0, 4, (BATCH,))}


# ------------------------------------------------------------------ audio
class _ResBlock(nn.Module):
    """HiFi-GAN's residual block: leaky ReLU, then dilated convolutions under weight normalization."""

    def __init__(self, c: int, dilation: int) -> None:
        super().__init__()
        wn = nn.utils.parametrizations.weight_norm
        self.c1 = wn(nn.Conv1d(c, c, 3, dilation=dilation, padding=dilation))
        self.c2 = wn(nn.Conv1d(c, c, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.c2(F.leaky_relu(self.c1(F.leaky_relu(x, 0.1)), 0.1))


class Vocoder(nn.Module):
    """A HiFi-GAN generator in small: mel frames in, a waveform out. A convolution, a transposed one that
    upsamples, residual blocks of dilated convolutions, each under weight normalization (the pre-hook
    ``nn.utils.weight_norm`` on the first, as HiFi-GAN's code calls it, the parametrization on the rest),
    tanh, an L1 loss."""

    def __init__(self, mels: int = 16, c: int = 32) -> None:
        super().__init__()
        self.pre = nn.utils.weight_norm(nn.Conv1d(mels, c, 7, padding=3))
        self.up = nn.utils.parametrizations.weight_norm(nn.ConvTranspose1d(c, c // 2, 4, stride=2, padding=1))
        self.blocks = nn.Sequential(_ResBlock(c // 2, 1), _ResBlock(c // 2, 3))
        self.post = nn.utils.parametrizations.weight_norm(nn.Conv1d(c // 2, 1, 7, padding=3))

    def forward(self, mel: torch.Tensor, wave: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.up(F.leaky_relu(self.pre(mel), 0.1)))
        return F.l1_loss(torch.tanh(self.post(F.leaky_relu(x))), wave)


def vocoder_tiny():
    """A vocoder on 8 clips of 12 mel frames (16 bands) and their 24-sample waveforms."""
    return Vocoder(), {"mel": torch.randn(BATCH, 16, 12), "wave": torch.rand(BATCH, 1, 24) * 2 - 1}


# ------------------------------------------------------------------ graphs
class GraphNet(nn.Module):
    """A graph convolutional network as written without a graph library: node features ``(nodes, features)``,
    an edge list ``(edges,)`` twice (sources, destinations), messages summed into each destination by
    ``index_add``, degrees by ``scatter_add``, a classifier over the nodes. The batch is the nodes; the edge
    lists are not batches of samples."""

    def __init__(self, features: int = 8, hidden: int = 16, classes: int = 3) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(features, hidden), nn.Linear(hidden, classes)

    def _propagate(self, h: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        degree = torch.zeros(h.shape[0], dtype=h.dtype).scatter_add(0, dst, torch.ones_like(dst, dtype=h.dtype))
        return h + torch.zeros_like(h).index_add(0, dst, h[src]) / degree.clamp(min=1)[:, None]

    def forward(self, x: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = F.relu(self._propagate(self.l1(x), src, dst))
        return F.cross_entropy(self._propagate(self.l2(h), src, dst), labels)


def graph_net():
    """A graph of 16 nodes and 40 random edges."""
    return GraphNet(), {
        "x": torch.randn(16, 8),
        "src": torch.randint(0, 16, (40,)),
        "dst": torch.randint(0, 16, (40,)),
        "labels": torch.randint(0, 3, (16,)),
    }


# ------------------------------------------------------------------ recommendation
class ClickModel(nn.Module):
    """A recommendation model as DLRM lays one out: dense features through an MLP, sparse ids pooled by an
    ``nn.EmbeddingBag``, both concatenated into a top MLP whose logit meets ``binary_cross_entropy_with_logits``
    (whose decomposition reaches ``log_sigmoid_forward``, which DTensor cannot run on a 2-D mesh)."""

    def __init__(self, rows: int = 100, width: int = 16) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(rows, width, mode="sum")
        self.dense = nn.Sequential(nn.Linear(13, width), nn.ReLU())
        self.top = nn.Sequential(nn.Linear(2 * width, width), nn.ReLU(), nn.Linear(width, 1))

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor, clicked: torch.Tensor) -> torch.Tensor:
        z = torch.cat([self.dense(dense), self.bag(sparse)], 1)
        return F.binary_cross_entropy_with_logits(self.top(z).squeeze(1), clicked)


def clicks_tiny():
    """A click model on 8 rows of 13 dense features and 5 sparse ids."""
    return ClickModel(), {
        "dense": torch.randn(8, 13),
        "sparse": torch.randint(0, 100, (8, 5)),
        "clicked": torch.randint(0, 2, (8,)).float(),
    }


HANDWRITTEN = {
    f.__name__: f
    for f in (
        nanogpt,
        nanogpt_lora,
        nanogpt_last_block,
        meta_llama,
        torch_encoder,
        torch_seq2seq,
        lstm_tiny,
        gru,
        unet,
        mobilenet_like,
        vocoder_tiny,
        graph_net,
        clicks_tiny,
    )
}
