"""Seconds from a fault to training again, and the steps it cost: a rank or a host lost
under torchrun's and spmd's launchers, the job resumed from its latest checkpoint.

    python benchmarks/faults.py [--rounds 3] [--strategy fsdp]

Each case runs ``tests/checkpoint_job.py`` (6 steps, a checkpoint every 2, float64, 2
ranks) with one fault in its first attempt:

- ``rank, torchrun``: ``torchrun --max-restarts 1``; rank 1 SIGKILLed in step 3's backward;
- ``rank, spmd-run``: ``python -m spmd.runtime.run --max-restarts 1``, the same fault;
- ``write, spmd-run``: rank 0 SIGKILLed while the checkpoint after step 4 is written;
- ``host, spmd-run``: two agents over 127.0.0.1 (one rank each, ``--nnodes 1:2
  --join-last-call 1``); host 1's agent SIGKILLed (its rank with it) at step 3: the job
  continues on host 0 alone.
- ``store's host, spmd-run``: three agents over 127.0.0.1 (``--nnodes 2:3``; node 0, which
  serves the store, with 2 ranks, nodes 1 and 2 with one); node 0's agent SIGKILLed (its
  ranks with it) at step 3: node 1 is elected to serve a new store and the job continues
  on nodes 1 and 2 (the store's loss noticed within ``SPMD_STORE_RECONNECT``, 10 s).

- ``replica, live``: ``spmd.runtime.ft`` (no restart), 3 replicas of one process each
  (``tests/ft_job.py``); replica r2 SIGKILLed in step 2 after its backward: from the
  kill to the survivors' step 2 done (the failed average, a new quorum once r2's beat
  is 2 s old, the average again over the two); and a replacement r3, started then,
  from its start to its first step done (import, join, healed from a peer).
- ``replica of 2 ranks, live``: the same with each replica a job of its own (``spmd-run
  --nproc-per-node 2``, the model ``fsdp``-sharded inside it, ft averaging shard k with
  the others' shards k); rank 1 of r2 SIGKILLed in step 2: r2's launcher restarts it, and
  it joins as r2.1, healed shard by shard.

"Fault to training" is from the kill to the end of the first step after the restart
(the stop of the others, the restart, the rendezvous, the restore, and that step's
planning); "steps lost" are the completed steps redone. Rounds alternate the cases;
the figure is the median and the range over rounds.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(REPO, "tests", "checkpoint_job.py")
KILLS = {"rank, torchrun": "3:backward:1", "rank, spmd-run": "3:backward:1",
         "write, spmd-run": "4:checkpoint:0", "host, spmd-run": "3:host:1",
         "store's host, spmd-run": "3:host:0"}


def _run(case: str, out: str, strategy: str) -> None:
    from spmd.runtime.launch import free_port

    job = [JOB, out, "--strategy", strategy, "--steps", "6", "--every", "2",
           "--kill", KILLS[case]]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    spmd_run = [sys.executable, "-m", "spmd.runtime.run"]
    if case == "rank, torchrun":
        commands = [[sys.executable, "-m", "torch.distributed.run", "--standalone",
                     "--nproc-per-node", "2", "--max-restarts", "1", *job]]
    elif case == "host, spmd-run":
        common = ["--nnodes", "1:2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
                  "--master-port", str(free_port()), "--max-restarts", "1",
                  "--join-last-call", "1"]
        commands = [[*spmd_run, "--node-rank", str(n), *common, *job] for n in (0, 1)]
    elif case == "store's host, spmd-run":
        common = ["--nnodes", "2:3", "--master-addr", "127.0.0.1", "--master-port",
                  str(free_port()), "--max-restarts", "1", "--join-last-call", "1"]
        commands = [[*spmd_run, "--node-rank", str(n), "--nproc-per-node", str(2 - min(n, 1)),
                     *common, *job] for n in (1, 2, 0)]  # (a survivor's exit status first)
    else:
        commands = [[*spmd_run, "--standalone", "--nproc-per-node", "2", "--max-restarts",
                     "1", *job]]
    procs = [subprocess.Popen(c, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for c in commands]
    errs = [p.communicate(timeout=300)[1] for p in procs]
    if procs[0].returncode != 0:
        raise RuntimeError(f"{case} failed:\n{errs[0][-3000:]}")


def _figures(out: str, kill: str) -> tuple[float, int]:
    def first(name: str) -> float:
        with open(os.path.join(out, name)) as f:
            return float(f.readline())

    with open(os.path.join(out, "attempts.txt")) as f:
        resumed = int(f.read().split("\n")[1].split()[1])
    step, point, _ = kill.split(":")  # steps complete when the fault struck:
    done_before = int(step) if point == "checkpoint" else int(step) - 1  # (after save)
    return first("trained-at") - first("killed-at"), done_before - resumed


def live(strategy: str = "") -> tuple[float, float, int]:
    """(kill to the survivors' step done, the replacement's start to its first step
    done, steps lost) of one run of tests/ft_job.py's live recovery; ``strategy``: each
    replica 2 ranks under spmd-run with that strategy inside."""
    import torch

    from spmd.runtime.launch import free_port
    from spmd.runtime.store.tcp_store import TCPStore
    from datetime import timedelta

    port = free_port()
    server = TCPStore("127.0.0.1", port, None, True, timedelta(seconds=60),
                      wait_for_workers=False)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    script = os.path.join(REPO, "tests", "ft_job.py")
    with tempfile.TemporaryDirectory() as out:
        def start(name: str, *extra: str, restarts: int = 0) -> subprocess.Popen:
            launch = ([sys.executable, "-m", "spmd.runtime.run", "--standalone",
                       "--nproc-per-node", "2", "--max-restarts", str(restarts)]
                      if strategy else [sys.executable])
            return subprocess.Popen([*launch, script, str(port), name, out, "--steps", "6",
                                     *(["--strategy", strategy] if strategy else []), *extra],
                                    cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, text=True)
        # the replacement: a new process (r3), or r2's launcher restarting it (r2.1)
        new = "r2.1" if strategy else "r3"
        try:
            first = [start("r0", "--wait-for", f"{new}:4"), start("r1", "--wait-for", f"{new}:4"),
                     start("r2", "--die", "2", *(["--die-rank", "1"] if strategy else []),
                           restarts=1)]
            if strategy:
                procs = first
            else:
                first[2].wait(timeout=120)
                procs = [*first[:2], start("r3")]
            for proc in procs:
                if proc.wait(timeout=120):
                    raise RuntimeError(f"a replica failed:\n{proc.stderr.read()[-3000:]}")
        finally:
            server.close()
        with open(os.path.join(out, "r2.killed-at")) as f:
            killed = float(f.read())
        r0 = torch.load(os.path.join(out, "r0.pt"), weights_only=False)
        late = torch.load(os.path.join(out, f"{new}.pt"), weights_only=False)
    return r0["done"][2] - killed, late["done"][0] - late["started"], 0


def main() -> None:
    p = harness.parser(__doc__, rounds=3)
    p.add_argument("--strategy", default="fsdp")
    args = p.parse_args()
    seconds: dict[str, list[float]] = {c: [] for c in KILLS}
    lost: dict[str, list[int]] = {c: [] for c in KILLS}
    for r in range(args.rounds):
        for case in harness.rotated(list(KILLS), r):
            with tempfile.TemporaryDirectory() as out:
                _run(case, out, args.strategy)
                s, n = _figures(out, KILLS[case])
            seconds[case].append(s)
            lost[case].append(n)
    survivors: dict[str, list[float]] = {"": [], "fsdp": []}
    healed: dict[str, list[float]] = {"": [], "fsdp": []}
    for r in range(args.rounds):
        for inside in harness.rotated(list(survivors), r):
            s, h, _ = live(inside)
            survivors[inside].append(s)
            healed[inside].append(h)
    print(f"\n{args.strategy}, 2 ranks, a checkpoint every 2 steps, {args.rounds} rounds\n")
    harness.table(("fault, launcher", "fault to training (s)", "range", "steps lost"), "lrll")
    for case in KILLS:
        harness.row(case, f"{statistics.median(seconds[case]):.2f}",
                    harness.span(seconds[case]), ", ".join(str(n) for n in sorted(set(lost[case]))))
    for inside, what in (("", "replica"), ("fsdp", "replica of 2 ranks (fsdp inside)")):
        harness.row(f"{what}, live (spmd.runtime.ft): survivors",
                    f"{statistics.median(survivors[inside]):.2f}",
                    harness.span(survivors[inside]), "0")
        harness.row(f"{what}, live: the replacement's start to its first step",
                    f"{statistics.median(healed[inside]):.2f}", harness.span(healed[inside]),
                    "")


if __name__ == "__main__":
    main()
