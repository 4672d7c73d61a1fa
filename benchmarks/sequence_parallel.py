"""Sequence parallelism: step time and peak memory of ``spmd.tp.megatron(
sequence_parallel=True)`` against spmd's plain tensor parallelism and torch's
``parallelize_module`` with and without ``SequenceParallel``, same run.

    python benchmarks/sequence_parallel.py [--steps 10] [--rounds 5] [--layers 4]
                                           [--width 256] [--heads 8] [--seq 512] [--batch 4]
                                           [--vocab 256]

Two local ranks (processes), one thread each, Gloo over loopback, one tensor-parallel
group; ``benchmarks/tp.py``'s pre-norm transformer (separate q/k/v/o, causal SDPA, GELU
MLP 4x, LayerNorms) with the same weights, batches and AdamW for every variant:

- ``spmd tp`` / ``spmd tp+sp`` / ``spmd tp+sp+vp``: ``spmd.parallelize(model,
  mesh=Mesh((2,), ("tp",)), placements=spmd.tp.megatron(sequence_parallel=...,
  vocab_parallel=...))``;
- ``spmd tp+sp+vp+lp``: the same with ``loss_parallel=True`` on the model with its
  cross-entropy inside (the head split along the vocabulary, the logits never gathered);
- ``torch TP``: ``ColwiseParallel`` q, k, v, linear1 and ``RowwiseParallel`` o, linear2
  in every block;
- ``torch TP+SP``: torchtitan's plan for this layout: ``SequenceParallel`` on every norm,
  the column-parallel layers taking ``Shard(1)`` input (each gathers it: the block has no
  attention module to gather once for q, k and v), the row-parallel ones giving
  ``Shard(1)`` output (a reduce-scatter), the embedding ``RowwiseParallel`` (vocabulary-
  parallel, output ``Shard(1)``), the head ``ColwiseParallel`` from ``Shard(1)`` to whole
  logits;
- ``torch TP+SP+lp``: the same, the head's logits left split (``use_local_output=False``)
  and the cross-entropy and its backward under ``loss_parallel()``.

Time: variants alternate in rounds; round 0 warms up (compiles) and is not counted; a
variant's figure is the median of its rounds' mean step times, with the lowest and
highest round. Memory: after the rounds, one more step of each variant on rank 0 under
``torch.profiler(profile_memory=True)``: the highest running sum of the step's
allocations and frees (what the step adds to what was alive before it: activations,
gradients, temporaries). spmd's plans also give the predicted saved activations
(``plan.memory().activations``). The step-0 losses of all variants are printed to show
they train the same model.
"""

from __future__ import annotations

import statistics

import torch

import harness
import tp
from memory import step_peak
from tp import SPLIT, _batch, _fresh, _train, alternate

COLUMN, ROW = SPLIT["encoder"]  # tp.py's model: q/k/v/linear1 by columns, o/linear2 by rows

VARIANTS = ("spmd tp", "spmd tp+sp", "spmd tp+sp+vp", "spmd tp+sp+vp+lp", "torch TP",
            "torch TP+SP", "torch TP+SP+lp")


class WithLoss(torch.nn.Module):
    """The model with its cross-entropy inside (as a Hugging Face model given labels):
    what loss parallelism needs to keep the logits split."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.model(x).flatten(0, 1), y.flatten())


def _train_inside(model, opt, batches) -> list[torch.Tensor]:
    losses = []
    for x, y in batches:
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _train_torch_lp(model, opt, batches) -> list[torch.Tensor]:
    from torch.distributed.tensor.parallel import loss_parallel

    losses = []
    for x, y in batches:
        with loss_parallel():
            loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().full_tensor())
    return losses


def rank_main(rank: int, steps: int, rounds: int, width: int, heads: int, layers: int,
              seq: int, batch: int, vocab: int) -> dict | None:
    import torch.distributed as tdist
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    import spmd

    tp.VOCAB = vocab  # (the model's and the batches')
    with harness.group(rank, timeout_s=900):
        mesh = spmd.Mesh((2,), dim_names=("tp",))
        torch_mesh = mesh.to_torch()

        def torch_tp(sequence_parallel: bool, loss_par: bool = False):
            model = _fresh(width, heads, layers)
            if not sequence_parallel:
                plan = {**{n: ColwiseParallel() for n in COLUMN},
                        **{n: RowwiseParallel() for n in ROW}}
                for block in model.layers:
                    parallelize_module(block, torch_mesh, plan)
                return model
            parallelize_module(model, torch_mesh, {
                "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                "norm": SequenceParallel(),
                "head": ColwiseParallel(input_layouts=Shard(1), use_local_output=False)
                if loss_par else ColwiseParallel(input_layouts=Shard(1),
                                                 output_layouts=Replicate())})
            plan = {"norm1": SequenceParallel(), "norm2": SequenceParallel(),
                    **{n: ColwiseParallel(input_layouts=Shard(1)) for n in COLUMN},
                    **{n: RowwiseParallel(output_layouts=Shard(1)) for n in ROW}}
            for block in model.layers:
                parallelize_module(block, torch_mesh, plan)
            return model

        def ours(sequence_parallel: bool, vocab_parallel: bool = False, loss_par: bool = False):
            model = _fresh(width, heads, layers)
            return spmd.parallelize(WithLoss(model) if loss_par else model, mesh=mesh,
                                    placements=spmd.tp.megatron(
                                        sequence_parallel=sequence_parallel,
                                        vocab_parallel=vocab_parallel, loss_parallel=loss_par))

        make = {"spmd tp": lambda: ours(False), "spmd tp+sp": lambda: ours(True),
                "spmd tp+sp+vp": lambda: ours(True, True),
                "spmd tp+sp+vp+lp": lambda: ours(True, True, True),
                "torch TP": lambda: torch_tp(False), "torch TP+SP": lambda: torch_tp(True),
                "torch TP+SP+lp": lambda: torch_tp(True, True)}
        trains = {"spmd tp+sp+vp+lp": _train_inside, "torch TP+SP+lp": _train_torch_lp}
        batches = [_batch(step, batch, seq) for step in range(steps)]
        models = {v: make[v]() for v in VARIANTS}
        opts = {v: torch.optim.AdamW(m.parameters(), lr=1e-3) for v, m in models.items()}
        times, first_loss, _ = alternate(models, opts, batches, rounds, tdist.barrier,
                                         trains=trains)
        peaks = {}
        for variant, model in models.items():
            tdist.barrier()
            train = trains.get(variant, _train)
            peaks[variant] = step_peak(lambda: train(model, opts[variant], batches[:1]))
        predicted = {v: spmd.inspect(models[v]).memory().activations
                     for v in ("spmd tp", "spmd tp+sp")}
        tdist.barrier()
        if rank:
            return None
        return {"times": times, "loss": first_loss, "peak": peaks, "predicted": predicted}


def main() -> None:
    parser = harness.parser(__doc__, steps=10, rounds=5)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    args = parser.parse_args()
    res = harness.spawn(rank_main, args.steps, args.rounds, args.width, args.heads,
                        args.layers, args.seq, args.batch, args.vocab, timeout=3000)[0]
    times, peak = res["times"], res["peak"]
    base = statistics.median(times["torch TP+SP"])
    print(f"\n### 2 ranks, tp=2: {args.layers} layers of width {args.width}, {args.heads} "
          f"heads, vocabulary {args.vocab}, {args.batch} x {args.seq} tokens, AdamW, "
          f"{args.steps} steps x "
          f"{args.rounds} rounds\n")
    harness.table(("variant", "step ms (median)", "rounds min-max", "torch TP+SP / variant",
                   "step peak MiB (rank 0)", "step-0 loss"), "lrrrrr")
    for v in VARIANTS:
        med = statistics.median(times[v])
        harness.row(v, f"{med * 1e3:.1f}", harness.span([t * 1e3 for t in times[v]], ".1f", "-"),
                    f"{base / med:.2f}x", f"{peak[v] / 2**20:.1f}", f"{res['loss'][v]:.6f}")
    pred = res["predicted"]
    print(f"\npredicted saved activations per rank: spmd tp {pred['spmd tp'] / 2**20:.1f} "
          f"MiB, spmd tp+sp {pred['spmd tp+sp'] / 2**20:.1f} MiB "
          f"({pred['spmd tp+sp'] / pred['spmd tp'] - 1:+.0%})")


if __name__ == "__main__":
    main()
