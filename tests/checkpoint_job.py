"""A training job that checkpoints with ``spmd.checkpoint.CheckpointManager`` and resumes
from the latest checkpoint, for the restart tests (tests/cpu/test_checkpoint_manager.py)
and the fault matrix: run under ``torchrun --max-restarts`` or ``python -m
spmd.runtime.run --max-restarts``.

    python tests/checkpoint_job.py OUT --strategy fsdp --steps 6 --every 2 \\
        [--kill STEP:POINT:RANK]

Every step's batch is a function of the step alone (and the random generators, which
the checkpoint carries): a run interrupted and resumed computes what one never
interrupted does, bit for bit in float64 on the same layout. ``--kill`` makes global
rank RANK kill itself with SIGKILL at STEP (counted from 1) in the first attempt only
(``TORCHELASTIC_RESTART_COUNT`` 0, no checkpoint restored), at POINT: ``forward``, ``backward``, ``optimizer``
(inside the optimizer step), ``checkpoint`` (the write of the checkpoint after that
step in flight), ``host`` (before the forward, the rank kills its launcher's agent,
whose ranks die with it: a whole host lost), ``freeze`` (the rank stops its agent and
itself with SIGSTOP: a host that hangs), ``stall`` (the rank stops itself with
SIGSTOP: alive, never answering) or ``partition`` (the rank writes ``OUT/partition-me``
and waits for ``OUT/partitioned``, which the test writes once it has cut the host's
link) or ``wait-for-host`` (the rank writes ``OUT/partition-me`` and waits, at most
60 s, for its launcher to end the round: a host joining an elastic job); before the other points the doomed rank waits for the last write, so
that the test knows which checkpoint the job resumes from. Rank 0 writes ``OUT/result.pt`` at the end: the parameters, the
optimizer state, the LR, the data position and the step resumed from per attempt in
``OUT/attempts.txt``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WIDTH, BATCH = 8, 8


class Position:
    """The data loader's position: the next step's index (the job's, the same on every
    rank), with ``state_dict``/``load_state_dict`` as a stateful loader has."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


class Rich(torch.nn.Module):
    """The loops users write, under a restart: a tied pair of weights, BatchNorm (running
    statistics in the checkpoint), a frozen layer and dropout (the generators restored)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(WIDTH, 16)
        self.norm = torch.nn.BatchNorm1d(16)
        self.frozen = torch.nn.Linear(16, 16).requires_grad_(False)
        self.drop = torch.nn.Dropout(0.1)
        self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
        self.b.weight = self.a.weight  # tied
        self.out = torch.nn.Linear(16, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.frozen(torch.tanh(self.norm(self.inp(x)))))
        return self.out(torch.tanh(self.b(torch.tanh(self.a(self.drop(h))))))


def model(kind: str = "plain") -> torch.nn.Module:
    if kind == "rich":
        torch.manual_seed(0)
        return Rich().double()
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, WIDTH)).double()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, WIDTH, generator=g, dtype=torch.float64)
    return x, x.flip(-1)


OUT = ""


def _stamp(name: str) -> None:
    """The wall-clock time of an event, for benchmarks/faults.py (fault to training)."""
    import time

    with open(os.path.join(OUT, name), "a") as f:
        f.write(f"{time.time():.6f}\n")


def _wait_for(path: str, seconds: float = 60) -> None:
    """Until ``path`` exists (the test writes it), at most ``seconds``."""
    import time

    deadline = time.monotonic() + seconds
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)  # polling a file the test writes, not ordering by time


def die() -> None:
    _stamp("killed-at")
    os.kill(os.getpid(), signal.SIGKILL)


def _parallel(spmd, strategy: str, world: int, kind: str = "plain"):
    """(the model under ``strategy``, whether the ranks split the batch): ddp, fsdp,
    zero1, zero2 on every rank; hsdp on (2, world/2) ("dp", "fsdp"); tp: the first
    two linear layers as a column- and row-parallel pair on a "tp" dimension of every
    rank; pp: a pipeline of ``world`` stages (gpipe,
    2 microbatches), the stages replicated."""
    if strategy == "hsdp":
        mesh = spmd.Mesh((2, world // 2), ("dp", "fsdp"))
        return spmd.parallelize(model(), mesh=mesh, strategy="hsdp"), True
    if strategy == "tp":
        pairs = {"0.weight": spmd.Shard(0), "0.bias": spmd.Shard(0),
                 "2.weight": spmd.Shard(1)}  # column-parallel, tanh, row-parallel
        return spmd.parallelize(model(), mesh=spmd.Mesh((world,), ("tp",)),
                                placements={"tp": pairs}), False
    if strategy == "pp":
        return spmd.parallelize(model(), mesh=spmd.Mesh((world,), ("pp",)),
                                pipeline=spmd.pp.schedule("gpipe", microbatches=2)), False
    return spmd.parallelize(model(kind), strategy=strategy), True


def _die_in_backward(net) -> None:
    """SIGKILL from the first gradient this rank's stage computes."""
    for p in net.parameters():
        p.register_hook(lambda g: die())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--kill", default="")
    p.add_argument("--timeout", type=float, default=60, help="collectives' timeout (s)")
    p.add_argument("--model", default="plain", help="plain, or rich (tied weights, "
                   "BatchNorm, a frozen layer, dropout; each step two accumulated halves "
                   "and an eval forward after every second): ddp, fsdp, zero2, hsdp")
    args = p.parse_args()
    global OUT
    OUT = args.out

    from datetime import timedelta

    import spmd
    from spmd import runtime as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    kill_step, point, kill_rank = 0, "", -1
    if args.kill and attempt == 0:
        text_step, point, text_rank = args.kill.split(":")
        kill_step, kill_rank = int(text_step), int(text_rank)

    net, split = _parallel(spmd, args.strategy, world, args.model)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    position = Position()
    ckpt = spmd.checkpoint.CheckpointManager(os.path.join(args.out, "ckpt"), net, opt,
                                             scheduler=sched, dataloader=position,
                                             every=args.every, keep=2)
    start = ckpt.restore() or 0
    # the fault strikes the job's first round only: a fresh start (a host joining does
    # not count as a restart, so the restart count alone would not tell)
    doomed = rank == kill_rank and start == 0
    if rank == 0:
        with open(os.path.join(args.out, "attempts.txt"), "a") as f:
            f.write(f"{attempt} {start} {world}\n")
    if doomed and point == "optimizer":
        def stop(*_: object) -> None:
            if position.step == kill_step:
                die()
        opt.register_step_pre_hook(stop)
    evals: list[float] = []
    while position.step < args.steps:
        step = position.step + 1
        x, y = batch(step)
        x = x + 1e-3 * torch.randn_like(x)  # the global generator: restored per rank
        if split:  # data parallel: this rank's rows (tp and pp ranks share the batch)
            x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        if doomed and step == kill_step and point != "checkpoint":
            ckpt.wait()  # the last write complete: the test knows where the job resumes
        if doomed and step == kill_step and point == "forward":
            die()
        if doomed and step == kill_step and point == "stall":  # stopped, not dead
            _stamp("killed-at")
            os.kill(os.getpid(), signal.SIGSTOP)
        if doomed and step == kill_step and point == "wait-for-host":  # until ended
            open(os.path.join(OUT, "partition-me"), "w").close()
            _wait_for(os.path.join(OUT, "never"))  # the launcher stops this round
        if doomed and step == kill_step and point == "partition":  # the test cuts the link
            _stamp("killed-at")
            open(os.path.join(OUT, "partition-me"), "w").close()
            _wait_for(os.path.join(OUT, "partitioned"))
        if doomed and step == kill_step and point == "freeze":  # the host hangs: its
            _stamp("killed-at")  # agent and this rank stop (SIGSTOP), not dead
            os.kill(os.getppid(), signal.SIGSTOP)
            os.kill(os.getpid(), signal.SIGSTOP)
        if doomed and step == kill_step and point == "host":  # the whole host: its agent
            _stamp("killed-at")
            os.kill(os.getppid(), signal.SIGKILL)  # (its ranks die with it)
            die()
        if args.strategy == "pp":
            if doomed and step == kill_step and point == "backward":
                _die_in_backward(net)
            net.step(x, y, lambda out, t: (out - t).square().mean())
        elif args.model == "rich":  # two halves accumulated, the first without a sync
            with net.no_sync():
                ((net(x[:len(x) // 2]) - y[:len(x) // 2]).square().mean() / 2).backward()
            loss = (net(x[len(x) // 2:]) - y[len(x) // 2:]).square().mean() / 2
            if doomed and step == kill_step and point == "backward":
                loss.register_hook(lambda g: die())
            loss.backward()
        else:
            loss = (net(x) - y).square().mean()
            if doomed and step == kill_step and point == "backward":
                loss.register_hook(lambda g: die())
            loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        position.step = step
        if args.model == "rich" and step % 2 == 0:  # an eval forward: changes nothing
            net.eval()
            with torch.no_grad():
                evals.append(net(x).square().mean().item())
            net.train()
        ckpt.save(step)
        if attempt and rank == 0 and position.step == start + 1:
            _stamp("trained-at")  # the first step after the restart done
        if doomed and step == kill_step and point == "checkpoint":
            die()  # the write just started on the manager's thread
    ckpt.close()
    state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    optim = spmd.checkpoint.get_state_dict(net, opt)[1]
    whole = {"model": state, "lr": sched.get_last_lr(), "step": position.step,
             "evals": evals}
    local = {k: {s: (v.to_local() if hasattr(v, "to_local") else v).clone()
                 for s, v in entry.items() if isinstance(v, torch.Tensor)}
             for k, entry in optim["state"].items()}
    torch.save({**whole, "optim": local}, os.path.join(args.out, f"result-{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
