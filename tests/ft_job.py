"""One data-parallel replica under ``spmd.runtime.ft.Manager`` (live recovery), for
tests/cpu/test_ft.py: ``python tests/ft_job.py PORT REPLICA OUT --steps 6 [--die STEP]``.

The model and optimizer are each replica's whole copy (float64, SGD with momentum);
a step's batch is a function of the step and the replica's name. ``--die STEP``: the
replica kills itself (SIGKILL) in that step, after its backward, before the average.
At the end it writes ``OUT/REPLICA.pt``: the parameters, the optimizer's momenta and
the members of every step it took part in (``Manager.history``, with the step's index).
``--wait-for REPLICA:STEP``: at STEP, wait until REPLICA has started (so that a
replacement started late joins before the job ends).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from datetime import timedelta

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(),
                               torch.nn.Linear(12, 3)).double()


def batch(step: int, replica: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + int(replica.lstrip("r")))
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
                   "that replica has started (its first beat in the store)")
    args = p.parse_args()
    started = time.time()

    from spmd.runtime.ft import Manager
    from spmd.runtime.store.tcp_store import TCPStore

    torch.set_num_threads(1)
    net, store = model(), TCPStore("127.0.0.1", args.port, None, False,
                                   timedelta(seconds=60))
    opt = optimizer(net)
    ft = Manager(store, args.replica, timeout=timedelta(seconds=args.timeout),
                 initial_replicas=3,
                 state_dict=lambda: {"model": net.state_dict(), "optim": opt.state_dict()},
                 load_state_dict=lambda s: (net.load_state_dict(s["model"]),
                                            opt.load_state_dict(s["optim"])))
    steps, done, stalled = [], [], False
    wait_for, wait_step = (args.wait_for.split(":") + [""])[:2] if args.wait_for else ("", "")
    while ft.step < args.steps:
        if wait_for and ft.step == int(wait_step):  # the test's replacement: started
            store.wait([f"ft/beat/{wait_for}"], timedelta(seconds=60))
        if args.wait_dropped and ft.step == int(args.wait_dropped.split(":")[1]):
            who, deadline = args.wait_dropped.split(":")[0], time.monotonic() + 60
            while store.check([f"ft/member/{who}"]) and time.monotonic() < deadline:
                time.sleep(0.02)  # polling a key the other replica deletes
        ft.start_step()
        x, y = batch(ft.step, args.replica)
        (net(x) - y).square().mean().backward()
        if ft.step == args.stall and not stalled:
            stalled = True
            with open(os.path.join(args.out, f"{args.replica}.stalled"), "w") as f:
                f.write(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)
        if ft.step == args.die:
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
    momenta = [opt.state[p]["momentum_buffer"].clone() for p in net.parameters()]
    torch.save({"params": [p.detach().clone() for p in net.parameters()],
                "momenta": momenta, "steps": steps, "done": done, "started": started},
               os.path.join(args.out, f"{args.replica}.pt"))


if __name__ == "__main__":
    main()
