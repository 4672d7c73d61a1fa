"""Expert parallelism (``spmd.ep``) on real ranks over Gloo, in float64.

- The ops alone (``spmd::ep_route``, ``ep_scatter``, ``grouped_mm``, ``ep_gather``): each
  rank's output and gradients for its tokens, and each rank's experts' weight gradients,
  equal one computation over every rank's tokens with every expert, to 1e-12; on routing
  that is uniform, skewed so that one expert gets no token, and so skewed that every
  token of every rank goes to rank 0's experts.
- ``spmd.parallelize(..., placements=spmd.ep.experts())`` on an own MoE language model
  (``tests/moe.py``: softmax router, top-2, normalised weights, a shared expert) under
  ``ddp``, ``fsdp``, ``zero2`` and ``hsdp`` (the experts along either dimension; along the
  replicas' one, sharded further along the other): AdamW with clipping, 3 steps, the batch
  sizes changing every step, equal to one process on the whole batch (1e-10: AdamW's
  division amplifies the re-associated sums to ~2e-12); a capacity factor against one
  process dropping the same pairs; checkpoints; the load-balancing loss; the plan's
  pricing on a simulated cluster; refusals.
- Headrooms (the received rows bounded, a forward that overflows run again):
  ``test_experts_headroom.py``.
- Composed with tensor parallelism, pipelines and ``strategy="auto"``:
  ``test_experts_compose.py``; Hugging Face families: ``test_hf_sweep.py``.
"""

from __future__ import annotations

import copy
import math
from datetime import timedelta

import pytest
import torch
import torch.nn.functional as F

import spmd
from spmd import runtime as dist

from ..moe import EXPERTS, MoELM, batch

ATOL = 1e-10


# -- the ops against one computation over every rank's tokens -----------------------


def _whole(x, idx, w, gu, dn, b):
    """Every token through its experts, one by one (the reference)."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            h = gu[e] @ x[t] + b[e]
            gate, up = h.chunk(2)
            out[t] = out[t] + w[t, j] * (dn[e] @ (F.silu(gate) * up))
    return out


def _routing(kind: str, tokens: int, k: int, experts: int, gen) -> torch.Tensor:
    if kind == "uniform":
        return torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    if kind == "one_idle":  # the last expert gets no token
        return torch.stack([torch.randperm(experts - 1, generator=gen)[:k]
                            for _ in range(tokens)])
    # every token of every rank to rank 0's first experts
    return torch.arange(k).repeat(tokens, 1)


def ops_job(rank: int, kinds: list[str]) -> dict:
    from spmd.lowering import experts as X
    from spmd.lowering.specs import Handles
    from spmd.runtime.groups import resolve_group

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    n = dist.get_world_size()
    group = resolve_group(None, "test")
    handles = Handles()
    found = {}
    for kind in kinds:
        gen = torch.Generator().manual_seed(5)  # the same draws on every rank
        experts, hidden, inter, tokens, k = 4 * n, 6, 5, 7, 2
        local = experts // n
        xs = torch.randn(n, tokens, hidden, dtype=torch.float64, generator=gen)
        idx = torch.stack([_routing(kind, tokens, k, experts, gen) for _ in range(n)])
        ws = torch.rand(n, tokens, k, dtype=torch.float64, generator=gen)
        gu = torch.randn(experts, 2 * inter, hidden, dtype=torch.float64, generator=gen)
        dn = torch.randn(experts, hidden, inter, dtype=torch.float64, generator=gen)
        b = torch.randn(experts, 2 * inter, dtype=torch.float64, generator=gen)
        grad = torch.randn(n, tokens, hidden, dtype=torch.float64, generator=gen)
        # the reference: every rank's tokens, every expert, one process
        ref = [t.clone().requires_grad_() for t in (xs, ws, gu, dn, b)]
        out = torch.stack([_whole(ref[0][r], idx[r], ref[1][r], ref[2], ref[3], ref[4])
                           for r in range(n)])
        (out * grad).sum().backward()
        # this rank: its tokens, its experts
        mine = slice(rank * local, (rank + 1) * local)
        x = xs[rank].clone().requires_grad_()
        w = ws[rank].clone().requires_grad_()
        p = [t[mine].clone().requires_grad_() for t in (gu, dn, b)]
        spec = X.ExpertsSpec(module="test", num_experts=experts, size=n, group=group)
        h = handles.add(spec)
        order, send, recv, offs = X.ep_route(idx[rank], h)
        rows = X.ep_scatter(x.repeat_interleave(k, 0), order, send, recv,
                            X.bound_rows(n, tokens, k), h)
        gate, up = X.grouped_mm(rows, p[0], offs, p[2], False, 1.0).chunk(2, -1)
        ys = X.grouped_mm(F.silu(gate) * up, p[1], offs, None, False, 1.0)
        got = (X.ep_gather(ys, order, send, recv, h).view(tokens, k, hidden)
               * w.unsqueeze(-1)).sum(1)
        (got * grad[rank]).sum().backward()
        pairs = [(got, out[rank]), (x.grad, ref[0].grad[rank]), (w.grad, ref[1].grad[rank]),
                 (p[0].grad, ref[2].grad[mine]), (p[1].grad, ref[3].grad[mine]),
                 (p[2].grad, ref[4].grad[mine])]
        found[kind] = (max(float((a - e).abs().max()) for a, e in pairs),
                       spec.load.tolist())
    dist.destroy_process_group()
    return found


KINDS = ["uniform", "one_idle", "all_to_rank0"]


@pytest.fixture(scope="module", params=[2, 4], ids=["2-ranks", "4-ranks"])
def op_runs(request):
    return dist.spawn(ops_job, args=(KINDS,), nprocs=request.param, start_method="thread",
                      timeout=100)


@pytest.mark.parametrize("kind", KINDS)
def test_dispatch_compute_combine_equal_one_computation(op_runs, kind):
    for rank, found in enumerate(op_runs):
        diff, load = found[kind]
        assert diff < 1e-12, f"rank {rank}: differs by {diff:.3g}"
        if kind == "all_to_rank0":
            # every token reached rank 0's experts: the others received none
            assert (sum(load) == 0) == (rank != 0), (rank, load)


@pytest.mark.parametrize("transposed", [False, True], ids=["out-in", "in-out"])
@pytest.mark.parametrize("hidden", [8, 6], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("path", ["torch._grouped_mm", "triton"])
def test_grouped_products_by_a_kernel_equal_the_loop(transposed, hidden, path, monkeypatch):
    """float32 on CPU, a kernel allowed there (on CUDA the default; on CPU the loop is
    faster): ``spmd::grouped_mm`` runs as one ``torch._grouped_mm`` where the rows' stride
    is a multiple of 16 bytes (8 features), else as the loop of ``torch.mm`` (6); under
    ``SPMD_KERNELS=triton`` as spmd's Triton kernels (interpreted here), whatever the
    stride. Forward and backward (rows, weights, bias) equal the float64 loop's to
    float32's rounding, an expert that received no row included, and the padding rows
    are zero."""
    from spmd.kernels import grouped
    from spmd.lowering import experts as X

    if path == "triton":
        monkeypatch.setenv("SPMD_KERNELS", "triton")
    else:
        monkeypatch.setitem(X._GROUPED_DTYPES, "cpu", X.CPU_GROUPED_DTYPES)

    gen = torch.Generator().manual_seed(3)
    experts, out_features, rows = 4, 12, 40
    offs = torch.tensor([10, 10, 30, 36])  # expert 1 gets no row; rows 36.. are padding
    shape = (experts, hidden, out_features) if transposed else (experts, out_features, hidden)
    x64 = torch.randn(rows, hidden, dtype=torch.float64, generator=gen)
    x64[36:] = 0  # what ep_scatter pads with
    w64 = torch.randn(shape, dtype=torch.float64, generator=gen)
    b64 = torch.randn(experts, out_features, dtype=torch.float64, generator=gen)
    seed = torch.randn(rows, out_features, dtype=torch.float64, generator=gen)
    runs = []
    for dtype in (torch.float64, torch.float32):
        x, w, b = (t.to(dtype).detach().requires_grad_() for t in (x64, w64, b64))
        y = X.grouped_mm(x, w, offs, b, transposed, 0.5)
        (y * seed.to(dtype)).sum().backward()
        runs.append([t.double() for t in (y, x.grad, w.grad, b.grad)])
    kernel = X.grouped_kernel(x, w if transposed else w.transpose(1, 2))
    assert kernel == (hidden == 8 and path != "triton")  # 6 float32 features: 24 bytes
    assert grouped._triton(x) == (path == "triton")  # (float64 stays on the loop)
    assert float(runs[1][0][36:].abs().max()) == 0.0  # the padding rows
    assert float(runs[1][2][1].abs().max()) == 0.0  # the idle expert's weight gradient
    for name, want, got in zip(["output", "rows' gradient", "weights' gradient",
                                "bias gradient"], *runs):
        assert float((got - want).abs().max()) < 1e-4 * (1 + float(want.abs().max())), name


# -- parallelize: a model of our own ---------------------------------------------------

ROWS = [2, 1, 3]  # per rank, step by step: the batch size changes


def _train(model, rank: int | None, world: int, clip: float = 0.5, sizes=ROWS,
           seq: int = 6) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step, rows in enumerate(sizes):
        x, y = batch(step, rows=rows * world, seq=seq)
        part = slice(None) if rank is None else slice(rank * rows, (rank + 1) * rows)
        F.cross_entropy(model(x[part]).flatten(0, 1), y[part].flatten()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    with torch.no_grad():  # an evaluation forward after training
        model.eval()
        x, _ = batch(99, rows=world, seq=seq)
        evaluated = model(x if rank is None else x[rank:rank + 1]).detach().clone()
        model.train()
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "eval": evaluated}


def train_parallel(base, shape, names, strategy: str, placements, sizes=ROWS,
                   seq: int = 6) -> tuple:
    """This rank's run: the process group, ``base`` parallelized on ``Mesh(shape, names)``
    and trained by :func:`_train` on its data rank's rows; the model, and what ``_train``
    gives with the plan, this rank's data index and its stored ``gate_up_proj`` shape.
    The caller destroys the group."""
    from ..zoo import data_index

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=90))
    model = spmd.parallelize(copy.deepcopy(base), mesh=spmd.Mesh(shape, dim_names=names),
                             strategy=strategy, placements=placements)
    planned = model._spmd.setup.strategy
    index, count = data_index(planned.mesh, planned)
    out = _train(model, index, count, sizes=sizes, seq=seq)
    out["plan"] = str(spmd.inspect(model))
    out["index"] = index
    out["stored"] = tuple(model.module.blocks[0].moe.experts._parameters["gate_up_proj"].shape)
    return model, out


def assert_like_one_process(got: dict, want: dict, rank: int, evaluation: bool = True) -> None:
    """Every parameter of a rank's run (and, with ``evaluation``, its evaluation forward
    on its rows) within ``ATOL`` of one process's."""
    for key, value in want["state"].items():
        diff = float((got["state"][key] - value).abs().max())
        assert diff < ATOL, f"rank {rank}: {key} differs by {diff:.3g}"
    if evaluation:
        row = got["index"]
        diff = float((got["eval"] - want["eval"][row:row + 1]).abs().max())
        assert diff < ATOL, f"rank {rank}: the evaluation differs by {diff:.3g}"


def model_job(rank: int, base, strategy: str, shape=(2,), names=("ep",), dim=None) -> dict:
    model, out = train_parallel(base, shape, names, strategy, spmd.ep.experts(dim=dim))
    out["load"] = {k: v.tolist() for k, v in spmd.ep.expert_load(model).items()}
    dist.destroy_process_group()
    return out


LAYOUTS = {  # name -> (strategy, mesh shape, dimension names, the experts' dimension)
    "ddp": ("ddp", (2,), ("ep",), None),
    "fsdp": ("fsdp", (2,), ("ep",), None),
    "zero2": ("zero2", (2,), ("dp",), None),
    # 2 x 2: the experts split along the sharding dimension and replicated along "dp", or
    # split along "dp" and sharded further along the sharding one (dp_shard_mod_ep)
    "hsdp-ep-on-fsdp": ("hsdp", (2, 2), ("dp", "fsdp"), "fsdp"),
    "hsdp-ep-on-dp": ("hsdp", (2, 2), ("dp", "fsdp"), "dp"),
}


@pytest.mark.parametrize("skew", [0.0, 4.0], ids=["routed", "skewed"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expert_parallel_model_trains_like_one_process(layout, skew):
    strategy, shape, names, dim = LAYOUTS[layout]
    world = math.prod(shape)
    ep = shape[names.index(dim)] if dim else world if len(shape) == 1 else None
    torch.manual_seed(0)
    base = MoELM(skew=skew).double()
    want = _train(copy.deepcopy(base), None, world)
    # processes: ranks as threads of one process share state that let one rank's
    # evaluation forward perturb another's optimizer step (seen without spmd.ep too)
    runs = dist.spawn(model_job, args=(base, strategy, shape, names, dim), nprocs=world,
                      start_method="forkserver", timeout=110)
    # its own experts only; under hsdp with the experts along "dp", sharded along "fsdp"
    # too (torchtitan's dp_shard_mod_ep): half of its own
    rows = EXPERTS // ep // (2 if layout == "hsdp-ep-on-dp" else 1)
    for rank, got in enumerate(runs):
        assert got["stored"][0] == rows, got["stored"]
        assert_like_one_process(got, want, rank)
        # the experts' ops broke no graph: every region is a first call, a recompile for
        # the new batch size or the evaluation's; nothing left to the eager path
        assert "graph break" not in got["plan"] and "eager safety net" not in got["plan"]
        assert f"expert parallelism along {dim or names[0]!r} ({ep} ranks)" in got["plan"]
        assert "blocks.1.moe.experts" in got["plan"]
        loads = got["load"]
        assert set(loads) == {"blocks.0.moe.experts", "blocks.1.moe.experts"}
        if skew:  # the last expert got no token in the last forward, and that is correct
            assert any(load[-1] == 0 for load in loads.values()), loads
    # gathered: every rank of an expert group sees every expert's load
    assert all(r["load"].keys() == runs[0]["load"].keys() for r in runs)


# -- a capacity factor: tokens dropped as one process with the same groups drops them -----


def capacity_job(rank: int, base, factor: float) -> dict:
    model, out = train_parallel(base, (2,), ("ep",), "fsdp",
                                spmd.ep.experts(capacity_factor=factor))
    out["dropped"] = {k: v.tolist() for k, v in spmd.ep.dropped_tokens(model).items()}
    dist.destroy_process_group()
    return out


def test_a_capacity_factor_drops_what_one_process_with_the_same_groups_drops():
    """``capacity_factor=1``: each expert takes at most ceil(T·k/E) of each rank's pairs
    (routing skewed: the first experts overflow). Equal to one process whose experts
    drop the same pairs of each rank's tokens (tests/moe.py's reference: the batch in the
    ranks' groups), the batch size changing; ``dropped_tokens`` says what was dropped."""
    torch.manual_seed(0)
    base = MoELM(skew=4.0).double()
    reference = copy.deepcopy(base)
    for block in reference.blocks:
        block.moe.experts.capacity_factor, block.moe.experts.groups = 1.0, 2
    want = _train(reference, None, 2)
    dropless = _train(copy.deepcopy(base), None, 2)
    apart = max(float((want["state"][k] - v).abs().max()) for k, v in dropless["state"].items())
    assert apart > 1e-4, "the reference dropped nothing: the test would test nothing"
    runs = dist.spawn(capacity_job, args=(base, 1.0), nprocs=2, start_method="forkserver",
                      timeout=110)
    for rank, got in enumerate(runs):
        assert_like_one_process(got, want, rank)
        assert "capacity factor 1" in got["plan"], got["plan"]
        # the skewed router overflows the first experts: pairs were dropped, by them
        dropped = got["dropped"]["blocks.0.moe.experts"]
        assert dropped[0] > 0 and dropped[-1] == 0, dropped
    assert runs[0]["dropped"] == runs[1]["dropped"]  # summed over the group


# -- checkpoints: saved split by expert, restored under another layout ------------------


def _steps(model, opt, rank: int | None, world: int, steps: range) -> None:
    for step in steps:
        x, y = batch(step, rows=2 * world)
        part = slice(None) if rank is None else slice(rank * 2, (rank + 1) * 2)
        F.cross_entropy(model(x[part]).flatten(0, 1), y[part].flatten()).backward()
        opt.step()
        opt.zero_grad()


def checkpoint_job(rank: int, base, directory: str, second: str) -> dict:
    from spmd.checkpoint import CheckpointManager

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=90))
    mesh = spmd.Mesh((2,), dim_names=("ep",))
    model = spmd.parallelize(copy.deepcopy(base), mesh=mesh, placements=spmd.ep.experts())
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    manager = CheckpointManager(directory, model, opt, async_save=False)
    _steps(model, opt, rank, 2, range(2))
    manager.save(2)
    manager.close()
    # the next run: another layout (fsdp with the experts whole, or ep again)
    placements = spmd.ep.experts() if second == "fsdp x ep" else None
    model = spmd.parallelize(copy.deepcopy(base), mesh=spmd.Mesh((2,), dim_names=("fsdp",)),
                             strategy="fsdp", placements=placements)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    manager = CheckpointManager(directory, model, opt, async_save=False)
    start = manager.restore()
    _steps(model, opt, rank, 2, range(start, 3))
    manager.close()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    dist.destroy_process_group()
    return {"start": start, "state": state}


@pytest.mark.parametrize("second", ["fsdp", "fsdp x ep"])
def test_a_checkpoint_split_by_expert_resumes_under_another_layout(tmp_path, second):
    torch.manual_seed(0)
    base = MoELM().double()
    model = copy.deepcopy(base)
    _steps(model, torch.optim.AdamW(model.parameters(), lr=0.01), None, 2, range(3))
    want = {k: v.detach() for k, v in model.state_dict().items()}
    runs = dist.spawn(checkpoint_job, args=(base, str(tmp_path), second), nprocs=2,
                      start_method="forkserver", timeout=110)
    for rank, got in enumerate(runs):
        assert got["start"] == 2
        worst = max(float((got["state"][k] - v).abs().max()) for k, v in want.items())
        assert worst < ATOL, f"rank {rank}: differs by {worst:.3g}"


# -- the router's auxiliary loss over the whole batch ------------------------------------

AUX = 0.1


def _train_aux(model, rank: int | None, world: int, handle_model) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(3):
        x, y = batch(step, rows=2 * world)
        part = slice(None) if rank is None else slice(rank * 2, (rank + 1) * 2)
        out, routed = model(x[part])
        aux = spmd.ep.load_balancing_loss(routed, 2, model=handle_model)
        (F.cross_entropy(out.flatten(0, 1), y[part].flatten()) + AUX * aux).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def aux_job(rank: int, base) -> tuple[dict, dict]:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=90))
    mesh = spmd.Mesh((dist.get_world_size(),), dim_names=("ep",))
    found = []
    for whole in (True, False):  # over every rank's tokens; each rank's alone
        model = spmd.parallelize(copy.deepcopy(base), mesh=mesh, placements=spmd.ep.experts())
        found.append(_train_aux(model, rank, dist.get_world_size(), model if whole else None))
    dist.destroy_process_group()
    return tuple(found)


def test_the_load_balancing_loss_is_the_whole_batchs():
    """With ``model=``, the auxiliary loss's means are taken over both ranks' tokens: the
    training equals one process's; each rank's own (what a model computing it per rank
    gets) does not."""
    torch.manual_seed(0)
    base = MoELM(router_logits=True).double()
    want = _train_aux(copy.deepcopy(base), None, 2, None)
    runs = dist.spawn(aux_job, args=(base,), nprocs=2, start_method="forkserver",
                      timeout=110)
    for rank, (whole, local) in enumerate(runs):
        worst = max(float((whole[k] - v).abs().max()) for k, v in want.items())
        assert worst < ATOL, f"rank {rank}: differs by {worst:.3g}"
        apart = max(float((local[k] - v).abs().max()) for k, v in want.items())
        assert apart > 1e-6, f"rank {rank}: per-rank aux loss came out equal ({apart:.3g})"


def test_a_plan_on_a_simulated_cluster_prices_the_expert_all_to_alls():
    """Planned without processes for 8 GPUs of a published cluster (two nodes of 4): the
    plan's expert section lists each layer and prices its all-to-alls on that link."""
    from spmd.hardware import H100_SXM

    mesh = spmd.Mesh.simulated((8,), dim_names=("ep",), hardware=H100_SXM(nodes_of=4))
    x, _ = batch(0, rows=8)
    text = str(spmd.inspect(MoELM(), x, mesh=mesh, placements=spmd.ep.experts()))
    assert "expert parallelism along 'ep' (8 ranks)" in text
    lines = [line for line in text.splitlines() if line.startswith("blocks.")]
    assert len(lines) == 2 and all(float(line.split()[-1]) > 0 for line in lines), lines
    assert "per link" in text


def test_the_all_to_all_across_nodes_is_priced_per_link_and_counted_in_the_step():
    """On 2 nodes of 4 H100s, an all-to-all's bytes for the other node's ranks go on each
    GPU's network path, those for its own node's over NVLink at the same time: cheaper
    than the flat pairwise price on the network alone. The predicted step holds the
    expert all-to-alls, blocking (exposed)."""
    from spmd.ep import all_to_all_seconds
    from spmd.hardware import H100_SXM
    from spmd.lowering.cost_model import CostModel, along

    mesh = spmd.Mesh.simulated((8,), dim_names=("ep",), hardware=H100_SXM(nodes_of=4))
    link = along(mesh, "ep", None)
    n = 64 << 20
    across = 4 * link.alpha + 4 / 8 * n * (link.outer_beta or link.beta)
    within = 3 * link.inner_alpha + 3 / 8 * n * link.inner_beta
    assert link.seconds("all_to_all", n) == pytest.approx(max(across, within))
    assert link.seconds("all_to_all", n) < CostModel.seconds(link, "all_to_all", n, "pairwise")
    x, _ = batch(0, rows=8)
    plan = spmd.inspect(MoELM(), x, mesh=mesh, placements=spmd.ep.experts())
    priced = all_to_all_seconds(plan)
    # per layer: the counts and the rows out and back in forward, again in backward
    assert sorted(len(nodes) for nodes in priced.values()) == [4, 6], priced
    total = sum(t for nodes in priced.values() for _, t in nodes.values())
    timeline = plan.predicted_timeline()
    assert timeline.exposed_seconds >= total > 0
    spans = [s for s in timeline.lane("communication") if s.label.endswith("all-to-all")]
    assert len(spans) == 10 and sum(s.seconds for s in spans) == pytest.approx(total)


def test_a_model_on_the_meta_device_is_planned_with_its_experts_split():
    """transformers' DeepSeek-V3 (tiny, normalised top-k: an in-place division of the
    routing weights) built on the meta device is captured and planned, its experts
    split: nothing is read from a meta tensor, and no activation is taken for a
    parameter written in place."""
    transformers = pytest.importorskip("transformers")
    config = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        n_group=2, topk_group=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, norm_topk_prob=True, use_cache=False)
    with torch.device("meta"):
        model = transformers.DeepseekV3ForCausalLM(config)
    ids = torch.zeros((1, 8), dtype=torch.int64, device="meta")
    plan = spmd.inspect(model, ids, mesh=spmd.Mesh.simulated((2,), dim_names=("ep",)),
                        strategy="fsdp", placements=spmd.ep.experts())
    text = str(plan)
    assert not plan.fallbacks and "1 captured region(s)" in text, text
    assert "model.layers.1.mlp.experts" in text


# -- bad input -------------------------------------------------------------------------


def test_experts_that_do_not_divide_over_the_ranks_are_refused_by_name():
    with pytest.raises(ValueError, match=r"blocks\.0\.moe\.experts has 8 experts, which "
                                         r"do not divide over the 3 ranks"):
        spmd.parallelize(MoELM(), mesh=spmd.Mesh.simulated(3), placements=spmd.ep.experts())


def test_a_model_without_experts_is_refused():
    with pytest.raises(ValueError, match="no module of it is an experts module"):
        spmd.parallelize(torch.nn.Linear(4, 4), mesh=spmd.Mesh.simulated(2),
                         placements=spmd.ep.experts())
    with pytest.raises(ValueError, match=r"no module matching \['nothing\.\*'\]"):
        spmd.parallelize(MoELM(), mesh=spmd.Mesh.simulated(2),
                         placements=spmd.ep.experts(modules=["nothing.*"]))


def test_bad_arguments_are_refused_before_anything_runs():
    with pytest.raises(TypeError, match="dim must be a mesh dimension's name"):
        spmd.ep.experts(dim=3)
    with pytest.raises(TypeError, match="modules must be a sequence"):
        spmd.ep.experts(modules="blocks")
    with pytest.raises(ValueError, match="spmd.ep.experts\\(\\) twice"):
        spmd.parallelize(MoELM(), mesh=spmd.Mesh.simulated(2),
                         placements=[spmd.ep.experts(), spmd.ep.experts()])
    with pytest.raises(ValueError, match="a dimension the batch is split along"):
        spmd.parallelize(MoELM(), mesh=spmd.Mesh.simulated(2),
                         placements=spmd.ep.experts(dim="tp"))


def test_an_experts_module_with_more_than_its_experts_is_refused_by_name():
    """A module the expert-parallel forward cannot stand in for (a per-expert norm inside
    it, as Ergo's) is refused, not run with its norm dropped."""
    from ..moe import Experts

    class NormedExperts(Experts):
        def __init__(self) -> None:
            super().__init__()
            self.norm = torch.nn.RMSNorm(16)

    model = MoELM()
    for block in model.blocks:
        block.moe.experts = NormedExperts()
    with pytest.raises(ValueError, match=r"blocks\.0\.moe\.experts \(NormedExperts\) cannot be "
                                         r"split by expert: it holds parameters besides its "
                                         r"experts' stacked weights \(norm\.weight\)"):
        spmd.parallelize(model, mesh=spmd.Mesh.simulated(2), placements=spmd.ep.experts())


def test_expert_tensor_parallelism_in_a_pipeline_or_searched_is_refused_until_planned():
    with pytest.raises(NotImplementedError, match="strategy='auto' with expert tensor"):
        spmd.inspect(MoELM(), batch(0, rows=2)[0], mesh=spmd.Mesh.simulated(2),
                     strategy="auto", placements=spmd.ep.experts(tensor_parallel="tp"))
    with pytest.raises(NotImplementedError, match="expert tensor parallelism in a pipeline"):
        spmd.parallelize(MoELM(), mesh=spmd.Mesh.simulated((2, 2, 2),
                                                           dim_names=("pp", "ep", "tp")),
                         placements=spmd.ep.experts(tensor_parallel="tp"),
                         pipeline=spmd.pp.schedule("gpipe", microbatches=2))


def test_a_capacity_factor_beside_context_parallelism_is_refused_until_planned():
    mesh = spmd.Mesh.simulated((2, 2), dim_names=("ep", "cp"))
    with pytest.raises(NotImplementedError, match="beside context parallelism \\(cp\\)"):
        spmd.parallelize(MoELM(), mesh=mesh, placements=[spmd.ep.experts(capacity_factor=1.0),
                                                         spmd.cp.ring()])


def test_a_capacity_factor_must_be_a_positive_number():
    for bad in (0, -1.0, "1.25", True):
        with pytest.raises(ValueError, match="capacity_factor must be a positive number"):
            spmd.ep.experts(capacity_factor=bad)


def test_expert_tensor_parallelism_names_another_dimension():
    with pytest.raises(TypeError, match="tensor_parallel must be a mesh dimension's name"):
        spmd.ep.experts(tensor_parallel=2)
    with pytest.raises(ValueError, match="is the experts' own dimension"):
        spmd.ep.experts(dim="ep", tensor_parallel="ep")
    with pytest.raises(ValueError, match="placements name mesh dimension 'tp'"):
        spmd.parallelize(MoELM(), mesh=spmd.Mesh.simulated((2,), dim_names=("ep",)),
                         placements=spmd.ep.experts(tensor_parallel="tp"))


def test_routing_to_an_expert_that_does_not_exist_names_it():
    from spmd.lowering import experts as X
    from spmd.lowering.specs import Handles

    handles = Handles()
    h = handles.add(X.ExpertsSpec(module="layers.0.experts", num_experts=4, size=1))
    with pytest.raises(ValueError, match=r"layers\.0\.experts: routed to expert 4"):
        X.ep_route(torch.tensor([[0, 4]]), h)
