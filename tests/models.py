"""Small models covering what data parallelism must get right, shared by the tests.

Each factory builds the same weights every time (its own seeded generator), so every
rank and the single-process reference start equal without relying on a broadcast.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def _seeded(build):
    def make():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return build()
    make.__name__ = build.__name__
    return make


class MLP(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.fc1, self.fc2, self.out = nn.Linear(8, width), nn.Linear(width, width), nn.Linear(width, 4)

    def forward(self, x):
        return self.out(F.relu(self.fc2(F.relu(self.fc1(x)))))


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1)
        self.conv2 = nn.Conv2d(6, 8, 3, padding=1)
        self.head = nn.Linear(8 * 2 * 2, 4)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.head(x.flatten(1))


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # bias=False: the key projection's bias has an identically zero gradient (softmax
        # ignores a shift), and AdamW turns rounding noise on a zero gradient into full steps
        layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, dropout=0.0,
                                           batch_first=True, bias=False)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.embed = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):  # x: (batch, 8) -> a sequence of 4 tokens per sample
        tokens = self.embed(x).unsqueeze(1).expand(-1, 4, -1) + torch.arange(4.0).view(1, 4, 1)
        return self.head(self.encoder(tokens).mean(1))


class Frozen(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.fc1.requires_grad_(False)


class SometimesUnused(MLP):
    """``extra`` is used on even steps only (the same on every rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        y = super().forward(x)
        return self.extra(y) if self.calls % 2 == 0 else y


class GraphBreak(MLP):
    """Dynamo splits this forward in two graphs."""

    def forward(self, x):
        h = F.relu(self.fc1(x))
        torch._dynamo.graph_break()
        return self.out(F.relu(self.fc2(h)))


@torch._dynamo.disable
def _eager_block(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return F.relu(layer(h))


class EagerRegion(MLP):
    """``fc2`` runs in code Dynamo must not capture: its gradient is computed eagerly."""

    def forward(self, x):
        return self.out(_eager_block(self.fc2, F.relu(self.fc1(x))))


class WithBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # no bias before BatchNorm: its gradient would be identically zero (see Encoder)
        self.fc1, self.bn = nn.Linear(8, 16, bias=False), nn.BatchNorm1d(16)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        return self.out(F.relu(self.bn(self.fc1(x))))


class Tied(nn.Module):
    """One parameter used by two layers (``b.weight`` is ``a.weight``)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.head = nn.Linear(8, 16), nn.Linear(16, 4)
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.head(F.relu(self.b(F.relu(self.a(F.relu(self.proj(x)))))))


MODELS = {
    "mlp": _seeded(MLP),
    "cnn": _seeded(CNN),
    "encoder": _seeded(Encoder),
    "frozen": _seeded(Frozen),
    "sometimes_unused": _seeded(SometimesUnused),
    "graph_break": _seeded(GraphBreak),
    "eager_region": _seeded(EagerRegion),
    "batchnorm": _seeded(WithBatchNorm),
}
# models only the sharded strategies' tests train (DDP's equivalence suite is unchanged)
SHARDED_MODELS = {**MODELS, "tied": _seeded(Tied)}


def batch(name: str, size: int = 12, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(size, 3, 8, 8, generator=g) if name == "cnn" else torch.randn(size, 8,
                                                                                   generator=g)
    return x, torch.randn(size, 4, generator=g)



class Block(nn.Module):
    """A pre-norm transformer block with separate query/key/value projections (the
    layout tensor parallelism splits by heads) and a GELU MLP."""

    def __init__(self, dim: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        # no key bias: softmax ignores it, so its gradient is rounding noise that AdamW
        # would amplify to whole steps, differently on every layout of the sums
        self.q, self.k = nn.Linear(dim, dim), nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.linear1 = nn.Linear(dim, 4 * dim)
        self.linear2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        y = self.norm1(x)

        def heads(z):
            return z.view(b, t, self.heads, d // self.heads).transpose(1, 2)

        a = F.scaled_dot_product_attention(heads(self.q(y)), heads(self.k(y)), heads(self.v(y)),
                                           is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        return x + self.linear2(F.gelu(self.linear1(self.norm2(x))))


class Transformer(nn.Module):
    """Token embedding, ``layers`` blocks, a vocabulary head: the tensor-parallel tests'
    model."""

    def __init__(self, layers: int = 2, dim: int = 16, vocab: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([Block(dim) for _ in range(layers)])
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.emb(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def tokens(step: int = 0, rows: int = 8, length: int = 6, vocab: int = 32):
    """A batch of token ids and the next-token targets, the same for a given step."""
    g = torch.Generator().manual_seed(1000 + step)
    seq = torch.randint(0, vocab, (rows, length + 1), generator=g)
    return seq[:, :-1], seq[:, 1:]


class Cumulative(nn.Module):
    """A column-parallel layer feeding an op with no sharding rule (``cumsum``), then a
    row-parallel one: tensor parallelism must replicate around it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear1 = nn.Linear(8, 16)
        self.linear2 = nn.Linear(16, 8)

    def forward(self, x):
        return self.linear2(torch.cumsum(self.linear1(x), dim=-1))
