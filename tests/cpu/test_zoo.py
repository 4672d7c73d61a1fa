"""The model zoo held in float64: every strategy composition docs/ offers trains every
model family exactly as one process on the whole batch does.

Each model of ``tests/zoo.py`` (our transformer, torch's ``TransformerEncoder``, our
LLaMA-style model in each rotary and grouped-query form, Hugging Face LLaMA, GPT-2,
Mistral, Qwen2, GLM and Mixtral (a mixture of experts) from tiny configs) trains a few AdamW steps with its gradients clipped,
on real ranks over Gloo, under ``ddp``, ``fsdp``, ``hsdp``, tensor parallelism (``tp``,
Megatron's placements from ``spmd.tp.megatron()``), ``zero1``, ``zero2``, 2-D ``fsdp``
(sharded over ``dp`` and ``fsdp`` at once) and the compositions ``dp x tp``,
``fsdp x tp``, ``hsdp x tp``, ``zero2 x tp``, 2-D ``fsdp x tp``, and with sequence
parallelism (``spmd.tp.megatron(sequence_parallel=True)``) ``tp+sp``, ``dp x tp+sp``,
``fsdp x tp+sp``, with vocabulary parallelism ``tp+vp``, ``fsdp x tp+sp+vp``, and with
context parallelism (``spmd.cp.ring()``: ring attention, 1-2 sequences per data rank)
``cp``, ``dp x cp``, ``fsdp x cp``, ``cp x tp``, ``fsdp x cp x tp``. Compared against
one process training on the whole batch in the test process: every step's output (this rank's rows) and every parameter at the end,
whole (through ``state_dict()``), to 1e-9. In float64 the parallel arithmetic differs
from one process only by re-associated sums (at most 1.4e-12 measured), so any larger
difference is a bug. Every plan is also verified as it is made (``SPMD_VERIFY=1``), no
gradient may fall back to the eager safety net, and no op may lack a sharding rule.

Profiles (``SPMD_ZOO``): ``ci`` (the default) runs every family under tensor parallelism
and the other compositions on one to three families each, covering each model and each
of our LLaMA forms in the CI budget (21 runs; the compositions of ``FULL_ONLY`` only as
their halves or a superset, among them the three 8-rank ones);
``full`` runs the whole matrix, every model under every composition (286 runs, about 30
minutes):
``SPMD_ZOO=full .venv/bin/python -m pytest -s tests/cpu/test_zoo.py`` prints each run's
largest difference and seconds, the figures of the composition matrix in docs/testing.md.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from datetime import timedelta

import pytest
import torch

import spmd
from spmd import runtime as dist

from ..jobs import Jobs
from ..zoo import ZOO, all_entries, data_index, entry

pytest.importorskip("transformers")

STEPS = 3
ROWS = 4  # the global batch: each data-parallel rank trains on ROWS / its data size
ATOL = 1e-9
LR, CLIP = 1e-2, 0.5  # clipped: the gradients' norm is about 1-3 at these sizes

# name -> (mesh shape, dimension names, strategy, tensor parallel: False, True, or Megatron's
# placements with sequence parallelism "sp", vocabulary parallelism "vp", or both "sp+vp")
COMPOSITIONS = {
    "ddp": ((2,), ("dp",), "ddp", False),
    "fsdp": ((2,), ("fsdp",), "fsdp", False),
    "tp": ((2,), ("tp",), "ddp", True),
    "hsdp": ((2, 2), ("dp", "fsdp"), "hsdp", False),
    "dp x tp": ((2, 2), ("dp", "tp"), "ddp", True),
    "fsdp x tp": ((2, 2), ("fsdp", "tp"), "fsdp", True),
    "hsdp x tp": ((2, 2, 2), ("dp", "fsdp", "tp"), "hsdp", True),
    "zero1": ((2,), ("dp",), "zero1", False),
    "zero2": ((2,), ("dp",), "zero2", False),
    "zero2 x tp": ((2, 2), ("dp", "tp"), "zero2", True),
    "2-D fsdp": ((2, 2), ("dp", "fsdp"), "fsdp", False),
    "2-D fsdp x tp": ((2, 2, 2), ("dp", "fsdp", "tp"), "fsdp", True),
    "tp+sp": ((2,), ("tp",), "ddp", "sp"),
    "tp+vp": ((2,), ("tp",), "ddp", "vp"),
    "fsdp x tp+sp+vp": ((2, 2), ("fsdp", "tp"), "fsdp", "sp+vp"),
    "fsdp x tp+sp": ((2, 2), ("fsdp", "tp"), "fsdp", "sp"),
    "dp x tp+sp": ((2, 2), ("dp", "tp"), "ddp", "sp"),
    "cp": ((2,), ("cp",), "ddp", "cp"),
    "dp x cp": ((2, 2), ("dp", "cp"), "ddp", "cp"),
    "fsdp x cp": ((2, 2), ("fsdp", "cp"), "fsdp", "cp"),
    "cp x tp": ((2, 2), ("cp", "tp"), "ddp", "cp+tp"),
    "fsdp x cp x tp": ((2, 2, 2), ("fsdp", "cp", "tp"), "fsdp", "cp+tp"),
}
# context parallelism: two sequences per data rank (the linear layers' reshapes merge the
# batch with the split sequence: StridedShard), one under fsdp x cp
ROWS_OF = {"cp": 2, "dp x cp": 4, "fsdp x cp": 2, "cp x tp": 2, "fsdp x cp x tp": 4}
MODELS = [e.name for e in all_entries()]

# the CI profile: every model family under tp; each other composition on one or more
# families and forms (each of our LLaMA forms under at least one sharded or tensor-parallel
# composition). What CI leaves out, SPMD_ZOO=full runs: among it, one composition whole,
# whose two halves CI runs apart.
FULL_ONLY = {"2-D fsdp x tp": "2-D fsdp and fsdp x tp run in CI; both at once takes 8 ranks",
             "hsdp x tp": "hsdp and dp x tp / fsdp x tp run in CI; both at once takes 8 ranks",
             "fsdp x cp x tp": "fsdp x cp and cp x tp run in CI; all three takes 8 ranks",
             "dp x cp": "cp and ddp run in CI",
             "dp x tp+sp": "tp+sp and dp x tp run in CI",
             "zero2 x tp": "zero2 and dp x tp / fsdp x tp run in CI",
             "fsdp x tp+sp": "fsdp x tp+sp+vp (its superset) runs in CI"}
CI = {
    "tp": [e.name for e in all_entries() if e.name in ZOO],
    "ddp": ["encoder"],
    "fsdp": ["gpt2"],
    "hsdp": ["qwen2"],
    "dp x tp": ["llama_complex_repeat_interleave"],
    "fsdp x tp": ["llama_complex_enable_gqa"],
    "zero1": ["llama"],
    "zero2": ["gpt2"],
    "2-D fsdp": ["encoder"],
    "tp+sp": ["encoder", "llama_half_expand"],
    "tp+vp": ["llama_complex_expand"],
    "fsdp x tp+sp+vp": ["gpt2"],
    "cp": ["llama_half_enable_gqa"],
    "fsdp x cp": ["mistral"],
    "cp x tp": ["llama_half_repeat_interleave"],
}

def _profile() -> dict[str, list[str]]:
    name = os.environ.get("SPMD_ZOO", "ci")
    if name == "full":
        return {c: MODELS for c in COMPOSITIONS}
    if name != "ci":
        raise ValueError(f"SPMD_ZOO={name!r}: expected ci or full")
    return CI


def _train(model, e, rows: slice, clip, total: int = ROWS
           ) -> tuple[list[torch.Tensor], dict]:
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    outputs = []
    for step in range(STEPS):
        x, y = e.make_batch(step, total)
        out = model(x[rows])
        outputs.append(out.detach().clone())
        e.loss_fn(out, y[rows]).backward()
        clip(model)
        opt.step()
        opt.zero_grad()
    return outputs, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _run(name: str, composition: str) -> dict:
    shape, names, strategy, tp = COMPOSITIONS[composition]
    e = entry(name)
    mesh = spmd.Mesh(shape, dim_names=names)
    start = time.perf_counter()
    placements = e.placements if tp else None
    if isinstance(tp, str) and "cp" in tp:  # "cp", "cp+tp"
        placements = [spmd.cp.ring()] + ([e.placements] if "tp" in tp else [])
    elif isinstance(tp, str):  # "sp", "vp", "sp+vp"
        placements = dataclasses.replace(placements, sequence_parallel="sp" in tp,
                                         vocab_parallel="vp" in tp)
    model = spmd.parallelize(e.model(), mesh=mesh, strategy=strategy, placements=placements)
    planned = model._spmd.setup.strategy  # (2-D fsdp: on the mesh with "dp_fsdp")
    index, count = data_index(planned.mesh, planned)
    total = ROWS_OF.get(composition, ROWS)
    per = total // count
    rows = slice(index * per, (index + 1) * per)
    outputs, params = _train(model, e, rows, lambda m: m.clip_grad_norm_(CLIP), total)
    plan = spmd.inspect(model)
    return {"rows": (rows.start, rows.stop), "outputs": outputs, "params": params,
            "fallbacks": [(f.param, f.reason) for f in plan.fallbacks],
            "unruled": sorted({p.op for p in plan.placed if p.fallback}),
            "collectives": sorted({(c.kind, c.mesh_dim) for c in plan.collectives}),
            "seconds": time.perf_counter() - start}


def zoo_job(rank: int, runs: list[tuple[str, str]]) -> dict:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=100))
    try:
        return {run: _run(*run) for run in runs}
    finally:
        dist.destroy_process_group()


def _world(run: tuple[str, str]) -> int:
    return math.prod(COMPOSITIONS[run[1]][0])


# runs per spawned job, by world size, each job inside tests.jobs.BUDGET quiet (a run took
# 1-2 s on 2 ranks, 2-9 s on 4, about 20 s on 8, compilation included)
CHUNK = {2: 6, 4: 2, 8: 1}


def _groups() -> list[list[tuple[str, str]]]:
    """Each job's runs, a composition's runs together."""
    by_world: dict[int, list[tuple[str, str]]] = {}
    for composition, models in _profile().items():
        runs = [(m, composition) for m in models]
        by_world.setdefault(_world(runs[0]), []).extend(runs)
    return [runs[i:i + CHUNK[world]] for world, runs in sorted(by_world.items())
            for i in range(0, len(runs), CHUNK[world])]


JOBS = Jobs(zoo_job, _groups(), nprocs=lambda runs: _world(runs[0]))
CASES = JOBS.cases
_REPORT: list[tuple[str, str, float, float]] = []  # composition, model, difference, seconds


@pytest.fixture(scope="module", autouse=True)
def report():
    """The largest difference from one process and the seconds of each run, printed at
    the end (``pytest -s``): the figures docs/testing.md's composition matrix quotes."""
    yield
    if _REPORT:
        print(f"\n{'composition':<11} {'model':<32} {'max |diff|':>10} {'seconds':>8}")
        for composition, name, diff, seconds in sorted(_REPORT):
            print(f"{composition:<11} {name:<32} {diff:>10.2e} {seconds:>8.2f}")


@pytest.fixture(scope="module")
def reference():
    """One process on the whole batch, once per model."""
    torch.set_num_threads(1)
    cache: dict[tuple[str, int], tuple] = {}

    def get(name: str, total: int = ROWS) -> tuple:
        if (name, total) not in cache:
            e = entry(name)
            cache[name, total] = _train(
                e.model(), e, slice(0, total),
                lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP), total)
        return cache[name, total]
    return get


@pytest.mark.parametrize("name,composition", CASES, ids=[f"{c}-{m}" for m, c in CASES])
def test_every_composition_trains_like_one_process(name, composition, reference):
    runs = JOBS.results((name, composition))
    want_outputs, want_params = reference(name, ROWS_OF.get(composition, ROWS))
    worst = 0.0
    for rank, run in enumerate(runs):
        assert run["fallbacks"] == [], f"rank {rank}: the safety net ran: {run['fallbacks']}"
        assert run["unruled"] == [], f"rank {rank}: ops without a rule: {run['unruled']}"
        lo, hi = run["rows"]
        for step, (got, want) in enumerate(zip(run["outputs"], want_outputs)):
            diff = (got - want[lo:hi]).abs().max().item()
            assert diff <= ATOL, f"rank {rank} step {step}: output differs by {diff:.3g}"
            worst = max(worst, diff)
        assert run["params"].keys() == want_params.keys()
        for key, want in want_params.items():
            diff = (run["params"][key] - want).abs().max().item()
            assert diff <= ATOL, f"rank {rank}: {key} differs by {diff:.3g}"
            worst = max(worst, diff)
    _REPORT.append((composition, name, worst, max(r["seconds"] for r in runs)))
    _, _, strategy, tp = COMPOSITIONS[composition]
    collectives = set(runs[0]["collectives"])
    assert any(d == "tp" for _, d in collectives) == (bool(tp) and tp != "cp")
    if isinstance(tp, str) and "cp" in tp:
        # the sequence stays split: attention passes blocks around the ring (no all-to-all
        # onto heads), only the caller's output is gathered, gradients summed over "cp"
        assert ("all_to_all", "cp") not in collectives
        assert {("all_gather", "cp"), ("all_reduce", "cp")} <= collectives
    # sequence parallelism: row-parallel layers reduce-scatter into the sequence shards,
    # column-parallel ones gather them
    assert ({("reduce_scatter", "tp"), ("all_gather", "tp")} <= collectives) == (
        isinstance(tp, str) and "sp" in tp)
    if strategy != "ddp":  # parameters stored as shards: gathered, gradients scattered
        shape, names = COMPOSITIONS[composition][:2]
        data = ("dp_fsdp" if composition.startswith("2-D") else
                "fsdp" if "fsdp" in names else "dp")
        assert {("all_gather", data), ("reduce_scatter", data)} <= collectives


def test_the_ci_profile_covers_every_model_and_composition():
    assert set(CI) | set(FULL_ONLY) == set(COMPOSITIONS) and not set(CI) & set(FULL_ONLY)
    assert all(part in CI for part in ("2-D fsdp", "fsdp x tp", "hsdp", "dp x tp"))
    assert {m for models in CI.values() for m in models} == set(MODELS)
