"""A ~1B Llama-style training step on one GPU against the plan's prediction for that card.

    python benchmarks/gpu_llama.py [--layers 16] [--width 2048] [--rows 4] [--length 2048]
                                   [--steps 10] [--profile out.json]

The model is Llama 3.2 1B's shape (``benchmarks/llm.py``: 16 layers of width 2,048, 32
query and 8 key/value heads, SwiGLU 8,192, vocabulary 128,256), in bfloat16, the loss
inside the forward, under ``@spmd.parallelize`` on ``Mesh.simulated(1)`` (world size 1,
Inductor compiling the step, as the planner picks for CUDA tensors), AdamW (fused) with
gradient clipping. Measured: the median step over ``--steps`` after three warm-up steps
(``torch.cuda.synchronize`` around each) and ``torch.cuda.max_memory_allocated``.
Predicted: the same model built on the meta device, planned by ``spmd.inspect`` on
``Mesh.simulated(1, hardware=<the card's preset>)``: the timeline's step (fused
memory-bound chains, attention as the fused kernel, AdamW and clipping) and
``plan.memory("adamw").peak``. ``--profile`` also records profiled steps and writes what
``spmd.hardware.fit`` needs to fit the card's efficiency. Prints a markdown table.
"""

from __future__ import annotations

import torch

import harness
import llm
from gpu_step import _preset, timed  # the card's preset; the timed loop


def main() -> None:
    parser = harness.parser(__doc__, steps=10)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--profile", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_llama.py: needs CUDA")
    import spmd

    config = llm.scaled(llm.LLAMA3_8B, layers=args.layers, dim=args.width, heads=32,
                        kv_heads=8, ffn=4 * args.width)
    card = torch.cuda.get_device_name()
    preset = _preset(card)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, config.vocab, (args.rows, args.length), generator=g)
    y = torch.randint(0, config.vocab, (args.rows, args.length), generator=g)
    with torch.device("cuda"):
        model = llm.build(config, args.length).to(torch.bfloat16)
    model = spmd.parallelize(model, mesh=spmd.Mesh.simulated(1), strategy="ddp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    xs, ys = x.cuda(), y.cuda()

    def step(model=model, opt=opt) -> None:
        model(xs, ys).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    measured, peak = timed(step, args.steps, warmup=3)
    if args.profile:
        spmd.profile(model, steps=3)
        for _ in range(3):
            step()
        spmd.inspect(model).save_profile(args.profile)
    del model, opt, step
    torch.cuda.empty_cache()
    with torch.device("meta"):
        meta = llm.build(config, args.length).to(torch.bfloat16)
    plan = spmd.inspect(meta, x.to("meta"), y.to("meta"),
                        mesh=spmd.Mesh.simulated(1, hardware=preset), strategy="ddp")
    predicted = plan.predicted_timeline(optimizer="adamw", clip_grad_norm=True).step_seconds
    memory = plan.memory("adamw").peak
    params = sum(p.numel() for p in meta.parameters())
    gib = 2**30
    print(f"\n### {card}: Llama-style {params / 1e9:.2f}B, bfloat16, batch {args.rows} x "
          f"{args.length}, AdamW + clipping, Inductor; preset {preset.name}\n")
    harness.table(("measured ms/step", "predicted ms/step", "time error", "measured peak GiB",
                   "predicted peak GiB", "memory error"), "rrrrrr")
    harness.row(f"{measured * 1e3:.1f}", f"{predicted * 1e3:.1f}",
                f"{(predicted - measured) / measured:+.0%}", f"{peak / gib:.2f}",
                f"{memory / gib:.2f}", f"{(memory - peak) / peak:+.0%}")
    print("\n" + plan.summary().split("\n\n")[0])
    if args.profile:
        fitted = spmd.hardware.fit(args.profile, preset)
        print(f"\nfitted compute efficiency: {fitted.device.efficiency:.1%}")


if __name__ == "__main__":
    main()
