"""Two hosts on shaped links: collectives predicted against measured, two-level against flat
and torch's Gloo all-reduce, and ddp/hsdp steps against torch DDP and FSDP2 HSDP.

    python benchmarks/hosts.py [--links 1:0.1,1:1,0.25:0.1] [--rounds 5] [--parts collectives,steps]

Needs root (network namespaces; tests/hosts.py). Each link setting ``GBPS:MS`` makes 2
hosts (network namespaces on the userspace switch) whose links carry ``GBPS`` Gbit/s with
``MS`` ms one-way latency, and starts 2 ranks on each with ``python -m
spmd.runtime.run``; every rank binds Gloo to the host's ``eth0`` (ours and torch's alike).
torch's variants run on torch's own process group (its own store and connections).

- ``collectives``: per size, our flat all-reduce, our two-level one
  (``all_reduce_hierarchical``), torch's all-reduce, our all-gather and reduce-scatter,
  alternating in every round; each beside the cost model's prediction from the probe
  the planner runs at start-up (the link between hosts) and a calibration within a host.
- ``steps``: the d256 transformer (4 layers, 3.3 M parameters, SGD, 8 sequences of 32
  tokens a rank): spmd ddp (the planner's choice per bucket), spmd ddp with every bucket
  flat (``SPMD_HIERARCHICAL=never``), torch DDP; spmd hsdp sharding within each host and
  replicating across (``Mesh((2, 2), ("dp", "fsdp"))``), the same mesh the other way
  round (sharding across hosts), and FSDP2 HSDP (``fully_shard`` on each layer over a
  ("replicate", "shard") device mesh).

Round 0 warms up and is not counted; the figure is the median over rounds, the spread
the lowest and highest per-round ratio. Prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)

import harness  # noqa: E402

SIZES = (256 << 10, 1 << 20, 4 << 20, 16 << 20)


# -- inside a host --------------------------------------------------------------------------


def _groups(timeout: float = 600):
    """Ours from the launcher's environment, then torch's own on the next port."""
    import torch
    import torch.distributed as tdist

    from spmd import runtime as dist

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    port = int(os.environ["MASTER_PORT"]) + 1
    tdist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{port}",
                             rank=rank, world_size=world, timeout=timedelta(seconds=timeout))
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
    return rank, world


def _cost_model():
    """What the planner prices collectives across the world with: calibrated within a
    host, the link between hosts probed."""
    from spmd import runtime as dist
    from spmd.lowering.calibrate import calibrate, probe_network
    from spmd.lowering.cost_model import CostModel, along

    default = dist.new_group()  # all ranks: the world's group under a name of its own
    levels = dist.hierarchy(default)
    inner = calibrate(levels.within, CostModel.default("gloo", 2))
    model = probe_network(default, inner, kinds=("all_reduce", "all_gather", "reduce_scatter"))
    return along(dist.Mesh(dist.get_world_size()), "dp", model), default


def collectives(rounds: int) -> dict | None:
    import torch
    import torch.distributed as tdist

    from spmd import runtime as dist

    rank, world = _groups()
    model, group = _cost_model()
    out: dict = {"model": model.source, "rows": []}
    for nbytes in SIZES:
        n = nbytes // 4
        x = torch.ones(n)
        gathered = torch.empty(n)
        shard = torch.empty(n // world)
        variants = {
            "all-reduce, flat": lambda: dist.all_reduce(x, group=group),
            "all-reduce, two-level": lambda: dist.all_reduce_hierarchical(x, group=group),
            "all-reduce, torch Gloo": lambda: tdist.all_reduce(x),
            "all-gather, flat": lambda: dist.all_gather_into_tensor(gathered, shard, group=group),
            "all-gather, two-level": lambda: dist.all_gather_hierarchical(gathered, shard,
                                                                          group=group),
            "reduce-scatter, flat": lambda: dist.reduce_scatter_tensor(shard, x, group=group),
            "reduce-scatter, two-level": lambda: dist.reduce_scatter_hierarchical(shard, x,
                                                                                  group=group),
        }
        repeat = max(1, min(20, (8 << 20) // nbytes))
        timed = harness.alternate({k: (lambda f=f: [f() for _ in range(repeat)])
                                   for k, f in variants.items()}, rounds,
                                  barrier=lambda: dist.barrier(group=group), per=repeat,
                                  order=harness.rotated)
        predicted = {
            "all-reduce, flat": model.seconds("all_reduce", nbytes, "ring"),
            "all-reduce, two-level": model.seconds("all_reduce", nbytes, "hierarchical"),
            "all-gather, flat": model.seconds("all_gather", nbytes, "ring"),
            "all-gather, two-level": model.seconds("all_gather", nbytes, "hierarchical"),
            "reduce-scatter, flat": model.seconds("reduce_scatter", nbytes, "ring"),
            "reduce-scatter, two-level": model.seconds("reduce_scatter", nbytes, "hierarchical"),
        }
        for name, samples in timed.times.items():
            out["rows"].append({"size": nbytes, "variant": name, "times": samples,
                                "torch": timed.times["all-reduce, torch Gloo"],
                                "predicted": predicted.get(name)})
    tdist.destroy_process_group()
    dist.destroy_process_group()
    return out if rank == 0 else None


def steps(rounds: int, per: int = 5) -> dict | None:
    import torch
    import torch.distributed as tdist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    import spmd
    from ddp import CASES, _batch, _fresh
    from spmd import runtime as dist

    rank, world = _groups()
    case = CASES["d256"]

    def ours(strategy: str, mesh=None):
        return spmd.parallelize(_fresh(case), strategy=strategy, mesh=mesh)

    def fsdp2():
        model = _fresh(case)
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        for layer in model.encoder.layers:
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    models = {
        "spmd ddp": ours("ddp"),
        "spmd ddp, flat buckets": ours("ddp"),
        "torch DDP": DistributedDataParallel(_fresh(case)),
        "spmd hsdp, shard within hosts": ours("hsdp", spmd.Mesh((2, 2), ("dp", "fsdp"))),
        "spmd hsdp, shard across hosts": ours("hsdp", spmd.Mesh((2, 2), ("dp", "fsdp"),
                                                                ranks=[0, 2, 1, 3])),
        "torch FSDP2 HSDP": fsdp2(),
    }
    opts = {k: case.optimizer(m.parameters()) for k, m in models.items()}
    batches = [_batch(case, s, rank, world) for s in range(per)]

    def train(name: str) -> None:
        model, opt = models[name], opts[name]
        for x, y in batches:
            case.loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()

    def choose(name: str) -> None:  # read when a model is planned, at its first step
        os.environ["SPMD_HIERARCHICAL"] = "never" if name.endswith("flat buckets") else "auto"

    timed = harness.alternate({k: (lambda k=k: train(k)) for k in models}, rounds,
                              barrier=tdist.barrier, per=per, order=harness.rotated,
                              before=choose)
    plans = {}
    for name in ("spmd ddp", "spmd ddp, flat buckets", "spmd hsdp, shard within hosts",
                 "spmd hsdp, shard across hosts"):
        plan = spmd.inspect(models[name])
        plans[name] = {"predicted": plan.predicted_communication_seconds(),
                       "buckets": [b.algorithm for b in plan.buckets]}
    tdist.destroy_process_group()
    dist.destroy_process_group()
    return {"times": timed.times, "plans": plans} if rank == 0 else None


def worker(part: str, rounds: int, target: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "eth0")
    result = {"collectives": collectives, "steps": steps}[part](rounds)
    if result is not None:
        with open(target, "w") as f:
            json.dump(result, f)


# -- the driver -----------------------------------------------------------------------------


def run_on_hosts(link: tuple[float, float], part: str, rounds: int, timeout: float) -> dict:
    from tests.hosts import Hosts, Link

    with tempfile.TemporaryDirectory() as tmp, \
            Hosts(2, link=Link(gbps=link[0], latency_ms=link[1])) as hosts:
        target = os.path.join(tmp, "out.json")
        procs = [hosts.popen(node, [
            sys.executable, "-m", "spmd.runtime.run", "--nnodes", "2", "--node-rank",
            str(node), "--nproc-per-node", "2", "--master-addr", hosts.address(0),
            "--master-port", "29500", os.path.abspath(__file__), "--worker", part,
            "--rounds", str(rounds), "--out", target], cwd=REPO,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for node in (0, 1)]
        deadline = time.monotonic() + timeout
        logs = [p.communicate(timeout=max(1, deadline - time.monotonic()))[0] for p in procs]
        if any(p.returncode for p in procs):
            raise RuntimeError(f"{part} on {link} failed:\n" + "\n".join(l[-3000:] for l in logs))
        with open(target) as f:
            return json.load(f)


def report_collectives(link: tuple[float, float], out: dict) -> None:
    print(f"\n**{link[0]:g} Gbit/s, {link[1]:g} ms** ({out['model']})\n")
    harness.table(("collective", "MiB", "measured ms", "predicted ms", "measured/predicted",
                   "vs torch Gloo all-reduce (x faster)", "spread"), "llrrrrl")
    for r in out["rows"]:
        t = statistics.median(r["times"])
        pred = r["predicted"]
        versus = harness.versus({"v": r["times"], "t": r["torch"]}, "t")["v"]
        kind = r["variant"]
        ratio = f"{versus.ratio:.2f}" if kind.startswith("all-reduce") else ""
        spread = versus.spread if kind.startswith("all-reduce") and "torch" not in kind else ""
        harness.row(kind, f"{r['size'] / 2**20:g}", f"{t * 1e3:.2f}",
                    "" if pred is None else f"{pred * 1e3:.2f}",
                    "" if pred is None else f"{t / pred:.2f}", ratio, spread)


def report_steps(link: tuple[float, float], out: dict) -> None:
    print(f"\n**{link[0]:g} Gbit/s, {link[1]:g} ms**\n")
    harness.table(("variant", "ms/step", "vs its torch peer (x faster)", "spread",
                   "predicted communication ms", "buckets"), "lrrlrl")
    times = out["times"]
    for peer, names in (("torch DDP", ["spmd ddp", "spmd ddp, flat buckets", "torch DDP"]),
                        ("torch FSDP2 HSDP", ["spmd hsdp, shard within hosts",
                                              "spmd hsdp, shard across hosts",
                                              "torch FSDP2 HSDP"])):
        figures = harness.versus({n: times[n] for n in names}, peer)
        for name in names:
            v = figures[name]
            plan = out["plans"].get(name)
            buckets = ""
            if plan is not None and plan["buckets"]:
                two = sum(a == "hierarchical" for a in plan["buckets"])
                buckets = f"{two} of {len(plan['buckets'])} two-level"
            harness.row(name, f"{v.median * 1e3:.1f}", f"{v.ratio:.2f}", v.spread,
                        "" if plan is None else f"{plan['predicted'] * 1e3:.1f}", buckets)


def main() -> None:
    p = harness.parser(__doc__, rounds=5)
    p.add_argument("--links", default="1:0.1,1:1,0.25:0.1",
                   help="GBPS:MS settings, comma-separated")
    p.add_argument("--parts", default="collectives,steps")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--worker", help=argparse.SUPPRESS)  # the ranks' side, inside a host
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.rounds, args.out)
        return
    from tests.hosts import unavailable

    why = unavailable()
    if why:
        sys.exit(f"benchmarks/hosts.py needs simulated hosts: {why}")
    parts = harness.choices(args.parts, ("collectives", "steps"), p, "part")
    links = [tuple(float(x) for x in item.split(":")) for item in args.links.split(",")]
    for part in parts:
        print(f"\n### {part}")
        for link in links:
            out = run_on_hosts(link, part, args.rounds, args.timeout)
            (report_collectives if part == "collectives" else report_steps)(link, out)
            sys.stdout.flush()


if __name__ == "__main__":
    main()
