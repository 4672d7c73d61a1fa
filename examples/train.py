"""The main job: a small transformer trained by 2 local ranks under ``@spmd.parallelize``.

    python examples/train.py [--nprocs 2] [--steps 300] [--compare 60] [--strategy fsdp]

Each rank learns to reverse random token sequences from its own shard of every batch.
Rank 0 shows a progress bar, the loss going down and the plan the compiler chose; then
both ranks time the same model, data and Gloo group under ``spmd.parallelize`` and
under ``torch.nn.parallel.DistributedDataParallel``, one thread each, and print the ratio.

``--strategy fsdp`` shards parameters, gradients and optimizer state (ZeRO-3); the job
then also prints the plan's memory view per rank and times torch's own FSDP2
(``fully_shard`` per layer) beside DDP.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

VOCAB, SEQ, WIDTH, LAYERS, BATCH = 32, 16, 64, 2, 32


def build_model():
    import torch
    import torch.nn as nn

    class TinyTransformer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, WIDTH)
            self.position = nn.Parameter(torch.randn(SEQ, WIDTH) * 0.02)
            layer = nn.TransformerEncoderLayer(WIDTH, nhead=4, dim_feedforward=4 * WIDTH,
                                               dropout=0.0, batch_first=True, norm_first=True)
            self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
            self.head = nn.Linear(WIDTH, VOCAB)

        def forward(self, tokens):
            return self.head(self.encoder(self.embed(tokens) + self.position))

    with torch.random.fork_rng():
        torch.manual_seed(0)
        return TinyTransformer()


def make_batch(step: int, rank: int, world: int):
    import torch

    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    return tokens[rows], tokens[rows].flip(1)  # learn to reverse the sequence


def rank_main(rank: int, steps: int, compare: int, strategy: str = "ddp") -> dict:
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    import spmd
    from spmd import runtime as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    world = dist.get_world_size()

    model = spmd.parallelize(build_model(), strategy=strategy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step_with(m, o, step):
        x, y = make_batch(step, rank, world)
        loss = F.cross_entropy(m(x).flatten(0, 1), y.flatten())
        loss.backward()
        o.step()
        o.zero_grad()
        return loss.item()

    losses = []
    start = time.perf_counter()
    for step in range(steps):
        losses.append(step_with(model, opt, step))
        if rank == 0 and (step % 10 == 0 or step == steps - 1):
            done = (step + 1) / steps
            bar = "#" * int(30 * done) + "-" * (30 - int(30 * done))
            sys.stderr.write(f"\r[{bar}] step {step + 1}/{steps} loss {losses[-1]:.3f} "
                             f"({time.perf_counter() - start:.1f}s)")
            sys.stderr.flush()
    if rank == 0:
        sys.stderr.write("\n")
    summary = str(spmd.inspect(model))
    if strategy != "ddp":
        summary += "\n\n" + str(spmd.inspect(model).memory("adamw"))

    # the same model, data and group under torch DDP, timed against parallelize: torch
    # sees the group spmd made (no second rendezvous, the same Gloo connections)
    ddp = DistributedDataParallel(build_model())
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    peers = {"spmd": (model, opt), "ddp": (ddp, ddp_opt)}
    if strategy != "ddp":  # torch's own parameter sharding, one unit per layer
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        reference = build_model()
        mesh = init_device_mesh("cpu", (world,))
        for layer in reference.encoder.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(reference, mesh=mesh)
        peers["fsdp2"] = (reference, torch.optim.AdamW(reference.parameters(), lr=1e-2))
    times = {name: [] for name in peers}
    for step in range(compare):  # alternate, so all see the same machine
        for name, (m, o) in peers.items():
            dist.barrier()
            t0 = time.perf_counter()
            step_with(m, o, steps + step)
            times[name].append(time.perf_counter() - t0)
    dist.destroy_process_group()  # torch's view of the group goes with it
    warm = max(1, compare // 5)
    median = {k: sorted(v[warm:])[len(v[warm:]) // 2] for k, v in times.items()}
    return {"losses": losses, "summary": summary, "median": median}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--compare", type=int, default=60)
    parser.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp")
    args = parser.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

    from spmd.runtime import spawn

    results = spawn(rank_main, args=(args.steps, args.compare, args.strategy),
                    nprocs=args.nprocs,
                    timeout=1800)
    first = results[0]
    print(first["summary"])
    losses = first["losses"]
    marks = sorted({0, len(losses) // 4, len(losses) // 2, 3 * len(losses) // 4, len(losses) - 1})
    print("\nloss: " + "  ".join(f"step {i + 1}: {losses[i]:.3f}" for i in marks))
    ours, theirs = first["median"]["spmd"], first["median"]["ddp"]
    print(f"step time (median, {args.nprocs} ranks, 1 thread each): spmd.parallelize "
          f"({args.strategy}) {ours * 1e3:.2f} ms, torch DDP {theirs * 1e3:.2f} ms -> "
          f"DDP/spmd = {theirs / ours:.2f}x")
    if "fsdp2" in first["median"]:
        fsdp2 = first["median"]["fsdp2"]
        print(f"torch FSDP2 (fully_shard per layer) {fsdp2 * 1e3:.2f} ms -> FSDP2/spmd = "
              f"{fsdp2 / ours:.2f}x")
    if losses[-1] >= losses[0]:
        raise SystemExit("the loss did not go down")


if __name__ == "__main__":
    main()
