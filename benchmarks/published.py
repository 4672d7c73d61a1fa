"""Predicted against published: tokens/s per GPU of large training runs others measured.

    python benchmarks/published.py [--runs M3,T2,...] [--no-calibration]

Each run is rebuilt at its published shape on the meta device (``benchmarks/llm.py``:
layers, width, heads, key/value heads, feed-forward, vocabulary; the loss inside the
forward; activation checkpointing as the run had it), planned by ``spmd.inspect`` on
``Mesh.simulated`` with the run's GPU count and parallelism and the preset of its GPU
(``spmd.hardware``), parameters float32 gathered in bfloat16 and reduced in float32 (the
mixed precision of FSDP and of Megatron's distributed optimizer), FP8 runs with matrix
products priced at the FP8 peak. A compiled run (torch.compile; NeMo's Transformer
Engine, whose kernels fuse the same chains) is priced with memory-bound chains fused, an
eager one node by node. The predicted time of one optimizer step is the run's
micro-batches (``GA`` of them: the data-parallel gradient reduction every micro-batch for
FSDP, once per step for Megatron's distributed optimizer) plus the AdamW step and
gradient clipping; tokens/s per GPU is the step's tokens over the step time and the
GPUs. The "predicted" column fits nothing to these runs: every efficiency is the
preset's sourced figure (``plan.summary()`` lists them). The "calibrated" column is
labelled as what it is: one run per GPU (``--calibrate-on``, M3 for H100, M10 for A100)
fits a single factor on every node's compute time, and that GPU's other runs are
predicted with it (held out: their own figures fit nothing).

Sources (the rows quote them; ``/tmp/scratch``-free, all public):

- **M** MosaicML llm-foundry, ``scripts/train/benchmarking/README.md`` (commit 061f2c7c):
  MPT models, FSDP full shard only, ``amp_bf16``, no torch.compile.
- **T** torchtitan ``docs/performance.md`` (commit eaea6f6a) and its older revision
  (commit 04133643, the A100 rows): Llama 3 with FSDP2 (and TP), sequence 8,192 (the
  configs' default). The H100 rows ran on Grand Teton H100s, 96 GB HBM2e at a 500 W
  limit: slower than the SXM5 700 W preset here.
- **N** NVIDIA NeMo ``docs/source/performance/performance_summary.md`` (commit
  070a0bb1, NeMo 24.07, DGX H100): Megatron-Core, distributed optimizer, FP8.
"""

from __future__ import annotations

import dataclasses
import resource
import statistics
import time
from dataclasses import dataclass

import torch

import harness
import llm


@dataclass(frozen=True, kw_only=True)
class Run:
    key: str
    source: str
    config: llm.Config
    gpu: str  # spmd.hardware preset
    network_gbps: float
    gpus: int
    tp: int
    strategy: str
    length: int
    micro_batch: int  # sequences per data-parallel rank per micro-batch
    accumulation: int
    fp8: bool
    compiled: bool
    checkpoint: str
    published: float  # tokens/s per GPU
    row: str  # the published row, as printed there

    @property
    def reduce_once(self) -> bool:
        """Megatron's distributed optimizer reduces gradients once per step; FSDP every
        micro-batch."""
        return self.strategy == "zero1"


RUNS = [
    Run(key="M3", source="llm-foundry", config=llm.MPT_7B, gpu="H100_SXM", network_gbps=400,
        gpus=8, tp=1, strategy="fsdp", length=2048, micro_batch=6, accumulation=1,
        fp8=False, compiled=False, checkpoint="none", published=10643,
        row="7b 2048 8 h100_80gb bf16 FSDP, MFU 46.44%, micro 6, global 48, 10643 tok/s/GPU"),
    Run(key="M5", source="llm-foundry", config=llm.MPT_13B, gpu="H100_SXM", network_gbps=400,
        gpus=64, tp=1, strategy="fsdp", length=2048, micro_batch=2, accumulation=1,
        fp8=False, compiled=False, checkpoint="none", published=4800,
        row="13b 2048 64 h100_80gb bf16 FSDP, MFU 39.86%, micro 2, global 128, 4800 tok/s/GPU"),
    Run(key="M7", source="llm-foundry", config=llm.MPT_70B, gpu="H100_SXM", network_gbps=400,
        gpus=64, tp=1, strategy="fsdp", length=2048, micro_batch=8, accumulation=4,
        fp8=False, compiled=False, checkpoint="full", published=1039,
        row="70b 2048 64 h100_80gb bf16 FSDP, activation checkpointing, MFU 42.57%, "
            "micro 8, global 2048, 1039 tok/s/GPU"),
    Run(key="M10", source="llm-foundry", config=llm.MPT_7B, gpu="A100_80GB",
        network_gbps=200, gpus=8, tp=1, strategy="fsdp", length=2048, micro_batch=6,
        accumulation=2, fp8=False, compiled=False, checkpoint="none", published=4641,
        row="7b 2048 8 a100_80gb bf16 FSDP, MFU 64.23%, micro 6, global 96, 4641 tok/s/GPU"),
    Run(key="T2", source="torchtitan", config=llm.LLAMA3_8B, gpu="H100_SXM", network_gbps=400,
        gpus=128, tp=1, strategy="fsdp", length=8192, micro_batch=2, accumulation=1,
        fp8=False, compiled=False, checkpoint="selective", published=5605,
        row="Llama 3.1 8B, 128 H100, FSDP, bf16, selective AC, local batch 2: 5605 wps"),
    Run(key="T3", source="torchtitan", config=llm.LLAMA3_70B, gpu="H100_SXM",
        network_gbps=400, gpus=256, tp=8, strategy="fsdp", length=8192, micro_batch=16,
        accumulation=1, fp8=True, compiled=True, checkpoint="full", published=829,
        row="Llama 3.1 70B, 256 H100, FSDP 32 x TP 8, Float8, compile, full AC, local "
            "batch 16: 829 wps (torchtitan's TP shards the sequence between the split "
            "layers; spmd has no sequence parallelism yet, so this plan holds whole "
            "activations and its memory is not the run's)"),
    Run(key="T6", source="torchtitan", config=llm.LLAMA3_70B, gpu="A100_80GB",
        network_gbps=200, gpus=64, tp=1, strategy="fsdp", length=8192, micro_batch=1,
        accumulation=1, fp8=False, compiled=False, checkpoint="full", published=331,
        row="Llama 3 70B, 64 A100 80GB, FSDP, bf16, full AC, batch 1: 331 wps, MFU 51.7%"),
    Run(key="N1", source="NeMo 24.07", config=llm.GPT3_5B, gpu="H100_SXM", network_gbps=400,
        gpus=64, tp=1, strategy="zero1", length=2048, micro_batch=4, accumulation=8,
        fp8=True, compiled=True, checkpoint="none", published=22521,
        row="GPT3-5B, 64 H100, FP8, TP 1, PP 1, MBS 4, GBS 2048: 22521 tokens/s/GPU"),
    Run(key="N2", source="NeMo 24.07", config=llm.GPT3_20B, gpu="H100_SXM", network_gbps=400,
        gpus=64, tp=2, strategy="zero1", length=2048, micro_batch=2, accumulation=4,
        fp8=True, compiled=True, checkpoint="none", published=5851,
        row="GPT3-20B, 64 H100, FP8, TP 2, PP 1, MBS 2, GBS 256: 5851 tokens/s/GPU"),
]


def _step(run: Run, plan, timeline, scale: float = 1.0) -> float:
    """One optimizer step of ``run``: its micro-batches and the optimizer."""
    micro = timeline.step_seconds - timeline.optimizer_seconds
    compute = sum(f + b for f, b in plan.compute.values()) * scale
    if run.reduce_once:
        return (run.accumulation - 1) * compute + micro + timeline.optimizer_seconds
    return run.accumulation * micro + timeline.optimizer_seconds


def scaled(run: Run, plan, factor: float) -> float:
    """Predicted tokens/s per GPU of ``run`` with the compute ``factor`` times as long
    (``compute_scale``: the timeline replayed, so what communication hides changes)."""
    timeline = plan.predicted_timeline(optimizer="adamw", clip_grad_norm=True,
                                       compute_scale=factor)
    return (run.micro_batch * run.length * run.accumulation / run.tp
            / _step(run, plan, timeline, factor))


def calibrate(run: Run, plan) -> float:
    """The compute factor at which ``run``'s prediction equals its published figure (as
    ``spmd.hardware.fit_step`` solves it for one step; here over the run's
    accumulation)."""
    low, high = 0.25, 4.0
    for _ in range(40):
        mid = (low * high) ** 0.5
        if scaled(run, plan, mid) > run.published:
            low = mid
        else:
            high = mid
    return (low * high) ** 0.5


def predict(run: Run) -> dict:
    """Plan ``run`` and return its predicted tokens/s per GPU, with what went into it."""
    import spmd

    hardware = getattr(spmd.hardware, run.gpu)(nodes_of=8, network_gbps=run.network_gbps)
    if run.fp8:
        hardware = dataclasses.replace(hardware, device=dataclasses.replace(
            hardware.device, matmul_dtype="float8_e4m3fn"))
    dp = run.gpus // run.tp
    if run.tp > 1:
        mesh = spmd.Mesh.simulated((dp, run.tp), dim_names=("dp", "tp"), hardware=hardware)
        extra = dict(placements=spmd.tp.megatron())
    else:
        mesh = spmd.Mesh.simulated(dp, hardware=hardware)
        extra = {}
    with torch.device("meta"):
        model = llm.build(run.config, run.length, run.checkpoint)
    tokens = torch.randint(0, run.config.vocab, (run.micro_batch, run.length), device="meta")
    start = time.perf_counter()
    plan = spmd.inspect(model, tokens, tokens, mesh=mesh, strategy=run.strategy,
                        param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                        compile_compute=run.compiled, **extra)
    timeline = plan.predicted_timeline(optimizer="adamw", clip_grad_norm=True)
    planning = time.perf_counter() - start
    compute = sum(f + b for f, b in plan.compute.values())
    step = _step(run, plan, timeline)
    tokens_per_gpu = run.micro_batch * run.length * run.accumulation / run.tp
    flops = spmd.plan.roofline.step_flops(plan.graphs, hardware.device)
    tflops = flops.model * run.accumulation / step / 1e12  # model TFLOP/s per GPU
    memory = plan.memory("adamw")
    return {"predicted": tokens_per_gpu / step, "step": step, "planning": planning,
            "compute": compute, "exposed": timeline.exposed_seconds, "tflops": tflops,
            "peak": memory.peak, "fits": memory.fits, "plan": plan}


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--runs", default=",".join(r.key for r in RUNS))
    parser.add_argument("--summary", action="store_true", help="print each plan's summary")
    parser.add_argument("--calibrate-on", default="M3,M10",
                        help="runs whose published figure fits a compute factor for their "
                             "GPU, applied to that GPU's other runs ('' for none)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    wanted = args.runs.split(",")
    unknown = set(wanted) - {r.key for r in RUNS}
    if unknown:
        raise SystemExit(f"unknown run(s) {sorted(unknown)}; known: {[r.key for r in RUNS]}")
    calibrators = [k for k in args.calibrate_on.split(",") if k]
    harness.table(("run", "model", "GPUs", "parallelism", "seq x micro x GA", "precision",
                   "published tok/s/GPU", "predicted", "error",
                   "predicted model TFLOP/s per GPU", "exposed comm", "peak memory",
                   "planning s", "calibrated", "error"), "llrlllrrrrrrrrr")
    errors, held_out, factors = [], [], {}
    for run in RUNS:
        if run.key not in wanted:
            continue
        got = predict(run)
        error = (got["predicted"] - run.published) / run.published
        errors.append(error)
        if run.key in calibrators:
            factors[run.gpu] = (run.key, calibrate(run, got["plan"]))
            calibrated = (f"fits {factors[run.gpu][1]:.2f}x compute", "-")
        elif run.gpu in factors:
            tok = scaled(run, got["plan"], factors[run.gpu][1])
            held_out.append((tok - run.published) / run.published)
            calibrated = (f"{tok:,.0f}", f"{held_out[-1]:+.0%}")
        else:
            calibrated = ("-", "-")
        par = (f"{run.strategy} {run.gpus // run.tp}" + (f" x tp {run.tp}" if run.tp > 1 else ""))
        prec = ("fp8" if run.fp8 else "bf16") + (", compiled" if run.compiled else "") + (
            f", AC {run.checkpoint}" if run.checkpoint != "none" else "")
        harness.row(f"{run.key} ({run.source})", run.config.name, f"{run.gpus} x {run.gpu}",
                    par, f"{run.length} x {run.micro_batch} x {run.accumulation}", prec,
                    f"{run.published:,.0f}", f"{got['predicted']:,.0f}", f"{error:+.0%}",
                    f"{got['tflops']:.0f}", f"{got['exposed'] * 1e3:.0f} ms",
                    f"{got['peak'] / 2**30:.1f} GiB{'' if got['fits'] else ' (does not fit)'}",
                    f"{got['planning']:.1f}", *calibrated, flush=True)
        if args.summary:
            print(got["plan"].summary())
    if errors:
        print(f"\n{len(errors)} runs: median |error| {statistics.median(map(abs, errors)):.0%}, "
              f"largest {max(errors, key=abs):+.0%}; within 20%: "
              f"{sum(abs(e) <= 0.2 for e in errors)} of {len(errors)}; process peak "
              f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    if held_out:
        print(f"calibrated ({', '.join(f'{g}: {k} x{f:.2f}' for g, (k, f) in factors.items())}"
              f"), held-out runs: median |error| "
              f"{statistics.median(map(abs, held_out)):.0%}, largest "
              f"{max(held_out, key=abs):+.0%}; within 20%: "
              f"{sum(abs(e) <= 0.2 for e in held_out)} of {len(held_out)}")
    print("\nSources: " + "; ".join(f"{r.key}: {r.row}" for r in RUNS if r.key in wanted))


if __name__ == "__main__":
    main()
