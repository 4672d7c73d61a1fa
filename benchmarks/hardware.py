"""Hardware models against published measurements, and planning a model built on the meta
device for a simulated cluster.

    python benchmarks/hardware.py [--layers 32] [--dim 4096] [--dtype bfloat16]

1. **Collectives.** The all-reduce bus bandwidth our presets predict for 8 GPUs in one
   node (NVLink, ring: ``busbw = bytes · 2(p-1)/p / time``, at 1 GiB where latency no
   longer counts), against the nccl-tests figures published for the same systems. The
   published ranges, large-message ``busbw`` of ``all_reduce_perf -g 8``: 8x H100 SXM5
   460-480 GB/s, 8x A100 SXM4 230-250 GB/s (Alaya New, "NCCL-tests in practice",
   2026-05-06, docs.alayanew.com/en/docs/tech-blog/2026-05-06-nccl-tests).
2. **Planning.** A GPT-3-6.7B-shaped transformer (32 layers of width 4096, 32 heads, MLP
   4x, vocabulary 32,000; ``tests/models.py``'s ``Transformer``) built on the meta device
   in ``--dtype``, one sequence of 2,048 tokens per rank, planned with ``hsdp`` for an (8 x 8) mesh of
   H100s (8 per node, 400 Gb/s between nodes): wall time, the process's peak memory,
   and the plan's predicted step, MFU and memory per device.
3. Published training runs are held against predictions in ``benchmarks/published.py``.
"""

from __future__ import annotations

import os
import resource
import sys
import time

import torch

import harness

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PUBLISHED = {"H100_SXM": (460e9, 480e9), "A100_80GB": (230e9, 250e9)}


def collectives() -> None:
    import spmd

    harness.table(("system", "predicted busbw (GB/s)", "published busbw (GB/s)", "error"),
                  "lrrr")
    mesh = spmd.Mesh.simulated(8)
    nbytes = 1 << 30
    for name, (low, high) in PUBLISHED.items():
        hw = getattr(spmd.hardware, name)(nodes_of=8)
        seconds = hw.cost_model(mesh, "dp").seconds("all_reduce", nbytes)
        busbw = nbytes * 2 * 7 / 8 / seconds
        middle = (low + high) / 2
        harness.row(f"8x {hw.device.name}", f"{busbw / 1e9:.0f}",
                    f"{low / 1e9:.0f}-{high / 1e9:.0f}", f"{(busbw - middle) / middle:+.0%}")


def planning(layers: int, dim: int, dtype: torch.dtype) -> None:
    import spmd
    from tests.models import Transformer

    with torch.device("meta"):
        model = Transformer(layers=layers, dim=dim, vocab=32000).to(dtype)
    for block in model.layers:
        block.heads = 32
    tokens = torch.randint(0, 32000, (1, 2048), device="meta")
    hardware = spmd.hardware.H100_SXM(nodes_of=8, network_gbps=400)
    mesh = spmd.Mesh.simulated((8, 8), dim_names=("dp", "fsdp"), hardware=hardware)
    start = time.perf_counter()
    plan = spmd.inspect(model, tokens, mesh=mesh, strategy="hsdp")
    elapsed = time.perf_counter() - start
    params = sum(p.numel() for p in model.parameters())
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    from spmd.plan.roofline import throughput

    print(f"\n{params / 1e9:.2f}B parameters ({str(dtype)[6:]}) on meta, hsdp on (8 x 8) {hardware.name}: "
          f"planned in {elapsed:.1f} s, process peak {peak_rss:.0f} MiB")
    print(f"  {len(plan.buckets)} collectives; {throughput(plan)}")
    print("  " + str(plan.memory("adamw")).replace("\n", "\n  "))


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    collectives()
    planning(args.layers, args.dim, getattr(torch, args.dtype))


if __name__ == "__main__":
    main()
