"""A training loop as users write it, under ``spmd.parallelize`` on 2 local ranks.

    python examples/training_loop.py [--strategy ddp|fsdp] [--epochs 2]

A ``DataLoader`` with ``drop_last=False`` over 100 samples split by
``DistributedSampler``: batches of 12 rows per rank, then a short last one (which Dynamo
compiles again, on the ranks that see it, without anyone waiting). Two micro-batches per
optimizer step, the first under ``no_sync()``; the weights re-initialised in place after
``parallelize`` (written through to each rank's shard under ``fsdp``); an eval pass after
every epoch. Rank 0 prints the loss, and the plan's list of compiled graphs with why each
was compiled.
"""

from __future__ import annotations

import argparse
import contextlib
from datetime import timedelta

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import spmd
from spmd import runtime as dist


def main(rank: int, strategy: str, epochs: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    world = dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(100, 16, generator=g)
    data = TensorDataset(x, x.sum(1, keepdim=True).sin())
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0,
                                 drop_last=False)
    loader = DataLoader(data, batch_size=12, sampler=sampler, drop_last=False)

    torch.manual_seed(0)
    model = spmd.parallelize(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1)),
                             strategy=strategy)
    for layer in (model[0], model[2]):
        layer.reset_parameters()  # after parallelize: reaches every rank's shard
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        model.train()
        batches = list(loader)
        for i in range(0, len(batches), 2):
            opt.zero_grad()
            micro = batches[i:i + 2]
            for k, (xb, yb) in enumerate(micro):
                sync = k == len(micro) - 1
                with contextlib.nullcontext() if sync else model.no_sync():
                    loss = F.mse_loss(model(xb), yb) / len(micro)
                    loss.backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            val = F.mse_loss(model(x[:20]), data.tensors[1][:20])
        if rank == 0:
            print(f"epoch {epoch}: validation loss {val.item():.4f}")
    if rank == 0:
        plan = spmd.inspect(model)
        print(f"\n{len(plan.graph_reasons)} graph(s) compiled on rank 0:")
        for name, why in plan.graph_reasons.items():
            print(f"  {name}: {why}")
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp")
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    dist.spawn(main, args=(args.strategy, args.epochs), nprocs=2, timeout=300)
