"""The memory view's predicted peak against the peak a real step allocates, here.

    python benchmarks/memory.py [--width 256] [--layers 4] [--length 256] [--rows 4]

A decoder of ``benchmarks/llm.py`` (float32, on CPU) under ``@spmd.parallelize`` on one
rank (``Mesh.simulated(1)``: the planned graphs, their collectives local), for each
strategy and activation-checkpointing mode: two warm-up steps (compilation, AdamW's
state), then one step (forward, backward, ``AdamW.step``, ``zero_grad``) recorded by
``torch.profiler`` with ``profile_memory=True``. Measured peak: the bytes alive when the
step starts (parameters, optimizer state, buffers, the batch) plus the highest running
sum of the step's allocations and frees as torch's allocator reported them. Predicted:
``spmd.inspect(model).memory("adamw").peak`` of the same model. Both count tensor bytes
only (no allocator slack).
"""

from __future__ import annotations

import torch

import harness
import llm


def _bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


def step_peak(step) -> int:
    """The highest running sum of the allocations and frees torch's allocator reports
    while ``step()`` runs (``torch.profiler`` with ``profile_memory=True``), in bytes: what
    the step adds at its highest to what was alive before it."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        step()
    running = peak = 0
    for _, nbytes in sorted((e.start_ns(), e.nbytes())
                            for e in prof.profiler.kineto_results.events()
                            if e.name() == "[memory]"):
        running += nbytes  # an allocation (+) or a free (-), in the allocator's order
        peak = max(peak, running)
    return peak


def measure(config: llm.Config, length: int, rows: int, strategy: str, checkpoint: str
            ) -> tuple[int, int, object]:
    """(predicted peak, measured peak, plan) of one training step, in bytes."""
    import spmd

    torch.manual_seed(0)
    model = spmd.parallelize(llm.build(config, length, checkpoint),
                             mesh=spmd.Mesh.simulated(1), strategy=strategy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, config.vocab, (rows, length), generator=g)
    y = torch.randint(0, config.vocab, (rows, length), generator=g)

    def step() -> None:
        model(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    alive = _bytes(list(model.parameters()) + list(model.buffers()) + state + [x, y])
    peak = step_peak(step)
    plan = spmd.inspect(model)
    return plan.memory("adamw").peak, alive + peak, plan


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = llm.scaled(llm.LLAMA3_8B, layers=args.layers, dim=args.width, heads=4,
                        kv_heads=2, ffn=args.width * 3, vocab=args.vocab)
    print(f"decoder: {args.layers} layers of width {args.width}, vocabulary {args.vocab}, "
          f"batch {args.rows} x {args.length}, float32, AdamW, one rank\n")
    harness.table(("strategy", "checkpointing", "predicted peak MiB", "measured peak MiB",
                   "error"), "llrrr")
    for strategy in ("ddp", "fsdp"):
        for checkpoint in ("none", "selective", "full"):
            predicted, measured, _ = measure(config, args.length, args.rows, strategy,
                                             checkpoint)
            harness.row(strategy, checkpoint, f"{predicted / 2**20:.2f}",
                        f"{measured / 2**20:.2f}", f"{(predicted - measured) / measured:+.1%}",
                        flush=True)


if __name__ == "__main__":
    main()
