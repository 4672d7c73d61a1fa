"""Step time of ``spmd.parallelize`` against torch DDP and against perfect scaling.

    python benchmarks/ddp.py [--nprocs 2] [--steps 40] [--rounds 5]

Two local ranks, one thread each, Gloo over loopback, the same model, data and optimizer
(AdamW) for every variant:

- ``spmd``: ``spmd.parallelize`` with its defaults (cost-model buckets, overlap on);
- ``spmd, bucketing off``: one all-reduce per parameter (``bucket_cap_mb=0``);
- ``spmd, overlap off``: every all-reduce waited right after it starts;
- ``torch DDP``: ``DistributedDataParallel`` with its defaults;
- ``limit``: each rank trains alone on its per-rank batch, no communication (eager):
  perfect scaling on this machine.

Models: a transformer encoder, and a model of many small parameters (where bucketing
matters most). Variants alternate in rounds so all see the same machine; the figure is
the median step time over all rounds. Prints a markdown table with ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH = 32


class Encoder(nn.Module):
    def __init__(self, width: int = 128, layers: int = 3) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=4 * width, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.embed = nn.Embedding(64, width)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, 64)

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


MODELS = {"transformer encoder": Encoder, "many small parameters": ManySmall}


def _data(name: str, step: int, rank: int, world: int):
    g = torch.Generator().manual_seed(step)
    if name == "transformer encoder":
        x = torch.randint(0, 64, (BATCH, 16), generator=g)
        y = torch.randint(0, 64, (BATCH, 16), generator=g)
    else:
        x, y = torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 16, generator=g)
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    return x[rows], y[rows]


def _loss(name: str, out, y):
    if name == "transformer encoder":
        return F.cross_entropy(out.flatten(0, 1), y.flatten())
    return F.mse_loss(out, y)


def _fresh(name: str) -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return MODELS[name]()


def rank_main(rank: int, steps: int, rounds: int) -> dict | None:
    import torch.distributed as tdist
    from torch.nn.parallel import DistributedDataParallel

    import spmd
    from spmd import runtime as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    world = dist.get_world_size()
    port = int(os.environ["MASTER_PORT"]) + 1
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                             world_size=world)
    results = {}
    for name in MODELS:
        variants = {
            "spmd": spmd.parallelize(_fresh(name)),
            "spmd, bucketing off": spmd.parallelize(_fresh(name), bucket_cap_mb=0),
            "spmd, overlap off": spmd.parallelize(_fresh(name), overlap=False),
            "torch DDP": DistributedDataParallel(_fresh(name)),
            "limit": _fresh(name),
        }
        opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-3) for k, m in variants.items()}
        times: dict[str, list[float]] = {k: [] for k in variants}
        for r in range(rounds + 1):  # round 0 warms up (compiles) and is not counted
            for key, model in variants.items():
                opt = opts[key]
                tdist.barrier()
                start = time.perf_counter()
                for step in range(steps):
                    x, y = _data(name, step, rank, world)
                    _loss(name, model(x), y).backward()
                    opt.step()
                    opt.zero_grad()
                if r:
                    times[key].append((time.perf_counter() - start) / steps)
        results[name] = {k: statistics.median(v) for k, v in times.items()}
        results[name]["plan"] = str(spmd.inspect(variants["spmd"])).splitlines()[0]
    tdist.destroy_process_group()
    dist.destroy_process_group()
    return results if rank == 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    from spmd.runtime import spawn

    results = spawn(rank_main, args=(args.steps, args.rounds), nprocs=args.nprocs,
                    timeout=3000)[0]
    print("| model | variant | ms/step | vs torch DDP (x faster) | vs limit (x slower) |")
    print("|---|---|---:|---:|---:|")
    for name, res in results.items():
        ddp, limit = res["torch DDP"], res["limit"]
        for key, t in res.items():
            if key == "plan":
                continue
            print(f"| {name} | {key} | {t * 1e3:.2f} | {ddp / t:.2f} | {t / limit:.2f} |")
    for name, res in results.items():
        print(f"\n{name}: {res['plan']}")


if __name__ == "__main__":
    main()
