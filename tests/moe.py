"""A small mixture-of-experts language model of our own, for expert parallelism's tests:
token embedding, two blocks of (RMSNorm, causal attention, RMSNorm, a routed MoE with a
shared expert), a head. The router is written as models write it (softmax scores, top-k,
weights normalised over the k); ``skew`` adds a bias to the router's logits that sends
most tokens to the first experts and none to the last (an expert with no token).

Its experts module has the interface transformers' ``use_experts_implementation`` gives
(stacked ``gate_up_proj`` (E, 2I, H) and ``down_proj`` (E, H, I),
``forward(hidden, top_k_index, top_k_weights)``), with an eager loop over experts as its
one-process forward."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, HIDDEN, EXPERTS, INTER, TOP_K, HEADS = 32, 16, 8, 12, 2, 2


class Experts(nn.Module):
    def __init__(self, experts: int = EXPERTS, hidden: int = HIDDEN, inter: int = INTER,
                 bias: bool = False) -> None:
        super().__init__()
        self.num_experts = experts
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * inter, hidden) * 0.2)
        self.down_proj = nn.Parameter(torch.randn(experts, hidden, inter) * 0.2)
        if bias:
            self.gate_up_proj_bias = nn.Parameter(torch.randn(experts, 2 * inter) * 0.1)
            self.down_proj_bias = nn.Parameter(torch.randn(experts, hidden) * 0.1)
        self.act_fn = nn.SiLU()
        # the one-process reference of a capacity factor: the tokens in ``groups``
        # contiguous groups (the ranks' rows), each expert keeping its first
        # ceil(factor * T/groups * k / E) pairs of each group in (token, choice) order
        self.capacity_factor: float | None = None
        self.groups = 1

    def kept(self, top_k_index: torch.Tensor) -> torch.Tensor:
        keep = torch.ones_like(top_k_index, dtype=torch.bool)
        if self.capacity_factor is None:
            return keep
        tokens, k = top_k_index.shape
        per = tokens // self.groups
        cap = math.ceil(self.capacity_factor * per * k / self.num_experts)
        for g in range(self.groups):
            seen: dict[int, int] = {}
            mask = keep[g * per:(g + 1) * per].view(-1)
            for i, e in enumerate(top_k_index[g * per:(g + 1) * per].reshape(-1).tolist()):
                seen[e] = seen.get(e, 0) + 1
                mask[i] = seen[e] <= cap
        return keep

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        keep = self.kept(top_k_index)
        for e in range(self.num_experts):
            token, choice = torch.where((top_k_index == e) & keep)
            if token.numel() == 0:
                continue
            h = hidden[token] @ self.gate_up_proj[e].t()
            if hasattr(self, "gate_up_proj_bias"):
                h = h + self.gate_up_proj_bias[e]
            gate, up = h.chunk(2, dim=-1)
            y = (self.act_fn(gate) * up) @ self.down_proj[e].t()
            if hasattr(self, "down_proj_bias"):
                y = y + self.down_proj_bias[e]
            out = out.index_add(0, token, y * top_k_weights[token, choice, None])
        return out


class MoE(nn.Module):
    def __init__(self, skew: float = 0.0, bias: bool = False) -> None:
        super().__init__()
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = Experts(bias=bias)
        self.shared = nn.Sequential(nn.Linear(HIDDEN, INTER), nn.SiLU(), nn.Linear(INTER, HIDDEN))
        # a fixed bias on the logits: the first experts take most tokens, the last none
        self.register_buffer("skew", torch.linspace(skew, -2 * skew, EXPERTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        flat = x.reshape(-1, h)
        logits = self.router(flat) + self.skew
        probs = logits.softmax(-1)
        weights, index = probs.topk(TOP_K, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = self.experts(flat, index, weights) + self.shared(flat)
        return out.view(b, s, h), logits


class Block(nn.Module):
    def __init__(self, skew: float, bias: bool) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.norm2 = nn.RMSNorm(HIDDEN)
        self.moe = MoE(skew, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, HEADS, h // HEADS).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        out, logits = self.moe(self.norm2(x))
        return x + out, logits


class MoELM(nn.Module):
    """``skew``: the router's bias towards the first experts (0: none; 4: the last expert
    gets no token); ``bias``: the experts have biases (as GPT-OSS's); ``router_logits``:
    return ``(logits, (each layer's router logits, ...))`` for an auxiliary loss."""

    def __init__(self, skew: float = 0.0, bias: bool = False, layers: int = 2,
                 router_logits: bool = False) -> None:
        super().__init__()
        self.router_logits = router_logits
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block(skew, bias) for _ in range(layers))
        self.norm = nn.RMSNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        routed = []
        for block in self.blocks:
            x, logits = block(x)
            routed.append(logits)
        out = self.head(self.norm(x))
        return (out, tuple(routed)) if self.router_logits else out


def batch(step: int, rows: int = 4, seq: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (rows, seq + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]
