"""Decoder-only language models of published shapes, for planning on the meta device and
for measuring small ones here.

    model = build(LLAMA3_8B, checkpoint="full")           # on the current device
    with torch.device("meta"):
        model = build(LLAMA3_70B)                          # no memory: plan it
    loss = model(tokens, labels)                           # cross-entropy inside forward

One block is ``x + attention(norm(x))`` then ``h + mlp(norm(h))``: grouped-query causal
attention through ``F.scaled_dot_product_attention`` (``enable_gqa`` when there are fewer
key/value heads) with rotary embeddings (rotate-half, cos/sin tables as buffers), a
SwiGLU (``w2(silu(w1 x) * w3 x)``) or GELU (``w2(gelu(w1 x))``) feed-forward, RMSNorm or
LayerNorm. Layer names are Meta's (``wq``/``wk``/``wv``/``wo``, ``w1``/``w2``/``w3``), which
``spmd.tp.megatron`` splits by name. Activation checkpointing is written the usual way,
``torch.utils.checkpoint.checkpoint(block, ..., use_reentrant=False)`` around every block
(``"full"``) or every other block (``"selective"``, torchtitan's selective layer
checkpointing at frequency 2). The loss is the float32 cross-entropy of the logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as _checkpoint

__all__ = ["Config", "Decoder", "build", "LLAMA3_8B", "LLAMA3_70B", "LLAMA3_405B", "LLAMA2_7B",
           "MPT_7B", "MPT_13B", "MPT_70B", "GPT3_5B", "GPT3_20B", "TINY", "scaled"]


@dataclass(frozen=True, kw_only=True)
class Config:
    """A decoder's shape. ``mlp``: ``"swiglu"`` or ``"gelu"``; ``norm``: ``"rms"`` or
    ``"layer"``; ``bias``: biases on the projections; ``tied``: the output projection is
    the embedding."""

    name: str
    layers: int
    dim: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    mlp: str = "swiglu"
    norm: str = "rms"
    bias: bool = False
    tied: bool = False

    def parameters(self) -> int:
        """Parameter count (closed form; tests compare it with the built model's)."""
        head = self.dim // self.heads
        bias = self.bias
        attention = (self.dim * head * (self.heads + 2 * self.kv_heads) + self.heads * head
                     * self.dim + (bias and head * (self.heads + 2 * self.kv_heads)
                                   + self.dim))
        mats = 3 if self.mlp == "swiglu" else 2
        mlp = mats * self.dim * self.ffn + (bias and (mats - 1) * self.ffn + self.dim)
        norm = self.dim * (2 if self.norm == "layer" else 1)
        block = attention + mlp + 2 * norm
        embed = self.vocab * self.dim
        return self.layers * block + norm + embed + (0 if self.tied else embed)


LLAMA3_8B = Config(name="Llama 3 8B", layers=32, dim=4096, heads=32, kv_heads=8, ffn=14336,
                   vocab=128256)
LLAMA3_70B = Config(name="Llama 3 70B", layers=80, dim=8192, heads=64, kv_heads=8,
                    ffn=28672, vocab=128256)
LLAMA3_405B = Config(name="Llama 3 405B", layers=126, dim=16384, heads=128, kv_heads=8,
                     ffn=53248, vocab=128256)
LLAMA2_7B = Config(name="Llama 2 7B", layers=32, dim=4096, heads=32, kv_heads=32, ffn=11008,
                   vocab=32000)
# MosaicML's MPT (llm-foundry yamls): GELU MLP 4x, LayerNorm, tied embeddings, vocabulary
# 50,368; their ALiBi attention bias is left out (rotary here, the same matrix products)
_MPT = dict(mlp="gelu", norm="layer", bias=True, tied=True, vocab=50368)
MPT_7B = Config(name="MPT-7b", layers=32, dim=4096, heads=32, kv_heads=32, ffn=16384, **_MPT)
MPT_13B = Config(name="MPT-13b", layers=40, dim=5120, heads=40, kv_heads=40, ffn=20480, **_MPT)
MPT_70B = Config(name="MPT-70b", layers=80, dim=8192, heads=64, kv_heads=64, ffn=32768, **_MPT)
# NeMo's GPT3-5B and GPT3-20B (GPTConfig5B/20B): GELU MLP 4x, LayerNorm; vocabulary
# GPT-2's, padded
GPT3_5B = Config(name="GPT3-5B", layers=24, dim=4096, heads=32, kv_heads=32, ffn=16384,
                 vocab=50304, mlp="gelu", norm="layer", bias=True)
GPT3_20B = Config(name="GPT3-20B", layers=44, dim=6144, heads=48, kv_heads=48, ffn=24576,
                  vocab=50304, mlp="gelu", norm="layer", bias=True)
TINY = Config(name="tiny", layers=2, dim=32, heads=4, kv_heads=2, ffn=64, vocab=64)


def _norm(config: Config) -> nn.Module:
    if config.norm == "rms":
        return nn.RMSNorm(config.dim, eps=1e-5)
    return nn.LayerNorm(config.dim)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.heads, self.kv_heads = config.heads, config.kv_heads
        self.head_dim = config.dim // config.heads
        bias = config.bias
        self.wq = nn.Linear(config.dim, config.heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(config.dim, config.kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(config.dim, config.kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(config.heads * self.head_dim, config.dim, bias=bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q = (q * cos + _rotate_half(q) * sin).to(x.dtype)
        k = (k * cos + _rotate_half(k) * sin).to(x.dtype)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=self.kv_heads != self.heads)
        return self.wo(o.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.swiglu = config.mlp == "swiglu"
        self.w1 = nn.Linear(config.dim, config.ffn, bias=config.bias)
        self.w2 = nn.Linear(config.ffn, config.dim, bias=config.bias)
        if self.swiglu:
            self.w3 = nn.Linear(config.dim, config.ffn, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = _norm(config), _norm(config)
        self.attention = Attention(config)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Decoder(nn.Module):
    """Embedding, blocks, final norm, output projection, and the loss: ``forward(tokens,
    labels)`` returns the mean cross-entropy (float32) of next-token logits."""

    def __init__(self, config: Config, length: int, checkpoint: str = "none") -> None:
        super().__init__()
        if checkpoint not in ("none", "full", "selective"):
            raise ValueError(f"checkpoint must be 'none', 'full' or 'selective', got "
                             f"{checkpoint!r}")
        self.config, self.checkpoint = config, checkpoint
        self.tok = nn.Embedding(config.vocab, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm = _norm(config)
        self.output = nn.Linear(config.dim, config.vocab, bias=False)
        if config.tied:
            self.output.weight = self.tok.weight
        head = config.dim // config.heads
        inv = 1.0 / (500000.0 ** (torch.arange(0, head, 2, dtype=torch.float32) / head))
        angles = torch.outer(torch.arange(length, dtype=torch.float32), inv)
        angles = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens)
        t = tokens.shape[1]
        cos, sin = self.cos[:t].to(h.dtype), self.sin[:t].to(h.dtype)
        for i, layer in enumerate(self.layers):
            if self.checkpoint == "full" or (self.checkpoint == "selective" and i % 2 == 0):
                h = _checkpoint(layer, h, cos, sin, use_reentrant=False)
            else:
                h = layer(h, cos, sin)
        logits = self.output(self.norm(h))
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def build(config: Config, length: int, checkpoint: str = "none", seed: int = 0) -> Decoder:
    """A :class:`Decoder` of ``config`` for sequences up to ``length`` on the current
    default device (``torch.device("meta")`` to plan a large one), seeded."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Decoder(config, length, checkpoint)
    if model.tok.weight.device.type != "meta":
        for name, p in model.named_parameters():  # small init: finite float64 losses
            if p.dim() > 1:
                nn.init.normal_(p, std=1.0 / math.sqrt(p.shape[-1]))
    return model


def on_meta(name: str, length: int = 8192, checkpoint: str = "full"
            ) -> tuple[Config, Decoder, torch.Tensor]:
    """The published model ``name`` (``"LLAMA3_8B"``...) built on the meta device, every
    block checkpointed, and one sequence of ``length`` meta tokens: what the planning
    benchmarks plan in a fresh process."""
    config = globals()[name]
    with torch.device("meta"):
        model = build(config, length, checkpoint)
    return config, model, torch.randint(0, config.vocab, (1, length), device="meta")


def scaled(config: Config, **changes: int) -> Config:
    """``config`` with some sizes changed (a smaller model of the same form)."""
    return replace(config, **changes)
