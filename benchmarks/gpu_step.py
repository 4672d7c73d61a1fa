"""A compiled training step on the GPU against the plan's prediction for that card.

    python benchmarks/gpu_step.py [--layers 8] [--width 1024] [--rows 8] [--length 1024]
                                  [--steps 20] [--strategies ddp,fsdp,zero1,zero2]

One GPU, one rank: each strategy runs on ``Mesh.simulated(1)`` (its graphs are the ones
planned for more ranks, their collectives local copies), Inductor compiling the compute
(the planner's choice for CUDA tensors), AdamW. Measured: the median step time over
``--steps`` steps after two warm-up steps (``torch.cuda.synchronize`` around each), and
``torch.cuda.max_memory_allocated`` over those steps. Predicted: ``spmd.inspect`` of the
same model and batch on ``Mesh.simulated(1, hardware=<the card's preset>)``: the
predicted timeline's step time (roofline compute of every graph) and
``plan.memory("adamw").peak`` (the roofline with Inductor's fusion of memory-bound
chains, as the measured run compiles). The model is ``benchmarks/fsdp.py``'s transformer
(embedding, pre-norm encoder layers, head) in float32. Prints a markdown table.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

import fsdp as bench
import harness


def _preset(name: str):
    from spmd import hardware

    if "H200" in name:
        return hardware.H200()
    if "A100" in name:
        return hardware.A100_80GB()
    return hardware.H100_SXM()


def timed(step, steps: int, warmup: int) -> tuple[float, int]:
    """(median seconds, peak bytes allocated) of ``steps`` calls of ``step`` after
    ``warmup`` more, each between two ``torch.cuda.synchronize``."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), torch.cuda.max_memory_allocated()


def main() -> None:
    parser = harness.parser(__doc__, steps=20)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--strategies", default="ddp,fsdp,zero1,zero2")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_step.py: needs CUDA")
    import spmd

    bench.ROWS, bench.LENGTH = args.rows, args.length
    bench.VOCAB = 32000
    card = torch.cuda.get_device_name()
    preset = _preset(card)
    x, y = (t.cuda() for t in bench._batch(0, 0))
    print(f"\n### {card}: {args.layers} layers of width {args.width}, batch {args.rows} x "
          f"{args.length} tokens, float32, AdamW; preset {preset.name}\n")
    harness.table(("strategy", "measured ms/step", "predicted ms/step", "time error",
                   "measured peak GiB", "predicted peak GiB", "memory error"), "lrrrrrr")
    gib = 2**30
    for strategy in args.strategies.split(","):
        torch.cuda.empty_cache()
        model = spmd.parallelize(bench._fresh(args.width, args.layers).cuda(),
                                 mesh=spmd.Mesh.simulated(1), strategy=strategy)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(model=model, opt=opt) -> None:
            F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
            opt.step()
            opt.zero_grad()

        measured, peak = timed(step, args.steps, warmup=2)
        del model, opt, step
        torch.cuda.empty_cache()
        plan = spmd.inspect(bench._fresh(args.width, args.layers).cuda(), x,
                            mesh=spmd.Mesh.simulated(1, hardware=preset), strategy=strategy)
        predicted = plan.predicted_timeline().step_seconds
        memory = plan.memory("adamw").peak
        harness.row(strategy, f"{measured * 1e3:.2f}", f"{predicted * 1e3:.2f}",
                    f"{(predicted - measured) / measured:+.0%}", f"{peak / gib:.2f}",
                    f"{memory / gib:.2f}", f"{(memory - peak) / peak:+.0%}", flush=True)


if __name__ == "__main__":
    main()
