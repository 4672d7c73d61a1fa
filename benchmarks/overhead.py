"""Where a compiled step's time goes, against the same model run eagerly, in one process.

    python benchmarks/overhead.py [--rounds 15] [--steps 20] [--cases mlp,d256] [--inductor]

No communication: ``spmd.parallelize`` on a simulated 2-rank mesh with one bucket, so the
graphs run their packing and every op as in a real step but no collective is sent. Each
step is timed in three parts (forward, backward, ``opt.step() + zero_grad()``), for the
compiled model and for the plain one, alternating, one thread; the figure is the fastest
round's mean (the least disturbed by the machine), and "extra" is the compiled minus the
eager time: what the compiler's path costs beyond the arithmetic. ``--inductor`` adds
``compile_compute=True`` (Inductor's kernels for the graphs' compute) beside the default
(generated Python calling ATen).

Cases: ``mlp`` (60 Linear(64, 64) + Tanh, batch 32, SGD) and ``d256`` (a 4-layer
transformer encoder of width 256, 8 sequences of 32 tokens, SGD), those of
``benchmarks/ddp.py``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ddp import CASES  # noqa: E402  (the benchmark models)


def timed(model, opt, case, batches) -> tuple[float, float, float]:
    fwd = bwd = step = 0.0
    for x, y in batches:
        t0 = time.perf_counter()
        loss = case.loss(model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t3 = time.perf_counter()
        fwd, bwd, step = fwd + t1 - t0, bwd + t2 - t1, step + t3 - t2
    n = len(batches)
    return fwd / n, bwd / n, step / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--cases", default="mlp,d256")
    parser.add_argument("--inductor", action="store_true",
                        help="also compile_compute=True (Inductor)")
    args = parser.parse_args()
    import spmd

    torch.set_num_threads(1)
    variants = ("eager", "spmd", "inductor") if args.inductor else ("eager", "spmd")
    print("| case | part | eager ms | " + " | ".join(
        f"{v} ms | {v} extra ms" for v in variants[1:]) + " |")
    print("|---|---|---:|" + "---:|---:|" * (len(variants) - 1))
    for name in args.cases.split(","):
        case = CASES[name]
        batches = []
        for step in range(args.steps):
            x, y = case.data(torch.Generator().manual_seed(step), 1)
            batches.append((x, y))
        models = {}
        for variant in variants:
            with torch.random.fork_rng():
                torch.manual_seed(0)
                model = case.model()
            if variant != "eager":
                model = spmd.parallelize(model, mesh=spmd.Mesh.simulated(2), bucket_cap_mb=1e4,
                                         compile_compute=variant == "inductor")
            models[variant] = (model, case.optimizer(list(model.parameters())))
        for variant, (model, opt) in models.items():
            timed(model, opt, case, batches[:3])  # compile, warm up
        best: dict[str, tuple[float, ...]] = {}
        for _ in range(args.rounds):
            for variant, (model, opt) in models.items():
                parts = timed(model, opt, case, batches)
                if variant not in best or sum(parts) < sum(best[variant]):
                    best[variant] = parts
        for i, part in enumerate(("forward", "backward", "optimizer", "step")):
            e = best["eager"][i] if i < 3 else sum(best["eager"])
            cells = []
            for v in variants[1:]:
                s = best[v][i] if i < 3 else sum(best[v])
                cells.append(f"{s * 1e3:.3f} | {(s - e) * 1e3:+.3f}")
            print(f"| {case.label} | {part} | {e * 1e3:.3f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
