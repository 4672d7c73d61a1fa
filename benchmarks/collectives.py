"""Our collectives against torch.distributed's, on the same Gloo, in the same run.

    python benchmarks/collectives.py [--nprocs 2] [--max-mib 64]
    python benchmarks/collectives.py --overhead
    python benchmarks/collectives.py --size-check [--nprocs 2]


Each rank joins both libraries (ours over our TCPStore, torch's over its own) with Gloo
pinned to the loopback interface, then times every operation and size, interleaving the
two libraries to cancel drift. Bandwidths use nccl-tests' formulas: algbw = bytes/time,
busbw = algbw x 2(n-1)/n for all_reduce, x (n-1)/n for all_gather and reduce_scatter,
x 1 for broadcast. "ratio" is our time over torch's; "extra" our extra time per call.

``--overhead`` measures what each library adds per call, without the network: one rank,
a 4-byte tensor, Gloo, in this process; the libraries alternate in rounds, and the table
gives the medians and the spread of each round's difference. On two ranks a 4-byte collective is dominated by
scheduling noise of hundreds of microseconds on a 2-core machine; one rank isolates the
Python and dispatch cost that the aim "at most 20 µs more per call" is about.

``--size-check`` measures what the size check (``spmd.runtime.sizecheck``, on by default:
a row all-gathered before each eager collective, which carries a small call's data
itself) costs on two ranks: the same operation on a group with the check on and on one
with it off, alternating in rounds, from 4 B (inside the row) to 1 MiB (the row, then the
data); the table gives the medians and the spread of each round's difference. With
``--nprocs 1`` the check is forced on: its own cost, without the network.
"""

from __future__ import annotations

import os
import statistics
import time
import warnings

import torch

import harness

SIZES = [4, 64, 1 << 10, 16 << 10, 256 << 10, 4 << 20, 64 << 20]
BUS = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
       "reduce_scatter": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0}


def _calls(lib, n: int, nbytes: int):
    """(op name, zero-arg callable) for each operation at ``nbytes`` of payload."""
    count = max(1, nbytes // 4)
    a = torch.ones(count)
    shard = torch.ones(max(1, count // n))
    full = torch.empty(shard.numel() * n)
    return {
        "all_reduce": lambda: lib.all_reduce(a),
        "broadcast": lambda: lib.broadcast(a, src=0),
        "all_gather": lambda: lib.all_gather_into_tensor(full, shard),
        "reduce_scatter": lambda: lib.reduce_scatter_tensor(shard, full),
    }


def _iterations(fns, tdist, budget: float) -> int:
    """How many calls fill ``budget`` seconds, agreed by every rank (they must match)."""
    tdist.barrier()
    for fn in fns:
        fn()  # warm up
    tdist.barrier()
    start = time.perf_counter()
    fns[0]()
    once = max(time.perf_counter() - start, 1e-6)
    agreed = torch.tensor([max(3, min(2000, int(budget / once)))])
    tdist.all_reduce(agreed, op=tdist.ReduceOp.MIN)
    return int(agreed)


def _compare(ours, theirs, tdist, rounds: int = 7, budget: float = 0.1) -> tuple[float, float]:
    """Best time per call of each, measured in alternating rounds to cancel drift."""
    iters = _iterations([ours, theirs], tdist, budget)
    times = harness.alternate({"ours": lambda: _repeat(ours, iters),
                               "theirs": lambda: _repeat(theirs, iters)},
                              rounds, warmup=0, per=iters, barrier=tdist.barrier).times
    return min(times["ours"]), min(times["theirs"])


def _repeat(fn, times: int) -> None:
    for _ in range(times):
        fn()


def rank_main(rank: int, max_bytes: int) -> list | None:
    import torch.distributed as tdist

    from spmd import runtime as ours

    # torch's own group first, on its own connections: initialized after ours, torch would
    # share our group and backend, and the comparison would be of the Python layers only
    with harness.group(rank, timeout_s=300, torch_group=True, threads=None) as n:
        warnings.filterwarnings("ignore", category=FutureWarning)  # torch's renamed functions
        rows = []
        for nbytes in [s for s in SIZES if s <= max_bytes]:
            mine, theirs = _calls(ours, n, nbytes), _calls(tdist, n, nbytes)
            for op in mine:
                t_ours, t_torch = _compare(mine[op], theirs[op], tdist)
                rows.append((op, nbytes, t_ours, t_torch))
        # the price of debug mode: the same 4-byte all_reduce with fingerprints compared
        checked = ours.new_group()
        checked.debug = True  # what SPMD_DEBUG=detail sets on every group
        t = torch.ones(1)
        plain, debug = _compare(lambda: ours.all_reduce(t),
                                lambda: ours.all_reduce(t, group=checked), tdist)
        rows.append(("all_reduce, debug=detail vs off", 4, debug, plain))
    return rows if rank == 0 else None


def _fmt_bytes(n: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n // size} {unit}"
    return f"{n} B"


def overhead(rounds: int = 9, iters: int = 3000) -> None:
    import torch.distributed as tdist

    from spmd import runtime as ours

    # torch's first: ours registers itself as torch's default group when there is none
    # (interoperation), and torch's must stay its own Gloo group here
    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    ours.init_process_group("gloo", store=ours.HashStore(), rank=0, world_size=1)
    warnings.filterwarnings("ignore", category=FutureWarning)
    mine, theirs = _calls(ours, 1, 4), _calls(tdist, 1, 4)
    harness.table(("op (1 rank, 4 B)", "spmd µs/call (median)", "torch µs/call (median)",
                   "extra µs (median)", "extra µs per round (min–max)"), "lrrrl")
    for op in mine:
        fns = {"spmd": mine[op], "torch": theirs[op]}
        times = harness.alternate({k: (lambda fn=fn: _repeat(fn, iters)) for k, fn in fns.items()},
                                  rounds, warmup=0, per=iters,
                                  before=lambda k: _repeat(fns[k], 100)).times
        extra = [(x - y) * 1e6 for x, y in zip(times["spmd"], times["torch"])]  # round by round
        harness.row(op, f"{statistics.median(times['spmd']) * 1e6:.1f}",
                    f"{statistics.median(times['torch']) * 1e6:.1f}",
                    f"{statistics.median(extra):+.1f}", harness.span(extra, "+.1f", " to "))
    tdist.destroy_process_group()
    ours.destroy_process_group()


def size_check_rank(rank: int, rounds: int, iters: int) -> list | None:
    import torch.distributed as tdist

    from spmd import runtime as ours

    # torch's group only paces the rounds
    with harness.group(rank, timeout_s=300, torch_group=True, threads=None) as n:
        checked, unchecked = ours.new_group(), ours.new_group()
        # on (the default past one rank; forced on one rank, where it measures the check's
        # own cost without the network) and off (what SPMD_SIZE_CHECK=0 sets on every group)
        checked.size_check, unchecked.size_check = True, False
        rows = []
        for nbytes in CHECKED_SIZES:
            calls = [{op: (lambda f=f, g=g: f(g)) for op, f in _group_calls(n, nbytes).items()}
                     for g in (checked, unchecked)]
            for op in calls[0]:
                fns = {"on": calls[0][op], "off": calls[1][op]}
                times = harness.alternate(
                    {k: (lambda fn=fn: _repeat(fn, iters)) for k, fn in fns.items()},
                    rounds, warmup=0, per=iters, barrier=tdist.barrier,
                    before=lambda k: _repeat(fns[k], 10)).times
                rows.append((op, nbytes, (times["on"], times["off"])))
    return rows if rank == 0 else None


CHECKED_SIZES = (4, 512, 4 << 10, 64 << 10, 1 << 20)


def _group_calls(n: int, nbytes: int):
    """(op name, callable taking the group) at ``nbytes`` of payload, as :func:`_calls`."""
    from spmd import runtime as ours

    count = max(1, nbytes // 4)
    a = torch.ones(count)
    shard = torch.ones(max(1, count // n))
    full = torch.empty(shard.numel() * n)
    return {
        "all_reduce": lambda g: ours.all_reduce(a, group=g),
        "broadcast": lambda g: ours.broadcast(a, src=0, group=g),
        "all_gather": lambda g: ours.all_gather_into_tensor(full, shard, group=g),
        "reduce_scatter": lambda g: ours.reduce_scatter_tensor(shard, full, group=g),
        **({"barrier": lambda g: ours.barrier(group=g)} if nbytes == 4 else {}),
    }


def size_check(nprocs: int, rounds: int = 9, iters: int = 200) -> None:
    rows = harness.spawn(size_check_rank, rounds, iters, nprocs=nprocs, timeout=3000)[0]
    harness.table((f"op ({nprocs} ranks)", "size", "check on µs/call (median)",
                   "check off µs/call (median)", "ratio", "extra µs (median)",
                   "extra µs per round (min–max)"), "lrrrrrl")
    for op, nbytes, (on, off) in rows:
        extra = [(x - y) * 1e6 for x, y in zip(on, off)]
        m_on, m_off = statistics.median(on), statistics.median(off)
        harness.row(op, _fmt_bytes(nbytes), f"{m_on * 1e6:.1f}", f"{m_off * 1e6:.1f}",
                    f"{m_on / m_off:.2f}", f"{statistics.median(extra):+.1f}",
                    harness.span(extra, "+.1f", " to "))


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--max-mib", type=int, default=64)
    parser.add_argument("--overhead", action="store_true",
                        help="per-call cost on one rank instead of the two-rank sweep")
    parser.add_argument("--size-check", action="store_true",
                        help="the size check's cost per call, on --nprocs ranks")
    args = parser.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # both libraries, same device
    if args.overhead:
        overhead()
        return
    if args.size_check:
        size_check(args.nprocs)
        return

    rows = harness.spawn(rank_main, args.max_mib << 20, nprocs=args.nprocs, timeout=3000)[0]
    n = args.nprocs
    harness.table(("op", "size", "spmd µs", "torch µs", "ratio", "extra µs", "spmd busbw GB/s",
                   "torch busbw GB/s"), "lrrrrrrr")
    ratios = []
    for op, nbytes, t_ours, t_torch in rows:
        if op not in BUS:
            print(f"\n{op}: {t_ours * 1e6:,.1f} µs against {t_torch * 1e6:,.1f} µs "
                  f"(+{(t_ours - t_torch) * 1e6:,.1f} µs per call)")
            continue
        bus = BUS[op](n)
        ratios.append(t_ours / t_torch)
        harness.row(op, _fmt_bytes(nbytes), f"{t_ours * 1e6:,.1f}", f"{t_torch * 1e6:,.1f}",
                    f"{t_ours / t_torch:.3f}", f"{(t_ours - t_torch) * 1e6:+.1f}",
                    f"{nbytes / t_ours * bus / 1e9:.3f}", f"{nbytes / t_torch * bus / 1e9:.3f}")
    print(f"\nmedian ratio {statistics.median(ratios):.3f} over {len(ratios)} measurements")


if __name__ == "__main__":
    main()
