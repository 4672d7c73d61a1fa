"""How long planning takes, against parameter count and the number of ranks.

    python benchmarks/planning.py [--strategy ddp|fsdp]
    python benchmarks/planning.py --llama      # Llama 3 8B and 70B shapes, 64 H100s
    python benchmarks/planning.py --long-context   # 70B at 131,072 tokens, (8, 8, 8) H100s
    python benchmarks/planning.py --pipeline  # 405B on (pp 8, fsdp 8, tp 8) H100s, 1F1B
        [--schedule 1f1b] [--microbatches 16] [--sequences 16]

``--llama``: Llama 3 8B and 70B (``benchmarks/llm.py``) built on the meta device, one
8,192-token sequence per rank, every block checkpointed, the loss inside the forward,
``fsdp`` over 64 simulated H100s with bfloat16 gathers and float32 reduction; each
planned in a fresh process (``spmd.inspect``, the summary and the memory view), whose
wall time and peak resident memory are reported.

Plans transformers of about 1, 3 and 10 million parameters for simulated meshes of 8,
64 and 1,024 ranks with ``spmd.inspect(model, tokens, mesh=Mesh.simulated(n))`` (no
process is started), and reports the wall time, the part spent in our passes, and the
number of buckets (for ddp the same for every n: only predicted communication changes).
With ``--strategy fsdp`` it also reports the plan's memory view per rank (persistent
bytes with AdamW, and the predicted peak).
"""

from __future__ import annotations

import time

import torch
import torch.nn as nn

import harness
import spmd
from spmd.lowering.state import state_of


class Transformer(nn.Module):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        layer = nn.TransformerEncoderLayer(width, 8, 4 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, 256)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)))


SIZES = {"~1M": (128, 4), "~3M": (192, 6), "~10M": (320, 8)}
RANKS = (8, 64, 1024)


_LLAMA = r"""
import resource, sys, time, torch
sys.path.insert(0, {here!r})
import llm, spmd
torch.set_num_threads(1)
config, model, tokens = llm.on_meta({name!r})
mesh = spmd.Mesh.simulated(64, hardware=spmd.hardware.H100_SXM())
start = time.perf_counter()
plan = spmd.inspect(model, tokens, tokens, mesh=mesh, strategy="fsdp",
                    param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
plan.summary()
view = plan.memory("adamw")
print(time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
      sum(p.numel() for p in model.parameters()), view.peak, len(plan.buckets),
      len(plan.collectives))
"""


def llama() -> None:
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    harness.table(("model", "parameters", "ranks", "planning s", "process peak MiB",
                   "predicted peak GiB per device", "buckets", "collectives"), "lrrrrrrr")
    for name in ("LLAMA3_8B", "LLAMA3_70B"):
        out = subprocess.run([sys.executable, "-c", _LLAMA.format(here=here, name=name)],
                             capture_output=True, text=True, check=True)
        seconds, rss, params, peak, buckets, collectives = out.stdout.split()[-6:]
        harness.row(name, f"{int(params):,}", 64, f"{float(seconds):.1f}",
                    f"{int(rss) / 1024:.0f}", f"{int(peak) / 2**30:.1f}", buckets, collectives,
                    flush=True)


_LONG = r"""
import resource, sys, time, torch
sys.path.insert(0, {here!r})
import llm, spmd
torch.set_num_threads(1)
config = llm.LLAMA3_70B
seq = 131072
with torch.device("meta"):
    model = llm.build(config, seq, "full")
tokens = torch.randint(0, config.vocab, (1, seq), device="meta")
mesh = spmd.Mesh.simulated((8, 8, 8), dim_names=("dp", "cp", "tp"),
                           hardware=spmd.hardware.H100_SXM())
start = time.perf_counter()
plan = spmd.inspect(model, tokens, tokens, mesh=mesh, strategy="fsdp",
                    placements=[spmd.tp.megatron(loss_parallel=True), spmd.cp.ring()],
                    param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
print(plan.summary())
view = plan.memory("adamw")
print(view)
print(time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


_PIPELINE = r"""
import resource, sys, time, torch
sys.path.insert(0, {here!r})
import llm, spmd
torch.set_num_threads(1)
config = llm.LLAMA3_405B
seq, microbatches, rows = 8192, {microbatches}, {rows}
with torch.device("meta"):
    model = llm.build(config, seq, "full")
tokens = torch.randint(0, config.vocab, (rows, seq), device="meta")
mesh = spmd.Mesh.simulated((8, 8, 8), dim_names=("pp", "fsdp", "tp"),
                           hardware=spmd.hardware.H100_SXM())
start = time.perf_counter()
plan = spmd.inspect(model, tokens, tokens, mesh=mesh, strategy="fsdp",
                    placements=spmd.tp.megatron(), param_dtype=torch.bfloat16,
                    reduce_dtype=torch.float32,
                    pipeline=spmd.pp.schedule({schedule!r}, microbatches))
seconds = time.perf_counter() - start
print(plan.summary())
print(plan.timeline())
tokens_per_gpu = rows * seq * 8 / plan.step_seconds / 512
print(f"tokens/s per GPU {{tokens_per_gpu:.1f}}")
print(f"planned in {{seconds:.1f}} s, process peak "
      f"{{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f}} MiB")
"""


def pipeline(schedule: str, microbatches: int, rows: int) -> None:
    """Llama 3 405B (126 blocks, each checkpointed) on (pp 8, fsdp 8, tp 8) simulated
    H100s: ``rows`` 8,192-token sequences per data rank in ``microbatches`` microbatches,
    bfloat16 gathers and float32 reduction; the pipeline plan's stages, timeline and
    bubble, memory per stage, and the planning time and process peak (or the stage that
    does not fit)."""
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run([sys.executable, "-c", _PIPELINE.format(
        here=here, schedule=schedule, microbatches=microbatches, rows=rows)],
        capture_output=True, text=True)
    print(out.stdout)
    if out.returncode:
        print(out.stderr.strip().splitlines()[-1])


def long_context() -> None:
    """Llama 3 70B at 131,072 tokens on (dp 8, cp 8, tp 8) simulated H100s: the plan's
    summary and memory view, the planning time and the process's peak memory."""
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run([sys.executable, "-c", _LONG.format(here=here)],
                         capture_output=True, text=True, check=True)
    print(out.stdout)


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp")
    parser.add_argument("--llama", action="store_true")
    parser.add_argument("--long-context", action="store_true")
    parser.add_argument("--pipeline", action="store_true")
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument("--sequences", type=int, default=None,
                        help="sequences per data rank (default: one per microbatch)")
    args = parser.parse_args()
    if args.pipeline:
        pipeline(args.schedule, args.microbatches, args.sequences or args.microbatches)
        return
    if args.llama:
        llama()
        return
    if args.long_context:
        long_context()
        return
    strategy = args.strategy
    torch.set_num_threads(1)
    tokens = torch.randint(0, 256, (4, 32))
    memory = ("persistent MiB", "predicted peak MiB") if strategy == "fsdp" else ()
    harness.table(("model", "parameters", "ranks", "planning s", "in passes s", "buckets",
                   "predicted comm ms", *memory), "lrrrrrr" + "r" * len(memory))
    for label, (width, layers) in SIZES.items():
        torch.manual_seed(0)
        model = Transformer(width, layers)
        params = sum(p.numel() for p in model.parameters())
        for n in RANKS:
            start = time.perf_counter()
            plan = spmd.inspect(model, tokens, mesh=spmd.Mesh.simulated(n),
                                strategy=strategy)
            elapsed = time.perf_counter() - start
            passes = sum(sum(state_of(gm).pass_seconds.values())
                         for gm in plan.graphs.values())
            extra = ()
            if strategy == "fsdp":
                view = plan.memory("adamw")
                extra = (f"{view.persistent / 2**20:.2f}", f"{view.peak / 2**20:.2f}")
            harness.row(label, f"{params:,}", n, f"{elapsed:.2f}", f"{passes:.3f}",
                        len(plan.buckets),
                        f"{plan.predicted_communication_seconds() * 1e3:.1f}", *extra)


if __name__ == "__main__":
    main()
