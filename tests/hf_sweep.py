"""Issue 43's sweep: every Hugging Face causal-LM family of ``tests/hf_catalogue.py``
trained 3 AdamW steps with its gradients clipped, in float64, under ``ddp``, ``fsdp``,
Megatron tensor parallelism from the family's own plan (``tp``: ``spmd.tp.megatron()`` on
2 ranks) and ``fsdp x tp`` (2 x 2), each compared with one process on the whole batch.

Each family/strategy cell ends as one of :data:`OUTCOMES`:

- ``equal``: every step's output (this rank's rows) and every parameter at the end within
  :data:`ATOL` of one process on every rank (``eager`` says how many of its graphs or
  gradients the plan left to the eager path, which is correct and listed in the plan).
  The one process is fed the batch as the cell's data-parallel ranks split it, their
  gradients accumulated (:func:`reference`); a cell of a family that computes parts in
  float32 and is not within ATOL is held to 10 times its float32 floor (how far one
  process moves when its parameters start perturbed by 1e-7), and says so;
- ``refused``: every rank raised the same ``ValueError``/``TypeError``/
  ``NotImplementedError``/``ShardingError`` naming spmd, while parallelizing or compiling
  the first step, before any step ran: a clear refusal;
- ``differs``: it trained, not like one process (a silent wrong answer: a bug);
- ``crash``: anything else raised (a bug, or a refusal that does not say spmd);
- ``hang``: a rank did not finish in time (a bug).

The ranks run a list of cells in one spawned job (``run_cells``); a cell that raises on
any rank ends the job there (the process group may be in a collective the others left),
and :func:`sweep` starts the rest in a new job. One process's result per family
(:func:`reference`) is computed twice: a family whose two runs differ is not
deterministic, and no parallel run could be compared with it.
"""

from __future__ import annotations

import math
import os
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.nn.functional as F

STEPS = 3
ROWS = 4
LENGTH = 8
ATOL = 1e-9
LR, CLIP = 1e-2, 0.5
OUTCOMES = ("equal", "refused", "differs", "crash", "hang")

# name -> (mesh shape, dimension names, strategy, preset: "" none, "tp" the family's own
# tensor-parallel plan, "ep" its experts split by index over the data ranks, "ep+tp" both);
# a mesh with a "pp" dimension cuts the model into a pipeline's stages along it
STRATEGIES: dict[str, tuple[tuple[int, ...], tuple[str, ...], str, str]] = {
    "ddp": ((2,), ("dp",), "ddp", ""),
    "fsdp": ((2,), ("fsdp",), "fsdp", ""),
    "tp": ((2,), ("tp",), "ddp", "tp"),
    "fsdp x tp": ((2, 2), ("fsdp", "tp"), "fsdp", "tp"),
    "ep": ((2,), ("ep",), "ddp", "ep"),
    "fsdp x ep": ((2,), ("ep",), "fsdp", "ep"),
    # the family's own plan on "tp" (where it has one) and its experts split by index on
    # "ep" and by their features on "tp" (expert tensor parallelism)
    "ep x tp": ((2, 2), ("ep", "tp"), "ddp", "ep+tp"),
    # 2 stages (1F1B, 2 microbatches), each stage's experts split by index on "ep"
    "pp x ep": ((2, 2), ("pp", "ep"), "ddp", "ep"),
    # the sequence split over "cp" (ring attention), each rank's part of it routed to the
    # experts split by index on "ep"
    "cp x ep": ((2, 2), ("ep", "cp"), "ddp", "ep+cp"),
}
# the strategies only a mixture of experts takes (a cell of any other family is not run)
EXPERTS_ONLY = ("ep", "fsdp x ep", "ep x tp", "pp x ep", "cp x ep")
MICROBATCHES = 2  # of a pipelined cell, per data rank
_REFUSALS = ("ValueError", "TypeError", "NotImplementedError", "ShardingError",
             "EmptyBackwardError", "Infeasible")


def world(strategy: str) -> int:
    return math.prod(STRATEGIES[strategy][0])


def make_batch(step: int, rows: int = ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (rows, LENGTH) and their next-token targets, the same for a given step;
    ids from 3 (0-2 are the catalogue's pad, bos and eos)."""
    from .hf_catalogue import VOCAB

    g = torch.Generator().manual_seed(2000 + step)
    seq = torch.randint(3, VOCAB, (rows, LENGTH + 1), generator=g)
    return seq[:, :-1], seq[:, 1:]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def train(model: torch.nn.Module, rows: slice, clip, parts: int = 1
          ) -> tuple[list[torch.Tensor], dict]:
    """STEPS AdamW steps on ``rows`` of each batch: (each step's output, parameters).
    ``parts`` > 1: each step's rows in that many equal micro-batches, their gradients
    accumulated (each loss divided by ``parts``): one process fed the data-parallel
    ranks' batches in turn."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    outputs = []
    for step in range(STEPS):
        x, y = make_batch(step)
        x, y = x[rows], y[rows]
        outs = []
        for xs, ys in zip(x.chunk(parts), y.chunk(parts)):
            out = model(xs)
            outs.append(out.detach().clone())
            (lm_loss(out, ys) / parts).backward()
        outputs.append(torch.cat(outs))
        clip(model)
        opt.step()
        opt.zero_grad()
    return outputs, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _largest(a: tuple[list[torch.Tensor], dict], b: tuple[list[torch.Tensor], dict]) -> float:
    """The largest difference between two runs' outputs and parameters."""
    diffs = [(x - y).abs().max().item() for x, y in zip(a[0], b[0])]
    diffs += [(a[1][k] - b[1][k]).abs().max().item() for k in a[1]]
    return max(diffs, default=0.0)


class _LowPrecision(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the ops that give a float32 (or narrower) tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype in (torch.float32, torch.float16,
                                                           torch.bfloat16):
                self.ops.add(func.overloadpacket.__name__)
        return out


def low_precision_ops(family: str) -> set[str]:
    """The ops one forward and backward of the family computes in float32 or narrower (a
    norm's or a router's ``.float()``, rotary tables), though every parameter and input
    is float64."""
    from .hf_catalogue import build

    model = build(family)
    x, y = make_batch(0)
    with _LowPrecision() as mode:
        lm_loss(model(x), y).backward()
    return mode.ops


def nudged(model: torch.nn.Module, by: float = 1e-7) -> torch.nn.Module:
    """``model`` with every parameter perturbed by ``by`` of itself (float32's rounding at
    1e-7), the same perturbation every call: how far a run then moves is the family's
    float32 floor."""
    if by:
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + by * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def reference(family: str) -> dict[Any, Any] | str:
    """One process: {1: on the whole batch, 2: on it as two data-parallel ranks' halves,
    gradients accumulated}, each (outputs, parameters), and ``"floor"``: None where the
    family computes everything in float64, else how far the whole-batch run moves when
    every parameter starts perturbed by float32's rounding (1e-7 of itself); or why there
    is none (the family does not train in one process, or two runs of it differ).

    In float64 a parallel run differs from one process only by sums taken in another
    order (~1e-16 relative), so a cell is held to :data:`ATOL`. A family that computes
    parts in float32 (a norm's or a router's ``.float()``) turns those last-bit
    differences into float32 ones wherever a parallel run splits what it reduces (a
    q/k norm over a tensor-parallel projection), and AdamW can grow them (a gradient near
    zero, of terms that cancel, becomes a step of up to the learning rate): a cell of
    such a family that is not within ATOL is held to 10 times its float32 floor, and
    says so."""
    from .hf_catalogue import build

    def once(parts: int = 1, nudge: float = 0.0) -> tuple[list[torch.Tensor], dict]:
        model = nudged(build(family), nudge)
        return train(model, slice(0, ROWS),
                     lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP), parts)

    try:
        first, second, split = once(), once(), once(parts=2)
        low = low_precision_ops(family)
        floor = _largest(first, once(nudge=1e-7)) if low else None
    except Exception as e:  # the family itself does not train
        return f"does not train in one process: {type(e).__name__}: {_first_line(e)}"
    if _largest(first, second) != 0.0:
        return "not deterministic: two runs in one process differ"
    return {1: first, 2: split, "floor": floor, "low": sorted(low)}


def data_size(strategy: str) -> int:
    """The number of data-parallel ranks of a strategy (its mesh without "tp", "pp" and
    "cp")."""
    shape, names = STRATEGIES[strategy][:2]
    return math.prod(n for n, d in zip(shape, names) if d not in ("tp", "pp", "cp"))


def pipelined(strategy: str) -> bool:
    """Whether the strategy cuts the model into a pipeline's stages (each rank then holds
    its stages' parameters only, and a step's output is its loss)."""
    return "pp" in STRATEGIES[strategy][1]


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else ""


def _cell(family: str, strategy: str) -> dict:
    """This rank's run of one cell: its rows, outputs and parameters, or where and what it
    raised. A pipelined cell (:func:`pipelined`: 1F1B, :data:`MICROBATCHES` per data
    rank, each stage parallelized on the other dimensions) gives the steps' losses
    instead of outputs (the logits stay on the last stage), and its stages' parameters
    only."""
    import types

    import spmd

    from .hf_catalogue import build
    from .zoo import data_index

    shape, names, kind, preset = STRATEGIES[strategy]
    staged = pipelined(strategy)
    start = time.perf_counter()
    stage = "parallelize"
    try:
        mesh = spmd.Mesh(shape, dim_names=names)
        model = build(family)
        placements = {"tp": spmd.tp.megatron(), "ep": spmd.ep.experts(),
                      "ep+tp": _experts_and_plan(model),
                      "ep+cp": [spmd.ep.experts(), spmd.cp.ring()]}.get(preset)
        if staged:
            model = spmd.parallelize(
                model, mesh=mesh, strategy=kind, placements=placements,
                pipeline=spmd.pp.schedule("1f1b", microbatches=MICROBATCHES))
            data = types.SimpleNamespace(data_dims=tuple(d for d in names if d != "pp"))
            index, count = data_index(mesh, data)
        else:
            model = spmd.parallelize(model, mesh=mesh, strategy=kind, placements=placements)
            planned = model._spmd.setup.strategy
            index, count = data_index(planned.mesh, planned)
        per = ROWS // count
        rows = slice(index * per, (index + 1) * per)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        outputs, losses = [], []
        for step in range(STEPS):
            stage = f"step {step}"
            x, y = make_batch(step)
            if staged:
                losses.append(model.step(x[rows], y[rows], lm_loss).detach().clone())
            else:
                out = model(x[rows])
                outputs.append(out.detach().clone())
                lm_loss(out, y[rows]).backward()
            model.clip_grad_norm_(CLIP)
            opt.step()
            opt.zero_grad()
        stage = "state"
        params = {k: v.detach().clone() for k, v in model.state_dict().items()}
        plans = model.plan().stage_plans.values() if staged else [spmd.inspect(model)]
        eager = sum(len(p.fallbacks) + len({o.op for o in p.placed if o.fallback})
                    for p in plans)
        return {"rows": (rows.start, rows.stop), "outputs": outputs, "losses": losses,
                "params": params, "eager": eager, "seconds": time.perf_counter() - start}
    except Exception as e:  # the cell's outcome, classified by the caller
        return {"error": type(e).__name__, "message": _first_line(e), "stage": stage,
                "trace": traceback.format_exc()[-3000:],
                "seconds": time.perf_counter() - start}


def _experts_and_plan(model: torch.nn.Module) -> list:
    """The experts split by index on "ep" and by features on "tp", beside the family's
    own tensor-parallel plan where it has one (the experts alone on "tp" where
    ``spmd.tp.megatron`` finds no layer to split)."""
    import spmd

    try:
        spmd.tp.megatron(model)
    except ValueError:
        return [spmd.ep.experts(tensor_parallel="tp")]
    return [spmd.ep.experts(tensor_parallel="tp"), spmd.tp.megatron()]


def run_cells(rank: int, cells: list[tuple[str, str]], progress: str) -> dict:
    """Spawned on the cells' world size: each cell in turn, until one raises on this rank
    (the job ends there; :func:`sweep` runs the rest anew). ``progress``: a file each rank
    appends the cell it starts to, which names the cell a hang was in."""
    import warnings

    from spmd import runtime as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=45))
    results: dict = {}
    try:
        for cell in cells:
            with open(progress, "a") as f:
                f.write(f"{rank}\t{cell[0]}\t{cell[1]}\n")
            results[cell] = _cell(*cell)
            if "error" in results[cell]:
                break
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # a group left in a collective by a raising rank
            pass
    return results


@dataclass
class Outcome:
    """One family/strategy cell."""

    family: str
    strategy: str
    outcome: str
    detail: str = ""
    diff: float = 0.0
    eager: int = 0
    seconds: float = 0.0
    ranks: list = field(default_factory=list, repr=False)


def judge(family: str, strategy: str, ranks: list[dict],
          wanted: dict[int, tuple[list[torch.Tensor], dict]]) -> Outcome:
    """A cell's outcome from every rank's result and one process's (:func:`reference`:
    the run that splits the batch as the cell's data-parallel ranks do; the detail notes
    where the family's own two one-process runs differ, its float32 rounding)."""
    seconds = max(r.get("seconds", 0.0) for r in ranks)
    errors = [r for r in ranks if "error" in r]
    if errors:
        first = errors[0]
        same = len(errors) == len(ranks) and all(
            (r["error"], r["message"], r["stage"]) == (first["error"], first["message"],
                                                       first["stage"]) for r in errors)
        refused = (same and first["error"] in _REFUSALS and "spmd" in first["message"]
                   and first["stage"] in ("parallelize", "step 0"))
        detail = f"{first['stage']}: {first['error']}: {first['message']}"
        return Outcome(family, strategy, "refused" if refused else "crash", detail,
                       seconds=seconds, ranks=ranks)
    want_outputs, want_params = wanted[data_size(strategy)]
    floor = wanted["floor"]
    tolerance = ATOL if floor is None else max(ATOL, 10 * floor)
    worst, where = 0.0, ""
    staged = pipelined(strategy)  # each rank holds its stages' entries; all of them together
    if staged and set().union(*(r["params"] for r in ranks)) != want_params.keys():
        worst, where = math.inf, "the stages' state_dicts together: other keys"
    for rank, run in enumerate(ranks):
        lo, hi = run["rows"]
        for step, (got, ref) in enumerate(zip(run["outputs"], want_outputs)):
            diff = (got - ref[lo:hi]).abs().max().item() if got.shape == ref[lo:hi].shape \
                else math.inf
            if diff > worst:
                worst, where = diff, f"rank {rank} step {step} output"
        keys = run["params"].keys()
        if not keys <= want_params.keys() if staged else keys != want_params.keys():
            worst, where = math.inf, f"rank {rank}: other state_dict keys"
            continue
        for key in keys:
            got, ref = run["params"][key], want_params[key]
            diff = (got - ref).abs().max().item() if got.shape == ref.shape else math.inf
            if diff > worst:
                worst, where = diff, f"rank {rank} {key}"
    eager = max(r["eager"] for r in ranks)
    if worst <= ATOL:
        return Outcome(family, strategy, "equal", "", worst, eager, seconds)
    note = "" if floor is None else (
        f"float32 inside ({', '.join(wanted['low'][:4])}): {worst:.2g} against a floor of "
        f"{floor:.2g}")
    if worst <= tolerance:
        return Outcome(family, strategy, "equal", note, worst, eager, seconds)
    return Outcome(family, strategy, "differs", f"{where} by {worst:.3g}" + (
        f"; {note}" if note else ""), worst, eager, seconds, ranks)


def _watch(ctx: Any, progress: str, timeout: float, stop: threading.Event,
           hung: list[str]) -> None:
    """Stop the job's ranks when one cell has run ``timeout`` seconds (the last line of
    ``progress`` unchanged that long): a hang is a cell's, not a long job's."""
    last, since = None, time.monotonic()
    while not stop.wait(1.0):
        with open(progress) as f:
            lines = f.read().splitlines()
        if lines[-1:] != last:
            last, since = lines[-1:], time.monotonic()
        elif time.monotonic() - since > timeout:
            hung.append(f"DistTimeoutError: the cell ran over {timeout:g} s; its ranks stopped")
            for proc in ctx.processes:
                proc.kill()
            return


def run_job(cells: list[tuple[str, str]], timeout: float
            ) -> tuple[dict[tuple[str, str], list[dict]], tuple[str, str] | None, str]:
    """The cells on their world size in one spawn: (each finished cell's rank results,
    the cell that hung (ran over ``timeout`` seconds) or whose job failed, why)."""
    from spmd import runtime as dist

    nprocs = world(cells[0][1])
    with tempfile.NamedTemporaryFile("r", suffix=".progress", delete=False) as f:
        progress = f.name
    stop, hung = threading.Event(), []
    try:
        ctx = dist.spawn(run_cells, args=(cells, progress), nprocs=nprocs,
                         start_method="forkserver", join=False)
        watcher = threading.Thread(target=_watch, args=(ctx, progress, timeout, stop, hung),
                                   daemon=True)
        watcher.start()
        try:
            found = ctx.join()
        except Exception as e:  # a hang (stopped by the watcher) or a rank that died
            with open(progress) as f:
                started = [tuple(line.rstrip("\n").split("\t")[1:]) for line in f]
            stuck = started[-1] if started else cells[0]
            why = hung[0] if hung else f"{type(e).__name__}: {_first_line(e)}"
            return {}, (stuck[0], stuck[1]), why
    finally:
        stop.set()
        os.unlink(progress)
    done = {cell: [ranks[cell] for ranks in found]
            for cell in cells if all(cell in ranks for ranks in found)}
    return done, None, ""


def sweep(cells: list[tuple[str, str]], *, timeout: float = 300.0, chunk: int = 12,
          want=reference, log=None) -> list[Outcome]:
    """Every cell's outcome. Cells run ``chunk`` at a time per job (grouped by world
    size); what a job did not reach runs in the next. ``want(family)`` is one process's
    result (or why there is none: the family's cells are then not run)."""
    wanted: dict[str, Any] = {}
    outcomes: dict[tuple[str, str], Outcome] = {}
    pending = list(cells)
    while pending:
        size = world(pending[0][1])
        batch = [c for c in pending if world(c[1]) == size][:chunk]
        for family, _ in batch:
            if family not in wanted:
                wanted[family] = want(family)
        skip = [c for c in batch if isinstance(wanted[c[0]], str)]
        for c in skip:
            outcomes[c] = Outcome(c[0], c[1], "skipped", wanted[c[0]])
            pending.remove(c)
        batch = [c for c in batch if c not in skip]
        if not batch:
            continue
        done, stuck, why = run_job(batch, timeout)
        for cell, ranks in done.items():
            outcomes[cell] = judge(*cell, ranks, wanted[cell[0]])
            pending.remove(cell)
            if log:
                log(outcomes[cell])
        if stuck is not None:
            outcomes[stuck] = Outcome(*stuck, "hang" if "Timeout" in why else "crash", why)
            pending.remove(stuck)
            if log:
                log(outcomes[stuck])
        elif not done:
            raise RuntimeError(f"a job of {batch} returned nothing")
        left = {f for f, _ in pending}
        for family in [f for f in wanted if f not in left]:
            del wanted[family]  # (its outputs and parameters: memory)
    return [outcomes[c] for c in cells]
