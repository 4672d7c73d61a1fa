"""A small LLaMA-style model in the forms its ops come in across codebases, shared by the
tests: RMSNorm written by hand (``x * rsqrt(mean(x**2) + eps) * w``), as
``F.rms_norm`` or as ``nn.RMSNorm``; rotary embeddings as rotate-half (cos/sin, Hugging
Face) or complex (``view_as_complex`` times ``freqs_cis``, Meta's original code);
grouped-query attention with ``enable_gqa=True``, ``repeat_interleave`` or
``expand`` + ``reshape`` of the key/value heads; a SwiGLU feed-forward. Layer names are
Meta's (``wq``/``wk``/``wv``/``wo``, ``w1``/``w2``/``w3``), which ``spmd.tp.megatron``
splits by name.

    model = Llama(norm="F", rope="complex", gqa="enable_gqa")
    model(torch.randint(0, 32, (2, 8)))
"""

from __future__ import annotations

import itertools

import torch
import torch.nn as nn
import torch.nn.functional as F

NORMS = ("hand", "F", "nn")
ROPES = ("half", "complex")
GQAS = ("enable_gqa", "repeat_interleave", "expand")
FORMS = list(itertools.product(NORMS, ROPES, GQAS))  # every combination, for parametrize


class RMSNorm(nn.Module):
    """Hand-written (``form="hand"``) or ``F.rms_norm`` (``"F"``); ``"nn"`` is
    ``nn.RMSNorm`` itself, made by :func:`rms_norm`."""

    def __init__(self, dim: int, eps: float = 1e-6, form: str = "hand") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.form = eps, form

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.form == "hand":
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rms_norm(dim: int, form: str) -> nn.Module:
    if form not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {form!r}")
    return nn.RMSNorm(dim, eps=1e-6) if form == "nn" else RMSNorm(dim, form=form)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, *, rope: str, gqa: str) -> None:
        super().__init__()
        if rope not in ROPES or gqa not in GQAS:
            raise ValueError(f"rope must be one of {ROPES} and gqa one of {GQAS}, got "
                             f"{rope!r}, {gqa!r}")
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)
        self.rope, self.gqa = rope, gqa

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               cis: torch.Tensor) -> torch.Tensor:
        """Rotary embedding of ``x`` [batch, length, heads, head_dim]."""
        if self.rope == "half":
            return (x * cos[:, None] + rotate_half(x) * sin[:, None]).to(x.dtype)
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * cis[:, None]).flatten(3).to(x.dtype)

    def forward(self, x, cos, sin, cis):
        b, t, _ = x.shape
        q = self.rotate(self.wq(x).view(b, t, self.heads, self.head_dim), cos, sin, cis)
        k = self.rotate(self.wk(x).view(b, t, self.kv_heads, self.head_dim), cos, sin, cis)
        v = self.wv(x).view(b, t, self.kv_heads, self.head_dim)
        q, k, v = (y.transpose(1, 2) for y in (q, k, v))
        group = self.heads // self.kv_heads
        if self.gqa == "enable_gqa":
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            if self.gqa == "repeat_interleave":
                k, v = (y.repeat_interleave(group, dim=1) for y in (k, v))
            else:
                k, v = (y[:, :, None].expand(b, self.kv_heads, group, t, self.head_dim)
                        .reshape(b, self.heads, t, self.head_dim) for y in (k, v))
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int, *, norm: str,
                 rope: str, gqa: str) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = rms_norm(dim, norm), rms_norm(dim, norm)
        self.attention = Attention(dim, heads, kv_heads, rope=rope, gqa=gqa)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x, cos, sin, cis):
        h = x + self.attention(self.attention_norm(x), cos, sin, cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Token embedding, ``layers`` blocks, a final norm and the output projection; the
    rotary tables (cos/sin and their complex form) are buffers for ``length`` positions.
    Built from a fixed seed: every instance has the same weights."""

    def __init__(self, *, vocab: int = 32, dim: int = 16, layers: int = 2, heads: int = 4,
                 kv_heads: int = 2, hidden: int = 32, length: int = 8, norm: str = "hand",
                 rope: str = "half", gqa: str = "expand") -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.tok = nn.Embedding(vocab, dim)
            self.layers = nn.ModuleList(
                Block(dim, heads, kv_heads, hidden, norm=norm, rope=rope, gqa=gqa)
                for _ in range(layers))
            self.norm = rms_norm(dim, norm)
            self.output = nn.Linear(dim, vocab, bias=False)
        head_dim = dim // heads
        inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).double() / head_dim))
        angles = torch.outer(torch.arange(length).double(), inv)
        dtype = torch.get_default_dtype()
        self.register_buffer("cos", torch.cat([angles.cos()] * 2, -1).to(dtype),
                             persistent=False)
        self.register_buffer("sin", torch.cat([angles.sin()] * 2, -1).to(dtype),
                             persistent=False)
        self.register_buffer("cis", torch.polar(torch.ones_like(angles), angles).to(
            dtype.to_complex()), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens)
        t = tokens.shape[1]
        for layer in self.layers:
            h = layer(h, self.cos[:t], self.sin[:t], self.cis[:t])
        return self.output(self.norm(h))


def tokens(rows: int = 2, length: int = 8, vocab: int = 32) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(0))
