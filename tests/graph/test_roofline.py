"""Predictions on a simulated GPU cluster (``spmd.plan.roofline``, ``spmd.lowering.meta_trace``):
attention traced on meta as the fused kernel a GPU runs and priced as one, the loss's
decomposition exact, model FLOPs in closed form, every efficiency sourced, memory-bound
chains fused for compiled runs, the optimizer step in the step time, and activation
checkpointing shown per layer."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import spmd
from spmd.hardware import A100_80GB, H100_SXM, H200, Efficiency
from spmd.lowering.cost_model import along
from spmd.lowering.meta_trace import cross_entropy, fused_attention, nll_loss
from spmd.plan.roofline import node_bytes, node_flops, node_times, step_flops


# -- the meta stand-ins are exact ---------------------------------------------------------


@pytest.mark.parametrize("kv_heads,causal,mask", [(4, True, None), (2, True, None),
                                                  (2, False, "bool"), (4, False, "float"),
                                                  (1, False, None)])
def test_fused_attention_equals_sdpa_in_float64(kv_heads, causal, mask):
    g = torch.Generator().manual_seed(kv_heads)
    q = torch.randn(2, 4, 6, 8, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(2, kv_heads, 6, 8, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(2, kv_heads, 6, 8, dtype=torch.float64, generator=g, requires_grad=True)
    m = None
    if mask == "bool":
        m = torch.rand(6, 6, generator=g) > 0.4
        m.fill_diagonal_(True)
    elif mask == "float":
        m = torch.randn(2, 1, 6, 6, dtype=torch.float64, generator=g)
    kwargs = dict(attn_mask=m, is_causal=causal, scale=0.3, enable_gqa=kv_heads != 4)
    ours, theirs = fused_attention(q, k, v, **kwargs), F.scaled_dot_product_attention(
        q, k, v, **kwargs)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)
    for a, b in zip(torch.autograd.grad(ours.square().sum(), (q, k, v)),
                    torch.autograd.grad(theirs.square().sum(), (q, k, v))):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_fused_attention_with_fewer_queries_than_keys_equals_sdpa():
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 4, 3, 8, dtype=torch.float64, generator=g)
    k, v = (torch.randn(1, 2, 5, 8, dtype=torch.float64, generator=g) for _ in range(2))
    torch.testing.assert_close(
        fused_attention(q, k, v, is_causal=True, enable_gqa=True),
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        rtol=0, atol=1e-12)


def test_fused_attention_refuses_mismatched_heads_without_enable_gqa():
    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
    with pytest.raises(RuntimeError, match="enable_gqa=True"):
        fused_attention(q, k, k)


@pytest.mark.parametrize("kwargs", [
    {}, {"reduction": "sum"}, {"reduction": "none"}, {"ignore_index": 2},
    {"label_smoothing": 0.1}, {"label_smoothing": 0.2, "ignore_index": 1},
    {"weight": True}, {"weight": True, "ignore_index": 3, "label_smoothing": 0.1},
    {"weight": True, "reduction": "sum", "label_smoothing": 0.3}])
@pytest.mark.parametrize("spatial", [False, True])
def test_the_loss_decompositions_equal_torch(kwargs, spatial):
    g = torch.Generator().manual_seed(1)
    shape = (5, 7, 3) if spatial else (5, 7)
    x = torch.randn(*shape, dtype=torch.float64, generator=g, requires_grad=True)
    target = torch.randint(0, 7, (5, 3) if spatial else (5,), generator=g)
    kwargs = dict(kwargs)
    if kwargs.pop("weight", False):
        kwargs["weight"] = torch.rand(7, dtype=torch.float64, generator=g) + 0.5
    ours, theirs = cross_entropy(x, target, **kwargs), F.cross_entropy(x, target, **kwargs)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)
    torch.testing.assert_close(torch.autograd.grad(ours.sum(), x)[0],
                               torch.autograd.grad(theirs.sum(), x)[0], rtol=0, atol=1e-12)
    nll = {k: v for k, v in kwargs.items() if k != "label_smoothing"}
    logp = torch.log_softmax(x, 1)
    torch.testing.assert_close(nll_loss(logp, target, **nll), F.nll_loss(logp, target, **nll),
                               rtol=0, atol=1e-12)
    probabilities = torch.softmax(torch.randn(*shape, dtype=torch.float64, generator=g), 1)
    soft = {k: v for k, v in kwargs.items() if k != "ignore_index"}
    torch.testing.assert_close(cross_entropy(x, probabilities, **soft),
                               F.cross_entropy(x, probabilities, **soft), rtol=0, atol=1e-12)


# -- a model whose FLOPs are known in closed form ----------------------------------------


class Block(nn.Module):
    def __init__(self, d: int, heads: int, kv: int, f: int) -> None:
        super().__init__()
        self.heads, self.kv, self.hd = heads, kv, d // heads
        self.wq = nn.Linear(d, d, bias=False)
        self.wk = nn.Linear(d, kv * self.hd, bias=False)
        self.wv = nn.Linear(d, kv * self.hd, bias=False)
        self.wo = nn.Linear(d, d, bias=False)
        self.w1 = nn.Linear(d, f, bias=False)
        self.w2 = nn.Linear(f, d, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        q = self.wq(x).view(b, s, self.heads, self.hd).transpose(1, 2)
        k = self.wk(x).view(b, s, self.kv, self.hd).transpose(1, 2)
        v = self.wv(x).view(b, s, self.kv, self.hd).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        h = x + self.wo(o.transpose(1, 2).reshape(b, s, d))
        return h + self.w2(F.relu(self.w1(h)))


class Net(nn.Module):
    """Embedding, ``layers`` blocks (every other one checkpointed with ``ckpt``), head,
    cross-entropy inside the forward."""

    def __init__(self, layers=2, d=64, heads=4, kv=2, f=128, vocab=96, ckpt=False) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads, kv, f) for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False)
        self.ckpt = ckpt

    def forward(self, x, y):
        h = self.emb(x)
        for i, block in enumerate(self.blocks):
            h = checkpoint(block, h, use_reentrant=False) if self.ckpt and i % 2 == 0 \
                else block(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def _plan(ckpt=False, hardware=None, rows=2, **options):
    with torch.device("meta"):
        model = Net(ckpt=ckpt).to(torch.bfloat16)
        x = torch.randint(0, 96, (rows, 32))
    mesh = spmd.Mesh.simulated(8, hardware=hardware or H100_SXM())
    return model, spmd.inspect(model, x, x, mesh=mesh, strategy="fsdp", **options)


def _attention(plan, phase):
    from spmd.lowering.meta_trace import attention, attention_backward

    target = attention if phase == "forward" else attention_backward
    return [n for n in plan.graphs[f"graph0.{phase}"].graph.nodes if n.target is target]


def test_attention_is_one_node_priced_as_the_fused_kernel():
    _, plan = _plan()
    b, h, kv, s, hd = 2, 4, 2, 32, 16
    forward, backward = _attention(plan, "forward"), _attention(plan, "backward")
    assert len(forward) == len(backward) == 2  # no math path: one node each way per layer
    assert not any("softmax" in str(n.target) and "log" not in str(n.target)
                   for n in plan.graphs["graph0.forward"].graph.nodes)
    full = 2 * b * h * s * s * (hd + hd)  # scores and the weighted sum
    assert node_flops(forward[0]) == full // 2  # causal: half the blocks
    assert node_flops(forward[0], causal_halved=False) == full
    assert node_flops(backward[0]) == full * 5 // 2 // 2  # recomputed scores + 4 products
    two = 2  # bytes of bfloat16
    q, kv_bytes, lse = b * h * s * hd * two, b * kv * s * hd * two, b * h * s * 4
    assert node_bytes(forward[0]) == q + 2 * kv_bytes + q + lse  # q, k, v -> out, lse
    assert node_bytes(backward[0]) == (q + q + 2 * kv_bytes + q + lse) + (q + 2 * kv_bytes)
    # what the forward saves for it: q, k, v, out, lse; never a (seq x seq) score tensor
    saved = {a.name for a in plan.graphs["graph0.forward"].graph.output_node().all_input_nodes}
    scores = b * h * s * s * two
    assert all(a.meta["val"].numel() * a.meta["val"].element_size() < scores
               for a in plan.graphs["graph0.forward"].graph.output_node().all_input_nodes
               if a.name in saved and isinstance(a.meta.get("val"), torch.Tensor)
               and a.meta["val"].dim() == 4)
    assert "FlashAttention" in plan.summary()


def test_model_flops_are_six_n_plus_attention_and_hardware_flops_count_recompute():
    b, s, d, f, vocab, layers, heads, kv = 2, 32, 64, 128, 96, 2, 4, 2
    tokens = b * s
    matmul_params = layers * (2 * d * d + 2 * d * (d // heads * kv) + 2 * d * f) + d * vocab
    attention_full = 4 * b * heads * s * s * (d // heads)  # forward, no causal halving
    model = 6 * tokens * matmul_params + 3 * layers * attention_full
    attention_hw = layers * (attention_full // 2 + attention_full * 5 // 2 // 2)
    _, plain = _plan()
    flops = step_flops(plain.graphs, H100_SXM().device)
    assert flops.model == model and flops.dtype == torch.bfloat16
    assert flops.hardware == 6 * tokens * matmul_params + attention_hw
    # checkpointing block 0 recomputes in backward what its backward reads: every forward
    # product (h = x + wo(o) is w1's input) and attention, but not w2, whose output only
    # feeds the residual add
    _, ckpt = _plan(ckpt=True)
    recomputed = 2 * tokens * (2 * d * d + 2 * d * (d // heads * kv) + d * f) \
        + attention_full // 2
    ckpt_flops = step_flops(ckpt.graphs, H100_SXM().device)
    assert ckpt_flops.model == model
    assert ckpt_flops.hardware == flops.hardware + recomputed
    line = ckpt.summary()
    step = ckpt.predicted_timeline().step_seconds
    assert f"MFU {model / (step * 989e12):.1%} of the bfloat16 peak" in line
    assert f"HFU {ckpt_flops.hardware / (step * 989e12):.1%}" in line


# -- sourced efficiencies ----------------------------------------------------------------


@pytest.mark.parametrize("preset", [A100_80GB, H100_SXM, H200])
def test_every_efficiency_of_a_preset_has_a_source(preset):
    device = preset().device
    for kind in ("matmul", "attention", "memory"):
        found = device.efficiency_of(kind, torch.bfloat16)
        assert 0 < found.value <= 1 and "unsourced" not in found.source
        assert any(word in found.source for word in ("measured", "published"))
    assert "unsourced" in device.efficiency_of("matmul", torch.float32).source
    hw = preset()
    assert hw.bus_efficiency(hw.intra).source.startswith("published")
    if preset is not A100_80GB:  # NCCL's SMs beside the compute: measured on an H100
        assert device.overlap().value == pytest.approx(108 / 132)
        assert hw.cost_model(spmd.Mesh.simulated(8), "dp").overlap == pytest.approx(108 / 132)
    lines = device.efficiency_lines()
    assert any(line.startswith("attention:") for line in lines)


def test_efficiencies_are_validated_and_used():
    hw = H100_SXM()
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        Efficiency(value=1.5, source="x")
    with pytest.raises(ValueError, match="'tensorcore'.*classes are"):
        dataclasses.replace(hw, device=dataclasses.replace(
            hw.device, efficiencies={"tensorcore": Efficiency(value=0.5, source="x")}))
    bare = dataclasses.replace(hw, device=dataclasses.replace(hw.device, efficiencies={}))
    _, plan = _plan(hardware=bare)
    summary = plan.summary()
    assert "matmul, attention, memory: 60.0% (default, unsourced)" in summary
    assert "collective: 100.0% (the links' datasheet figures)" in summary
    assert "overlap: 100.0% (default, unsourced" in summary
    _, sourced = _plan()
    assert sourced.predicted_timeline().step_seconds < plan.predicted_timeline().step_seconds
    # NCCL's SMs slow the compute beside a collective: without them the step is shorter
    free = dict(hw.device.efficiencies, overlap=Efficiency(value=1.0, source="x"))
    _, unshared = _plan(hardware=dataclasses.replace(hw, device=dataclasses.replace(
        hw.device, efficiencies=free)), rows=4096)  # enough compute to hide behind
    _, shared = _plan(rows=4096)
    assert unshared.predicted_timeline().step_seconds < shared.predicted_timeline().step_seconds
    # the bus efficiency scales the link's bandwidth
    a100 = A100_80GB()
    mesh = spmd.Mesh.simulated(8)
    assert a100.cost_model(mesh, "dp").beta == pytest.approx(1 / (300e9 * 0.8))


# -- fusion, the optimizer step, memory by layer ----------------------------------------


def test_a_compiled_run_prices_a_memory_bound_chain_as_one_pass():
    from torch.fx.experimental.proxy_tensor import make_fx

    def chain(x, y):
        return (torch.relu(x * 2) + y).sigmoid() @ y

    x, y = torch.empty(256, 256, device="meta"), torch.empty(256, 256, device="meta")
    gm = make_fx(chain, tracing_mode="fake")(x, y)
    device = H100_SXM().device
    rate = device.memory_bandwidth * device.efficiency_of("memory").value
    mm = next(n for n in gm.graph.nodes if "mm" in str(n.target))
    eager = node_times(gm, device, fused=False)
    fused = node_times(gm, device, fused=True)
    nbytes = 256 * 256 * 4
    # eager: mul (r+w), relu (r+w), add (2r+w), sigmoid (r+w): 9 passes
    assert sum(t for n, t in eager.items() if n != mm.name) == pytest.approx(9 * nbytes / rate)
    # fused: x and y read once, the sigmoid's result written once
    assert sum(t for n, t in fused.items() if n != mm.name) == pytest.approx(3 * nbytes / rate)
    assert eager[mm.name] == fused[mm.name]
    _, compiled = _plan(compile_compute=True)
    _, eager_plan = _plan(compile_compute=False)
    assert compiled.fused and not eager_plan.fused
    assert sum(map(sum, compiled.compute.values())) < sum(map(sum, eager_plan.compute.values()))
    assert "fused memory-bound chains" in compiled.summary()


def test_the_optimizer_step_and_clipping_are_in_the_step_time():
    _, plan = _plan()
    device = H100_SXM().device
    rate = device.memory_bandwidth * device.efficiency_of("memory").value
    trainable = sum(local for local, _, grad in plan.parameters.values() if grad)
    bare = plan.predicted_timeline(optimizer=None)
    adamw = plan.predicted_timeline()
    assert adamw.optimizer_seconds == pytest.approx(7 * trainable / rate)
    assert adamw.step_seconds == pytest.approx(bare.step_seconds + 7 * trainable / rate)
    clipped = plan.predicted_timeline(clip_grad_norm=True)
    norm = along(plan.mesh, "dp", plan.cost_model).seconds("all_reduce", 4)
    assert clipped.optimizer_seconds == pytest.approx((10 * trainable) / rate + norm)
    assert plan.predicted_timeline("sgd").optimizer_seconds == pytest.approx(3 * trainable / rate)
    with pytest.raises(ValueError, match="optimizer must be one of"):
        plan.predicted_timeline("lamb")


def test_checkpointed_layers_show_what_they_save_per_layer():
    _, plan = _plan(ckpt=True)
    view = plan.memory()
    rows = {layer: (n, ckpt) for layer, n, ckpt in view.saved_by_layer}
    hidden = 2 * 32 * 64 * 2  # (batch, seq, width) in bfloat16
    # its input (all a checkpointed layer saves) and its output, which block 1's products
    # read in their backward (charged to the layer that computed it)
    assert rows["blocks.0"] == (2 * hidden, True)
    assert rows["blocks.1"][1] is False and rows["blocks.1"][0] > 4 * hidden
    assert "checkpointed: recomputed in backward" in str(view)
    _, plain = _plan()
    assert plain.memory().activations > view.activations


def test_tensor_parallel_attention_on_meta_splits_the_fused_node_by_heads():
    from tests.llama import Llama

    with torch.device("meta"):
        model = Llama(dim=32, heads=4, kv_heads=2, hidden=64, length=16, norm="F",
                      gqa="enable_gqa").to(torch.bfloat16)
        x = torch.randint(0, 32, (4, 16))
    mesh = spmd.Mesh.simulated((2, 2), dim_names=("dp", "tp"), hardware=H100_SXM())
    plan = spmd.inspect(model, x, mesh=mesh, strategy="fsdp", placements=spmd.tp.megatron())
    plan.verify()
    decisions = [p for p in plan.placed if "attention" in p.op and p.mesh_dim == "tp"]
    assert decisions and all("each rank its heads" in p.reason for p in decisions)
    assert {p.op for p in decisions} == {"spmd.attention.default",
                                         "spmd.attention_backward.default"}


def test_a_selective_checkpointing_policy_saves_what_it_names():
    """torch's selective activation checkpointing (a policy per op): saving the matrix
    products' outputs, a checkpointed block keeps exactly those and its input."""
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        return (CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default
                else CheckpointPolicy.PREFER_RECOMPUTE)

    class Selective(Net):
        def forward(self, x, y):
            h = self.emb(x)
            for block in self.blocks:
                h = checkpoint(block, h, use_reentrant=False, context_fn=functools.partial(
                    create_selective_checkpoint_contexts, policy))
            return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())

    with torch.device("meta"):
        model = Selective()
        x = torch.randint(0, 96, (2, 32))
    plan = spmd.inspect(model, x, x, mesh=spmd.Mesh.simulated(8, hardware=H100_SXM()),
                        strategy="fsdp")
    rows = {layer: (n, ckpt) for layer, n, ckpt in plan.memory().saved_by_layer}
    tokens, d, f, kv = 2 * 32, 64, 128, 2 * 16
    products = tokens * (d + kv + kv + d + f + d) * 4  # wq wk wv wo w1 w2, float32
    assert rows["blocks.1"] == (products + tokens * d * 4, True)


def test_a_whole_step_is_priced_with_its_collectives_and_its_optimizer():
    """``spmd.inspect(step_fn, ...)`` on a simulated GPU cluster: the one step graph is
    priced by the roofline, its collectives are on the timeline, and the optimizer it
    holds is not added again."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Net()
    opt = torch.optim.AdamW(model.parameters())

    def step(model, x, y, opt):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    x = torch.randint(0, 96, (4, 32))
    plan = spmd.inspect(step, model, x, x, opt, strategy="fsdp",
                        mesh=spmd.Mesh.simulated(8, hardware=H100_SXM()))
    (name,) = plan.compute
    assert plan.compute[name][1] == pytest.approx(sum(plan.node_seconds[f"{name}.step"].values()))
    timeline = plan.predicted_timeline()
    assert timeline.optimizer_seconds == 0.0
    assert timeline.communication_seconds == pytest.approx(
        plan.predicted_communication_seconds())
    assert plan.tokens_per_step == 4 * 32 and "tokens/s per device" in plan.summary()


def test_a_measured_step_fits_the_compute_efficiencies():
    """``spmd.hardware.fit_step``: the plan re-made on the fitted hardware predicts the
    measured step, every compute efficiency says where it came from, and steps the
    plan cannot reach are refused by name."""
    from spmd.hardware import fit_step

    _, plan = _plan(rows=512)
    predicted = plan.predicted_timeline().step_seconds
    fitted = fit_step(plan, 1.5 * predicted)
    matmul = fitted.device.efficiency_of("matmul", torch.bfloat16)
    assert "fitted to a measured step" in matmul.source and "MAMF" not in matmul.source[:40]
    assert matmul.value < H100_SXM().device.efficiency_of("matmul", torch.bfloat16).value
    hw = H100_SXM()
    assert fitted.bus_efficiency(fitted.intra) == hw.bus_efficiency(hw.intra)  # links kept
    _, again = _plan(rows=512, hardware=fitted)
    assert again.predicted_timeline().step_seconds == pytest.approx(1.5 * predicted, rel=0.02)
    with pytest.raises(ValueError, match="communication alone"):
        fit_step(plan, 1e-9)
    with pytest.raises(ValueError, match="over 64x"):
        fit_step(plan, 1e3)
    tokens = torch.randint(0, 96, (2, 8))
    cpu = spmd.inspect(Net(), tokens, tokens, mesh=spmd.Mesh.simulated(2))
    with pytest.raises(ValueError, match="no hardware model"):
        fit_step(cpu, 1.0)


def test_attention_with_dropout_plans_on_meta():
    """Dropout inside attention is a shape on meta: the plan is made, one fused node."""
    class Dropping(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(16, 48)

        def forward(self, x):
            q, k, v = self.qkv(x).view(2, 8, 3, 2, 8).unbind(2)
            return F.scaled_dot_product_attention(
                *(t.transpose(1, 2) for t in (q, k, v)), dropout_p=0.1, is_causal=True).sum()

    with torch.device("meta"):
        model, x = Dropping(), torch.randn(2, 8, 16)
    plan = spmd.inspect(model, x, mesh=spmd.Mesh.simulated(4, hardware=H100_SXM()))
    assert len(_attention(plan, "forward")) == len(_attention(plan, "backward")) == 1
