"""Step time of ``spmd.parallelize`` against torch DDP and against perfect scaling.

    python benchmarks/ddp.py [--nprocs 2] [--steps 40] [--rounds 5] [--cases a,b,...]

Two local ranks, one thread each, Gloo over loopback, the same model, data and optimizer
for every variant of a case:

- ``spmd``: ``spmd.parallelize`` with its defaults (cost-model buckets, overlap on);
- ``spmd, whole step``: the training step itself under ``@spmd.parallelize`` (forward,
  backward, ``opt.step()``, ``opt.zero_grad()`` in one graph; SGD and AdamW then run
  from each reduced bucket);
- ``spmd, bucketing off``: one all-reduce per parameter (``bucket_cap_mb=0``);
- ``spmd, overlap off``: every all-reduce waited right after it starts;
- ``torch DDP``: ``DistributedDataParallel`` with its defaults;
- ``limit``: each rank trains alone on its per-rank batch, no communication (eager):
  perfect scaling on this machine.

Cases (``--cases``, all by default):

- ``encoder``: a 3-layer transformer encoder of width 128 on token ids, AdamW, 32
  sequences in all (every variant);
- ``small``: 60 residual blocks of Linear(32, 32) + LayerNorm, 244 small parameters,
  AdamW (every variant);
- ``mlp``: 60 Linear(64, 64) + Tanh layers, plain SGD, a batch of 32 per rank (spmd,
  DDP, limit);
- ``d256``: a 4-layer transformer encoder of width 256, plain SGD, 8 sequences of 32
  tokens per rank (spmd, DDP, limit).

Variants alternate in rounds so all see the same machine; round 0 warms up (compiles)
and is not counted. The figure is the median step time over the rounds; "spread" is the
lowest and highest per-round ratio of DDP's time to spmd's. Prints a markdown table.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import harness


class Encoder(nn.Module):
    def __init__(self, width: int = 128, layers: int = 3, vocab: int = 64) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=4 * width, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.embed = nn.Embedding(vocab, width)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)))


class ManySmall(nn.Module):
    """60 residual blocks of Linear(32, 32) + LayerNorm: 240 small parameters."""

    def __init__(self, blocks: int = 60, width: int = 32) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width))
                                    for _ in range(blocks))
        self.inp, self.out = nn.Linear(16, width), nn.Linear(width, 16)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + torch.relu(block(h))
        return self.out(h)


def deep_mlp() -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(60):
        layers += [nn.Linear(64, 64), nn.Tanh()]
    return nn.Sequential(*layers)


ALL_VARIANTS = ("spmd", "spmd, whole step", "spmd, bucketing off", "spmd, overlap off",
                "torch DDP", "limit")
SHORT_VARIANTS = ("spmd", "torch DDP", "limit")


@dataclass(frozen=True, kw_only=True)
class Case:
    label: str
    model: Callable[[], nn.Module]
    data: Callable[[torch.Generator, int], tuple[torch.Tensor, torch.Tensor]]  # (g, ranks)
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    optimizer: Callable[[list], torch.optim.Optimizer]
    variants: tuple[str, ...]


def _tokens(vocab: int, rows: int, length: int):
    def make(g: torch.Generator, ranks: int):
        return (torch.randint(0, vocab, (rows * ranks, length), generator=g),
                torch.randint(0, vocab, (rows * ranks, length), generator=g))
    return make


def _token_loss(out, y):
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


CASES = {
    "encoder": Case(label="transformer encoder (AdamW)", model=Encoder,
                    data=lambda g, ranks: _tokens(64, 32 // ranks, 16)(g, ranks),
                    loss=_token_loss, variants=ALL_VARIANTS,
                    optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3)),
    "small": Case(label="many small parameters (AdamW)", model=ManySmall,
                  data=lambda g, ranks: (torch.randn(32, 16, generator=g),
                                         torch.randn(32, 16, generator=g)),
                  loss=F.mse_loss, variants=ALL_VARIANTS,
                  optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3)),
    "mlp": Case(label="60 x Linear(64)+Tanh (SGD)", model=deep_mlp,
                data=lambda g, ranks: (torch.randn(32 * ranks, 64, generator=g),
                                       torch.randn(32 * ranks, 64, generator=g)),
                loss=F.mse_loss, variants=SHORT_VARIANTS,
                optimizer=lambda p: torch.optim.SGD(p, lr=1e-3)),
    "d256": Case(label="transformer d256 x 4 (SGD)",
                 model=lambda: Encoder(width=256, layers=4, vocab=256),
                 data=_tokens(256, 8, 32), loss=_token_loss, variants=SHORT_VARIANTS,
                 optimizer=lambda p: torch.optim.SGD(p, lr=1e-3)),
}


def _fresh(case: Case) -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return case.model()


def _batch(case: Case, step: int, rank: int, world: int):
    x, y = case.data(torch.Generator().manual_seed(step), world)
    rows = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
    return x[rows], y[rows]


def whole_step(loss: Callable) -> Callable:
    """A training step under ``@spmd.parallelize``: ``step(model, x, y, opt)``."""
    import spmd

    @spmd.parallelize
    def step(model, x, y, opt):
        value = loss(model(x), y)
        value.backward()
        opt.step()
        opt.zero_grad()
        return value

    return step


def train(model: nn.Module, opt: torch.optim.Optimizer, batches: list, loss: Callable,
          step: Callable | None = None) -> None:
    """One round of a variant: every batch, forward, backward and optimizer step
    (``step``: the variant's own ``step(model, x, y, opt)``, a whole step)."""
    for x, y in batches:
        if step is not None:
            step(model, x, y, opt)
            continue
        loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def time_rounds(models: dict, opts: dict, batches: list, loss: Callable, rounds: int,
                barrier: Callable[[], Any], steps: dict | None = None
                ) -> dict[str, list[float]]:
    """Each variant's mean step time per round (:func:`harness.alternate`, every rank
    starting each variant together behind ``barrier``). ``steps``: a variant's own
    ``step(model, x, y, opt)`` (a whole step), instead of the loop's."""
    steps = steps or {}
    return harness.alternate(
        {v: (lambda v=v, m=m: train(m, opts[v], batches, loss, steps.get(v)))
         for v, m in models.items()},
        rounds, barrier=barrier, per=len(batches)).times


def rank_main(rank: int, steps: int, rounds: int, names: list[str]) -> dict | None:
    import torch.distributed as tdist
    from torch.nn.parallel import DistributedDataParallel

    import spmd

    make = {
        "spmd": lambda c: spmd.parallelize(_fresh(c)),
        "spmd, whole step": _fresh,  # its step is parallelized (whole_step)
        "spmd, bucketing off": lambda c: spmd.parallelize(_fresh(c), bucket_cap_mb=0),
        "spmd, overlap off": lambda c: spmd.parallelize(_fresh(c), overlap=False),
        "torch DDP": lambda c: DistributedDataParallel(_fresh(c)),
        "limit": _fresh,
    }
    results = {}
    # torch DDP runs on a group of torch's own, as DDP users run it
    with harness.group(rank, torch_group=True) as world:
        for name in names:
            case = CASES[name]
            models = {v: make[v](case) for v in case.variants}
            opts = {v: case.optimizer(list(m.parameters())) for v, m in models.items()}
            batches = [_batch(case, step, rank, world) for step in range(steps)]
            own = {"spmd, whole step": whole_step(case.loss)} \
                if "spmd, whole step" in models else None
            times = time_rounds(models, opts, batches, case.loss, rounds, tdist.barrier, own)
            results[name] = {"times": times,
                             "plan": str(spmd.inspect(models["spmd"])).splitlines()[0]}
    return results if rank == 0 else None


def main() -> None:
    parser = harness.parser(__doc__, steps=40, rounds=5)
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"comma-separated, of {', '.join(CASES)}")
    args = parser.parse_args()
    names = harness.choices(args.cases, list(CASES), parser)
    results = harness.spawn(rank_main, args.steps, args.rounds, names, nprocs=args.nprocs)[0]
    harness.table(("case", "variant", "ms/step", "vs torch DDP (x faster)",
                   "spread over rounds", "vs limit (x slower)"), "llrrlr")
    for name, res in results.items():
        times = res["times"]
        limit = statistics.median(times["limit"])
        for variant, v in harness.versus(times, "torch DDP").items():
            harness.row(CASES[name].label, variant, f"{v.median * 1e3:.2f}", f"{v.ratio:.2f}",
                        v.spread, f"{v.median / limit:.2f}")
    for name, res in results.items():
        print(f"\n{CASES[name].label}: {res['plan']}")


if __name__ == "__main__":
    main()
