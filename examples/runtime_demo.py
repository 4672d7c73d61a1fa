"""A local multi-rank tour of the runtime: rendezvous, the store, and Gloo over it.

    python examples/runtime_demo.py [--nprocs 4]

Each rank meets the others through env:// (spawn sets the variables), publishes its
process id in the store, takes a ticket from an atomic counter, then builds a Gloo
process group over our store and all-reduces a tensor. Rank 0 prints what it saw.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta


def rank_main(rank: int) -> dict:
    import torch
    import torch.distributed as tdist

    from spmd.runtime import rendezvous, to_torch_store

    start = time.perf_counter()
    store, rank, world = rendezvous("env://", timeout=timedelta(seconds=60))
    met = time.perf_counter() - start
    store.set(f"pid/{rank}", str(os.getpid()))
    ticket = store.add("tickets", 1)
    pids = [int(v) for v in store.multi_get([f"pid/{r}" for r in range(world)])]
    pg = tdist.ProcessGroupGloo(to_torch_store(store), rank, world, timedelta(seconds=60))
    t = torch.full((4,), float(rank + 1))
    pg.allreduce([t]).wait()
    pg.barrier().wait()
    return {"rank": rank, "ticket": ticket, "pids": pids, "sum": t.tolist(), "met_s": met}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=4)
    args = parser.parse_args()

    from spmd.runtime import spawn

    results = spawn(rank_main, nprocs=args.nprocs, timeout=120)
    world = args.nprocs
    print(f"{world} ranks met through env:// (TCPStore on 127.0.0.1)")
    for r in results:
        print(f"  rank {r['rank']}: ticket {r['ticket']}, rendezvous {r['met_s'] * 1e3:.1f} ms, "
              f"all_reduce -> {r['sum']}")
    expected = float(world * (world + 1) // 2)
    assert all(r["sum"] == [expected] * 4 for r in results), "all_reduce disagrees"
    assert sorted(r["ticket"] for r in results) == list(range(1, world + 1))
    print(f"every rank holds {expected:g} = 1 + ... + {world}; tickets were unique")


if __name__ == "__main__":
    main()
