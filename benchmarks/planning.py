"""How long planning takes, against parameter count and the number of ranks.

    python benchmarks/planning.py [--strategy ddp|fsdp]

Plans transformers of about 1, 3 and 10 million parameters for simulated meshes of 8,
64 and 1,024 ranks with ``spmd.inspect(model, tokens, mesh=Mesh.simulated(n))`` (no
process is started), and reports the wall time, the part spent in our passes, and the
number of buckets (for ddp the same for every n: only predicted communication changes).
With ``--strategy fsdp`` it also reports the plan's memory view per rank (persistent
bytes with AdamW, and the predicted peak).
"""

from __future__ import annotations

import time

import torch
import torch.nn as nn

import spmd
from spmd.lowering.state import state_of


class Transformer(nn.Module):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        layer = nn.TransformerEncoderLayer(width, 8, 4 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, 256)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)))


SIZES = {"~1M": (128, 4), "~3M": (192, 6), "~10M": (320, 8)}
RANKS = (8, 64, 1024)


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp")
    strategy = parser.parse_args().strategy
    torch.set_num_threads(1)
    tokens = torch.randint(0, 256, (4, 32))
    memory = " persistent MiB | predicted peak MiB |" if strategy == "fsdp" else ""
    print(f"| model | parameters | ranks | planning s | in passes s | buckets | "
          f"predicted comm ms |{memory}")
    print("|---|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if memory else ""))
    for label, (width, layers) in SIZES.items():
        torch.manual_seed(0)
        model = Transformer(width, layers)
        params = sum(p.numel() for p in model.parameters())
        for n in RANKS:
            start = time.perf_counter()
            plan = spmd.inspect(model, tokens, mesh=spmd.Mesh.simulated(n),
                                strategy=strategy)
            elapsed = time.perf_counter() - start
            passes = sum(sum(state_of(gm).pass_seconds.values())
                         for gm in plan.graphs.values())
            extra = ""
            if strategy == "fsdp":
                view = plan.memory("adamw")
                extra = f" {view.persistent / 2**20:.2f} | {view.peak / 2**20:.2f} |"
            print(f"| {label} | {params:,} | {n} | {elapsed:.2f} | {passes:.3f} | "
                  f"{len(plan.buckets)} | {plan.predicted_communication_seconds() * 1e3:.1f} |"
                  f"{extra}")


if __name__ == "__main__":
    main()
