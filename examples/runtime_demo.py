"""A local multi-rank tour of the runtime, written as a torch.distributed program would be.

    python examples/runtime_demo.py [--nprocs 4]

spawn starts the ranks with MASTER_ADDR/PORT, RANK and WORLD_SIZE set, so
init_process_group needs no arguments. Each rank then all-reduces, passes a token
around a ring with send/recv, gathers Python objects, and times a 1 MiB all_reduce
against torch.distributed's on the same Gloo. Rank 0 prints what it saw.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta


def rank_main(rank: int) -> dict:
    import torch
    import torch.distributed as tdist

    from spmd import runtime as dist

    # torch.distributed's own group first, on its own port and connections, so the timing
    # below compares two runtimes (initialized after ours, torch would share our group)
    port = int(os.environ["MASTER_PORT"]) + 1
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                             world_size=int(os.environ["WORLD_SIZE"]))
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    world = dist.get_world_size()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    token = torch.zeros(1)
    if rank == 0:
        dist.send(token + 1, dst=1 % world)
        dist.recv(token, src=world - 1)
    else:
        dist.recv(token, src=rank - 1)
        dist.send(token + 1, dst=(rank + 1) % world)
    hosts = [None] * world
    dist.all_gather_object(hosts, {"rank": rank, "pid": os.getpid()})

    payload = torch.ones(1 << 18)  # 1 MiB
    timings = {}
    for name, fn in (("spmd", dist.all_reduce), ("torch.distributed", tdist.all_reduce)):
        fn(payload)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(20):
            fn(payload)
        timings[name] = (time.perf_counter() - start) / 20
    tdist.destroy_process_group()
    dist.destroy_process_group()
    return {"total": total.item(), "token": token.item(), "hosts": hosts, "timings": timings}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=4)
    args = parser.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

    from spmd.runtime import spawn

    results = spawn(rank_main, nprocs=args.nprocs, timeout=300)
    n = args.nprocs
    first = results[0]
    print(f"{n} ranks over Gloo, met through env:// and our TCPStore")
    print(f"  all_reduce of rank+1:        {first['total']:g} (expected {n * (n + 1) // 2})")
    print(f"  token after a ring of sends: {first['token']:g} (expected {n})")
    print(f"  all_gather_object:           {[h['pid'] for h in first['hosts']]} (pids)")
    t = first["timings"]
    print(f"  1 MiB all_reduce: spmd {t['spmd'] * 1e3:.2f} ms, torch.distributed "
          f"{t['torch.distributed'] * 1e3:.2f} ms (ratio {t['spmd'] / t['torch.distributed']:.2f})")
    assert first["total"] == n * (n + 1) // 2 and first["token"] == n


if __name__ == "__main__":
    main()
