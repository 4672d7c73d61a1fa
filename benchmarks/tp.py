"""Step time of tensor parallelism (``spmd.tp.megatron()``) against torch's
``parallelize_module``, and planning time for a simulated 8 x 128 mesh.

    python benchmarks/tp.py [--quick] [--steps 20] [--rounds 5] [--layers 4] [--width 256]
                            [--heads 8] [--seq 64] [--batch 4] [--plan-width 1024]
                            [--plan-heads 128] [--plan-layers 4] [--plan-seq 16] [--plan-batch 8]
                            [--global-heads]

Two local ranks (processes), one thread each, Gloo over loopback; the same model, initial
weights, batches (every rank the same ones: one tensor-parallel group) and optimizer
(AdamW) for every variant:

- ``spmd tp``: ``spmd.parallelize(model, mesh=Mesh((2,), dim_names=("tp",)),
  placements=spmd.tp.megatron())``: q/k/v and ``linear1`` column-parallel, ``o`` and
  ``linear2`` row-parallel, the rest replicated;
- ``torch TP``: ``torch.distributed.tensor.parallel.parallelize_module`` on each block
  (``ColwiseParallel`` for q, k, v, linear1; ``RowwiseParallel`` for o, linear2) on
  ``mesh.to_torch()``, a ``DeviceMesh`` over the same Gloo group;
- ``1 process``: the model unparallelized on rank 0 alone (rank 1 waits at a barrier),
  for context.

The model: token embedding, ``--layers`` pre-norm blocks (separate q/k/v/o linears,
causal ``scaled_dot_product_attention``, GELU MLP 4x), a final LayerNorm and a vocabulary
head. Attention splits heads with ``view(b, t, -1, head_dim)``, so one class serves both:
spmd traces whole shapes (-1 is every head), torch's TP runs on local ones (-1 is this
rank's heads).

Time: variants alternate in rounds so all see the same machine; round 0 warms up
(compiles) and is not counted. A round's figure is its mean step time; the variant's is
the median over rounds, with the lowest and highest round beside it. The ratio is torch
TP's median over the variant's (above 1: faster than torch TP).

Sanity check: the step-0 losses (the warm-up round's first step, same weights and batch)
of every variant, and how far spmd's is from torch's (tolerance 1e-4); then the last
step's losses, after every variant trained the same steps on the same batches.

Planning: ``spmd.inspect(model, tokens, mesh=Mesh.simulated((8, 128), dim_names=("dp",
"tp")), placements=spmd.tp.megatron())`` in the parent process (no process group): a
copy of a model whose widths and heads divide by 128 runs one forward and backward; the
wall time of that call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 256
VARIANTS = ("spmd tp", "torch TP", "1 process")
COLUMN, ROW = ("q", "k", "v", "linear1"), ("o", "linear2")


class Block(nn.Module):
    """Pre-norm block. ``local_heads``: split heads as ``view(b, t, -1, head_dim)`` (the
    count follows the tensor: what torch's TP needs); False: the global ``heads``."""

    def __init__(self, width: int, heads: int, local_heads: bool = True) -> None:
        super().__init__()
        self.heads, self.head_dim, self.local_heads = heads, width // heads, local_heads
        self.norm1 = nn.LayerNorm(width)
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.o = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.linear1 = nn.Linear(width, 4 * width)
        self.linear2 = nn.Linear(4 * width, width)

    def forward(self, x):
        d = x.shape[-1]
        heads = -1 if self.local_heads else self.heads
        y = self.norm1(x)
        q = self.q(y)
        b, t = q.shape[:2]  # (torch's sequence parallelism: x holds a part of the sequence)

        def split(z):
            return z.view(b, t, heads, self.head_dim).transpose(1, 2)

        a = F.scaled_dot_product_attention(split(q), split(self.k(y)),
                                           split(self.v(y)), is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, -1 if heads < 0 else d))
        return x + self.linear2(F.gelu(self.linear1(self.norm2(x))))


class Transformer(nn.Module):
    def __init__(self, width: int, heads: int, layers: int, local_heads: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.layers = nn.ModuleList(Block(width, heads, local_heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, tokens):
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def _fresh(width: int, heads: int, layers: int, local_heads: bool = True) -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return Transformer(width, heads, layers, local_heads)


def _batch(step: int, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)  # the same on every rank
    tokens = torch.randint(0, VOCAB, (batch, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _train(model: nn.Module, opt: torch.optim.Optimizer, batches) -> list[torch.Tensor]:
    """The losses, detached."""
    losses = []
    for x, y in batches:
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def alternate(models: dict, opts: dict, batches, rounds: int, barrier,
              runs=lambda variant: True, trains: dict | None = None
              ) -> tuple[dict, dict, dict]:
    """Train every variant on ``batches`` in turn, ``rounds`` times after a warm-up round
    (compilation; not counted), each start behind ``barrier()``: each variant's mean step
    seconds per round, its step-0 loss (from the warm-up round) and its last loss. A
    variant ``runs`` says no to on this rank waits at the next barrier; ``trains`` gives
    a variant its own training loop (``_train``'s arguments; a loss inside the model)."""
    steps = len(batches)
    times: dict[str, list[float]] = {v: [] for v in models}
    first_loss: dict[str, float] = {}
    last_loss: dict[str, float] = {}
    for r in range(rounds + 1):
        for variant, model in models.items():
            barrier()
            if not runs(variant):
                continue
            start = time.perf_counter()
            losses = (trains or {}).get(variant, _train)(model, opts[variant], batches)
            if r:
                times[variant].append((time.perf_counter() - start) / steps)
            else:
                first_loss[variant] = losses[0].item()
            last_loss[variant] = losses[-1].item()
    return times, first_loss, last_loss


def rank_main(rank: int, steps: int, rounds: int, width: int, heads: int, layers: int,
              seq: int, batch: int, local_heads: bool) -> dict | None:
    import torch.distributed as tdist
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    import spmd
    from spmd import runtime as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    mesh = spmd.Mesh((2,), dim_names=("tp",))
    torch_mesh = mesh.to_torch()  # the same Gloo group, seen by torch.distributed

    def torch_tp() -> nn.Module:
        model = _fresh(width, heads, layers)  # torch runs local shapes: -1 heads always
        plan = {**{n: ColwiseParallel() for n in COLUMN}, **{n: RowwiseParallel() for n in ROW}}
        for block in model.layers:
            parallelize_module(block, torch_mesh, plan)
        return model

    make = {
        "spmd tp": lambda: spmd.parallelize(_fresh(width, heads, layers, local_heads),
                                            mesh=mesh, placements=spmd.tp.megatron()),
        "torch TP": torch_tp,
        "1 process": lambda: _fresh(width, heads, layers),
    }
    batches = [_batch(step, batch, seq) for step in range(steps)]
    models = {v: make[v]() for v in VARIANTS}
    opts = {v: torch.optim.AdamW(m.parameters(), lr=1e-3) for v, m in models.items()}
    # "1 process" runs on rank 0 alone
    times, first_loss, last_loss = alternate(models, opts, batches, rounds, tdist.barrier,
                                             lambda v: v != "1 process" or rank == 0)
    tdist.barrier()
    summary = str(spmd.inspect(models["spmd tp"])).splitlines()[:2]
    dist.destroy_process_group()
    if rank:
        return None
    return {"times": times, "loss": first_loss, "last": last_loss, "plan": summary}


def plan_simulated(width: int, heads: int, layers: int, seq: int, batch: int) -> dict:
    import spmd

    torch.set_num_threads(1)
    model = _fresh(width, heads, layers)
    tokens, _ = _batch(0, batch, seq)
    mesh = spmd.Mesh.simulated((8, 128), dim_names=("dp", "tp"))
    start = time.perf_counter()
    try:
        plan = spmd.inspect(model, tokens, mesh=mesh, placements=spmd.tp.megatron())
    except Exception as e:  # reported, not raised: the step-time table still prints
        return {"seconds": time.perf_counter() - start, "error": f"{type(e).__name__}: {e}"}
    return {"seconds": time.perf_counter() - start, "plan": str(plan).splitlines()[:2],
            "params": sum(p.numel() for p in model.parameters())}


def report(res: dict, plan: dict, args: argparse.Namespace) -> None:
    times, loss = res["times"], res["loss"]
    print(f"\n### 2 ranks, tp=2: {args.layers} layers of width {args.width}, {args.heads} "
          f"heads, {args.batch} x {args.seq} tokens, AdamW, {args.steps} steps x "
          f"{args.rounds} rounds\n")
    print("| variant | ms/step (median) | rounds min–max ms | vs torch TP (x faster) "
          "| step-0 loss |")
    print("|---|---:|---:|---:|---:|")
    ref = statistics.median(times["torch TP"])
    for variant in VARIANTS:
        t = statistics.median(times[variant])
        print(f"| {variant} | {t * 1e3:.2f} | {min(times[variant]) * 1e3:.2f}–"
              f"{max(times[variant]) * 1e3:.2f} | {ref / t:.2f} | {loss[variant]:.7f} |")
    gap = abs(loss["spmd tp"] - loss["torch TP"])
    print(f"\nstep-0 loss |spmd tp - torch TP| = {gap:.2e} "
          f"({'ok' if gap < 1e-4 else 'MISMATCH'}, tolerance 1e-4); "
          f"|spmd tp - 1 process| = {abs(loss['spmd tp'] - loss['1 process']):.2e}")
    last, trained = res["last"], (args.rounds + 1) * args.steps
    print(f"after {trained} identical steps, last loss: " + ", ".join(
        f"{v} {last[v]:.7f}" for v in VARIANTS)
        + f"; |spmd tp - torch TP| = {abs(last['spmd tp'] - last['torch TP']):.2e}")
    print("spmd tp plan: " + " / ".join(res["plan"]))
    where = (f"planning, simulated (dp=8, tp=128): {args.plan_layers} layers of width "
             f"{args.plan_width}, {args.plan_heads} heads, {args.plan_batch} x {args.plan_seq} tokens per dp rank")
    if "error" in plan:
        print(f"{where}: FAILED after {plan['seconds']:.2f} s: {plan['error']}")
    else:
        print(f"{where} ({plan['params'] / 1e6:.1f}M parameters): {plan['seconds']:.2f} s "
              f"wall\n  " + " / ".join(plan["plan"]))
    t_ours, t_torch = statistics.median(times["spmd tp"]), ref
    print(f"\nsummary: spmd tp {t_ours * 1e3:.1f} ms/step, torch TP {t_torch * 1e3:.1f} "
          f"ms/step: ours {t_torch / t_ours:.2f}x faster; step-0 losses within {gap:.1e}; "
          + (f"8x128 plan in {plan['seconds']:.2f} s" if "error" not in plan
             else "8x128 plan FAILED"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 steps x 2 rounds, a small plan")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--plan-width", type=int, default=1024)
    parser.add_argument("--plan-heads", type=int, default=128)
    parser.add_argument("--plan-layers", type=int, default=4)
    parser.add_argument("--plan-seq", type=int, default=16)
    parser.add_argument("--plan-batch", type=int, default=8, help="sequences per dp rank")
    parser.add_argument("--global-heads", action="store_true",
                        help="spmd's model splits heads with the global count, not -1")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds, args.plan_layers = 3, 2, 1
    if args.width % args.heads or args.heads % 2:
        parser.error("--width must divide by --heads, and --heads by 2 (tp=2)")
    if args.plan_width % args.plan_heads or args.plan_heads % 128:
        parser.error("--plan-width must divide by --plan-heads, and --plan-heads by 128")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    from spmd.runtime import spawn

    res = spawn(rank_main, args=(args.steps, args.rounds, args.width, args.heads, args.layers,
                                 args.seq, args.batch, not args.global_heads),
                nprocs=2, start_method="forkserver", timeout=1200)[0]
    plan = plan_simulated(args.plan_width, args.plan_heads, args.plan_layers, args.plan_seq,
                          args.plan_batch)
    report(res, plan, args)


if __name__ == "__main__":
    main()
