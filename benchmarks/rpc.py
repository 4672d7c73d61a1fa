"""spmd.runtime.rpc against torch.distributed.rpc (TensorPipe), measured in the same run.

    python benchmarks/rpc.py [--rounds 5] [--calls 1000] [--mib 64] [--steps 200]

Each library runs alone in its own pair of fresh worker processes (default options, 16
worker threads), and rounds alternate the libraries (spmd, torch, torch, spmd, ...) so a
load that comes and goes on a shared machine hits both alike. Rank 0 measures, rank 1
serves:

- round-trip latency of ``rpc_sync`` of a no-op (median of ``--calls`` calls);
- no-op calls per second with 16 ``rpc_async`` calls in flight (``4 x --calls`` calls);
- a ``--mib`` MiB float32 tensor as the argument of a no-op ``rpc_sync`` (median of 7),
  and the rate in GB/s (tensor bytes / time);
- the CPU an idle worker process uses (% of one core, over 1 s after the measurements);
- one distributed-autograd training step (median of ``--steps``): in a
  ``dist_autograd.context()``, a local 8-layer MLP (16 leaves), an ``rpc_sync`` through a
  layer on rank 1, ``dist_autograd.backward`` across both and ``get_gradients``. Both
  libraries run the same code; ours moves each leaf's ``.grad`` aside during a pass, so
  its cost per leaf shows here. Also the backward alone, and a plain local backward of
  the MLP in the same process (``OMP_NUM_THREADS=1`` takes intra-op threads out).

Each cell is the median over rounds. The libraries do not share processes: TensorPipe
busy-polls (about half a core per idle process here), which also shortens the wake-ups
of anything else in the process and would flatter a library measured beside it.
Prints a markdown table with the ratio "spmd advantage" (> 1: spmd is better).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time

import harness


def _noop(*args):
    return None


def _idle_cpu() -> float:
    start = time.process_time()
    time.sleep(1.0)
    return (time.process_time() - start) * 100


_REMOTE: list = []  # rank 1's layer, made by its first call


def _remote_forward(h):
    import torch

    if not _REMOTE:
        torch.manual_seed(1)
        _REMOTE.append(torch.nn.Linear(h.shape[1], 1))
    return _REMOTE[0](h)


def _autograd_step(rpc, dist_autograd, steps: int) -> dict:
    """Medians in ms: the whole step, its backward alone, and a plain local
    ``loss.backward()`` of the same MLP in the same process (what the engine adds is
    the difference)."""
    import torch

    torch.manual_seed(0)
    layers = []
    for _ in range(8):
        layers += [torch.nn.Linear(256, 256), torch.nn.ReLU()]
    local = torch.nn.Sequential(*layers)
    x = torch.randn(32, 256)
    step, backward, plain = [], [], []
    for i in range(steps + 5):
        start = time.perf_counter()
        with dist_autograd.context() as cid:
            loss = rpc.rpc_sync("w1", _remote_forward, args=(local(x),)).sum()
            mid = time.perf_counter()
            dist_autograd.backward(cid, [loss])
            end = time.perf_counter()
            grads = dist_autograd.get_gradients(cid)
        done = time.perf_counter()
        local(x).sum().backward()
        local.zero_grad(set_to_none=True)
        if i >= 5:  # the first steps warm up both ends
            step.append(done - start)
            backward.append(end - mid)
            plain.append(time.perf_counter() - done)
    assert len(grads) == 16, len(grads)  # the local leaves' gradients
    return {"autograd_ms": statistics.median(step) * 1e3,
            "autograd_backward_ms": statistics.median(backward) * 1e3,
            "local_backward_ms": statistics.median(plain) * 1e3}


def _measure(rpc, dist_autograd, calls: int, mib: int, steps: int) -> dict:
    import torch

    for _ in range(300):
        rpc.rpc_sync("w1", _noop)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        rpc.rpc_sync("w1", _noop)
        times.append(time.perf_counter() - start)
    result = {"latency_us": statistics.median(times) * 1e6}
    n = 4 * calls
    start = time.perf_counter()
    window = []
    for _ in range(n):
        window.append(rpc.rpc_async("w1", _noop))
        if len(window) >= 16:
            window.pop(0).wait()
    for f in window:
        f.wait()
    result["calls_per_s"] = n / (time.perf_counter() - start)
    big = torch.ones(mib << 18, dtype=torch.float32)
    for _ in range(2):
        rpc.rpc_sync("w1", _noop, args=(big,))
    times = []
    for _ in range(7):
        start = time.perf_counter()
        rpc.rpc_sync("w1", _noop, args=(big,))
        times.append(time.perf_counter() - start)
    result["big_ms"] = statistics.median(times) * 1e3
    result["big_gbps"] = (mib << 20) / statistics.median(times) / 1e9
    result["idle_cpu"] = (_idle_cpu() + rpc.rpc_sync("w1", _idle_cpu)) / 2
    result.update(_autograd_step(rpc, dist_autograd, steps))
    return result


def _worker(kind: str, rank: int, port: int, calls: int, mib: int, steps: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if kind == "spmd":
        from spmd.runtime import autograd as dist_autograd
        from spmd.runtime import rpc

        rpc.init_rpc(f"w{rank}", rank=rank, world_size=2)
    else:
        import torch.distributed.autograd as dist_autograd
        import torch.distributed.rpc as rpc

        rpc.init_rpc(f"w{rank}", rank=rank, world_size=2,
                     rpc_backend_options=rpc.TensorPipeRpcBackendOptions(num_worker_threads=16))
    result = _measure(rpc, dist_autograd, calls, mib, steps) if rank == 0 else None
    rpc.shutdown()
    if rank == 0:
        out.send(result)


def _run(kind: str, calls: int, mib: int, steps: int) -> dict:
    # Imported here, not at the top: the spawned workers import only the library they run.
    from spmd.runtime.launch import free_port

    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(kind, r, port, calls, mib, steps, send)) for r in (0, 1)]
    for p in procs:
        p.start()
    result = recv.recv()
    for p in procs:
        p.join(60)
    return result


def main() -> None:
    parser = harness.parser(__doc__, rounds=5)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200)
    a = parser.parse_args()
    # each run in fresh processes: no warm-up round; the order turns each round
    runs = harness.alternate({kind: (lambda kind=kind: _run(kind, a.calls, a.mib, a.steps))
                              for kind in ("spmd", "torch")},
                             a.rounds, warmup=0, order=harness.back_and_forth).results
    med = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in runs.items()}
    s, t = med["spmd"], med["torch"]
    rows = [
        ("no-op rpc_sync round trip (µs)", s["latency_us"], t["latency_us"],
         t["latency_us"] / s["latency_us"]),
        ("no-op calls/s, 16 in flight", s["calls_per_s"], t["calls_per_s"],
         s["calls_per_s"] / t["calls_per_s"]),
        (f"{a.mib} MiB tensor argument (ms)", s["big_ms"], t["big_ms"], t["big_ms"] / s["big_ms"]),
        (f"{a.mib} MiB tensor argument (GB/s)", s["big_gbps"], t["big_gbps"],
         s["big_gbps"] / t["big_gbps"]),
        ("idle worker process (% of a core)", s["idle_cpu"], t["idle_cpu"],
         t["idle_cpu"] / max(s["idle_cpu"], 0.01)),
        ("dist autograd step, 16 local leaves + 1 remote layer (ms)", s["autograd_ms"],
         t["autograd_ms"], t["autograd_ms"] / s["autograd_ms"]),
        ("  its dist_autograd.backward (ms)", s["autograd_backward_ms"],
         t["autograd_backward_ms"], t["autograd_backward_ms"] / s["autograd_backward_ms"]),
        ("  a plain local backward of the MLP, same process (ms)", s["local_backward_ms"],
         t["local_backward_ms"], t["local_backward_ms"] / s["local_backward_ms"]),
    ]
    harness.table(("measure", "spmd", "torch (TensorPipe)", "spmd advantage (x)"), "lrrr")
    for name, ours, theirs, ratio in rows:
        harness.row(name, f"{ours:,.1f}", f"{theirs:,.1f}", f"{ratio:.2f}")
    for kind, results in runs.items():
        print(f"\n{kind} rounds: " + "; ".join(
            f"{r['latency_us']:.0f} µs, {r['calls_per_s']:.0f}/s, {r['big_ms']:.1f} ms, "
            f"autograd {r['autograd_ms']:.2f} ms (backward {r['autograd_backward_ms']:.2f}, "
            f"local {r['local_backward_ms']:.2f})" for r in results))


if __name__ == "__main__":
    main()
