"""One data-parallel replica under ``spmd.runtime.ft.Manager`` (live recovery), for
tests/cpu/test_ft.py: ``python tests/ft_job.py PORT REPLICA OUT --steps 6 [--die STEP]``.

The model and optimizer are each replica's whole copy (float64, SGD with momentum);
a step's batch is a function of the step and the replica's name. ``--die STEP``: the
replica kills itself (SIGKILL) in that step, after its backward, before the average.
At the end it writes ``OUT/REPLICA.pt``: the parameters, the optimizer's momenta and
the members of every step it took part in (``Manager.history``, with the step's index).

``--strategy fsdp|ddp``: the replica is a job of its own (run it under ``spmd-run
--nproc-per-node N``): the model ``spmd.parallelize``d over the replica's ranks, each
taking its rows of the replica's batch, and ft averaging rank k's shards with the other
replicas' ranks k (an hsdp whose replicate dimension loses and gains members). Only
``--die-rank`` dies; a restarted replica (``TORCHELASTIC_RESTART_COUNT`` > 0) is named
``REPLICA.<count>`` and joins as a replacement. Rank 0 writes the whole parameters and
momenta.
``--wait-for REPLICA:STEP``: at STEP, wait until REPLICA has started (so that a
replacement started late joins before the job ends).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import zlib
from datetime import timedelta

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(),
                               torch.nn.Linear(12, 3)).double()


def batch(step: int, replica: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + zlib.crc32(replica.encode()) % 1000)
    x = torch.randn(4, 6, generator=g, dtype=torch.float64)
    return x, x[:, :3].sin()


def optimizer(net: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("port", type=int)
    p.add_argument("replica")
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--die", type=int, default=-1)
    p.add_argument("--wait-dropped", default="", help="REPLICA:STEP: at STEP, wait until "
                   "that replica has dropped out (it found a step done without it)")
    p.add_argument("--timeout", type=float, default=30, help="the manager's timeout (s)")
    p.add_argument("--stall", type=int, default=-1, help="stop (SIGSTOP) in that step, "
                   "after the backward, until the test continues it")
    p.add_argument("--wait-for", default="", help="REPLICA:STEP: at STEP, wait until "
                   "that replica has started (every rank's first beat in the store)")
    p.add_argument("--strategy", default="", help="fsdp or ddp inside the replica (run "
                   "under spmd-run)")
    p.add_argument("--store-host", default="127.0.0.1", help="where the ft store is served")
    p.add_argument("--die-rank", type=int, default=0, help="with --die or --stall: the "
                   "rank that dies or stalls")
    args = p.parse_args()
    started = time.time()

    import spmd
    from spmd import runtime as dist
    from spmd.runtime.ft import Manager
    from spmd.runtime.store.tcp_store import TCPStore

    torch.set_num_threads(1)
    rank, size, attempt = 0, 1, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt:
        args.replica, args.die, args.stall = f"{args.replica}.{attempt}", -1, -1
    net = model()
    if args.strategy:
        dist.init_process_group("gloo")
        rank, size = dist.get_rank(), dist.get_world_size()
        net = spmd.parallelize(net, strategy=args.strategy)
    store = TCPStore(args.store_host, args.port, None, False, timedelta(seconds=60))
    opt = optimizer(net)
    if args.strategy:  # this rank's shards, rank k to rank k
        def state_dict():
            return {"params": [p.detach().clone() for p in net.parameters()],
                    "optim": opt.state_dict()}

        def load_state_dict(state):
            with torch.no_grad():
                for p, v in zip(net.parameters(), state["params"]):
                    p.copy_(v)
            opt.load_state_dict(state["optim"])
    else:
        def state_dict():
            return {"model": net.state_dict(), "optim": opt.state_dict()}

        def load_state_dict(state):
            net.load_state_dict(state["model"])
            opt.load_state_dict(state["optim"])
    ft = Manager(store, args.replica, timeout=timedelta(seconds=args.timeout),
                 initial_replicas=3, state_dict=state_dict, load_state_dict=load_state_dict)
    steps, done, stalled = [], [], False
    wait_for, wait_step = (args.wait_for.split(":") + [""])[:2] if args.wait_for else ("", "")
    while ft.step < args.steps:
        if wait_for and ft.step == int(wait_step):  # the test's replacement: started
            store.wait([f"ft/beat/{wait_for}/{k}" for k in range(size)],
                       timedelta(seconds=60))  # (every rank of it: then it is alive)
        if args.wait_dropped and ft.step == int(args.wait_dropped.split(":")[1]):
            who, deadline = args.wait_dropped.split(":")[0], time.monotonic() + 60
            while store.check([f"ft/member/{who}"]) and time.monotonic() < deadline:
                time.sleep(0.02)  # polling a key the other replica deletes
        ft.start_step()
        x, y = batch(ft.step, args.replica)
        rows = len(x) // size  # this rank's rows of the replica's batch
        (net(x[rank * rows:(rank + 1) * rows]) - y[rank * rows:(rank + 1) * rows]
         ).square().mean().backward()
        if ft.step == args.stall and not stalled and rank == args.die_rank:
            stalled = True
            with open(os.path.join(args.out, f"{args.replica}.stalled"), "w") as f:
                f.write(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)
        if ft.step == args.die and rank == args.die_rank:
            with open(os.path.join(args.out, f"{args.replica}.killed-at"), "w") as f:
                f.write(f"{time.time():.6f}")
            os.kill(os.getpid(), signal.SIGKILL)
        steps.append((ft.step, ft.average_gradients(net.parameters())))
        opt.step()
        opt.zero_grad()
        ft.end_step()
        done.append(time.time())
        with open(os.path.join(args.out, f"{args.replica}.progress"), "w") as f:
            f.write(str(ft.step))
    ft.close()
    params = [p.detach().clone() for p in net.parameters()]
    momenta = [opt.state[p]["momentum_buffer"].clone() for p in net.parameters()]
    if args.strategy == "fsdp":  # the whole of each: the shards' rows, padding cut
        wholes = [p.shape for p in model().parameters()]
        params, momenta = ([_whole(t, shape, size) for t, shape in zip(ts, wholes)]
                           for ts in (params, momenta))
        gathered = list(net.state_dict().values())  # (the module's own gather agrees)
        assert all(torch.equal(a, b) for a, b in zip(params, gathered))
    if rank == 0:
        torch.save({"params": params, "momenta": momenta, "steps": steps, "done": done,
                    "started": started}, os.path.join(args.out, f"{args.replica}.pt"))
    if args.strategy:
        dist.destroy_process_group()


def _whole(shard: torch.Tensor, shape: torch.Size, size: int) -> torch.Tensor:
    """The whole tensor of a dim-0 shard: every rank's gathered, the padding cut."""
    from spmd import runtime as dist

    every = [torch.empty_like(shard) for _ in range(size)]
    dist.all_gather(every, shard.contiguous())
    return torch.cat(every)[:shape[0]].reshape(shape)


if __name__ == "__main__":
    main()
