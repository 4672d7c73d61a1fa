"""Pipeline parallelism: step time of ``spmd.pp`` against ``torch.distributed.pipelining``
with the same schedule, stages and microbatches, and the measured bubble against the
schedule's theoretical one.

    python benchmarks/pipeline.py [--ranks 2] [--rounds 4] [--steps 4] [--microbatches 8]
                                  [--layers 8] [--dim 256] [--seq 128] [--batch 16]
                                  [--schedules gpipe,1f1b,interleaved-1f1b,zb-h1]

``--ranks`` local ranks (processes), one thread each, Gloo over loopback, one pipeline of
that many stages (``interleaved-1f1b``: two per rank). The model: token embedding,
``--layers`` pre-norm transformer blocks (``nn.TransformerEncoderLayer``, GELU, no
dropout), a final LayerNorm and the vocabulary head; the loss is the cross-entropy of
the logits, inside the pipeline's last stage for both.

- ``spmd``: ``spmd.parallelize(model, mesh=Mesh((P,), ("pp",)), pipeline=spmd.pp.schedule(
  name, M, split_points=...))``, ``model.step(x, y, loss_fn)``;
- ``torch``: ``torch.distributed.pipelining.pipeline(model, split_spec=...)`` with the
  same split points, each rank's stage(s) built on the same Gloo group
  (``mesh.get_group("pp").to_torch()``), and the matching schedule class
  (``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``; for ``zb-h1``,
  ``ScheduleInterleavedZeroBubble`` with one stage per rank), ``schedule.step(x,
  target=y, losses=...)``.

Both run the same weights, batches and SGD step. Variants alternate inside each round
(same processes, same machine state); round 0 warms up and is not counted. A round's
figure is its mean step time; a variant's is the median over rounds with the lowest and
highest beside it; the ratio is spmd's over torch's (below 1: spmd faster).

The bubble: spmd records each action's start and end on every rank (time spent waiting
for a receive counts as idle); the measured bubble is the idle share of every rank's
step, against :meth:`spmd.pp.Schedule.bubble` (equal stages, free sends).
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn as nn
import torch.nn.functional as F

import harness


class Model(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.tok = nn.Embedding(vocab, dim)
            self.layers = nn.ModuleList(
                nn.TransformerEncoderLayer(dim, max(dim // 64, 1), 4 * dim, dropout=0.0,
                                           activation="gelu", batch_first=True,
                                           norm_first=True)
                for _ in range(layers))
            self.norm = nn.LayerNorm(dim)
            self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


VOCAB = 512


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _split_points(layers: int, stages: int) -> list[str]:
    per = layers / stages
    return [f"layers.{round(per * s)}" for s in range(1, stages)]


def _torch_schedule(name: str, model: nn.Module, points: list[str], stages: int, ranks: int,
                    rank: int, group, mb: torch.Tensor, microbatches: int):
    from torch.distributed import pipelining as tp

    spec = {p: tp.SplitPoint.BEGINNING for p in points}
    pipe = tp.pipeline(model, mb_args=(mb,), split_spec=spec)
    mine = [s for s in range(stages) if s % ranks == rank]
    built = [pipe.build_stage(s, torch.device("cpu"), group) for s in mine]
    cls = {"gpipe": tp.ScheduleGPipe, "1f1b": tp.Schedule1F1B,
           "interleaved-1f1b": tp.ScheduleInterleaved1F1B,
           "zb-h1": tp.ScheduleInterleavedZeroBubble}[name]
    looped = name in ("interleaved-1f1b", "zb-h1")
    schedule = cls(built if looped else built[0], microbatches, loss_fn=loss_fn)
    params = [p for st in built for p in st.submod.parameters()]
    return schedule, params, built


def rank_main(rank: int, args: argparse.Namespace) -> dict:
    import spmd
    import spmd.runtime as dist

    with harness.group(rank):
        ranks = args.ranks
        mesh = spmd.Mesh((ranks,), ("pp",))
        group = mesh.get_group("pp").to_torch()
        g = torch.Generator().manual_seed(0)
        batches = [torch.randint(0, VOCAB, (args.batch, args.seq + 1), generator=g)
                   for _ in range(args.steps)]
        out: dict = {}
        for name in args.schedules:
            v = 2 if name == "interleaved-1f1b" else 1
            stages = ranks * v
            points = _split_points(args.layers, stages)
            variants: dict = {}
            # spmd
            model = Model(VOCAB, args.dim, args.layers)
            pm = spmd.parallelize(model, mesh=mesh, pipeline=spmd.pp.schedule(
                name, args.microbatches, split_points=points))
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)

            def spmd_step(batch, pm=pm, opt=opt):
                loss = pm.step(batch[:, :-1], batch[:, 1:], loss_fn)
                opt.step()
                opt.zero_grad()
                return loss.item()

            variants["spmd"] = (spmd_step, pm)
            # torch
            tmodel = Model(VOCAB, args.dim, args.layers)
            mb = batches[0][: args.batch // args.microbatches, :-1]
            try:
                sched, params, built = _torch_schedule(name, tmodel, points, stages, ranks,
                                                       rank, group, mb, args.microbatches)
                topt = torch.optim.SGD(params, lr=1e-3)
                first = any(st.is_first for st in built)
                last = any(st.is_last for st in built)

                def torch_step(batch, sched=sched, topt=topt, first=first, last=last):
                    losses: list = []
                    kwargs = {}
                    if last:
                        kwargs = {"target": batch[:, 1:], "losses": losses}
                    if first:
                        sched.step(batch[:, :-1], **kwargs)
                    else:
                        sched.step(**kwargs)
                    topt.step()
                    topt.zero_grad()
                    return torch.stack(losses).mean().item() if losses else float("nan")

                variants["torch"] = (torch_step, None)
            except Exception as e:  # a schedule torch cannot run here: said in the table
                out.setdefault("errors", {})[name] = f"{type(e).__name__}: {str(e)[:160]}"
            bubbles: list[float] = []

            def barrier():
                dist.barrier(group=mesh.get_group("pp"))

            def run(step):
                losses = [step(batch) for batch in batches]
                barrier()  # every rank's step done: the pipeline's time
                return losses

            def busy(label, r, variants=variants):
                if r and variants[label][1] is not None:
                    bubbles.append(_busy(variants[label][1]))

            timed = harness.alternate({label: (lambda s=step: run(s))
                                       for label, (step, _) in variants.items()},
                                      args.rounds, barrier=barrier, per=len(batches),
                                      after=busy)
            out[name] = {"times": timed.times, "busy": bubbles,
                         "loss": {k: v[0] for k, v in timed.warmup.items()},
                         "theory": spmd.pp.schedule(name, args.microbatches).bubble(ranks)}
        return out


def _busy(pm) -> tuple[float, float]:
    """(busy seconds, step seconds) of this rank's last step."""
    spans = pm.last_spans
    busy = sum(end - start for _, start, end in spans)
    return busy, max(end for _, _, end in spans)


def main() -> None:
    parser = harness.parser(__doc__, steps=4, rounds=4)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--schedules", default="gpipe,1f1b,interleaved-1f1b,zb-h1")
    args = parser.parse_args()
    args.schedules = args.schedules.split(",")
    results = harness.spawn(rank_main, args, nprocs=args.ranks, timeout=3600)
    print(f"{args.ranks} ranks, {args.layers} x d{args.dim} blocks, batch {args.batch} x "
          f"{args.seq} tokens, {args.microbatches} microbatches, {args.rounds} rounds x "
          f"{args.steps} steps\n")
    harness.table(("schedule", "spmd ms (min-max)", "torch ms (min-max)", "spmd / torch",
                   "measured bubble (min-max)", "theoretical", "step-0 loss spmd, torch"),
                  "lrrrrrl")
    for name in args.schedules:
        runs = [r[name] for r in results]
        row = [name]
        medians = {}
        for label in ("spmd", "torch"):
            per_round = [max(r["times"][label][k] for r in runs)
                         for k in range(len(runs[0]["times"].get(label, [])))]
            if not per_round:
                row.append("—")
                continue
            medians[label] = statistics.median(per_round)
            row.append(f"{medians[label] * 1e3:.1f} ({min(per_round) * 1e3:.1f}-"
                       f"{max(per_round) * 1e3:.1f})")
        row.append(f"{medians['spmd'] / medians['torch']:.2f}x" if len(medians) == 2 else "—")
        bubbles = []
        for k in range(len(runs[0]["busy"])):
            step = max(r["busy"][k][1] for r in runs)
            bubbles.append(1 - sum(r["busy"][k][0] for r in runs) / (len(runs) * step))
        row.append(f"{statistics.median(bubbles):.1%} ({min(bubbles):.1%}-{max(bubbles):.1%})")
        row.append(f"{runs[0]['theory']:.1%}")
        losses = runs[-1]["loss"]
        row.append(", ".join(f"{losses[k]:.6f}" for k in ("spmd", "torch") if k in losses))
        harness.row(*row)
    errors = results[0].get("errors")
    if errors:
        print()
        for name, why in errors.items():
            print(f"torch could not run {name}: {why}")


if __name__ == "__main__":
    main()
