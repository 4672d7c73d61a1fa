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

import time

import torch

import harness
from ddp import CASES  # the benchmark models


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
    parser = harness.parser(__doc__, steps=20, rounds=15)
    parser.add_argument("--cases", default="mlp,d256")
    parser.add_argument("--inductor", action="store_true",
                        help="also compile_compute=True (Inductor)")
    args = parser.parse_args()
    import spmd

    torch.set_num_threads(1)
    variants = ("eager", "spmd", "inductor") if args.inductor else ("eager", "spmd")
    harness.table(("case", "part", "eager ms",
                   *(f"{v} {c}" for v in variants[1:] for c in ("ms", "extra ms"))),
                  "llr" + "rr" * (len(variants) - 1))
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
        rounds = harness.alternate({v: (lambda m=m, o=o: timed(m, o, case, batches))
                                    for v, (m, o) in models.items()}, args.rounds, warmup=0)
        # the fastest round: the least disturbed by the machine
        best = {v: min(parts, key=sum) for v, parts in rounds.results.items()}
        for i, part in enumerate(("forward", "backward", "optimizer", "step")):
            e = best["eager"][i] if i < 3 else sum(best["eager"])
            cells = []
            for v in variants[1:]:
                s = best[v][i] if i < 3 else sum(best[v])
                cells += [f"{s * 1e3:.3f}", f"{(s - e) * 1e3:+.3f}"]
            harness.row(case.label, part, f"{e * 1e3:.3f}", *cells)


if __name__ == "__main__":
    main()
