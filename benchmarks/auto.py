"""``strategy="auto"`` against the hand-written strategies it chooses among.

    python benchmarks/auto.py [--rounds 5] [--steps 5]     # measured: 2 ranks, Gloo
    python benchmarks/auto.py --simulated                  # Llama 3 8B and 70B, H100s

Measured (this machine): for three models (an MLP, a pre-norm transformer, a LLaMA-style
decoder with grouped-query attention and SwiGLU), float32, AdamW, two ranks over Gloo,
one thread each. The budget is ddp's predicted peak less one byte, so plain ddp does not
fit. Variants: ``auto`` (``spmd.parallelize(model, strategy="auto",
memory_budget=budget)``) and every hand-written strategy whose predicted peak fits
(``fsdp``, ``zero2``, ``zero1``), each a fresh model from the same weights. They
alternate in rounds, the order rotated each round; round 0 warms up (compiles, and
auto's search and measurement of its finalists) and is not counted.
A variant's figure is the median over rounds of its mean step time, with the lowest and
highest round; the ratio is auto's median over the best hand-written one's.

``--simulated``: Llama 3 8B on (8, 8) and 70B on (8, 16) simulated H100s (one
8,192-token sequence per rank when every dimension splits the batch, every block
checkpointed as written, bfloat16 gathers, float32 reduction), each in a fresh process:
``spmd.inspect(..., strategy="auto")`` under the device's memory; the candidates'
predicted step, tokens/s per GPU and peak, the integer programs' solve time and the
whole search's wall time.
"""

from __future__ import annotations

import os
import statistics
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import harness

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FAMILIES = ("mlp", "transformer", "llama")
HAND = ("fsdp", "zero2", "zero1")


class MLP(nn.Module):
    def __init__(self, width: int = 1024, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.out = nn.Linear(width, 16)

    def forward(self, x):
        for layer in self.layers:
            x = F.relu(layer(x))
        return self.out(x)


def build(family: str) -> nn.Module:
    torch.manual_seed(0)
    if family == "mlp":
        return MLP()
    if family == "transformer":
        from tests.models import Transformer

        return Transformer(layers=4, dim=256, vocab=512)
    from tests.llama import Llama

    return Llama(vocab=512, dim=256, layers=4, heads=8, kv_heads=4, hidden=704, length=64)


def batch(family: str, step: int, rows: int = 8):
    g = torch.Generator().manual_seed(step)
    if family == "mlp":
        return torch.randn(rows, 1024, generator=g), torch.randn(rows, 16, generator=g)
    seq = torch.randint(0, 512, (rows, 65), generator=g)
    return seq[:, :-1], seq[:, 1:]


def loss_of(family: str, out, y):
    if family == "mlp":
        return F.mse_loss(out, y)
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def job(rank: int, family: str, rounds: int, steps: int) -> dict:
    import spmd
    import spmd.runtime as dist

    with harness.group(rank, timeout_s=300):
        x0, _ = batch(family, 0)
        mesh = spmd.Mesh.simulated(2)
        peaks = {s: spmd.inspect(build(family), x0, mesh=mesh, strategy=s).memory().peak
                 for s in ("ddp",) + HAND}
        budget = peaks["ddp"] - 1
        variants = {"auto": dict(strategy="auto", memory_budget=budget)}
        variants.update({s: dict(strategy=s) for s in HAND if peaks[s] <= budget})
        runs = {}
        for name, kwargs in variants.items():
            model = spmd.parallelize(build(family), **kwargs)
            runs[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        def train(model, opt):
            for s in range(steps):
                x, y = batch(family, s)
                loss_of(family, model(x), y).backward()
                opt.step()
                opt.zero_grad()

        times = harness.alternate({name: (lambda run=run: train(*run))
                                   for name, run in runs.items()},
                                  rounds, barrier=dist.barrier, per=steps,
                                  order=harness.rotated).times
        chosen = spmd.inspect(runs["auto"][0]).auto.runs
        return {"times": times, "budget": budget, "peaks": peaks, "chosen": chosen}


def measured(rounds: int, steps: int) -> None:
    harness.table(("model", "budget", "auto chose", "auto ms", "best hand-written", "its ms",
                   "auto / best (low-high rounds)"), "lrlrlrr")
    for family in FAMILIES:
        out = harness.spawn(job, family, rounds, steps, start_method="forkserver",
                            timeout=1200)[0]
        med = {n: statistics.median(t) for n, t in out["times"].items()}
        hand = [n for n in med if n != "auto"]
        best = min(hand, key=med.get)
        ratios = harness.ratios(out["times"]["auto"], out["times"][best])
        harness.row(family, f"{out['budget'] / 2**20:.2f} MiB", out["chosen"],
                    f"{med['auto'] * 1e3:.2f}", best, f"{med[best] * 1e3:.2f}",
                    f"{med['auto'] / med[best]:.3f} ({harness.span(ratios, '.3f', '-')})",
                    flush=True)
        for name in hand:
            print(f"|  | | {name}: {med[name] * 1e3:.2f} ms | | | | |")


_SIMULATED = r"""
import resource, sys, time, torch
sys.path.insert(0, {here!r})
import llm, spmd
torch.set_num_threads(1)
config, model, tokens = llm.on_meta({name!r})
mesh = spmd.Mesh.simulated({shape!r}, ("a", "b"), hardware=spmd.hardware.H100_SXM())
start = time.perf_counter()
plan = spmd.inspect(model, tokens, tokens, mesh=mesh, strategy="auto",
                    param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
seconds = time.perf_counter() - start
auto = plan.auto
world = mesh.size()
print(auto)
print("ROWS")
for c in auto.candidates:
    if c.error:
        print(f"| {{c.label}} | not plannable | | | |")
        continue
    tokens_per_step = 8192 * world  # the same global batch for every layout
    print(f"| {{c.label}} | {{c.seconds:.3f}} | {{tokens_per_step / c.seconds / world:,.0f}} | "
          f"{{c.peak / 2**30:.1f}} | {{'chosen' if c is auto.chosen else ('fits' if c.fits(auto.budget) else 'over')}} |")
print(f"search {{seconds:.1f}} s, programs {{auto.solve_seconds:.2f}} s, process peak "
      f"{{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f}} MiB")
"""


def simulated() -> None:
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    for name, shape in (("LLAMA3_8B", (8, 8)), ("LLAMA3_70B", (8, 16))):
        print(f"\n{name} on {shape} H100s", flush=True)
        out = subprocess.run([sys.executable, "-c", _SIMULATED.format(
            here=here, name=name, shape=shape)], capture_output=True, text=True)
        if out.returncode:
            print(out.stderr[-3000:])
            continue
        print(out.stdout, flush=True)


def main() -> None:
    parser = harness.parser(__doc__, steps=5, rounds=5)
    parser.add_argument("--simulated", action="store_true")
    args = parser.parse_args()
    if args.simulated:
        simulated()
    else:
        measured(args.rounds, args.steps)


if __name__ == "__main__":
    main()
