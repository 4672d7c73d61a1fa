"""TCPStore against torch.distributed.TCPStore, measured in the same run.

    python benchmarks/store.py [--ops 20000] [--clients 16] [--rendezvous 64]

For each store: the server lives in its own process (as on a real master, whose main
thread is busy training), and clients are separate processes on this machine.

- single-client ops/s of set, get and add (set is one-way in both stores: no reply);
- ops/s summed over 16 concurrent client processes (each a mix of add and get);
- the time for 64 client processes to rendezvous: from a common start signal, each
  connects, sets its key and waits for all 64 keys; the figure is the time until the
  last one has seen them all.

Prints a markdown table with our figure, PyTorch's, and the ratio.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from datetime import timedelta

import harness

T = timedelta(seconds=120)


def _connect(kind: str, port: int, world: int | None = None):
    if kind == "spmd":
        from spmd.runtime import TCPStore

        return TCPStore("127.0.0.1", port, world, False, T)
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, world, False, T)


def _server(kind: str, port_out, stop) -> None:
    if kind == "spmd":
        from spmd.runtime import TCPStore

        store = TCPStore("127.0.0.1", 0, None, True, T)
    else:
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", 0, None, True, T, wait_for_workers=False)
    port_out.send(store.port)
    stop.wait()


def _single(kind: str, port: int, ops: int, out) -> None:
    store = _connect(kind, port)
    store.set("k", b"v" * 16)
    result = {}
    for op in ("set", "get", "add"):
        start = time.perf_counter()
        if op == "set":
            for _ in range(ops):
                store.set("k", b"v" * 16)
            store.get("k")  # the sets are applied before the clock stops
        elif op == "get":
            for _ in range(ops):
                store.get("k")
        else:
            for _ in range(ops):
                store.add("n", 1)
        result[op] = ops / (time.perf_counter() - start)
    out.send(result)


def _concurrent(kind: str, port: int, ops: int, rank: int, go, out) -> None:
    store = _connect(kind, port)
    store.set(f"c{rank}", b"1")
    go.wait()
    start = time.perf_counter()
    for i in range(ops):
        if i % 2:
            store.add("shared", 1)
        else:
            store.get(f"c{rank}")
    out.send((start, time.perf_counter()))


def _rendezvous(kind: str, port: int, rank: int, world: int, go, out) -> None:
    if kind == "spmd":
        import spmd.runtime  # noqa: F401  (imports before the clock starts)
    else:
        import torch.distributed  # noqa: F401
    go.wait()
    store = _connect(kind, port)
    store.set(f"rdzv/{rank}", str(rank))
    store.wait([f"rdzv/{i}" for i in range(world)])
    out.send(time.time())


def _with_server(kind: str, body):
    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    stop = ctx.Event()
    server = ctx.Process(target=_server, args=(kind, send, stop))
    server.start()
    port = recv.recv()
    try:
        return body(ctx, port)
    finally:
        stop.set()
        server.join(10)


def single(kind: str, ops: int) -> dict:
    def body(ctx, port):
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_single, args=(kind, port, ops, send))
        p.start()
        result = recv.recv()
        p.join()
        return result

    return _with_server(kind, body)


def _clients(ctx, n: int, target, args_of_rank, settle: float) -> tuple[float, list]:
    """Start ``n`` client processes ``target(*args_of_rank(rank), go, out)``, give them
    ``settle`` seconds to get ready, release them together, and collect what each sends
    to ``out``. Returns the wall-clock time of the release and the results in rank order."""
    go = ctx.Event()
    pipes, procs = [], []
    for r in range(n):
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=target, args=(*args_of_rank(r), go, send))
        p.start()
        pipes.append(recv)
        procs.append(p)
    time.sleep(settle)
    start = time.time()
    go.set()
    results = [r.recv() for r in pipes]
    for p in procs:
        p.join()
    return start, results


def concurrent(kind: str, clients: int, ops: int) -> float:
    def body(ctx, port):
        _, spans = _clients(ctx, clients, _concurrent, lambda r: (kind, port, ops, r),
                            settle=3.0)  # every client connected and waiting
        return clients * ops / (max(e for _, e in spans) - min(s for s, _ in spans))

    return _with_server(kind, body)


def rendezvous(kind: str, world: int) -> float:
    def body(ctx, port):
        start, ends = _clients(ctx, world, _rendezvous, lambda r: (kind, port, r, world),
                               settle=8.0)  # every process started and imported
        return max(ends) - start

    return _with_server(kind, body)


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--ops", type=int, default=20000)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--rendezvous", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    rows = []
    ours = [single("spmd", args.ops) for _ in range(args.repeat)]
    theirs = [single("torch", args.ops) for _ in range(args.repeat)]
    for op in ("set", "get", "add"):
        a = statistics.median(r[op] for r in ours)
        b = statistics.median(r[op] for r in theirs)
        rows.append((f"{op}, 1 client (ops/s)", a, b, a / b))
    per = max(1, args.ops // 10)
    a = statistics.median(concurrent("spmd", args.clients, per) for _ in range(args.repeat))
    b = statistics.median(concurrent("torch", args.clients, per) for _ in range(args.repeat))
    rows.append((f"add+get, {args.clients} clients (ops/s)", a, b, a / b))
    a = statistics.median(rendezvous("spmd", args.rendezvous) for _ in range(args.repeat))
    b = statistics.median(rendezvous("torch", args.rendezvous) for _ in range(args.repeat))
    rows.append((f"rendezvous of {args.rendezvous} clients (s)", a, b, b / a))

    harness.table(("measure", "spmd", "torch", "spmd advantage (x)"), "lrrr")
    for name, a, b, ratio in rows:
        fmt = "{:.3f}" if a < 100 else "{:,.0f}"
        harness.row(name, fmt.format(a), fmt.format(b), f"{ratio:.2f}")


if __name__ == "__main__":
    main()
