"""Predicted against measured communication, after calibration, on real ranks.

    python benchmarks/prediction.py [--steps 12]

For each benchmark model (benchmarks/ddp.py) on 2 and 3 ranks: parallelize with
``calibrate=True`` (the cost model fitted to the live group) and ``overlap=False`` (each
all-reduce then has the network and the CPU to itself, which is what the α–β model
describes), profile real steps, and compare the plan's predicted communication per step
with the measured one. A collective cannot finish before its last rank starts it; ranks
sharing two cores drift apart by milliseconds, and that waiting is load imbalance, not
communication. So a collective is measured from the latest rank's issue to the first
completion any rank saw (Gloo's completion callback, or the end of the wait if that came
first), on one clock: all ranks are processes of this machine and ``time.perf_counter``
is system-wide. The figure is the median over steps; the error is |predicted - measured| /
measured.

This is a benchmark, not a test: the project measures time in benchmarks, never as
timed assertions in tests (tests/cpu/test_profiling.py checks the mechanism instead).
"""

from __future__ import annotations

import statistics

import torch

import harness
from ddp import CASES, _batch, _fresh

MODELS = list(CASES)


def profiled(rank: int, name: str, steps: int) -> dict:
    import spmd
    from spmd.plan.profiling import completions

    with harness.group(rank, timeout_s=300) as world:
        case = CASES[name]
        model = spmd.parallelize(_fresh(case), calibrate=True, overlap=False)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step(i: int) -> None:
            x, y = _batch(case, i, rank, world)
            case.loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()

        for i in range(3):
            step(i)
        prof = spmd.profile(model, steps=steps)
        for i in range(steps):
            step(i)
        plan = spmd.inspect(model)
    return {
        "predicted": plan.predicted_communication_seconds(),
        "buckets": len(plan.buckets),
        "raw": [[("issue", n, t) for kind, n, t in step if kind == "issue"]
                + [("done", n, t) for n, t in completions(step).items()] for step in prof.raw],
    }


def measured_per_step(runs: list[dict]) -> list[float]:
    """Per step: the sum over collectives of (first completion seen - the latest issue).

    The latest rank's issue is when the collective could start; the first rank to see it
    complete bounds when it finished (a rank descheduled after waking, as happens with
    more threads than cores, would only report it later)."""
    steps = []
    for k in range(len(runs[0]["raw"])):
        issue: dict[str, float] = {}
        done: dict[str, float] = {}
        for r in runs:
            for kind, name, t in r["raw"][k]:
                if kind == "issue":
                    issue[name] = max(issue.get(name, t), t)
                else:
                    done[name] = min(done.get(name, t), t)
        steps.append(sum(max(0.0, done[n] - issue[n]) for n in issue))
    return steps


def main() -> None:
    args = harness.parser(__doc__, steps=12).parse_args()
    harness.table(("model", "ranks", "buckets", "predicted ms", "measured ms (median)",
                   "error"), "lrrrrr")
    for name in MODELS:
        for nprocs in (2, 3):
            runs = harness.spawn(profiled, name, args.steps, nprocs=nprocs, timeout=600)
            measured = statistics.median(measured_per_step(runs))
            predicted = runs[0]["predicted"]
            harness.row(name, nprocs, runs[0]["buckets"], f"{predicted * 1e3:.3f}",
                        f"{measured * 1e3:.3f}", f"{abs(predicted - measured) / measured:.0%}")


if __name__ == "__main__":
    main()
