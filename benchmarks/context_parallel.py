"""Context parallelism: step time and peak memory of ``spmd.cp.ring()`` (ring attention)
against one process on the whole sequence, same run, at a sequence length where
attention dominates.

    python benchmarks/context_parallel.py [--steps 3] [--rounds 3] [--layers 2]
                                          [--width 128] [--heads 4] [--seq 4096]
                                          [--ranks 2]

``--ranks`` local processes, one thread each, Gloo over loopback, one "cp" group;
``benchmarks/tp.py``'s pre-norm transformer (separate q/k/v/o, causal SDPA, GELU MLP 4x,
LayerNorms) with the same weights, one sequence and AdamW for every variant:

- ``1 process``: the model on rank 0 alone, the whole sequence (the others wait);
- ``spmd cp (balanced)``: ``spmd.parallelize(model, mesh=Mesh((n,), ("cp",)),
  placements=spmd.cp.ring())``: each rank 1/n of the sequence, causal attention
  load-balanced (zigzag halves);
- ``spmd cp (contiguous)``: ``spmd.cp.ring(load_balance=False)``: rank r the r-th block
  (the last rank attends to every block, the first to its own).

torch's own ``context_parallel`` (``torch.distributed.tensor.experimental``) does not run
here: on CPU, scaled dot-product attention is the ``_scaled_dot_product_flash_attention
_for_cpu`` kernel, for which torch 2.13 registers no sharding strategy
(``NotImplementedError`` on Gloo), so it has no figure in this table.

Time: variants alternate in rounds; round 0 warms up (compiles) and is not counted; a
variant's figure is the median of its rounds' mean step times, with the lowest and
highest round. Memory: one more step of each variant on rank 0 under
``torch.profiler(profile_memory=True)``: the highest running sum of the step's
allocations and frees. spmd's plans also give the predicted saved activations
(``plan.memory().activations``). The step-0 losses show every variant trains the same
model.
"""

from __future__ import annotations

import statistics

import torch

import harness
from memory import step_peak
from tp import _batch, _fresh, _train, alternate

VARIANTS = ("1 process", "spmd cp (balanced)", "spmd cp (contiguous)")


def rank_main(rank: int, ranks: int, steps: int, rounds: int, width: int, heads: int,
              layers: int, seq: int) -> dict | None:
    import torch.distributed as tdist

    import spmd

    with harness.group(rank, timeout_s=1800):
        mesh = spmd.Mesh((ranks,), dim_names=("cp",))
        mesh.to_torch()  # torch.distributed's barrier on the same group

        def ours(balance: bool):
            return spmd.parallelize(_fresh(width, heads, layers), mesh=mesh,
                                    placements=spmd.cp.ring(load_balance=balance))

        make = {"1 process": lambda: _fresh(width, heads, layers),
                "spmd cp (balanced)": lambda: ours(True),
                "spmd cp (contiguous)": lambda: ours(False)}
        batches = [_batch(step, 1, seq) for step in range(steps)]
        models = {v: make[v]() for v in VARIANTS}
        opts = {v: torch.optim.AdamW(m.parameters(), lr=1e-3) for v, m in models.items()}
        times, first_loss, _ = alternate(models, opts, batches, rounds, tdist.barrier,
                                         lambda v: v != "1 process" or rank == 0)
        peaks = {}
        for variant, model in models.items():
            tdist.barrier()
            if variant == "1 process" and rank:
                continue
            peaks[variant] = step_peak(lambda: _train(model, opts[variant], batches[:1]))
        predicted = {v: spmd.inspect(models[v]).memory().activations for v in VARIANTS[1:]}
        tdist.barrier()
        if rank:
            return None
        return {"times": times, "loss": first_loss, "peak": peaks, "predicted": predicted}


def main() -> None:
    parser = harness.parser(__doc__, steps=3, rounds=3)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    res = harness.spawn(rank_main, args.ranks, args.steps, args.rounds, args.width,
                        args.heads, args.layers, args.seq, nprocs=args.ranks, timeout=3600)[0]
    times, peak = res["times"], res["peak"]
    base = statistics.median(times["1 process"])
    print(f"\n### cp={args.ranks} ({args.ranks} processes, 1 thread each): {args.layers} "
          f"layers of width {args.width}, {args.heads} heads, 1 x {args.seq} tokens, causal, "
          f"AdamW, {args.steps} steps x {args.rounds} rounds\n")
    harness.table(("variant", "step ms (median)", "rounds min-max", "1 process / variant",
                   "step peak MiB (rank 0)", "step-0 loss"), "lrrrrr")
    for v in VARIANTS:
        med = statistics.median(times[v])
        harness.row(v, f"{med * 1e3:.1f}", harness.span([t * 1e3 for t in times[v]], ".1f", "-"),
                    f"{base / med:.2f}x", f"{peak[v] / 2**20:.1f}", f"{res['loss'][v]:.6f}")
    pred = res["predicted"]
    print("\npredicted saved activations per rank: "
          + ", ".join(f"{v} {b / 2**20:.1f} MiB" for v, b in pred.items()))


if __name__ == "__main__":
    main()
