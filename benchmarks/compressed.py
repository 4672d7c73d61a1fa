"""Low-precision gradient all-reduce: accuracy and DDP step time, ours against torch's
``bf16_compress_hook``.

    python benchmarks/compressed.py [--part accuracy|speed|call|all] [--quick]
                                    [--worlds 2,4,8] [--elements 1048576]
                                    [--nprocs 2,3] [--steps 20] [--rounds 5]

Local ranks (processes), one thread each, Gloo over loopback.

**Accuracy** (``--worlds``): each rank holds ``--elements`` float32 "gradients",
``m * (s + n_r)``: a magnitude ``m = 10**U(-3, 0)`` and a signal ``s ~ N(0, 1)`` per
element, common to all ranks (a parameter's gradients have one scale and the ranks agree
on a direction), and noise ``n_r ~ N(0, 1)`` of the rank's own. The reference is the
mean over the ranks in float64. Methods, each on a copy of the same inputs:

- ``fp32 all_reduce / p``: ``spmd.runtime.all_reduce`` (sum) in float32, then divided;
- ``torch bf16_compress_hook``: torch's hook itself, called as torch's DDP calls it
  (``hook(None, bucket)`` with a :class:`spmd.lowering.reduction.GradBucket` over the
  buffer, torch.distributed's default group being ours), its future waited: cast to
  bfloat16, divided by ``p``, all-reduced in bfloat16 (Gloo adds in bfloat16 at each
  step), cast back;
- ``ours, bf16 wire`` / ``ours, fp8 wire``: ``spmd.runtime.all_reduce_compressed(AVG)``
  with ``wire_dtype`` bfloat16 / float8_e4m3fn and the compiler's ``combine`` (sent by
  all-to-all, added in float32, rounded once, all-gathered);
- two floors, computed, not communicated: ``bf16(exact mean)``, the exact mean rounded
  once (the best a bfloat16 result can be), and ``mean of bf16(inputs)``, the exact mean
  of the inputs rounded to bfloat16 (what the wire alone loses).

Errors against the reference ``r``: ``||x - r||_2 / ||r||_2``, ``max |x - r| / max |r|``
and the median over the elements of ``|x - r| / |r|``; "x one rounding" is the L2 error
over that of ``bf16(exact mean)``. Every rank must hold the same result (checked).

**Speed** (``--nprocs``): DDP step time of ``benchmarks/ddp.py``'s encoder case (a
3-layer transformer encoder of width 128, AdamW, 32 sequences of 16 tokens split over the
ranks), the same model, data and optimizer for every variant:

- ``spmd, fp32 wire``: ``spmd.parallelize(model)``;
- ``spmd, bf16 wire``: ``spmd.parallelize(model, reduce_dtype=torch.bfloat16)`` (over 2
  ranks the backend's bfloat16 all-reduce, one addition; above, ours: float32 addition);
- ``torch DDP + bf16 hook``: ``DistributedDataParallel`` with ``bf16_compress_hook``
  (wrapped in a lambda: torch's DDP refuses the hook by name off NCCL);
- ``torch DDP``: ``DistributedDataParallel`` with its defaults (float32), for context.

torch's DDP runs on a Gloo group of torch's own, as in ``benchmarks/ddp.py``. Variants
alternate in rounds so all see the same machine; round 0 warms up (compiles) and is not
counted. The figure is the median step time over the rounds; the ratio is the hooked
DDP's time over the variant's (above 1: faster than DDP with the bf16 hook) and "spread"
the lowest and highest per-round ratio. After the rounds, every variant has trained from
the same weights on the same batches: the largest difference of its weights from plain
DDP's. More ranks than cores (3 on a 2-core machine) time the machine's scheduler as
much as the all-reduce: read those ratios with their spread.

**Call** (``--part call``, not in ``all``): the time of one call on ``--elements``
float32 (default 2^22, a 16 MiB bucket) over each of ``--nprocs``, the three methods that
communicate alternating call by call after a barrier (``--steps`` calls a round,
``--rounds`` rounds, the first call of each not counted): ours with the bfloat16 wire,
torch's ``bf16_compress_hook`` and the float32 all-reduce. The figure is the median of
the per-round medians; the ratio is the hook's time over ours, with its spread over the
rounds.

``--quick``: 2^18 elements, 2 ranks for speed, 10 steps x 3 rounds. Prints markdown
tables.
"""

from __future__ import annotations

import hashlib
import statistics
import time

import torch

import harness
from ddp import CASES, _batch, _fresh, time_rounds

METHODS = ("fp32 all_reduce / p", "torch bf16_compress_hook", "ours, bf16 wire",
           "ours, fp8 wire")
FLOORS = ("bf16(exact mean)", "mean of bf16(inputs)")
VARIANTS = ("spmd, fp32 wire", "spmd, bf16 wire", "torch DDP + bf16 hook", "torch DDP")
HOOKED = "torch DDP + bf16 hook"


# -- accuracy --------------------------------------------------------------------------


def _gradients(rank: int, n: int) -> torch.Tensor:
    """Rank ``rank``'s float32 gradients: ``m * (s + n_r)`` (see the module doc)."""
    shared = torch.Generator().manual_seed(0)
    magnitude = 10.0 ** (-3.0 * torch.rand(n, generator=shared, dtype=torch.float64))
    signal = torch.randn(n, generator=shared, dtype=torch.float64)
    noise = torch.randn(n, generator=torch.Generator().manual_seed(1 + rank),
                        dtype=torch.float64)
    return (magnitude * (signal + noise)).float()


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.contiguous().numpy().tobytes()).hexdigest()


def accuracy_main(rank: int, n: int) -> dict:
    import torch.distributed as tdist
    from spmd.lowering.reduction import GradBucket, _combine
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from spmd import runtime as dist

    with harness.group(rank) as p:
        # the hook all-reduces on torch's default group: it must be ours
        if not tdist.is_initialized() or tdist.get_world_size() != p:
            raise RuntimeError("torch.distributed does not see spmd's default group")
        x = _gradients(rank, n)
        out: dict[str, torch.Tensor] = {}

        y = x.clone()
        dist.all_reduce(y)
        out[METHODS[0]] = y.div_(p)

        buffer = x.clone()
        bucket = GradBucket(0, buffer, [], [buffer], True)
        future = default_hooks.bf16_compress_hook(None, bucket)
        result = future.wait()
        out[METHODS[1]] = result[0] if isinstance(result, (list, tuple)) else result

        for method, wire in ((METHODS[2], torch.bfloat16), (METHODS[3], torch.float8_e4m3fn)):
            y = x.clone()
            dist.all_reduce_compressed(y, dist.ReduceOp.AVG, wire_dtype=wire, combine=_combine)
            out[method] = y
        digests = {m: _digest(t) for m, t in out.items()}
        return {"results": out, "digests": digests} if rank == 0 else {"digests": digests}


def _errors(x: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    d = x.double() - ref
    nonzero = ref != 0
    return {"l2": (d.norm() / ref.norm()).item(),
            "max": (d.abs().max() / ref.abs().max()).item(),
            "median": (d.abs()[nonzero] / ref.abs()[nonzero]).median().item()}


def accuracy(worlds: list[int], n: int) -> None:
    rows: dict[int, dict[str, dict[str, float]]] = {}
    notes: list[str] = []
    for p in worlds:
        start = time.perf_counter()
        runs = harness.spawn(accuracy_main, n, nprocs=p, start_method="forkserver",
                             timeout=1200)
        seconds = time.perf_counter() - start
        results = runs[0]["results"]
        xs = [_gradients(r, n) for r in range(p)]
        ref = sum(x.double() for x in xs) / p
        sent = [x.to(torch.bfloat16) for x in xs]
        floors = {FLOORS[0]: ref.to(torch.bfloat16),
                  FLOORS[1]: sum(s.double() for s in sent) / p}
        # ours' float32 model: the bf16 inputs added in float32 in rank order, scaled once,
        # rounded once (bit for bit what it should return)
        total = torch.zeros(n, dtype=torch.float32)
        for s in sent:
            total += s.float()
        model = (total * (1.0 / p)).to(torch.bfloat16).float()
        rows[p] = {m: _errors(results[m], ref) for m in METHODS}
        rows[p].update({f: _errors(v, ref) for f, v in floors.items()})
        unequal = [m for m in METHODS if len({run["digests"][m] for run in runs}) > 1]
        notes.append(f"{p} ranks ({seconds:.0f} s): ranks hold the same result: "
                     f"{'yes' if not unequal else 'NO for ' + ', '.join(unequal)}; ours, bf16 "
                     f"wire equals its float32 model bit for bit: "
                     f"{'yes' if torch.equal(results[METHODS[2]], model) else 'NO'}")

    print(f"\n### Accuracy: {n:,} float32 gradients per rank, mean over the ranks, against "
          f"float64\n")
    harness.table(("ranks", "method", "rel. L2 error", "max abs error / max abs",
                   "median rel. error", "x one rounding"), "rlrrrr")
    for p, row in rows.items():
        unit = row[FLOORS[0]]["l2"]
        for method, e in row.items():
            harness.row(p, method, f"{e['l2']:.3e}", f"{e['max']:.3e}", f"{e['median']:.3e}",
                        f"{e['l2'] / unit:.3g}")
    print()
    for note in notes:
        print(note)
    hook = {p: row[METHODS[1]]["l2"] / row[FLOORS[0]]["l2"] for p, row in rows.items()}
    ours = {p: row[METHODS[2]]["l2"] / row[FLOORS[0]]["l2"] for p, row in rows.items()}
    wire = {p: row[FLOORS[1]]["l2"] / row[FLOORS[0]]["l2"] for p, row in rows.items()}
    fmt = lambda d: ", ".join(f"{v:.2f}x at {p}" for p, v in d.items())
    print(f"\nIn units of one bfloat16 rounding of the exact mean (L2): ours with a bf16 "
          f"wire {fmt(ours)} (the wire alone: {fmt(wire)}); torch's bf16_compress_hook "
          f"{fmt(hook)}.")


# -- speed -----------------------------------------------------------------------------


def speed_main(rank: int, steps: int, rounds: int) -> dict | None:
    import torch.distributed as tdist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    import spmd

    case = CASES["encoder"]

    def hooked():
        ddp = DistributedDataParallel(_fresh(case))
        # torch's DDP refuses bf16_compress_hook by name off NCCL; called through, it runs
        # (torch checks the hook's parameters by name: state, bucket)
        ddp.register_comm_hook(
            None, lambda state, bucket: default_hooks.bf16_compress_hook(state, bucket))
        return ddp

    make = {
        "spmd, fp32 wire": lambda: spmd.parallelize(_fresh(case)),
        "spmd, bf16 wire": lambda: spmd.parallelize(_fresh(case), reduce_dtype=torch.bfloat16),
        HOOKED: hooked,
        "torch DDP": lambda: DistributedDataParallel(_fresh(case)),
    }
    # torch DDP on a Gloo group of torch's own, as DDP users run it
    with harness.group(rank, torch_group=True) as world:
        models = {v: make[v]() for v in VARIANTS}
        opts = {v: case.optimizer(list(m.parameters())) for v, m in models.items()}
        batches = [_batch(case, step, rank, world) for step in range(steps)]
        times = time_rounds(models, opts, batches, case.loss, rounds, tdist.barrier)

        weights = {v: {k.removeprefix("module."): t for k, t in m.state_dict().items()}
                   for v, m in models.items()}
        base = weights["torch DDP"]
        differences = {v: max((w[k] - base[k]).abs().max().item() for k in base)
                       for v, w in weights.items() if v != "torch DDP"}
        initial = _fresh(case).state_dict()
        moved = max((base[k] - initial[k]).abs().max().item() for k in base)
        plans = {}
        for variant in ("spmd, fp32 wire", "spmd, bf16 wire"):
            plan = spmd.inspect(models[variant])
            reasons = sorted({c.provenance.reason for c in plan.collectives})
            plans[variant] = (str(plan).splitlines()[0], reasons)
    if rank:
        return None
    return {"times": times, "differences": differences, "moved": moved, "plans": plans}


def speed(worlds: list[int], steps: int, rounds: int) -> None:
    for p in worlds:
        res = harness.spawn(speed_main, steps, rounds, nprocs=p, start_method="forkserver",
                            timeout=1200)[0]
        print(f"\n### Speed, {p} ranks: {CASES['encoder'].label}, {steps} steps x {rounds} "
              f"rounds\n")
        harness.table(("variant", "ms/step", "vs DDP + bf16 hook (x faster)",
                       "spread over rounds", "max abs w - DDP's w"), "lrrlr")
        for variant, v in harness.versus(res["times"], HOOKED).items():
            diff = res["differences"].get(variant)
            harness.row(variant, f"{v.median * 1e3:.2f}", f"{v.ratio:.2f}", v.spread,
                        "" if diff is None else f"{diff:.2e}")
        print(f"\n(torch DDP's weights moved up to {res['moved']:.2e} from their initial "
              f"values)")
        for variant, (summary, reasons) in res["plans"].items():
            print(f"{variant}: {summary}")
            for reason in reasons:
                if reason:
                    print(f"  reduction: {reason}")


CALLS = ("ours, bf16 wire", "torch bf16_compress_hook", "fp32 all_reduce / p")


def call_main(rank: int, n: int, calls: int, rounds: int) -> dict | None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from spmd import runtime as dist
    from spmd.lowering.reduction import GradBucket, _combine

    with harness.group(rank) as p:
        x = _gradients(rank, n)

        def ours(y):
            dist.all_reduce_compressed(y, dist.ReduceOp.AVG, wire_dtype=torch.bfloat16,
                                       combine=_combine)

        def hook(y):
            default_hooks.bf16_compress_hook(None, GradBucket(0, y, [], [y], True)).wait()

        def fp32(y):
            dist.all_reduce(y)
            y.div_(p)

        run = dict(zip(CALLS, (ours, hook, fp32)))
        fresh: dict[str, torch.Tensor] = {}  # each call's own copy, made before its clock

        def copy(name: str) -> None:
            fresh[name] = x.clone()

        medians: dict[str, list[float]] = {name: [] for name in CALLS}
        for _ in range(rounds):
            # the methods alternate call by call; the first call of each is not counted
            times = harness.alternate({name: (lambda name=name: run[name](fresh[name]))
                                       for name in CALLS}, calls, barrier=dist.barrier,
                                      before=copy).times
            for name in CALLS:
                medians[name].append(statistics.median(times[name]))
    return medians if rank == 0 else None


def call(worlds: list[int], n: int, calls: int, rounds: int) -> None:
    for p in worlds:
        medians = harness.spawn(call_main, n, calls, rounds, nprocs=p,
                                start_method="forkserver", timeout=1200)[0]
        print(f"\n### One call, {p} ranks, {n:,} float32 ({n * 4 / 2**20:.0f} MiB), {calls} "
              f"calls x {rounds} rounds\n")
        harness.table(("method", "ms/call", "hook's time / this (x)", "spread over rounds"),
                      "lrrl")
        for name, v in harness.versus(medians, "torch bf16_compress_hook").items():
            harness.row(name, f"{v.median * 1e3:.1f}", f"{v.ratio:.2f}", v.spread)


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--part", choices=("accuracy", "speed", "call", "all"), default="all")
    parser.add_argument("--quick", action="store_true",
                        help="2^18 elements, 2 ranks for speed, 10 steps x 3 rounds")
    parser.add_argument("--worlds", default="2,4,8", help="accuracy: comma-separated ranks")
    parser.add_argument("--elements", type=int, default=None,
                        help="accuracy: gradients per rank (default 2^20; 2^18 with --quick)")
    parser.add_argument("--nprocs", default=None,
                        help="speed: comma-separated ranks (default 2,3; 2 with --quick)")
    parser.add_argument("--steps", type=int, default=None, help="speed (default 20; 10)")
    parser.add_argument("--rounds", type=int, default=None, help="speed (default 5; 3)")
    args = parser.parse_args()
    quick = args.quick
    elements = args.elements or (1 << 18 if quick else 1 << 20)
    nprocs = args.nprocs or ("2" if quick else "2,3")
    steps = args.steps or (10 if quick else 20)
    rounds = args.rounds or (3 if quick else 5)
    worlds = harness.world_sizes(args.worlds, parser, "--worlds")
    speed_worlds = harness.world_sizes(nprocs, parser, "--nprocs")
    if args.part in ("accuracy", "all"):
        accuracy(worlds, elements)
    if args.part in ("speed", "all"):
        speed(speed_worlds, steps, rounds)
    if args.part == "call":
        call(speed_worlds, args.elements or (1 << 18 if quick else 1 << 22), steps, rounds)


if __name__ == "__main__":
    main()
