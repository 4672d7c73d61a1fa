"""Expert parallelism (``spmd.ep``) composed with the other dimensions, on real ranks over
Gloo in float64 (the own MoE model of ``tests/moe.py`` and transformers' Mixtral), each
equal to one process on the whole batch:

- beside tensor parallelism (2 x 2: the experts whole on "tp", or split by their
  features too: ``spmd.ep.experts(tensor_parallel="tp")``);
- beside context parallelism (2 x 2: each rank routes its own part of the sequence over
  its "ep" group), and the refusal of an op that would gather the rows its experts
  received;
- in a pipeline (2 x 2: each stage's experts split over "ep"), and its plan on a
  simulated cluster;
- searched by ``strategy="auto"`` (each layout with and without its experts split; a
  live search with ``spmd.ep.experts()`` given).

The expert parallelism of one data dimension, its options and its refusals:
``test_experts.py``.
"""

from __future__ import annotations

import copy
from datetime import timedelta

import pytest
import torch
import torch.nn.functional as F

import spmd
from spmd import runtime as dist

from ..moe import EXPERTS, TOP_K, MoELM, batch
from .test_experts import ATOL, ROWS, _train, assert_like_one_process, train_parallel


# -- beside tensor parallelism: 2 x 2 ranks -------------------------------------------

# Megatron's attention and shared expert on "tp" (qkv split by head groups)
_ATTENTION = {"blocks.*.qkv.weight": spmd.StridedShard(0, 3),
              "blocks.*.qkv.bias": spmd.StridedShard(0, 3), "blocks.*.proj.weight": spmd.Shard(1),
              "blocks.*.moe.shared.0.weight": spmd.Shard(0),
              "blocks.*.moe.shared.0.bias": spmd.Shard(0),
              "blocks.*.moe.shared.2.weight": spmd.Shard(1)}

TP_LAYOUTS = {  # name -> (strategy, the experts split on "tp" too, batch sizes per step)
    # the experts whole on "tp" (Megatron-Core's expert_tensor_parallel_size=1); the batch
    # size changes: the recompiled dynamic graphs run on the eager path (tensor
    # parallelism plans fixed shapes), whose experts gather their pieces
    "ddp x ep x tp": ("ddp", False, ROWS),
    # expert tensor parallelism: gate_up column-parallel, down row-parallel
    "fsdp x ep x etp": ("fsdp", True, [2, 2, 2]),
}


def tp_job(rank: int, base, strategy: str, split: bool, sizes) -> dict:
    _, out = train_parallel(base, (2, 2), ("ep", "tp"), strategy, [
        spmd.ep.experts(tensor_parallel="tp" if split else None), {"tp": dict(_ATTENTION)}],
        sizes)
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("layout", list(TP_LAYOUTS))
def test_expert_parallel_beside_tensor_parallelism_trains_like_one_process(layout):
    """2 x 2 ranks ("ep", "tp"): the experts split by expert index along "ep" and, with
    ``tensor_parallel="tp"``, by their features along "tp"; routing skewed so that an
    expert gets no token. Equal to one process on the whole batch."""
    strategy, split, sizes = TP_LAYOUTS[layout]
    torch.manual_seed(0)
    base = MoELM(skew=4.0).double()
    want = _train(copy.deepcopy(base), None, 2, sizes=sizes)
    runs = dist.spawn(tp_job, args=(base, strategy, split, sizes), nprocs=4,
                      start_method="forkserver", timeout=115)
    for rank, got in enumerate(runs):
        # its 4 experts of 8; with expert tensor parallelism half of each one's features
        assert got["stored"] == (EXPERTS // 2, 12 if split else 24, 16), got["stored"]
        assert_like_one_process(got, want, rank)
        plan = got["plan"]
        assert "expert parallelism along 'ep' (2 ranks)" in plan
        # the experts' weights are never gathered along "tp" by the compiled step
        gathers = [line for line in plan.splitlines()
                   if line.startswith("all_gather") and "grouped_mm" in line]
        assert not gathers, gathers
        if sizes != ROWS:  # fixed shapes: every training step ran the planned graph
            assert "graph1 (recompiled" not in plan and "graph2 (" not in plan, plan


# -- beside context parallelism: 2 x 2 ranks ("ep", "cp") -----------------------------

CP_LAYOUTS = {  # name -> (strategy, batch sizes per step)
    # fixed shapes: every step runs the planned graph (each rank routes its part of the
    # sequence)
    "ddp x ep x cp": ("ddp", [2, 2, 2], None),
    # the batch size changes: the recompiled dynamic graphs run on the eager path (every
    # rank the whole sequence, routed over its expert-parallel group)
    "fsdp x ep x cp": ("fsdp", ROWS, None),
    # each rank's experts bounded at its share of T·k rows: the skewed routing overflows
    # it, every rank of the mesh (both "cp" parts) runs the forward again
    "ddp x ep x cp, headroom 1": ("ddp", [2, 2, 2], 1.0),
}
CP_SEQ = 8  # a causal ring over 2 ranks, load-balanced: 4 chunks


def cp_job(rank: int, base, strategy: str, sizes, headroom=None) -> dict:
    model, out = train_parallel(base, (2, 2), ("ep", "cp"), strategy,
                                [spmd.ep.experts(headroom=headroom), spmd.cp.ring()], sizes,
                                seq=CP_SEQ)
    out["grown"] = sum(spec.grown for spec in model._spmd.experts.values())
    out["load"] = {k: v.tolist() for k, v in spmd.ep.expert_load(model).items()}
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("layout", list(CP_LAYOUTS))
def test_expert_parallel_beside_context_parallelism_trains_like_one_process(layout):
    """2 x 2 ranks ("ep", "cp"): the sequence split over "cp" (ring attention), the
    experts by expert index over "ep"; each rank routes its own part of the sequence
    over its "ep" group. Routing skewed so that an expert gets no token. Equal to one
    process on the whole batch; the planned step gathers nothing along "cp" but the
    caller's output (the router, the token rows repeated for their choices and the
    combine keep the sequence split)."""
    strategy, sizes, headroom = CP_LAYOUTS[layout]
    torch.manual_seed(0)
    base = MoELM(skew=4.0).double()
    want = _train(copy.deepcopy(base), None, 2, sizes=sizes, seq=CP_SEQ)
    runs = dist.spawn(cp_job, args=(base, strategy, sizes, headroom), nprocs=4,
                      start_method="forkserver", timeout=115)
    for rank, got in enumerate(runs):
        assert got["stored"] == (EXPERTS // 2, 24, 16), got["stored"]
        assert_like_one_process(got, want, rank)
        # the last forward (an evaluation, one row per data rank): every (token, choice)
        # of the whole batch counted once, each rank's part of the sequence summed
        assert got["load"] == runs[0]["load"]
        assert all(sum(load) == 2 * CP_SEQ * TOP_K for load in got["load"].values())
        plan = got["plan"]
        assert "expert parallelism along 'ep' (2 ranks)" in plan
        if sizes == CP_LAYOUTS["ddp x ep x cp"][1]:
            gathers = [line for line in plan.splitlines()
                       if line.startswith("all_gather") and "/cp/" in line]
            assert len(set(gathers)) == 1 and "the caller receives whole" in gathers[0], gathers
            # every training step planned (recompiled only where a headroom grew)
            assert "(recompiled for" not in plan, plan
        assert (got["grown"] > 0) == (headroom is not None), got["grown"]


def _train_accumulating(model, rank, world: int, seq: int = CP_SEQ) -> dict:
    """The loop with two microbatches per step (two forward and backward calls, one
    optimizer step), each layer's router frozen in step 1 and trained again after: what
    a rank feeds with ``rank`` (None: one process, the whole batch)."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    routers = [p for n, p in model.named_parameters() if ".router." in n]
    for step in range(3):
        for p in routers:
            p.requires_grad_(step != 1)
        for micro in range(2):
            x, y = batch(10 * step + micro, rows=2 * world, seq=seq)
            part = slice(None) if rank is None else slice(rank * 2, (rank + 1) * 2)
            (F.cross_entropy(model(x[part]).flatten(0, 1), y[part].flatten()) / 2).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        model.eval()
        x, _ = batch(99, rows=world, seq=seq)
        evaluated = model(x if rank is None else x[rank:rank + 1]).detach().clone()
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "eval": evaluated}


def cp_loop_job(rank: int, base) -> dict:
    from ..zoo import data_index

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=90))
    model = spmd.parallelize(copy.deepcopy(base), mesh=spmd.Mesh((2, 2), dim_names=("ep", "cp")),
                             strategy="ddp", placements=[spmd.ep.experts(), spmd.cp.ring()])
    index, count = data_index(model._spmd.setup.strategy.mesh, model._spmd.setup.strategy)
    out = _train_accumulating(model, index, count)
    out["index"], out["plan"] = index, str(spmd.inspect(model))
    dist.destroy_process_group()
    return out


def test_expert_parallel_beside_context_parallelism_in_the_loops_users_write():
    """ddp x ep x cp on 2 x 2 ranks, the loop users write around it: gradients
    accumulated over two backward calls per step, the routers frozen for one step (a
    graph of its own) and trained again, clipping, an evaluation forward. Equal to one
    process accumulating the same microbatches of the whole batch."""
    torch.manual_seed(0)
    base = MoELM(skew=4.0).double()
    want = _train_accumulating(copy.deepcopy(base), None, 2)
    frozen = {k: v for k, v in base.state_dict().items() if ".router." in k}
    runs = dist.spawn(cp_loop_job, args=(base,), nprocs=4, start_method="forkserver",
                      timeout=115)
    for rank, got in enumerate(runs):
        assert_like_one_process(got, want, rank)
        assert "expert parallelism along 'ep' (2 ranks)" in got["plan"]
        assert "graph1 (a new region or code path" in got["plan"]  # the frozen step's
    # (the routers did train in the other steps: the check above is not on frozen values)
    assert all(not torch.equal(want["state"][k], v) for k, v in frozen.items())


class _Mish(torch.nn.Module):
    def forward(self, x):
        return F.mish(x)  # aten.mish: no sharding rule


def test_an_op_between_the_expert_products_that_would_gather_received_rows_is_an_error():
    """Beside context parallelism the rows an experts layer receives are each rank's own
    (no split of a whole tensor): an activation without a sharding rule, which would
    gather them along "cp", is refused naming it, never run on gathered rows."""
    model = MoELM()
    for block in model.blocks:
        block.moe.experts.act_fn = _Mish()
    mesh = spmd.Mesh.simulated((2, 2), dim_names=("ep", "cp"))
    x, _ = batch(0, rows=2, seq=CP_SEQ)
    with pytest.raises(spmd.ShardingError, match="mish .*holds rows an experts layer "
                                                  "received"):
        spmd.inspect(model, x, mesh=mesh, placements=[spmd.ep.experts(), spmd.cp.ring()])


# -- in a pipeline: pp x ep, 2 x 2 ranks -----------------------------------------------

PP_ROWS = [2, 4, 2]  # per data rank, step by step (a new shape traces the stages again)


def _lm_loss(out, y):
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def _pp_model(family: str):
    """(model, loss_fn, batch(step, rows)) of the own MoE model or a zoo family."""
    if family == "own":
        torch.manual_seed(0)
        return MoELM(skew=4.0).double(), _lm_loss, lambda k, rows: batch(k, rows=rows)
    from ..zoo import entry

    e = entry(family)
    return e.model(), e.loss_fn, lambda k, rows: e.make_batch(step=k, rows=rows)


def _train_pipeline(step, model, batch_of, rank: int | None) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for k, rows in enumerate(PP_ROWS):
        x, y = batch_of(k, 2 * rows)
        part = slice(None) if rank is None else slice(rank * rows, (rank + 1) * rows)
        step(x[part], y[part])
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()


def pp_job(rank: int, family: str, strategy: str, schedule: str) -> dict:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=90))
    mesh = spmd.Mesh((2, 2), dim_names=("pp", "ep"))
    model, loss_fn, batch_of = _pp_model(family)
    pm = spmd.parallelize(model, mesh=mesh, strategy=strategy, placements=spmd.ep.experts(),
                          pipeline=spmd.pp.schedule(schedule, microbatches=2))
    me = mesh.coordinate()[1]
    _train_pipeline(lambda x, y: pm.step(x, y, loss_fn), model, batch_of, me)
    out = {"state": {k: v.detach().clone() for k, v in pm.state_dict().items()},
           "stored": {n: tuple(p.shape) for n, p in model.named_parameters()
                      if "experts" in n and p.numel()},
           "load": {k: v.tolist() for k, v in spmd.ep.expert_load(model).items()},
           "plan": "\n".join(str(p) for p in pm.plan().stage_plans.values())}
    dist.destroy_process_group()
    return out


PP_CASES = {  # name -> (model, strategy on "ep", schedule)
    "own ddp 1f1b": ("own", "ddp", "1f1b"),
    "own fsdp gpipe": ("own", "fsdp", "gpipe"),
    "mixtral ddp 1f1b": ("mixtral", "ddp", "1f1b"),  # transformers' Mixtral, zoo config
}


@pytest.mark.parametrize("case", list(PP_CASES))
def test_expert_parallel_stages_of_a_pipeline_train_like_one_process(case):
    """pp x ep: the model cut into 2 stages over "pp", each stage's experts split by
    expert index over "ep" (the rest of it under ddp or fsdp there); 2 microbatches, the
    batch size changing, clipping over every stage. Each rank's stages equal one process
    on the whole batch, and hold only their own experts."""
    family, strategy, schedule = PP_CASES[case]
    reference, loss_fn, batch_of = _pp_model(family)
    experts = next(m.gate_up_proj.shape[0] for n, m in reference.named_modules()
                   if n.endswith("experts"))
    _train_pipeline(lambda x, y: loss_fn(reference(x), y).backward(), reference, batch_of,
                    None)
    want = reference.state_dict()
    runs = dist.spawn(pp_job, args=(family, strategy, schedule), nprocs=4,
                      start_method="forkserver", timeout=115)
    held = set()
    for rank, got in enumerate(runs):
        assert got["state"], f"rank {rank} holds no stage"
        for key, value in got["state"].items():
            diff = float((value - want[key]).abs().max())
            assert diff < ATOL, f"rank {rank}: {key} differs by {diff:.3g}"
        held |= set(got["state"])
        # this rank's experts only: half of each layer's
        assert got["stored"] and all(shape[0] == experts // 2
                                     for shape in got["stored"].values()), got["stored"]
        assert "expert parallelism along 'ep' (2 ranks)" in got["plan"], got["plan"]
    assert held == set(want)  # the pipeline's ranks hold every entry between them
    if family == "own":  # skewed: some expert of some stage got no token
        assert any(0 in load for r in runs for load in r["load"].values())


def test_a_pipeline_plan_on_a_simulated_cluster_lists_each_stages_experts():
    """pp x ep planned without processes (2 stages of 2 blocks on 2 x 4 simulated H100s):
    each stage's plan holds the expert ops of its own blocks and prices them on "ep"."""
    from spmd.hardware import H100_SXM

    mesh = spmd.Mesh.simulated((2, 4), dim_names=("pp", "ep"), hardware=H100_SXM(nodes_of=4))
    x, y = batch(0, rows=8)
    plan = spmd.inspect(MoELM(layers=4), x, target=y, loss_fn=_lm_loss, mesh=mesh,
                        placements=spmd.ep.experts(),
                        pipeline=spmd.pp.schedule("1f1b", microbatches=4))
    layers = []
    for index, stage in sorted(plan.stage_plans.items()):
        text = str(stage)
        assert "expert parallelism along 'ep' (4 ranks)" in text, text
        layers.append([line.split()[0] for line in text.splitlines()
                       if line.startswith("blocks.")])
    assert layers == [["blocks.0.moe.experts", "blocks.1.moe.experts"],
                      ["blocks.2.moe.experts", "blocks.3.moe.experts"]], layers


# -- strategy="auto" over expert parallelism ---------------------------------------------


def test_the_automatic_layout_plans_each_layout_with_and_without_expert_parallelism():
    """A model with experts modules: every data strategy is planned as it is and with its
    experts split ("x ep"), each priced with its all-to-alls; with ``spmd.ep.experts()``
    given, the chosen layout is one that splits them."""
    mesh = spmd.Mesh.simulated((8,), dim_names=("ep",), hardware=_h100())
    x, _ = batch(0, rows=4)
    auto = spmd.inspect(MoELM(), x, mesh=mesh, strategy="auto").auto
    labels = {c.label for c in auto.candidates}
    assert {"fsdp x ep", "ddp x ep", "zero2 x ep"} <= labels, labels
    with_ep = [c for c in auto.candidates if c.experts is not None and not c.error]
    assert with_ep and all(c.seconds > 0 and "expert parallelism along" in str(c.plan)
                           for c in with_ep)
    forced = spmd.inspect(MoELM(), x, mesh=mesh, strategy="auto",
                          placements=spmd.ep.experts()).auto
    assert forced.chosen.experts is not None and forced.chosen.label.endswith(" x ep")
    assert forced.chosen.seconds == min(c.seconds for c in forced.candidates
                                        if c.experts is not None and c.fits(forced.budget))


def _h100():
    from spmd.hardware import H100_SXM

    return H100_SXM(nodes_of=4)


def auto_job(rank: int, base) -> dict:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=90))
    mesh = spmd.Mesh((2,), dim_names=("ep",))
    model = spmd.parallelize(copy.deepcopy(base), mesh=mesh, strategy="auto",
                             placements=spmd.ep.experts())
    out = _train(model, rank, 2, sizes=[2, 2, 2])
    out["auto"] = model._spmd.auto.summary
    out["stored"] = tuple(model.module.blocks[0].moe.experts._parameters["gate_up_proj"].shape)
    dist.destroy_process_group()
    return out


def test_the_automatic_layout_with_experts_trains_like_one_process():
    """``strategy="auto"`` with ``spmd.ep.experts()`` on 2 live ranks: the search (on rank
    0, sent to the other) picks a layout that splits the experts, and it trains equal to
    one process."""
    torch.manual_seed(0)
    base = MoELM().double()
    want = _train(copy.deepcopy(base), None, 2, sizes=[2, 2, 2])
    runs = dist.spawn(auto_job, args=(base,), nprocs=2, start_method="forkserver",
                      timeout=115)
    for rank, got in enumerate(runs):
        assert got["stored"][0] == EXPERTS // 2, got["stored"]
        assert "x ep" in got["auto"].splitlines()[0], got["auto"]
        assert_like_one_process(got, want, rank, evaluation=False)


# -- transformers' families, the batch size changing ----------------------------------

HF_FAMILIES = ("deepseek_v3", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss")
HF_ROWS = [2, 1, 3]  # per rank, step by step


def _hf_model(family: str):
    """The family's tiny causal LM; DeepSeek-V3's routing (4 experts, top-2) skewed
    through its bias-corrected selection: experts 0 and 1 chosen by every token, so that
    every pair goes to rank 0 and rank 1's experts get none."""
    from ..hf_catalogue import build

    model = build(family)
    for module in model.modules():
        bias = getattr(module, "e_score_correction_bias", None)
        if bias is not None:
            with torch.no_grad():
                bias[0], bias[1], bias[3] = 1e3, 1e3, -1e3
    return model


def _hf_tolerance(family: str) -> float:
    """1e-9 for a family computed wholly in float64; for one that computes parts in
    float32 (DeepSeek-V3's router), 10 times how far one process's run moves when every
    parameter starts perturbed by float32's rounding (tests/hf_sweep.py's floor)."""
    from ..hf_sweep import low_precision_ops, nudged

    if not low_precision_ops(family):
        return 1e-9
    moved = _hf_train(nudged(_hf_model(family)), None, 2)
    plain = _hf_train(_hf_model(family), None, 2)
    return max(1e-9, 10 * max(float((moved[k] - v).abs().max()) for k, v in plain.items()))


def _hf_train(model, rank, world: int) -> dict:
    from ..hf_sweep import CLIP, LR, lm_loss, make_batch

    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step, rows in enumerate(HF_ROWS):
        x, y = make_batch(step, rows=rows * world)
        part = slice(None) if rank is None else slice(rank * rows, (rank + 1) * rows)
        lm_loss(model(x[part]), y[part]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def hf_job(rank: int, families, headroom) -> dict:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=90))
    out = {}
    for family in families:
        model = spmd.parallelize(_hf_model(family), mesh=spmd.Mesh((2,), dim_names=("ep",)),
                                 placements=spmd.ep.experts(headroom=headroom))
        state = _hf_train(model, rank, 2)
        out[family] = (state, {k: v.tolist() for k, v in spmd.ep.expert_load(model).items()},
                       sum(spec.grown for spec in model._spmd.experts.values()))
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("families,headroom", [
    (HF_FAMILIES[:2], None), (HF_FAMILIES[2:], None), (HF_FAMILIES[:1], 1.0)],
    ids=["deepseek_v3+mixtral", "qwen2_moe+qwen3_moe+olmoe+gpt_oss", "deepseek_v3-headroom"])
def test_transformers_families_under_ep_with_the_batch_size_changing(families, headroom):
    """The MoE families the issue names, from transformers' tiny configs, under ep on 2
    ranks with each rank's rows changing step by step (2, 1, 3: the dynamic graphs run
    the eager path), AdamW and clipping, equal to one process in float64 (DeepSeek-V3,
    whose router computes in float32, within 10 times its float32 floor). DeepSeek-V3's
    routing is skewed through its bias-corrected selection so that every pair goes to
    rank 0's experts and rank 1's get none; with a headroom of 1 that overflows, and the
    forward runs again."""
    runs = dist.spawn(hf_job, args=(families, headroom), nprocs=2,
                      start_method="forkserver", timeout=115)
    for family in families:
        want = _hf_train(_hf_model(family), None, 2)
        tolerance = _hf_tolerance(family)
        for rank, out in enumerate(runs):
            state, load, grown = out[family]
            for key, value in want.items():
                diff = float((state[key] - value).abs().max())
                assert diff < tolerance, f"{family} rank {rank}: {key} differs by {diff:.3g}"
            if family == "deepseek_v3":  # the last step's load (3 rows of 8 per rank)
                for counts in load.values():
                    assert counts == [2 * 3 * 8, 2 * 3 * 8, 0, 0], counts
                assert (grown > 0) == (headroom is not None), grown
