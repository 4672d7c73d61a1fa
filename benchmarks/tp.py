"""Step time of tensor parallelism (``spmd.tp.megatron()``) against torch's
``parallelize_module``, and planning time for a simulated 8 x 128 mesh.

    python benchmarks/tp.py [--quick] [--model encoder|llama] [--steps 20] [--rounds 5]
                            [--layers 4] [--width 256] [--heads 8] [--seq 64] [--batch 4]
                            [--variants ...] [--plan-width 1024] [--plan-heads 128]
                            [--plan-layers 4] [--plan-seq 16] [--plan-batch 8] [--global-heads]

Two local ranks (processes), one thread each, Gloo over loopback; the same model, initial
weights, batches (every rank the same ones: one tensor-parallel group) and optimizer
(AdamW) for every variant:

- ``spmd tp``: ``spmd.parallelize(model, mesh=Mesh((2,), dim_names=("tp",)),
  placements=spmd.tp.megatron())``: q/k/v and ``linear1`` column-parallel, ``o`` and
  ``linear2`` row-parallel, the rest replicated;
- ``spmd tp (Inductor)``: the same with ``compile_compute=True`` (Inductor's C++ kernels
  for the graphs' compute; the planner's default on a CPU is generated Python);
- ``torch TP``: ``torch.distributed.tensor.parallel.parallelize_module`` on each block
  (``ColwiseParallel`` for q, k, v and the MLP's first linear(s); ``RowwiseParallel`` for
  the attention output and the MLP's last linear) on ``mesh.to_torch()``, a
  ``DeviceMesh`` over the same Gloo group;
- ``torch TP (compiled)``: the same model under ``torch.compile`` (Dynamo traces DTensor's
  dispatch away; Inductor compiles the compute);
- ``1 process``: the model unparallelized on rank 0 alone (rank 1 waits at a barrier),
  for context.

The models (``--model``): token embedding, ``--layers`` pre-norm blocks, a final norm and a
vocabulary head. ``encoder``: separate q/k/v/o linears, causal
``scaled_dot_product_attention``, LayerNorm, GELU MLP 4x. ``llama``: RMSNorm, rotary
embeddings (rotate-half), ``wq``/``wk``/``wv``/``wo``, a SwiGLU MLP (``w1``, ``w3``, ``w2``)
of 8/3 the width rounded up to 256. Attention splits heads with ``view(b, t, -1,
head_dim)``, so one class serves both: spmd traces whole shapes (-1 is every head),
torch's TP runs on local ones (-1 is this rank's heads).

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
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import harness

VOCAB = 256
VARIANTS = ("spmd tp", "spmd tp (Inductor)", "torch TP", "torch TP (compiled)", "1 process")
DEFAULT_VARIANTS = ("spmd tp", "torch TP", "torch TP (compiled)", "1 process")
SPLIT = {"encoder": (("q", "k", "v", "linear1"), ("o", "linear2")),  # (column, row)
         "llama": (("wq", "wk", "wv", "w1", "w3"), ("wo", "w2"))}


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


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class LlamaBlock(nn.Module):
    """LLaMA-style pre-norm block (RMSNorm, rotary q/k, SwiGLU); heads as in ``Block``."""

    def __init__(self, width: int, heads: int, local_heads: bool = True) -> None:
        super().__init__()
        self.heads, self.head_dim, self.local_heads = heads, width // heads, local_heads
        hidden = -(-8 * width // 3 // 256) * 256
        self.attention_norm, self.ffn_norm = nn.RMSNorm(width), nn.RMSNorm(width)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(width, width, bias=False)
                                              for _ in range(4))
        self.w1 = nn.Linear(width, hidden, bias=False)
        self.w3 = nn.Linear(width, hidden, bias=False)
        self.w2 = nn.Linear(hidden, width, bias=False)

    def forward(self, x, cos, sin):
        d = x.shape[-1]
        heads = -1 if self.local_heads else self.heads
        y = self.attention_norm(x)
        q = self.wq(y)
        b, t = q.shape[:2]

        def split(z, rotate):
            z = z.view(b, t, heads, self.head_dim)
            if rotate:
                z = z * cos[:, None] + _rotate_half(z) * sin[:, None]
            return z.transpose(1, 2)

        a = F.scaled_dot_product_attention(split(q, True), split(self.wk(y), True),
                                           split(self.wv(y), False), is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, t, -1 if heads < 0 else d))
        z = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(z)) * self.w3(z))


class Transformer(nn.Module):
    def __init__(self, width: int, heads: int, layers: int, local_heads: bool = True,
                 model: str = "encoder", seq: int = 64) -> None:
        super().__init__()
        self.model = model
        block = LlamaBlock if model == "llama" else Block
        self.embed = nn.Embedding(VOCAB, width)
        self.layers = nn.ModuleList(block(width, heads, local_heads) for _ in range(layers))
        self.norm = nn.RMSNorm(width) if model == "llama" else nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=model != "llama")
        head_dim = width // heads
        inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        angles = torch.outer(torch.arange(seq).float(), inv)
        self.register_buffer("cos", torch.cat([angles.cos()] * 2, -1), persistent=False)
        self.register_buffer("sin", torch.cat([angles.sin()] * 2, -1), persistent=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        t = tokens.shape[1]
        for layer in self.layers:
            h = layer(h, self.cos[:t], self.sin[:t]) if self.model == "llama" else layer(h)
        return self.head(self.norm(h))


def _fresh(width: int, heads: int, layers: int, local_heads: bool = True,
           model: str = "encoder", seq: int = 64) -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return Transformer(width, heads, layers, local_heads, model, seq)


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
    """Train every variant on ``batches`` in turn (:func:`harness.alternate`), ``rounds``
    times after a warm-up round: each variant's mean step seconds per round, its step-0
    loss (from the warm-up round) and its last loss. A variant ``runs`` says no to on
    this rank only waits at the barrier; ``trains`` gives a variant its own training loop
    (``_train``'s arguments; a loss inside the model)."""
    trains = trains or {}

    def run(variant: str):
        if runs(variant):
            return trains.get(variant, _train)(models[variant], opts[variant], batches)
        return None

    timed = harness.alternate({v: (lambda v=v: run(v)) for v in models}, rounds,
                              barrier=barrier, per=len(batches))
    mine = [v for v in models if runs(v)]
    times = {v: timed.times[v] if runs(v) else [] for v in models}
    first_loss = {v: timed.warmup[v][0].item() for v in mine}
    last_loss = {v: (timed.results[v] or [timed.warmup[v]])[-1][-1].item() for v in mine}
    return times, first_loss, last_loss


def rank_main(rank: int, steps: int, rounds: int, width: int, heads: int, layers: int,
              seq: int, batch: int, local_heads: bool, model: str,
              variants: tuple[str, ...]) -> dict | None:
    import torch.distributed as tdist
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    import spmd

    with harness.group(rank):
        mesh = spmd.Mesh((2,), dim_names=("tp",))
        torch_mesh = mesh.to_torch()  # the same Gloo group, seen by torch.distributed

        column, row = SPLIT[model]

        def fresh(local: bool = True) -> nn.Module:
            return _fresh(width, heads, layers, local, model, seq)

        def torch_tp() -> nn.Module:
            tp = fresh()  # torch runs local shapes: -1 heads always
            plan = {**{n: ColwiseParallel() for n in column},
                    **{n: RowwiseParallel() for n in row}}
            for block in tp.layers:
                parallelize_module(block, torch_mesh, plan)
            return tp

        make = {
            "spmd tp": lambda: spmd.parallelize(fresh(local_heads), mesh=mesh,
                                                placements=spmd.tp.megatron()),
            "spmd tp (Inductor)": lambda: spmd.parallelize(fresh(local_heads), mesh=mesh,
                                                          placements=spmd.tp.megatron(),
                                                          compile_compute=True),
            "torch TP": torch_tp,
            "torch TP (compiled)": lambda: torch.compile(torch_tp()),
            "1 process": lambda: fresh(),
        }
        batches = [_batch(step, batch, seq) for step in range(steps)]
        models = {v: make[v]() for v in variants}
        opts = {v: torch.optim.AdamW(m.parameters(), lr=1e-3) for v, m in models.items()}
        # "1 process" runs on rank 0 alone
        times, first_loss, last_loss = alternate(models, opts, batches, rounds, tdist.barrier,
                                                 lambda v: v != "1 process" or rank == 0)
        tdist.barrier()
        summary = str(spmd.inspect(models["spmd tp"])).splitlines()[:2]
        if rank:
            return None
        return {"times": times, "loss": first_loss, "last": last_loss, "plan": summary}


def plan_simulated(width: int, heads: int, layers: int, seq: int, batch: int,
                   model_kind: str) -> dict:
    import spmd

    torch.set_num_threads(1)
    model = _fresh(width, heads, layers, model=model_kind, seq=seq)
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
    print(f"\n### 2 ranks, tp=2, {args.model}: {args.layers} layers of width {args.width}, "
          f"{args.heads} heads, {args.batch} x {args.seq} tokens, AdamW, {args.steps} steps x "
          f"{args.rounds} rounds\n")
    compiled = "torch TP (compiled)" in times
    harness.table(("variant", "ms/step (median)", "rounds min–max ms", "vs torch TP (x faster)",
                   *(("vs compiled torch TP (x of its time)",) if compiled else ()),
                   "step-0 loss"), "lrrr" + ("r" if compiled else "") + "r")
    ref = statistics.median(times["torch TP"])
    for variant in args.variants:
        t = statistics.median(times[variant])
        ratios = [f"{ref / t:.2f}"]
        if compiled:
            ratios.append(f"{t / statistics.median(times['torch TP (compiled)']):.3f}")
            per_round = harness.ratios(times[variant], times["torch TP (compiled)"])
            ratios[-1] += f" ({harness.span(per_round, '.3f')})"
        harness.row(variant, f"{t * 1e3:.2f}",
                    harness.span([x * 1e3 for x in times[variant]]), *ratios,
                    f"{loss[variant]:.7f}")
    gap = abs(loss["spmd tp"] - loss["torch TP"])
    print(f"\nstep-0 loss |spmd tp - torch TP| = {gap:.2e} "
          f"({'ok' if gap < 1e-4 else 'MISMATCH'}, tolerance 1e-4); "
          + (f"|spmd tp - 1 process| = {abs(loss['spmd tp'] - loss['1 process']):.2e}"
             if "1 process" in loss else ""))
    last, trained = res["last"], (args.rounds + 1) * args.steps
    print(f"after {trained} identical steps, last loss: " + ", ".join(
        f"{v} {last[v]:.7f}" for v in args.variants)
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
    parser = harness.parser(__doc__, steps=20, rounds=5)
    parser.add_argument("--quick", action="store_true", help="3 steps x 2 rounds, a small plan")
    parser.add_argument("--model", choices=sorted(SPLIT), default="encoder")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help=f"comma-separated, of: {', '.join(VARIANTS)} (spmd tp and torch TP "
                             f"always run)")
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
    wanted = {v.strip() for v in args.variants.split(",") if v.strip()} | {"spmd tp", "torch TP"}
    if wanted - set(VARIANTS):
        parser.error(f"--variants: unknown {sorted(wanted - set(VARIANTS))}; "
                     f"choose from {', '.join(VARIANTS)}")
    args.variants = tuple(v for v in VARIANTS if v in wanted)
    if args.width % args.heads or args.heads % 2:
        parser.error("--width must divide by --heads, and --heads by 2 (tp=2)")
    if args.plan_width % args.plan_heads or args.plan_heads % 128:
        parser.error("--plan-width must divide by --plan-heads, and --plan-heads by 128")
    res = harness.spawn(rank_main, args.steps, args.rounds, args.width, args.heads,
                        args.layers, args.seq, args.batch, not args.global_heads, args.model,
                        args.variants, start_method="forkserver", timeout=1200)[0]
    plan = plan_simulated(args.plan_width, args.plan_heads, args.plan_layers, args.plan_seq,
                          args.plan_batch, args.model)
    report(res, plan, args)


if __name__ == "__main__":
    main()
