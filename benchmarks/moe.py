"""Step time and peak memory of expert parallelism (``spmd.ep.experts()``) against a
torchtitan-style expert parallelism written with torch (DDP and ``all_to_all_single``),
and the all-to-all's predicted time against the measured one for uneven splits.

    python benchmarks/moe.py [--steps 10] [--rounds 5] [--width 256] [--experts 8]
                             [--inter 512] [--layers 2] [--seq 128] [--batch 4] [--top-k 2]
                             [--variants ...] [--memory] [--all-to-all] [--grouped]

Two local ranks (processes), one thread each, Gloo over loopback; the same mixture-of-
experts language model (token embedding, ``--layers`` blocks of RMSNorm, causal
attention, RMSNorm and a routed MoE (softmax router, top-k, weights normalised over the
k, ``--experts`` SwiGLU experts stacked as ``gate_up_proj``/``down_proj``), a head),
initial weights, batches (each rank its own rows) and AdamW for every variant:

- ``spmd ep``: ``spmd.parallelize(model, mesh=Mesh((2,), ("ep",)),
  placements=spmd.ep.experts())``: each rank holds half the experts; tokens routed by
  ``spmd::ep_scatter``/``ep_gather`` (uneven all-to-all), the rest as ``ddp``; the rows
  each rank's experts receive padded to every pair of both ranks (``2·T·k``);
- ``spmd ep (headroom 1.25)``: the same with ``spmd.ep.experts(headroom=1.25)``: the rows
  padded to ``1.25·T·k`` (a forward whose routing brings more runs again with the bound
  grown; the warm-up round sees any such growth);
- ``torch EP``: what torchtitan's expert parallelism does, written with torch: the
  experts module's forward sorts the (token, choice) rows by expert, exchanges the
  counts with ``all_to_all_single``, sends the rows with
  ``torch.distributed._functional_collectives.all_to_all_single_autograd`` (uneven
  splits, differentiable), runs each local expert over its rows (torchtitan's
  ``_run_experts_for_loop``), sends them back and combines; the other parameters under
  ``torch.nn.parallel.DistributedDataParallel`` (the experts' ignored), the experts'
  gradients divided by the expert ranks;
- ``spmd ddp``: every rank holds every expert (no expert parallelism), for context;
- ``1 process``: the model unparallelized on rank 0 on both ranks' rows (rank 1 waits).

Time: variants alternate in rounds (round 0 compiles and is not counted); a round's
figure is its mean step time, a variant's the median over rounds with the per-round
ratios' range. Ratio: torch EP's median over the variant's (above 1: faster).

``--memory``: each variant again in processes of its own: the growth of the peak resident
set (``ru_maxrss``) from before the first step to after ``--steps`` steps, on rank 0.

``--all-to-all``: ``all_to_all_single`` with uneven splits (rank 0 sends a share ``s``
of its rows to rank 1, rank 1 a share ``1 - s`` to rank 0) for several sizes and skews,
median of 20 calls, against the cost model's pairwise formula priced on the larger of
the two ranks' outgoing bytes (what the slower rank waits for).

``--grouped``: one expert layer's grouped products on one rank's rows, the loop of
``torch.mm`` the compiler runs on CPU against ``torch._grouped_mm`` (which it runs on
CUDA), forward and with the backward, rounds alternating (:func:`grouped_main`).
"""

from __future__ import annotations

import resource
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import harness

VARIANTS = ("spmd ep", "spmd ep (headroom 1.25)", "torch EP", "spmd ddp", "1 process")


class Experts(nn.Module):
    """Stacked SwiGLU experts with transformers' experts interface; its own forward is
    an eager loop (one process, and ``spmd ddp``)."""

    def __init__(self, experts: int, width: int, inter: int) -> None:
        super().__init__()
        self.num_experts = experts
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * inter, width) * width ** -0.5)
        self.down_proj = nn.Parameter(torch.randn(experts, width, inter) * inter ** -0.5)
        self.act_fn = nn.SiLU()

    def forward(self, hidden, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden)
        for e in range(self.num_experts):
            token, choice = torch.where(top_k_index == e)
            gate, up = (hidden[token] @ self.gate_up_proj[e].t()).chunk(2, dim=-1)
            y = (self.act_fn(gate) * up) @ self.down_proj[e].t()
            out = out.index_add(0, token, y * top_k_weights[token, choice, None])
        return out


class Block(nn.Module):
    def __init__(self, width: int, heads: int, experts: int, inter: int, top_k: int) -> None:
        super().__init__()
        self.heads, self.top_k = heads, top_k
        self.norm1, self.norm2 = nn.RMSNorm(width), nn.RMSNorm(width)
        self.qkv, self.o = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.router = nn.Linear(width, experts, bias=False)
        self.experts = Experts(experts, width, inter)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, -1).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, h))
        flat = self.norm2(x).reshape(-1, h)
        weights, index = self.router(flat).softmax(-1).topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        return x + self.experts(flat, index, weights).view(b, s, h)


class MoELM(nn.Module):
    def __init__(self, vocab: int, width: int, layers: int, heads: int, experts: int,
                 inter: int, top_k: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, heads, experts, inter, top_k)
                                    for _ in range(layers))
        self.norm, self.head = nn.RMSNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


# -- the torch peer: torchtitan's expert parallelism, written with torch -----------------


def _torch_ep_forward(self, hidden, top_k_index, top_k_weights):
    """torchtitan's token dispatch and combine around a loop over the local experts."""
    import torch.distributed as tdist
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    ep, local = self._ep_size, self.gate_up_proj.shape[0]
    tokens, k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    send = torch.bincount(flat, minlength=ep * local)
    recv = torch.empty_like(send)
    tdist.all_to_all_single(recv, send)  # the counts, per (rank, local expert)
    out_splits = send.view(ep, local).sum(1).tolist()
    in_splits = recv.view(ep, local).sum(1).tolist()
    rows = hidden.repeat_interleave(k, dim=0)[order]
    arrived = all_to_all_single_autograd(rows, in_splits, out_splits, tdist.group.WORLD)
    # arrived source by source, each source's local experts in order: per expert, loop
    per = recv.view(ep, local)
    starts = torch.cumsum(per.reshape(-1), 0) - per.reshape(-1)
    outs = [None] * (ep * local)
    for e in range(local):
        for src in range(ep):
            i, n = src * local + e, int(per[src, e])
            x = arrived[int(starts[i]):int(starts[i]) + n]
            gate, up = (x @ self.gate_up_proj[e].t()).chunk(2, dim=-1)
            outs[i] = (self.act_fn(gate) * up) @ self.down_proj[e].t()
    back = all_to_all_single_autograd(torch.cat(outs), out_splits, in_splits,
                                      tdist.group.WORLD)
    unsorted = torch.empty_like(back)
    unsorted[order] = back
    return (unsorted.view(tokens, k, -1) * top_k_weights.unsqueeze(-1)).sum(1)


def torch_ep(model: nn.Module, rank: int, ep: int) -> nn.Module:
    """``model`` with its experts split over torch's group and the rest under DDP."""
    import torch.distributed as tdist
    from torch.nn.parallel import DistributedDataParallel as DDP

    ignored = []
    for path, mod in model.named_modules():
        if isinstance(mod, Experts):
            local = mod.num_experts // ep
            for name in ("gate_up_proj", "down_proj"):
                whole = getattr(mod, name)
                piece = nn.Parameter(whole.detach()[rank * local:(rank + 1) * local].clone())
                setattr(mod, name, piece)
                # the gradient of the whole batch's mean loss: every rank's sum over ep
                piece.register_hook(lambda g: g / ep)
                ignored.append(f"{path}.{name}")
            mod._ep_size = ep
            mod.forward = _torch_ep_forward.__get__(mod)
    DDP._set_params_and_buffers_to_ignore_for_model(model, ignored)
    assert tdist.get_world_size() == ep
    return DDP(model)


# -- timing ---------------------------------------------------------------------------


def _build(args) -> MoELM:
    torch.manual_seed(0)
    return MoELM(256, args.width, args.layers, args.heads, args.experts, args.inter,
                 args.top_k)


def _batches(args, rows: int, rank: int | None, count: int) -> list:
    out = []
    for step in range(count):
        g = torch.Generator().manual_seed(10 + step)
        ids = torch.randint(0, 256, (2 * rows, args.seq + 1), generator=g)
        part = ids if rank is None else ids[rank * rows:(rank + 1) * rows]
        out.append((part[:, :-1], part[:, 1:]))
    return out


def _step(model, opt, batch) -> float:
    x, y = batch
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


def _make(name: str, args, rank: int, world: int):
    import spmd

    model = _build(args)
    if name.startswith("spmd ep"):
        mesh = spmd.Mesh((world,), dim_names=("ep",))
        headroom = 1.25 if name.endswith("(headroom 1.25)") else None
        model = spmd.parallelize(model, mesh=mesh,
                                 placements=spmd.ep.experts(headroom=headroom))
    elif name == "spmd ddp":
        model = spmd.parallelize(model, mesh=spmd.Mesh((world,), dim_names=("dp",)))
    elif name == "torch EP":
        model = torch_ep(model, rank, world)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def rank_main(rank: int, args) -> dict | None:
    with harness.group(rank, torch_group=True) as world:
        import torch.distributed as tdist

        made = {v: _make(v, args, rank, world) for v in args.variants}
        mine = _batches(args, args.batch, rank, args.steps)
        whole = _batches(args, args.batch, None, args.steps)
        losses: dict[str, float] = {}

        def run(name: str):
            model, opt = made[name]
            if name == "1 process":
                if rank == 0:
                    for b in whole:
                        losses[name] = _step(model, opt, b)
                return None
            for b in mine:
                losses[name] = _step(model, opt, b)

        timed = harness.alternate({v: (lambda v=v: run(v)) for v in args.variants},
                                  args.rounds, barrier=tdist.barrier, per=args.steps,
                                  order=harness.rotated)
        grown = {v: sum(spec.grown for spec in made[v][0]._spmd.experts.values())
                 for v in made if v.startswith("spmd ep")}
        return {"times": timed.times, "losses": losses, "grown": grown} if rank == 0 else None


def memory_main(rank: int, args, variant: str) -> float | None:
    with harness.group(rank, torch_group=True) as world:
        import torch.distributed as tdist

        model, opt = _make(variant, args, rank, world)
        batches = _batches(args, args.batch, None if variant == "1 process" else rank,
                           args.steps)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        if variant != "1 process" or rank == 0:
            for b in batches:
                _step(model, opt, b)
        tdist.barrier()
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        return grown / 1024 if rank == 0 else None  # MiB


def all_to_all_main(rank: int, sizes: list[int], skews: list[float]) -> list | None:
    with harness.group(rank) as world:
        from spmd.lowering.cost_model import CostModel
        from spmd.runtime import barrier
        from spmd.runtime.collectives import all_to_all_single

        model = CostModel.default("gloo", world)
        rows_out = []
        for nbytes in sizes:
            rows = nbytes // (4 * 256)
            for skew in skews:
                # rank 0 sends `skew` of its rows away, rank 1 sends 1 - skew
                away = round(rows * (skew if rank == 0 else 1 - skew))
                send = [rows - away, away] if rank == 0 else [away, rows - away]
                other_away = round(rows * ((1 - skew) if rank == 0 else skew))
                recv = [send[0], other_away] if rank == 0 else [other_away, send[1]]
                x = torch.randn(rows, 256)
                out = torch.empty(sum(recv), 256)
                times = []
                for _ in range(22):
                    barrier()
                    start = time.perf_counter()
                    all_to_all_single(out, x, recv, send)
                    times.append(time.perf_counter() - start)
                worst = max(rows * skew, rows * (1 - skew)) * 4 * 256 * world
                predicted = model.seconds("all_to_all", int(worst))
                rows_out.append((nbytes, skew, statistics.median(times[2:]), predicted))
        return rows_out if rank == 0 else None


def grouped_main(args) -> list[tuple[str, float, float]]:
    """One expert layer's grouped products (``gate_up``, the gate, ``down``) and their
    backward at the model's shapes on one rank's rows (``2·T·k`` padded rows, ``T·k``
    real ones spread evenly over ``E/2`` local experts), float32, one thread: the loop
    of ``torch.mm`` against ``torch._grouped_mm`` (allowed on CPU for the run), rounds
    alternating; (what, loop ms, kernel ms) per round's median of 10 calls."""
    from spmd.lowering import experts as X

    torch.set_num_threads(1)
    tokens, k, local = args.batch * args.seq, args.top_k, args.experts // 2
    real, bound = tokens * k, 2 * tokens * k
    offs = torch.linspace(real / local, real, local).round().long()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(bound, args.width, generator=g)
    gate_up = torch.randn(local, 2 * args.inter, args.width, generator=g)
    down = torch.randn(local, args.width, args.inter, generator=g)

    def layer(backward: bool) -> None:
        xs, gu, dn = (t.detach().requires_grad_(backward) for t in (x, gate_up, down))
        h = X.grouped_mm(xs, gu, offs, None, False, 0.5, real)
        gate, up = h.chunk(2, -1)
        y = X.grouped_mm(F.silu(gate) * up, dn, offs, None, False, 0.5, real)
        if backward:
            y.sum().backward()

    def ms(backward: bool) -> float:
        layer(backward)
        times = []
        for _ in range(10):
            start = time.perf_counter()
            layer(backward)
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    found = []
    for _ in range(args.rounds):
        for backward in (False, True):
            X._GROUPED_DTYPES.pop("cpu", None)
            loop = ms(backward)
            X._GROUPED_DTYPES["cpu"] = X.CPU_GROUPED_DTYPES
            kernel = ms(backward)
            X._GROUPED_DTYPES.pop("cpu", None)
            found.append(("forward and backward" if backward else "forward", loop, kernel))
    return found


def main() -> None:
    p = harness.parser(__doc__, steps=10, rounds=5)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--inter", type=int, default=512)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="rows per rank")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--memory", action="store_true")
    p.add_argument("--all-to-all", action="store_true")
    p.add_argument("--grouped", action="store_true")
    args = p.parse_args()
    args.variants = harness.choices(args.variants, VARIANTS, p)
    print(f"model: width {args.width}, {args.layers} layers, {args.experts} experts of "
          f"{args.inter}, top-{args.top_k}; {args.batch} x {args.seq} tokens per rank, "
          f"float32, 2 ranks")
    if args.all_to_all:
        found = harness.spawn(all_to_all_main, [1 << 16, 1 << 20, 1 << 23],
                              [0.5, 0.75, 0.95], nprocs=2)[0]
        harness.table(("bytes per rank", "share sent by rank 0", "measured ms",
                       "predicted ms", "predicted / measured"), "rrrrr")
        for nbytes, skew, measured, predicted in found:
            harness.row(f"{nbytes:,}", f"{skew:.2f}", f"{measured * 1e3:.3f}",
                        f"{predicted * 1e3:.3f}", f"{predicted / measured:.2f}")
        return
    if args.grouped:
        found = grouped_main(args)
        harness.table(("products", "loop ms", "torch._grouped_mm ms",
                       "kernel / loop (spread)"), "lrrl")
        for what in ("forward", "forward and backward"):
            mine = [(loop, kernel) for w, loop, kernel in found if w == what]
            loop = statistics.median(a for a, _ in mine)
            kernel = statistics.median(b for _, b in mine)
            ratios = [b / a for a, b in mine]
            harness.row(what, f"{loop:.2f}", f"{kernel:.2f}",
                        f"{kernel / loop:.2f} ({min(ratios):.2f}–{max(ratios):.2f})")
        return
    found = harness.spawn(rank_main, args, nprocs=2)[0]
    times = found["times"]
    harness.table(("variant", "ms/step", "vs torch EP (x faster)", "spread"), "lrrl")
    for variant, v in harness.versus(times, "torch EP").items():
        harness.row(variant, f"{v.median * 1e3:.1f}", f"{v.ratio:.2f}", v.spread)
    print("last losses:", {k: round(v, 5) for k, v in found["losses"].items()})
    print("headroom grown (times, over the run):", found["grown"])
    if args.memory:
        harness.table(("variant", "peak RSS growth, rank 0 (MiB)"), "lr")
        for variant in args.variants:
            grown = harness.spawn(memory_main, args, variant, nprocs=2)[0]
            harness.row(variant, f"{grown:.0f}")


if __name__ == "__main__":
    main()
