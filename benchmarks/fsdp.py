"""Step time and memory of ``strategy="fsdp"`` against torch FSDP2 (and spmd's DDP).

    python benchmarks/fsdp.py [--nprocs 2,4] [--steps 20] [--rounds 5] [--layers 8]
                              [--width 128] [--reshard-after-forward true|false|N]

Local ranks (processes), one thread each, Gloo over loopback; the same model, data and
optimizer (AdamW) for every variant:

- ``spmd fsdp``: ``spmd.parallelize(model, strategy="fsdp")`` with its defaults (dim-0
  shards, bucketed all-gathers one bucket ahead, reduce-scatters, reshard after forward);
- ``torch FSDP2``: ``torch.distributed.fsdp.fully_shard`` on each transformer layer, then
  on the root, over the same Gloo group (torch.distributed sees the group spmd made);
- ``spmd ddp``: ``spmd.parallelize(model)`` (parameters replicated, gradients averaged).

``--reshard-after-forward`` (default true) is given to both fsdp variants alike: false
keeps the forward's gathered parameters for backward; an integer N (FSDP2's) keeps 1/N
and gathers it again among N ranks in backward.

The model: token embedding, ``--layers`` pre-norm ``nn.TransformerEncoderLayer``s of
width ``--width`` (4 heads, feed-forward 4x, no dropout), a final LayerNorm and a head;
each rank trains on its own 8 sequences of 32 tokens.

Time: variants alternate in rounds so all see the same machine; round 0 warms up
(compiles) and is not counted. The figure is the median step time over the rounds; the
ratio is FSDP2's time over the variant's (above 1: faster than FSDP2) and "spread" the
lowest and highest per-round ratio.

Memory, rank 0's, measured, not computed from shapes:

- ``persistent``: ``numel * element_size`` of the local tensors this rank keeps after a
  step (parameters and their gradients: FSDP2's DTensors through ``to_local()``, spmd's
  shards as they are; AdamW's state from ``optimizer.state``), before ``zero_grad``.
- ``peak``: the most CPU-allocator bytes alive during one step, from
  ``torch.profiler.profile(profile_memory=True)``'s allocation events (each with its
  pointer and size; a free has a negative size) summed in time order. The profile starts
  before the variant's model is built and covers its warm-up (compiling) step, so what a
  variant allocated earlier and keeps across steps (spmd ddp's gradient buckets, FSDP2's
  shards) is in the sum; the peak is taken over a second step. Frees of memory the
  profile did not see allocated are skipped. Each variant is measured alone, on fresh
  instances built after the timed rounds (the profiler slows the compile's compute
  estimate, so a plan's buckets may differ from the timed model's: the plan
  fingerprints are printed, the timed one first).
- ``predicted``: ``spmd.inspect(model).memory(optimizer="adamw").peak`` of the instance
  that was measured, and its error against the measured peak.

Where spmd fsdp's time goes: one extra step of every variant after the timed rounds,
under ``spmd.profile`` for spmd fsdp (compute, communication in flight, waits exposed),
beside the plan's predicted timeline. Where the profile recorded no collective (fsdp's
gathers and reduce-scatters are not stamped yet), only the time inside the compiled
graphs, waits included, is shown.

Sanity check: after the timed rounds (and that extra step) every variant has trained
from the same initial weights on the same batches: the largest absolute difference of
spmd fsdp's and spmd ddp's whole ``state_dict()`` from FSDP2's full state dict
(``get_model_state_dict(full_state_dict=True)``), beside how far FSDP2's weights moved
from their initial values. Prints markdown tables, one per world size.
"""

from __future__ import annotations

import gc
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import harness

VOCAB, ROWS, LENGTH = 256, 8, 32  # token ids; sequences and tokens per rank
VARIANTS = ("spmd fsdp", "torch FSDP2", "spmd ddp")


class Transformer(nn.Module):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        # layers built one by one (nn.TransformerEncoder deep-copies one: equal weights)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=4 * width, dropout=0.0,
                                       batch_first=True, norm_first=True)
            for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, tokens):
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def _fresh(width: int, layers: int) -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return Transformer(width, layers)


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return (torch.randint(0, VOCAB, (ROWS, LENGTH), generator=g),
            torch.randint(0, VOCAB, (ROWS, LENGTH), generator=g))


def _train(model: nn.Module, opt: torch.optim.Optimizer, batches, zero: bool = True) -> None:
    for x, y in batches:
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        if zero:
            opt.zero_grad()


def _local_bytes(t: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def _persistent_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Parameters, gradients and optimizer state this rank keeps (call before zero_grad)."""
    params = list(model.parameters())
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return (sum(_local_bytes(p) for p in params)
            + sum(_local_bytes(p.grad) for p in params if p.grad is not None)
            + sum(_local_bytes(v) for v in state))


def _peak_bytes(prof, start_ns: int, end_ns: int) -> int:
    """The most bytes alive between ``start_ns`` and ``end_ns`` (:func:`memory_between`)."""
    return memory_between(prof, start_ns, end_ns)[0]


def memory_between(prof, start_ns: int, end_ns: int) -> tuple[int, int]:
    """(the most bytes alive between ``start_ns`` and ``end_ns``, the bytes alive at
    ``end_ns``), on ``time.time_ns()``, the profiler's clock: allocation events in time
    order, each free matched by pointer to an allocation this profile saw (a free of
    older memory, whose size the allocator's reporter may remember from an earlier
    profile, is skipped)."""
    from torch._C._profiler import _EventType

    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            events.append(node)
        stack.extend(node.children)
    events.sort(key=lambda n: n.start_time_ns)
    live: dict[int, int] = {}
    alive = peak = 0
    for node in events:
        if node.start_time_ns > end_ns:
            break
        size, ptr = node.extra_fields.alloc_size, node.extra_fields.ptr
        if size > 0:
            live[ptr] = size
            alive += size
        elif ptr in live:
            alive -= live.pop(ptr)
        if node.start_time_ns >= start_ns:
            peak = max(peak, alive)
    return peak, alive


def rank_main(rank: int, steps: int, rounds: int, width: int, layers: int,
              reshard: bool | int = True) -> dict | None:
    with harness.group(rank) as world:  # torch sees it: FSDP2 runs over the same Gloo
        out = _measure(rank, world, steps, rounds, width, layers, reshard)
    return out if rank == 0 else None


def _measure(rank: int, world: int, steps: int, rounds: int, width: int, layers: int,
             reshard: bool | int = True) -> dict:
    import torch.distributed as tdist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.profiler import ProfilerActivity, profile

    import spmd

    # FSDP2 warns that the root returns a view (the head's matmul output): only an
    # in-place op on it would skip its hook, and the loss reads it out of place
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view")
    mesh = init_device_mesh("cpu", (world,))

    def fsdp2() -> nn.Module:
        model = _fresh(width, layers)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
        return fully_shard(model, mesh=mesh, reshard_after_forward=reshard)

    make = {
        "spmd fsdp": lambda: spmd.parallelize(_fresh(width, layers), strategy="fsdp",
                                              reshard_after_forward=reshard),
        "torch FSDP2": fsdp2,
        "spmd ddp": lambda: spmd.parallelize(_fresh(width, layers)),
    }
    batches = [_batch(step, rank) for step in range(steps)]

    # -- step time: variants alternate within each round ---------------------------------
    models = {v: make[v]() for v in VARIANTS}
    opts = {v: torch.optim.AdamW(m.parameters(), lr=1e-3) for v, m in models.items()}
    times = harness.alternate({v: (lambda v=v: _train(models[v], opts[v], batches))
                               for v in VARIANTS},
                              rounds, barrier=tdist.barrier, per=steps).times

    # -- where spmd fsdp's time goes: one more step of every variant, that one profiled --
    profiler = spmd.profile(models["spmd fsdp"], steps=1)
    for variant, model in models.items():
        _train(model, opts[variant], batches[:1])
    plan = spmd.inspect(models["spmd fsdp"])
    measured, predicted = profiler.timelines[-1], plan.predicted_timeline()
    fingerprints = {"spmd fsdp": [plan.fingerprint()],
                    "spmd ddp": [spmd.inspect(models["spmd ddp"]).fingerprint()]}

    # -- sanity: all trained alike (every rank gathers; collectives in the same order) ---
    reference = get_model_state_dict(models["torch FSDP2"],
                                     options=StateDictOptions(full_state_dict=True))
    initial = _fresh(width, layers).state_dict()
    moved = max((reference[k] - initial[k]).abs().max().item() for k in reference)
    differences = {}
    for variant in ("spmd fsdp", "spmd ddp"):
        whole = models[variant].state_dict()
        differences[variant] = max((whole[k] - reference[k]).abs().max().item()
                                   for k in reference)
    del models, opts, reference, whole

    # -- memory: each variant alone, profiled from construction; the peak of step 2 ------
    memory: dict[str, dict] = {}
    for variant in VARIANTS:
        gc.collect()
        tdist.barrier()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                     record_shapes=False) as prof:
            model = make[variant]()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            _train(model, opt, batches[:1])  # warm-up: compiles
            gc.collect()
            start = time.time_ns()
            _train(model, opt, batches[1:2] or batches[:1])
            end = time.time_ns()
        _train(model, opt, batches[:1], zero=False)
        memory[variant] = {"persistent": _persistent_bytes(model, opt),
                           "peak": _peak_bytes(prof, start, end)}
        opt.zero_grad()
        if variant.startswith("spmd"):
            memory[variant]["view"] = spmd.inspect(model).memory(optimizer="adamw")
            fingerprints[variant].append(spmd.inspect(model).fingerprint())
        del model, opt, prof

    return {"times": times, "memory": memory, "moved": moved, "differences": differences,
            "measured": measured, "predicted": predicted,
            "fingerprints": fingerprints, "plan": str(plan).splitlines()[0]}


def _lanes(timeline) -> str:
    busy = {lane: sum(s.seconds for s in timeline.lane(lane)) * 1e3
            for lane in ("compute", "communication", "exposed")}
    if timeline.source == "measured" and not timeline.lane("communication"):
        # no collective was stamped: waits inside the graphs count as their compute
        return (f"step {timeline.step_seconds * 1e3:.1f} ms: in the compiled graphs "
                f"{busy['compute']:.1f} ms (no collective recorded: waits count as compute)")
    return (f"step {timeline.step_seconds * 1e3:.1f} ms: compute {busy['compute']:.1f} ms, "
            f"communication in flight {busy['communication']:.1f} ms, waits exposed "
            f"{busy['exposed']:.1f} ms")


def report(world: int, res: dict, steps: int, rounds: int, width: int, layers: int,
           reshard: bool | int = True) -> None:
    mib = 2**20
    times, memory = res["times"], res["memory"]
    print(f"\n### {world} ranks: {layers} layers of width {width}, AdamW, {steps} steps x "
          f"{rounds} rounds, reshard_after_forward={reshard}\n")
    harness.table(("variant", "ms/step", "vs FSDP2 (x faster)", "spread over rounds",
                   "persistent MiB", "measured peak MiB", "predicted peak MiB",
                   "prediction error"), "lrrlrrrr")
    for variant, v in harness.versus(times, "torch FSDP2").items():
        mem = memory[variant]
        predicted = error = ""
        if variant == "spmd fsdp":
            predicted = f"{mem['view'].peak / mib:.2f}"
            error = f"{(mem['view'].peak - mem['peak']) / mem['peak']:+.1%}"
        harness.row(variant, f"{v.median * 1e3:.2f}", f"{v.ratio:.2f}", v.spread,
                    f"{mem['persistent'] / mib:.2f}", f"{mem['peak'] / mib:.2f}", predicted,
                    error)
    view = memory["spmd fsdp"]["view"]
    print(f"\nspmd fsdp: {res['plan']}")
    print(f"spmd fsdp, predicted memory: persistent {view.persistent / mib:.2f} MiB + "
          f"transient {view.peak_transient / mib:.2f} MiB at {view.peak_at} (activations "
          f"saved {view.activations / mib:.2f} MiB, gathered parameters at most "
          f"{view.peak_gathered / mib:.2f} MiB)")
    print(f"spmd fsdp, one step on rank 0, measured:  {_lanes(res['measured'])}")
    print(f"spmd fsdp, one step on rank 0, predicted: {_lanes(res['predicted'])}")
    print("plan fingerprints (timed model, memory model): "
          + "; ".join(f"{v} {' '.join(f)}" for v, f in res["fingerprints"].items()))
    diffs = ", ".join(f"{v} {d:.2e}" for v, d in res["differences"].items())
    print(f"same training: max |w - FSDP2's w| over the whole state dict: {diffs} "
          f"(FSDP2's weights moved up to {res['moved']:.2e} from their initial values)")


def _reshard(value: str) -> bool | int:
    """``--reshard-after-forward``: true, false or an integer."""
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    return int(value)


def cli(doc: str, rank_main, report, nprocs: str, reshard: bool = False) -> None:
    """Parse this model's options (world sizes, steps, rounds, layers, width; with
    ``reshard``, ``--reshard-after-forward``), run ``rank_main`` on each world size and
    print ``report`` of rank 0's result; shared by the benchmarks of this model
    (``zero.py``)."""
    parser = harness.parser(doc, steps=20, rounds=5)
    parser.add_argument("--nprocs", default=nprocs, help="comma-separated world sizes")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=128)
    if reshard:
        parser.add_argument("--reshard-after-forward", type=_reshard, default=True,
                            help="true, false or N, for both fsdp variants")
    args = parser.parse_args()
    worlds = harness.world_sizes(args.nprocs, parser)
    if args.width % 4:
        parser.error("--width: a multiple of 4 (4 attention heads)")
    extra = (args.reshard_after_forward,) if reshard else ()
    for world in worlds:
        res = harness.spawn(rank_main, args.steps, args.rounds, args.width, args.layers,
                            *extra, nprocs=world, start_method="forkserver")[0]
        report(world, res, args.steps, args.rounds, args.width, args.layers, *extra)


def main() -> None:
    cli(__doc__, rank_main, report, "2,4", reshard=True)


if __name__ == "__main__":
    main()
