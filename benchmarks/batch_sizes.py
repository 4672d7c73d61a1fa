"""Changing batch sizes: step time of ``spmd.parallelize`` against torch DDP on a loop whose
batch size changes (a ``DataLoader`` with ``drop_last=False``: full batches, then a short
last one, uneven across ranks), after the recompiles; how many graphs each rank compiled;
and the price of the eager safety net's gradient hooks, which stay on every parameter.

    python benchmarks/batch_sizes.py [--steps 24] [--rounds 5] [--cases encoder,small]

Two local ranks, one thread each, Gloo over loopback. Per-rank rows cycle 8, 8, 8, then
5 on rank 0 and 4 on rank 1 (and, for the ``sizes`` pattern, 8, 6, 4, 2). Variants:

- ``spmd``: ``spmd.parallelize`` with its defaults;
- ``spmd, hooks removed``: the same with the safety net's per-parameter hooks removed
  after compiling (unsafe: measures what the hooks cost, nothing else);
- ``torch DDP``: ``DistributedDataParallel`` with its defaults.

Variants alternate in rounds; round 0 compiles and is not counted. Prints a markdown
table: median ms/step, the ratio to torch DDP with its spread over rounds, and graphs.
"""

from __future__ import annotations

import torch

import harness
from ddp import CASES as DDP_CASES
from ddp import _fresh, time_rounds

CASES = {"encoder": DDP_CASES["encoder"], "small": DDP_CASES["small"]}
PATTERNS = {"last": [8, 8, 8, None], "sizes": [8, 6, 4, 2]}  # None: 5 and 4 rows
VARIANTS = ("spmd", "spmd, hooks removed", "torch DDP")


def _batches(case, pattern: list, steps: int, rank: int, world: int) -> list:
    out = []
    for step in range(steps):
        rows = pattern[step % len(pattern)]
        rows = (5 if rank == 0 else 4) if rows is None else rows
        x, y = case.data(torch.Generator().manual_seed(step), world)
        out.append((x[:rows], y[:rows]))
    return out


def rank_main(rank: int, steps: int, rounds: int, names: list[str]) -> dict | None:
    import torch.distributed as tdist
    from torch.nn.parallel import DistributedDataParallel

    import spmd
    from spmd import runtime as dist

    results = {}
    with harness.group(rank, torch_group=True) as world:
        for name in names:
            case = CASES[name]
            for pattern_name, pattern in PATTERNS.items():
                models = {"spmd": spmd.parallelize(_fresh(case)),
                          "spmd, hooks removed": spmd.parallelize(_fresh(case)),
                          "torch DDP": DistributedDataParallel(_fresh(case))}
                opts = {v: case.optimizer(list(m.parameters())) for v, m in models.items()}
                batches = _batches(case, pattern, steps, rank, world)
                # compile every size first, then take the hooks off the measuring variant
                time_rounds({"spmd, hooks removed": models["spmd, hooks removed"]}, opts,
                            batches[:len(pattern)], case.loss, 0, tdist.barrier)
                state = models["spmd, hooks removed"]._spmd
                for hook in state.net.hooks.values():
                    hook.remove()
                state.net.hooks.clear()
                state.net.hook_all = lambda: None
                times = time_rounds(models, opts, batches, case.loss, rounds, tdist.barrier)
                graphs = {v: [r.reason for r in m._spmd.records] for v, m in models.items()
                          if v.startswith("spmd")}
                every = [None] * world
                dist.all_gather_object(every, len(graphs["spmd"]))
                results[(name, pattern_name)] = {"times": times, "graphs": every,
                                                 "reasons": graphs["spmd"],
                                                 "hooks": len(models["spmd"]._spmd.net.hooks)}
    return results if rank == 0 else None


def main() -> None:
    parser = harness.parser(__doc__, steps=24, rounds=5)
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    names = harness.choices(args.cases, list(CASES), parser)
    results = harness.spawn(rank_main, args.steps, args.rounds, names, nprocs=2)[0]
    harness.table(("case", "batch sizes", "variant", "ms/step", "vs torch DDP (x faster)",
                   "spread", "graphs per rank"), "lllrrll")
    for (name, pattern), res in results.items():
        for variant, v in harness.versus(res["times"], "torch DDP").items():
            graphs = "/".join(map(str, res["graphs"])) if variant == "spmd" else ""
            harness.row(CASES[name].label, pattern, variant, f"{v.median * 1e3:.2f}",
                        f"{v.ratio:.2f}", v.spread, graphs)
    for (name, pattern), res in results.items():
        print(f"\n{CASES[name].label}, {pattern}: {res['hooks']} hooks; graphs on rank 0:")
        for reason in res["reasons"]:
            print(f"  - {reason}")


if __name__ == "__main__":
    main()
