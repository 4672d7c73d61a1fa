"""ZeRO stages 1 and 2 (``strategy="zero1"``/``"zero2"``) against torch's
``ZeroRedundancyOptimizer`` over DDP (ZeRO-1), and against spmd's fsdp and ddp: step
time, held bytes and peak, same run.

    python benchmarks/zero.py [--nprocs 2] [--steps 20] [--rounds 5] [--layers 8]
                              [--width 128]

Local ranks (processes), one thread each, Gloo over loopback; the model, data and
optimizer (AdamW) of ``benchmarks/fsdp.py`` for every variant:

- ``spmd zero1``: ``spmd.parallelize(model, strategy="zero1")`` and ``torch.optim.AdamW``
  over its parameters (the shards): gradients all-reduced whole, each rank keeps its
  rows, steps them, and the parameters are gathered once, in the next forward;
- ``spmd zero2``: the same with the gradients reduce-scattered;
- ``torch ZeRO-1``: ``ZeroRedundancyOptimizer(optimizer_class=AdamW)`` over
  ``DistributedDataParallel`` on a torch Gloo group of the same ranks (each rank steps
  the parameters it owns, then broadcasts them);
- ``spmd fsdp`` (gathered at each use, resharded after forward) and ``spmd ddp``.

Time: variants alternate in rounds; round 0 warms up (compiles) and is not counted; the
median step time over rounds, the ratio ZeRO-1's time over the variant's (above 1:
faster than torch) and its spread over rounds. Memory, rank 0's, measured with
``torch.profiler`` (``profile_memory=True``) from the variant's construction on, each
variant alone: ``held`` the allocator bytes alive at the end of a step (parameters,
gradients, optimizer state, and whatever each keeps between steps: spmd zero's gathered
parameters, DDP's buckets), ``peak`` the most alive during that step. Sanity: every
variant trained from the same weights on the same batches (largest difference of the
whole state dict from torch ZeRO-1's).
"""

from __future__ import annotations

import gc
import time

import torch
import torch.nn as nn

import harness
from fsdp import _batch, _fresh, _train, cli, memory_between

VARIANTS = ("spmd zero1", "spmd zero2", "torch ZeRO-1", "spmd fsdp", "spmd ddp")


def rank_main(rank: int, steps: int, rounds: int, width: int, layers: int) -> dict | None:
    # torch's ZeRO-1 runs over DDP on a group of torch's own, as its users run it
    with harness.group(rank, torch_group=True):
        out = _measure(rank, steps, rounds, width, layers)
    return out if rank == 0 else None


def _measure(rank: int, steps: int, rounds: int, width: int, layers: int) -> dict:
    import torch.distributed as tdist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel
    from torch.profiler import ProfilerActivity, profile

    import spmd

    def build(variant: str) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = _fresh(width, layers)
        if variant == "torch ZeRO-1":
            model = DistributedDataParallel(model)
            return model, ZeroRedundancyOptimizer(model.parameters(),
                                                  optimizer_class=torch.optim.AdamW, lr=1e-3)
        strategy = variant.split()[1]
        model = spmd.parallelize(model, strategy=strategy)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    batches = [_batch(step, rank) for step in range(steps)]
    built = {v: build(v) for v in VARIANTS}
    times = harness.alternate({v: (lambda v=v: _train(*built[v], batches)) for v in VARIANTS},
                              rounds, barrier=tdist.barrier, per=steps).times

    wholes = {}
    for variant, (model, _) in built.items():  # every rank gathers: all call it
        state = (model.module if variant == "torch ZeRO-1" else model).state_dict()
        wholes[variant] = {k.removeprefix("module."): v for k, v in state.items()}
    reference = wholes.pop("torch ZeRO-1")
    differences = {v: max((w[k] - reference[k]).abs().max().item() for k in reference)
                   for v, w in wholes.items()}
    del built, reference, wholes

    memory: dict[str, tuple[int, int]] = {}
    for variant in VARIANTS:
        gc.collect()
        tdist.barrier()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                     record_shapes=False) as prof:
            model, opt = build(variant)
            _train(model, opt, batches[:1])  # warm-up: compiles
            gc.collect()
            start = time.time_ns()
            _train(model, opt, batches[1:2] or batches[:1])
            end = time.time_ns()
        memory[variant] = memory_between(prof, start, end)
        del model, opt, prof
    return {"times": times, "memory": memory, "differences": differences}


def report(world: int, res: dict, steps: int, rounds: int, width: int, layers: int) -> None:
    mib = 2**20
    times, memory = res["times"], res["memory"]
    print(f"\n### {world} ranks: {layers} layers of width {width}, AdamW, {steps} steps x "
          f"{rounds} rounds\n")
    harness.table(("variant", "ms/step", "vs torch ZeRO-1 (x faster)", "spread over rounds",
                   "held MiB", "peak MiB", "max |w - ZeRO-1's w|"), "lrrlrrr")
    for variant, v in harness.versus(times, "torch ZeRO-1").items():
        peak, held = memory[variant]
        diff = res["differences"].get(variant)
        harness.row(variant, f"{v.median * 1e3:.2f}", f"{v.ratio:.2f}", v.spread,
                    f"{held / mib:.2f}", f"{peak / mib:.2f}",
                    "" if diff is None else f"{diff:.1e}")


def main() -> None:
    cli(__doc__, rank_main, report, "2")


if __name__ == "__main__":
    main()
