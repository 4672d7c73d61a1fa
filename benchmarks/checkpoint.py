"""Training while a checkpoint is written: spmd's CheckpointManager against no checkpoint
and against torch's ``dcp.async_save``.

    python benchmarks/checkpoint.py [--rounds 5] [--steps 8] [--every 4] [--case d256]

2 ranks (Gloo, loopback), the model of ``benchmarks/ddp.py``'s case: spmd fsdp with no
checkpoint and with ``CheckpointManager(every=N)`` (asynchronous: the state copied off
the training path, written by DCP on the manager's thread); torch FSDP2 (``fully_shard``
on each layer) with no checkpoint and with ``dcp.async_save`` every N steps (its
staging, its thread, a process group of its own; each save waits for the last, as the
manager does). A round is ``--steps`` steps of each variant, rotated within the round;
round 0 warms up. The checkpoints go to a temporary directory on this machine's disk.
The figure is the median step time over rounds, and x faster than the peer (below 1:
slower); the spread, the lowest and highest per-round ratio. Prints a markdown table and the manager's own accounting (seconds the
training thread spent staging and waiting, seconds a write took on its thread).
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402


def rank_main(rank: int, case_name: str, steps: int, every: int, rounds: int) -> dict | None:
    import torch
    import torch.distributed as tdist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import spmd
    from ddp import CASES, _batch, _fresh
    from spmd import runtime as dist

    case = CASES[case_name]
    with harness.group(rank) as world:
        box = [tempfile.mkdtemp(prefix="spmd-ckpt-bench-") if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        root = box[0]

        def fsdp2():
            model = _fresh(case)
            mesh = init_device_mesh("cpu", (world,))
            for layer in model.encoder.layers:
                fully_shard(layer, mesh=mesh)
            return fully_shard(model, mesh=mesh)

        models = {"spmd fsdp": spmd.parallelize(_fresh(case), strategy="fsdp"),
                  "torch FSDP2": fsdp2()}
        models["spmd fsdp, checkpoint"] = spmd.parallelize(_fresh(case), strategy="fsdp")
        models["torch FSDP2, dcp.async_save"] = fsdp2()
        opts = {k: case.optimizer(m.parameters()) for k, m in models.items()}
        manager = spmd.checkpoint.CheckpointManager(
            os.path.join(root, "spmd"), models["spmd fsdp, checkpoint"],
            opts["spmd fsdp, checkpoint"], every=every, keep=2)
        torch_pg = tdist.new_group(backend="gloo")  # async_save's own, as torch advises
        pending: list = []
        counter = {"spmd": 0, "torch": 0}
        batches = [_batch(case, s, rank, world) for s in range(steps)]

        def torch_save(step: int) -> None:
            if step % every:
                return
            if pending:
                pending.pop().result()
            name = "torch FSDP2, dcp.async_save"
            model_sd, optim_sd = get_state_dict(models[name], opts[name])
            pending.append(dcp.async_save({"model": model_sd, "optim": optim_sd},
                                          checkpoint_id=os.path.join(root, "torch", str(step)),
                                          process_group=torch_pg))

        def train(name: str) -> None:
            model, opt = models[name], opts[name]
            for x, y in batches:
                case.loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
                if name == "spmd fsdp, checkpoint":
                    counter["spmd"] += 1
                    manager.save(counter["spmd"])
                elif name == "torch FSDP2, dcp.async_save":
                    counter["torch"] += 1
                    torch_save(counter["torch"])

        timed = harness.alternate({k: (lambda k=k: train(k)) for k in models}, rounds,
                                  barrier=dist.barrier, per=steps, order=harness.rotated)
        manager.close()
        if pending:
            pending.pop().result()
        stats = manager.stats
        out = {"times": timed.times, "staged": [s.staged for s in stats],
               "waited": [s.waited for s in stats], "written": [s.written for s in stats],
               "bytes": stats[-1].bytes if stats else 0}
        dist.barrier()
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
        return out if rank == 0 else None


def main() -> None:
    p = harness.parser(__doc__, rounds=5)
    p.add_argument("--steps", type=int, default=8, help="steps a round")
    p.add_argument("--every", type=int, default=4, help="checkpoint every N steps")
    p.add_argument("--case", default="d256")
    args = p.parse_args()
    out = harness.spawn(rank_main, args.case, args.steps, args.every, args.rounds,
                        nprocs=2, start_method="forkserver")[0]
    times = out["times"]
    print(f"\n{args.case}, 2 ranks, a checkpoint every {args.every} steps "
          f"({out['bytes'] / 2**20:.1f} MiB a rank), {args.steps} steps a round, "
          f"{args.rounds} rounds\n")
    harness.table(("variant", "ms/step", "vs no checkpoint (x faster)", "spread",
                   "vs torch with async_save (x faster)", "spread"), "lrrlrl")
    own = {"spmd fsdp, checkpoint": "spmd fsdp", "torch FSDP2, dcp.async_save": "torch FSDP2"}
    for name in times:
        median = statistics.median(times[name])
        base = own.get(name)
        slower = harness.versus({name: times[name], base: times[base]}, base)[name] \
            if base else None
        against = harness.versus({name: times[name], "t": times["torch FSDP2, dcp.async_save"]},
                                 "t")[name] if name == "spmd fsdp, checkpoint" else None
        harness.row(name, f"{median * 1e3:.1f}",
                    "" if slower is None else f"{slower.ratio:.3f}",
                    "" if slower is None else slower.spread,
                    "" if against is None else f"{against.ratio:.3f}",
                    "" if against is None else against.spread)
    ms = lambda xs: f"{statistics.median(xs) * 1e3:.1f} ms (max {max(xs) * 1e3:.1f})"
    print(f"\nthe manager, per checkpoint: staged {ms(out['staged'])}, waited for the last "
          f"write {ms(out['waited'])}, written on its thread {ms(out['written'])}")


if __name__ == "__main__":
    main()
