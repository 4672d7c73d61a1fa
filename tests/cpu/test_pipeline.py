"""Pipeline parallelism on real ranks over Gloo, against one process on the whole batch in
float64: every schedule at pp=2 and pp=4, a tied head, changing batch sizes, evaluation,
and compositions with ddp, fsdp and tensor parallelism (up to 8 ranks)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.nn.functional as F

import spmd
import spmd.runtime as dist
from spmd.pp import SCHEDULES
from tests.jobs import Jobs
from tests.llama import Llama
from tests.zoo import entry

STEPS = ((8, 0), (4, 1))  # (rows, step): the second step's batch is smaller (a new trace)


def _lm_loss(out, y):
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def _llama(layers: int) -> torch.nn.Module:
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return Llama(vocab=32, dim=16, layers=layers, heads=4, kv_heads=2, hidden=32,
                     length=8)
    finally:
        torch.set_default_dtype(default)


def _batch(rows: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    seq = torch.randint(0, 32, (rows, 9), generator=g)
    return seq[:, :-1], seq[:, 1:]


def _reference(build, batches, loss_fn) -> dict[str, torch.Tensor]:
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for x, y in batches:
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(pm, model, batches, loss_fn, rows_of=lambda x: x) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    losses = []
    for x, y in batches:
        losses.append(pm.step(rows_of(x), rows_of(y), loss_fn).item())
        opt.step()
        opt.zero_grad()
    return losses


def _diff(pm, reference: dict[str, torch.Tensor]) -> float:
    """The largest difference of this rank's parameters (whole, from its stages'
    state) from the reference's."""
    worst = 0.0
    for module in pm._stages.values():
        for name, value in module.state_dict().items():
            if name in reference:
                worst = max(worst, (value - reference[name]).abs().max().item())
    return worst


def _init() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=90))


def schedules_job(rank: int, cases: list[str], ranks: int) -> dict:
    """Each schedule of ``cases`` trained on ``ranks`` pipeline ranks against one
    process; the case "extras" runs ``_pp2_extras``."""
    _init()
    try:
        out: dict = {}
        batches = [_batch(rows, step) for rows, step in STEPS]
        layers = 2 * ranks
        mesh = spmd.Mesh((ranks,), ("pp",))
        if "extras" in cases:
            out["extras"] = _pp2_extras(mesh)
        names = [name for name in cases if name != "extras"]
        reference = _reference(lambda: _llama(layers), batches, _lm_loss) if names else {}
        for name in names:
            model = _llama(layers)
            pm = spmd.parallelize(model, mesh=mesh,
                                  pipeline=spmd.pp.schedule(name, 2 if ranks == 2 else 4))
            losses = _train(pm, model, batches, _lm_loss)
            held = sum(p.numel() for p in model.parameters())
            out[name] = {"diff": _diff(pm, reference), "losses": losses, "held": held,
                         "stages": pm.local_stages(),
                         "spans": [(a.kind, a.stage, a.microbatch) for a, _, _ in pm.last_spans]}
        return out
    finally:
        dist.destroy_process_group()


def _pp2_extras(mesh) -> dict:
    out: dict = {}
    # a tied head (GPT-2): both end stages hold it, gradients summed across them
    e = entry("gpt2")
    batches = [e.make_batch(step=s, rows=4) for s in range(2)]
    reference = _reference(e.model, batches, e.loss_fn)
    model = e.model()
    pm = spmd.parallelize(model, mesh=mesh, pipeline=spmd.pp.schedule("1f1b", 2))
    _train(pm, model, batches, e.loss_fn)
    out["tied"] = {"diff": _diff(pm, reference), "tied": dict(pm._last_cut.tied)}
    # clipping the torch way clips by the whole model's norm (a tied head counted once)
    x, y = batches[0]
    pm.step(x, y, e.loss_fn)
    out["norm"] = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3).item()
    ref = _gpt2_at(reference)
    e.loss_fn(ref(x), y).backward()
    out["norm_reference"] = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3).item()
    clipped = {n: p.grad.clone() for n, p in ref.named_parameters()}
    out["clip_diff"] = max((p.grad - clipped[n]).abs().max().item()
                           for n, p in model.named_parameters() if p.grad is not None)
    for p in model.parameters():
        p.grad = None
    # evaluation: the loss only, no gradient
    x, y = batches[0]
    with torch.no_grad():
        out["eval"] = pm.step(x, y, e.loss_fn).item()
        out["eval_reference"] = e.loss_fn(_gpt2_at(reference)(x), y).item()
    out["eval_grads"] = [n for n, p in model.named_parameters() if p.grad is not None]
    # bad input, before anything is sent
    errors = {}
    try:
        pm.step(x[:3], y[:3], e.loss_fn)
    except ValueError as err:
        errors["rows"] = str(err)
    try:
        pm(x)
    except RuntimeError as err:
        errors["forward"] = str(err)
    # ranks whose models differ: named before anything is sent
    try:
        wide = 32 if dist.get_rank() == 1 else 16
        odd = spmd.parallelize(Llama(vocab=32, dim=wide, layers=2, heads=4, kv_heads=2,
                                     hidden=32, length=8).double(), mesh=mesh,
                               pipeline=spmd.pp.schedule("gpipe", 2))
        odd.step(*_batch(4, 0), _lm_loss)
    except RuntimeError as err:
        errors["differ"] = str(err)
    out["errors"] = errors
    # a checkpoint per pipeline rank: its stages' entries, loaded into a fresh pipeline
    saved = pm.state_dict()
    fresh = spmd.parallelize(e.model(), mesh=mesh, pipeline=spmd.pp.schedule("1f1b", 2))
    fresh.load_state_dict(saved)
    with torch.no_grad():
        out["reloaded"] = (fresh.step(x, y, e.loss_fn).item(), pm.step(x, y, e.loss_fn).item())
    params = dict(model.named_parameters())
    out["saved"] = sorted(k for k in saved if k in params)
    # the plan of a running pipeline
    plan = pm.plan()
    out["plan"] = {"stages": len(plan.stages), "explain": plan.explain("stages"),
                   "bubble": plan.bubble, "sources": [s.source for s in plan.stages]}
    return out


def _gpt2_at(params: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = entry("gpt2").model()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name])
    return model


def compose_job(rank: int, shape: tuple[int, ...], names: tuple[str, ...], cases: list
                ) -> dict:
    """Each case trained on ``Mesh(shape, names)``."""
    _init()
    try:
        return _compose(shape, names, cases)
    finally:
        dist.destroy_process_group()


def _compose(shape: tuple[int, ...], names: tuple[str, ...], cases: list) -> dict:
    out = {}
    mesh = spmd.Mesh(shape, names)
    dp, me = 1, 0  # this rank's index among the data ranks (hsdp: over both)
    for d in (d for d in names if d in ("dp", "fsdp")):
        dp, me = dp * mesh.size(d), me * mesh.size(d) + mesh.coordinate()[names.index(d)]
    for label, family, schedule, options in cases:
        if family == "own":
            build, loss_fn = (lambda: _llama(4)), _lm_loss
            batches = [_batch(8, s) for s in range(2)]
        else:
            e = entry(family)
            build, loss_fn = e.model, e.loss_fn
            batches = [e.make_batch(step=s, rows=8) for s in range(2)]
        reference = _reference(build, batches, loss_fn)
        model = build()
        opts = dict(options)
        if opts.pop("megatron", False):
            opts["placements"] = spmd.tp.megatron()
        pm = spmd.parallelize(model, mesh=mesh, pipeline=spmd.pp.schedule(schedule, 2),
                              **opts)
        per = 8 // dp
        # an evaluation step on the whole batch first: its program cuts the stages, and
        # training traces again with each stage's parameters sharded (the trace read the
        # shards' shapes: it failed)
        with torch.no_grad():
            pm.step(*batches[0], loss_fn)
        _train(pm, model, batches, loss_fn, lambda t: t[me * per:(me + 1) * per])
        pieces = {n: tuple(p.shape) for n, p in model.named_parameters() if p.numel()}
        out[label] = {"diff": _diff(pm, reference), "pieces": pieces}
    return out


# two schedules per job (a job of all four and the extras took 125 s on a loaded machine)
PP2 = Jobs(schedules_job, [SCHEDULES[:2], SCHEDULES[2:], ["extras"]], nprocs=2, args=(2,))
PP4 = Jobs(schedules_job, [SCHEDULES[:2], SCHEDULES[2:]], nprocs=4, args=(4,))


@pytest.mark.parametrize("name", SCHEDULES)
def test_each_schedule_at_pp2_is_one_process(name):
    runs = PP2.results(name)
    for rank, run in enumerate(runs):
        assert run["diff"] < 1e-12, (rank, run["diff"])
        # each rank keeps only its stages' parameters
        assert 0 < run["held"] < sum(p.numel() for p in _llama(4).parameters())
    assert runs[0]["losses"] == runs[1]["losses"]  # the loss on every rank
    if name == "zb-h1":  # the weight gradients ran as their own actions
        assert any(kind == "W" for kind, _, _ in runs[0]["spans"])


def test_tied_head_eval_errors_and_plan_at_pp2():
    pp2 = PP2.results("extras")
    for out in pp2:
        assert out["tied"]["tied"] == {"hf.transformer.wte.weight": (0, 1)}
        assert out["tied"]["diff"] < 1e-12
        assert out["norm"] == pytest.approx(out["norm_reference"], rel=1e-12)
        assert out["clip_diff"] < 1e-15
        assert out["eval"] == pytest.approx(out["eval_reference"], rel=1e-13)
        assert out["eval_grads"] == []
        assert "microbatches=2 do not divide the batch of 3 rows" in out["errors"]["rows"]
        assert "model.step(inputs, target, loss_fn)" in out["errors"]["forward"]
        assert "ranks cut different graphs: rank 0 cut at" in out["errors"]["differ"]
        assert out["reloaded"][0] == out["reloaded"][1]
        plan = out["plan"]
        assert plan["stages"] == 2 and "Cut points:" in plan["explain"]
        assert plan["bubble"] > 0
    # each rank's checkpoint: its own stage, the tied head in both
    assert "hf.transformer.wte.weight" in pp2[0]["saved"] and \
        "hf.transformer.wte.weight" in pp2[1]["saved"]
    assert not set(pp2[0]["saved"]) - {"hf.transformer.wte.weight"} & set(pp2[1]["saved"])
    assert pp2[0]["plan"]["sources"][0] == "measured on this rank, last step"
    assert pp2[0]["plan"]["sources"][1].startswith("scaled by FLOPs")


@pytest.mark.parametrize("name", SCHEDULES)
def test_each_schedule_at_pp4_is_one_process(name):
    runs = PP4.results(name)
    for rank, run in enumerate(runs):
        assert run["diff"] < 1e-12, (rank, run["diff"])
    assert [run["stages"] for run in runs] == (
        [[0, 4], [1, 5], [2, 6], [3, 7]] if name == "interleaved-1f1b" else [[0], [1], [2], [3]])


def test_pipeline_composes_with_ddp_and_fsdp():
    cases = [("ddp", "own", "1f1b", {"strategy": "ddp"}),
             ("fsdp", "qwen2", "zb-h1", {"strategy": "fsdp"})]
    runs = dist.spawn(compose_job, args=((2, 2), ("pp", "dp"), cases), nprocs=4,
                      start_method="forkserver", timeout=115)
    for out in runs:
        for label, run in out.items():
            assert run["diff"] < 1e-11, (label, run["diff"])
    assert all(shape[0] < 64 for shape in runs[0]["fsdp"]["pieces"].values())  # shards


def test_pipeline_fsdp_tp_on_8_ranks():
    """Hugging Face LLaMA (grouped-query attention): each stage sharded over "fsdp" and
    split by Megatron's placements over "tp"."""
    cases = [("fsdp_tp", "llama", "gpipe", {"strategy": "fsdp", "megatron": True})]
    runs = dist.spawn(compose_job, args=((2, 2, 2), ("pp", "fsdp", "tp"), cases),
                      nprocs=8, start_method="forkserver", timeout=115)
    for out in runs:
        assert out["fsdp_tp"]["diff"] < 1e-11, out["fsdp_tp"]["diff"]
    # q_proj (32 x 32): a quarter under fsdp x tp
    pieces = runs[0]["fsdp_tp"]["pieces"]
    assert any(shape == (8, 32) for name, shape in pieces.items() if "q_proj" in name)


def test_pipeline_hsdp_on_8_ranks():
    """Each stage under hsdp (sharded over "fsdp", replicated over "dp", the batch split
    over both: a group over the stage mesh that every rank of the world makes)."""
    cases = [("hsdp", "llama", "1f1b", {"strategy": "hsdp"})]
    runs = dist.spawn(compose_job, args=((2, 2, 2), ("pp", "dp", "fsdp"), cases),
                      nprocs=8, start_method="forkserver", timeout=115)
    for out in runs:
        assert out["hsdp"]["diff"] < 1e-11, out["hsdp"]["diff"]
    # q_proj (32 x 32): half under hsdp (sharded over "fsdp")
    pieces = runs[0]["hsdp"]["pieces"]
    assert any(shape == (16, 32) for name, shape in pieces.items() if "q_proj" in name)
