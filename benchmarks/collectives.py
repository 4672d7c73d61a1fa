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

import argparse
import os
import warnings
import statistics
import time
from datetime import timedelta

import torch

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
    best = [float("inf"), float("inf")]
    for _ in range(rounds):
        for i, fn in enumerate((ours, theirs)):
            tdist.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            best[i] = min(best[i], (time.perf_counter() - start) / iters)
    return best[0], best[1]


def rank_main(rank: int, max_bytes: int) -> list | None:
    import torch.distributed as tdist

    from spmd import runtime as ours

    n = int(os.environ["WORLD_SIZE"])
    # torch's own group first, on its own connections: initialized after ours, torch would
    # share our group and backend, and the comparison would be of the Python layers only
    port = int(os.environ["MASTER_PORT"]) + 1
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                             world_size=n, timeout=timedelta(seconds=300))
    ours.init_process_group("gloo", timeout=timedelta(seconds=300))
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
    plain, debug = _compare(lambda: ours.all_reduce(t), lambda: ours.all_reduce(t, group=checked),
                            tdist)
    rows.append(("all_reduce, debug=detail vs off", 4, debug, plain))
    tdist.destroy_process_group()
    ours.destroy_process_group()
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
    print("| op (1 rank, 4 B) | spmd µs/call (median) | torch µs/call (median) | extra µs "
          "(median) | extra µs per round (min–max) |")
    print("|---|---:|---:|---:|---|")
    for op in mine:
        times: list[list[float]] = [[], []]
        for _ in range(rounds):
            for i, fn in enumerate((mine[op], theirs[op])):
                for _ in range(100):
                    fn()
                start = time.perf_counter()
                for _ in range(iters):
                    fn()
                times[i].append((time.perf_counter() - start) / iters)
        extra = [(x - y) * 1e6 for x, y in zip(*times)]  # each round's own pair
        print(f"| {op} | {statistics.median(times[0]) * 1e6:.1f} | "
              f"{statistics.median(times[1]) * 1e6:.1f} | {statistics.median(extra):+.1f} | "
              f"{min(extra):+.1f} to {max(extra):+.1f} |")
    tdist.destroy_process_group()
    ours.destroy_process_group()


def size_check_rank(rank: int, rounds: int, iters: int) -> list | None:
    import torch.distributed as tdist

    from spmd import runtime as ours

    port = int(os.environ["MASTER_PORT"]) + 1  # torch's group only paces the rounds
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                             world_size=int(os.environ["WORLD_SIZE"]),
                             timeout=timedelta(seconds=300))
    ours.init_process_group("gloo", timeout=timedelta(seconds=300))
    checked, unchecked = ours.new_group(), ours.new_group()
    # on (the default past one rank; forced on one rank, where it measures the check's own
    # cost without the network) and off (what SPMD_SIZE_CHECK=0 sets on every group)
    checked.size_check, unchecked.size_check = True, False
    n = ours.get_world_size()
    rows = []
    for nbytes in CHECKED_SIZES:
        calls = [{op: (lambda f=f, g=g: f(g)) for op, f in _group_calls(n, nbytes).items()}
                 for g in (checked, unchecked)]
        for op in calls[0]:
            times: list[list[float]] = [[], []]
            for _ in range(rounds):
                for i in (0, 1):
                    fn = calls[i][op]
                    for _ in range(10):
                        fn()
                    tdist.barrier()
                    start = time.perf_counter()
                    for _ in range(iters):
                        fn()
                    times[i].append((time.perf_counter() - start) / iters)
            rows.append((op, nbytes, times))
    tdist.destroy_process_group()
    ours.destroy_process_group()
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
    from spmd.runtime import spawn

    rows = spawn(size_check_rank, args=(rounds, iters), nprocs=nprocs, timeout=3000)[0]
    print(f"| op ({nprocs} ranks) | size | check on µs/call (median) | check off µs/call "
          f"(median) | ratio | extra µs (median) | extra µs per round (min–max) |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for op, nbytes, (on, off) in rows:
        extra = [(x - y) * 1e6 for x, y in zip(on, off)]
        m_on, m_off = statistics.median(on), statistics.median(off)
        print(f"| {op} | {_fmt_bytes(nbytes)} | {m_on * 1e6:.1f} | {m_off * 1e6:.1f} | "
              f"{m_on / m_off:.2f} | {statistics.median(extra):+.1f} | "
              f"{min(extra):+.1f} to {max(extra):+.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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

    from spmd.runtime import spawn

    rows = spawn(rank_main, args=(args.max_mib << 20,), nprocs=args.nprocs, timeout=3000)[0]
    n = args.nprocs
    print("| op | size | spmd µs | torch µs | ratio | extra µs | spmd busbw GB/s | "
          "torch busbw GB/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    ratios = []
    for op, nbytes, t_ours, t_torch in rows:
        if op not in BUS:
            print(f"\n{op}: {t_ours * 1e6:,.1f} µs against {t_torch * 1e6:,.1f} µs "
                  f"(+{(t_ours - t_torch) * 1e6:,.1f} µs per call)")
            continue
        bus = BUS[op](n)
        ratios.append(t_ours / t_torch)
        print(f"| {op} | {_fmt_bytes(nbytes)} | {t_ours * 1e6:,.1f} | {t_torch * 1e6:,.1f} | "
              f"{t_ours / t_torch:.3f} | {(t_ours - t_torch) * 1e6:+.1f} | "
              f"{nbytes / t_ours * bus / 1e9:.3f} | {nbytes / t_torch * bus / 1e9:.3f} |")
    print(f"\nmedian ratio {statistics.median(ratios):.3f} over {len(ratios)} measurements")


if __name__ == "__main__":
    main()
