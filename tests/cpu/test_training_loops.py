"""Training loops as users write them, on 2 process ranks against one process on the whole
batch, in float64 (where the parallel arithmetic is exact): batch sizes that change (and
sequence lengths, under sequence and vocabulary parallelism), an uneven last batch, ``no_sync()`` around backward only, a gradient that reaches a
parameter from eager code late in training, in-place init after sharding, and whole
steps with scalar arguments, frozen layers, accumulation over calls, an optimizer made
before sharding and a second step function on the same model."""

from __future__ import annotations

import contextlib
from datetime import timedelta

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd
from spmd import runtime as dist

from ..jobs import Jobs, pack, selected
from ..models import MODELS

WORLD = 2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.out = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.relu(self.fc2(F.relu(self.fc1(x)))))


def make(dtype: torch.dtype = torch.float64) -> Net:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Net().to(dtype)


def data(n: int, i: int, dtype: torch.dtype = torch.float64
         ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    return (torch.randn(n, 8, generator=g, dtype=dtype),
            torch.randn(n, 4, generator=g, dtype=dtype))


def rows(x: torch.Tensor, rank: int) -> torch.Tensor:
    n = len(x)
    return x[rank * n // WORLD:(rank + 1) * n // WORLD]


def batch(n: int, i: int, rank: int | None, dtype: torch.dtype = torch.float64
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``i``'s batch of ``n`` rows: this rank's rows, or all of them (rank None)."""
    x, y = data(n, i, dtype)
    return (x, y) if rank is None else (rows(x, rank), rows(y, rank))


def state(model: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)


# -- the loops: each is run by every rank (rank >= 0, its rows) and by one process (rank
# -- None, the whole batch)

SIZES = (12, 8, 4, 6, 2, 8)  # the whole batch per step; a DataLoader's sizes change too


def changing_batch(rank, strategy, build=make):
    m = build() if rank is None else spmd.parallelize(build(), strategy=strategy)
    opt = sgd(m)
    for i, n in enumerate(SIZES):
        x, y = batch(n, i, rank)
        opt.zero_grad()
        F.mse_loss(m(x), y).backward()
        opt.step()
    graphs = None if rank is None else spmd.inspect(m).graph_reasons
    return state(m), graphs


def changing_batch_encoder(rank, strategy):
    """The same loop on another family: torch's transformer encoder (attention, layer
    norms, a sequence built from each row)."""
    return changing_batch(rank, strategy, lambda: MODELS["encoder"]().double())


def _llama_small():
    from ..llama import Llama

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # its rotary tables too
    try:
        return Llama(vocab=32, dim=16, layers=2, heads=4, kv_heads=2, hidden=32, length=16)
    finally:
        torch.set_default_dtype(default)


def _split_loop(rank, strategy, dim, placements, shapes, after_changes, family):
    """Our transformer or our LLaMA-style model (``family``) on a 1-D mesh along ``dim`` (both ranks
    see the whole batch), gradients accumulated over two backward calls per step at each
    ``(rows, length)`` of ``shapes``: the first two alike (planned graphs, whose plan is
    kept), then changing ones (a dynamic graph, run eagerly). The parameters, and per
    family (its capture failure, fallbacks, collectives)."""
    from ..models import Transformer, tokens

    out, planned = {}, {}
    builds = {"transformer": lambda: Transformer(layers=2).double(), "llama": _llama_small}
    for build in [builds[family]]:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            m = build()
        if rank is not None:
            mesh = spmd.Mesh((WORLD,), dim_names=(dim,))
            m = spmd.parallelize(m, mesh=mesh, strategy=strategy, placements=placements)
        opt = sgd(m)
        for i, (n, length) in enumerate(shapes):
            if i == 2 and rank is not None:  # the fixed-shape steps' plan
                plan = spmd.inspect(m)
                planned[family] = (m._spmd.capture_failed,
                                   [f.param for f in plan.fallbacks],
                                   sorted({(c.kind, c.mesh_dim) for c in plan.collectives}))
            opt.zero_grad()
            for half in range(2):  # accumulation
                x, y = tokens(step=2 * i + half, rows=n, length=length)
                logits = m(x)
                (F.cross_entropy(logits.flatten(0, 1), y.flatten()) / 2).backward()
            opt.step()
        out.update({f"{family}.{k}": v for k, v in state(m).items()})
        if rank is not None and after_changes:
            planned[f"{family} after changing shapes"] = m._spmd.capture_failed
    return out, planned


def sequence_parallel(rank, strategy, family="transformer"):
    """Sequence and vocabulary parallelism (``megatron(sequence_parallel=True,
    vocab_parallel=True)``, tp=2) on our transformer and our LLaMA-style model, gradients
    accumulated over two backward calls per step, first at one shape (planned graphs),
    then with batch sizes and sequence lengths that change (a dynamic graph, which tensor
    parallelism does not plan yet: the model then runs eagerly, and says so)."""
    return _split_loop(rank, strategy, "tp",
                       spmd.tp.megatron(sequence_parallel=True, vocab_parallel=True),
                       ((4, 8), (4, 8), (2, 6), (6, 4)), after_changes=True, family=family)


def sequence_parallel_llama(rank, strategy):
    return sequence_parallel(rank, strategy, "llama")


def context_parallel(rank, strategy, family="transformer"):
    """Context parallelism (``spmd.cp.ring()``, cp=2; each rank its half of every
    sequence, attention as ring attention) on the same models and loop: two sequences at
    one shape (planned graphs), then batch sizes and sequence lengths that change (run
    eagerly, as tensor parallelism's dynamic graphs are)."""
    return _split_loop(rank, strategy, "cp", spmd.cp.ring(),
                       ((2, 8), (2, 8), (1, 6), (3, 4)), after_changes=False, family=family)


def context_parallel_llama(rank, strategy):
    return context_parallel(rank, strategy, "llama")


def uneven_last_batch(rank, strategy):
    """23 samples in batches of 12: the last batch is 6 rows on rank 0 and 5 on rank 1.
    The loss is the sum over the whole batch's rows (scaled by the world size, as the
    gradients are averaged), so every rank's rows count once, as in one process."""
    m = make() if rank is None else spmd.parallelize(make(), strategy=strategy)
    opt = sgd(m)
    for i, n in enumerate((12, 11)):
        x, y = data(n, i)
        scale = 1.0 / (n * 4)
        if rank is not None:
            cut = [0, 6, n]
            x, y = x[cut[rank]:cut[rank + 1]], y[cut[rank]:cut[rank + 1]]
            scale *= WORLD
        opt.zero_grad()
        (F.mse_loss(m(x), y, reduction="sum") * scale).backward()
        opt.step()
    return state(m), None


def join_uneven(rank, strategy):
    """Under model.join(): rank 0 has three batches (the last one short), rank 1 two. The
    joined rank adds zeros and the sum is divided by 2 (DDP's divide_by_initial_world_size),
    so one process's loss is half the sum of the ranks' mean losses."""
    m = make() if rank is None else spmd.parallelize(make(), strategy=strategy)
    opt = sgd(m)
    shares = {0: [(0, 6), (0, 6), (0, 5)], 1: [(6, 12), (6, 12)]}
    context = m.join() if rank is not None else contextlib.nullcontext()
    with context:
        for i in range(len(shares[0]) if rank is None else len(shares[rank])):
            x, y = data(12, i)
            opt.zero_grad()
            if rank is None:
                loss = sum(F.mse_loss(m(x[a:b]), y[a:b]) for r, batches in shares.items()
                           if i < len(batches) for a, b in [batches[i]]) / WORLD
            else:
                a, b = shares[rank][i]
                loss = F.mse_loss(m(x[a:b]), y[a:b])
            loss.backward()
            opt.step()
    return state(m), None


class Tagged(Net):
    """A forward taking a string: Dynamo guards on its value, so ten values hit its
    recompile limit (8) and the forward runs eagerly from then on."""

    def forward(self, x: torch.Tensor, tag: str) -> torch.Tensor:
        return super().forward(x) * float(tag)


def recompile_limit(rank, strategy):
    m = Tagged().double()
    m.load_state_dict(make().state_dict())
    if rank is not None:
        m = spmd.parallelize(m, strategy=strategy)
    opt = sgd(m)
    for i in range(11):
        x, y = batch(8, i, rank)
        opt.zero_grad()
        F.mse_loss(m(x, f"{1.0 + 0.05 * i}"), y).backward()
        opt.step()
    reasons = None if rank is None else sorted({f.reason for f in spmd.inspect(m).fallbacks})
    return state(m), reasons


def no_sync_backward_only(rank, strategy):
    """Two micro-batches per step; the first backward (not its forward) under no_sync(),
    and a second loop the other way round: the forward decides, as with DDP."""
    m = make() if rank is None else spmd.parallelize(make(), strategy=strategy)
    opt = sgd(m)
    for i in range(4):
        opt.zero_grad()
        for k in range(2):
            x, y = batch(8, 10 * i + k, rank)
            if rank is None:
                (F.mse_loss(m(x), y) / 2).backward()
            elif i < 2 and k == 0:  # forward outside, backward inside: averaged
                loss = F.mse_loss(m(x), y) / 2
                with m.no_sync():
                    loss.backward()
            elif i >= 2 and k == 0:  # forward inside, backward outside: accumulated
                with m.no_sync():
                    loss = F.mse_loss(m(x), y) / 2
                loss.backward()
            else:
                (F.mse_loss(m(x), y) / 2).backward()
        opt.step()
    return state(m), None


def late_eager_gradient(rank, strategy):
    """A loss term reading a parameter outside the compiled forward, from the fifth step
    on, and different on every rank: its gradient must still be averaged."""
    m = make() if rank is None else spmd.parallelize(make(), strategy=strategy)
    opt = sgd(m)
    for i in range(6):
        x, y = batch(8, i, rank)
        opt.zero_grad()
        loss = F.mse_loss(m(x), y)
        if i >= 4:
            weight = 1.5 if rank is None else 1.0 + rank  # the ranks' average is 1.5
            loss = loss + 0.1 * weight * (m.fc1.weight ** 2).sum()
        loss.backward()
        opt.step()
    fallbacks = None if rank is None else sorted(f.param for f in spmd.inspect(m).fallbacks)
    return state(m), fallbacks


def inplace_init(rank, strategy):
    """Writes through the module attributes after parallelize, as FSDP2 allows."""
    m = make() if rank is None else spmd.parallelize(make(), strategy=strategy)
    with torch.no_grad():
        m.out.weight.zero_()
        m.fc2.weight[0].fill_(3.0)  # a view of the parameter
        m.fc2.weight.data[1].copy_(torch.arange(16.0, dtype=torch.float64))
        m.fc2.bias.add_(1.0)
        # the whole tensor assigned (old-style weight loading): stored into each piece
        m.fc2.bias.data = torch.linspace(-1.0, 1.0, m.fc2.bias.numel(), dtype=torch.float64)
    torch.manual_seed(5)
    m.fc1.reset_parameters()
    nn.init.constant_(m.out.bias, 0.25)
    refused = None
    if rank is not None:
        try:
            m.fc1.bias.zero_()  # autograd on: torch refuses this on a leaf parameter
        except RuntimeError as e:
            refused = str(e)
    x, y = batch(8, 0, rank)
    opt = sgd(m)
    F.mse_loss(m(x), y).backward()
    opt.step()
    return state(m), refused


def _writes(m: nn.Module) -> None:
    with torch.no_grad():
        m.out.weight.zero_()
        m.fc2.weight[0].fill_(3.0)
        m.fc2.weight.data[1].copy_(torch.arange(16.0, dtype=torch.float64))
        m.fc1.weight[:, 2] = 0.5  # across every rank's rows
        m.fc1.bias.data = torch.linspace(-1.0, 1.0, m.fc1.bias.numel(), dtype=torch.float64)
    torch.manual_seed(5)
    m.fc2.reset_parameters()


def inplace_init_mixed_precision(rank, strategy):
    """Gathered in bfloat16, stored in float64: only the elements a write changes are
    stored, the rest keep every bit."""
    m = make() if rank is None else spmd.parallelize(make(), strategy=strategy,
                                                      param_dtype=torch.bfloat16)
    with torch.no_grad():
        m.out.weight[1].fill_(0.5)
        m.fc1.bias.zero_()
    return state(m), None


def inplace_init_tensor_parallel(rank, strategy):
    """Pieces of a tensor-parallel model (fc1 split by rows, fc2 by columns; and, under
    fsdp, sharded along the other dimension), written through the attributes."""
    if rank is None:
        m = make()
    else:
        names = ("fsdp", "tp") if strategy == "fsdp" else ("tp",)
        mesh = spmd.Mesh((1, WORLD) if strategy == "fsdp" else (WORLD,), dim_names=names)
        m = spmd.parallelize(make(), mesh=mesh, strategy=strategy, placements={
            "tp": {"fc1.weight": spmd.Shard(0), "fc1.bias": spmd.Shard(0),
                   "fc2.weight": spmd.Shard(1)}})
    _writes(m)
    return state(m), None


def scaled_step(model, x, y, opt, weight):
    opt.zero_grad()
    loss = F.mse_loss(model(x), y) * weight
    loss.backward()
    opt.step()
    return loss


def plain_step(model, x, y, opt):
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss


def backward_step(model, x, y):
    loss = F.mse_loss(model(x), y) / 3
    loss.backward()
    return loss


def optimizer_step(model, x, y, opt):
    loss = F.mse_loss(model(x), y) / 3
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


@torch.no_grad()
def eval_step(model, x, y):
    return F.mse_loss(model(x), y)


def _step(fn, rank, strategy):
    return fn if rank is None else spmd.parallelize(fn, strategy=strategy)


def step_scalar_argument(rank, strategy):
    m = make()
    opt, step = sgd(m), _step(scaled_step, rank, strategy)
    for i, w in enumerate((1.0, 3.0, 0.5, 3.0)):
        x, y = batch(8, i, rank)
        step(m, x, y, opt, w)
    return state(m), None


def step_adamw_alternate_freeze(rank, strategy, dtype=torch.float64):
    """fc1 frozen on odd steps: AdamW's step counts differ across parameters. In float32
    the optimizer runs fused from the buckets (its kernels take no float64)."""
    m = make(dtype)
    opt, step = torch.optim.AdamW(m.parameters(), lr=0.05), _step(plain_step, rank, strategy)
    for i in range(5):
        m.fc1.requires_grad_(i % 2 == 0)
        x, y = batch(8, i, rank, dtype)
        step(m, x, y, opt)
    m.fc1.requires_grad_(True)
    how = None if rank is None else spmd.inspect(step).optimizer
    return state(m), how


def step_adamw_alternate_freeze_f32(rank, strategy):
    return step_adamw_alternate_freeze(rank, strategy, torch.float32)


def step_accumulation_over_calls(rank, strategy):
    """Two backward-only steps, then one with the optimizer: it steps on all three."""
    m = make()
    opt = sgd(m)
    back, opt_step = _step(backward_step, rank, strategy), _step(optimizer_step, rank, strategy)
    for i in range(2):
        for k in range(3):
            x, y = batch(8, 10 * i + k, rank)
            if k < 2:
                back(m, x, y)
            else:
                opt_step(m, x, y, opt)
    return state(m), None


def step_optimizer_outside(rank, strategy):
    """The optimizer made before the first call, and stepped outside the step."""
    m = make()
    opt, step = sgd(m), _step(backward_step, rank, strategy)
    for i in range(3):
        x, y = batch(8, i, rank)
        step(m, x, y)
        opt.step()
        opt.zero_grad()
    return state(m), None


def two_step_functions(rank, strategy):
    m = make()
    opt = sgd(m)
    train, evaluate = _step(plain_step, rank, strategy), _step(eval_step, rank, strategy)
    losses = []
    for i in range(3):
        x, y = batch(8, i, rank)
        train(m, x, y, opt)
        losses.append(float(evaluate(m, x, y)))
    return state(m), None


class Checkpointed(nn.Module):
    """Self-attention and an MLP, each block under ``torch.utils.checkpoint`` (non-
    reentrant): the backward recomputes them, and on CPU the fused attention kernel is a
    random op, which checkpointing wraps in an RNG-state save."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.qkv, self.proj = nn.Linear(16, 48), nn.Linear(16, 16)
        self.fc, self.out = nn.Linear(16, 16), nn.Linear(16, 4)

    def attend(self, h: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(h).view(*h.shape[:2], 3, 2, 8).unbind(2)
        o = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                           is_causal=True)
        return h + self.proj(o.transpose(1, 2).flatten(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = self.inp(x).unsqueeze(1).expand(-1, 3, -1)  # a sequence of 3 per row
        h = checkpoint(self.attend, h, use_reentrant=False)
        h = checkpoint(lambda t: t + F.gelu(self.fc(t)), h, use_reentrant=False)
        return self.out(h.mean(1))


def activation_checkpointing(rank, strategy):
    """Blocks under activation checkpointing are planned (not left to the safety net)
    and train as one process."""
    def build():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return Checkpointed().double()

    return changing_batch(rank, strategy, build)


def activation_checkpointing_llama(rank, strategy):
    """Another family: a LLaMA-style model (RMSNorm, rotary, grouped-query attention,
    SwiGLU) with every block checkpointed, token batches that change size, its
    cross-entropy as one process computes it."""
    from torch.utils.checkpoint import checkpoint

    from ..llama import Llama

    class Checkpointed(Llama):
        def forward(self, tokens):
            h = self.tok(tokens)
            t = tokens.shape[1]
            for layer in self.layers:
                h = checkpoint(layer, h, self.cos[:t], self.sin[:t], self.cis[:t],
                               use_reentrant=False)
            return self.output(self.norm(h))

    def build():  # seeded by Llama itself; float64 buffers from the default dtype
        torch.set_default_dtype(torch.float64)
        try:
            return Checkpointed(norm="F", gqa="enable_gqa")
        finally:
            torch.set_default_dtype(torch.float32)

    m = build() if rank is None else spmd.parallelize(build(), strategy=strategy)
    opt = sgd(m)
    for i, n in enumerate((4, 2, 6)):
        tokens = torch.randint(0, 32, (n, 8), generator=torch.Generator().manual_seed(i))
        if rank is not None:
            tokens = rows(tokens, rank)
        opt.zero_grad()
        logits = m(tokens)
        F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
    return state(m), None


def _checkpointed_plan(rank, strategy):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        m = spmd.parallelize(Checkpointed().double(), strategy=strategy)
    x, y = batch(4, 0, rank)
    F.mse_loss(m(x), y).backward()
    plan = spmd.inspect(m)
    return [f.param for f in plan.fallbacks], m._spmd.capture_failed, len(plan.collectives)


LOOPS = {
    "changing_batch": (changing_batch, ("ddp", "fsdp", "zero2")),
    "activation_checkpointing": (activation_checkpointing, ("ddp", "fsdp")),
    "activation_checkpointing_llama": (activation_checkpointing_llama, ("ddp", "fsdp")),
    "changing_batch_encoder": (changing_batch_encoder, ("ddp", "fsdp")),
    "uneven_last_batch": (uneven_last_batch, ("ddp", "fsdp")),
    "join_uneven": (join_uneven, ("ddp",)),
    "recompile_limit": (recompile_limit, ("ddp", "fsdp")),
    "no_sync_backward_only": (no_sync_backward_only, ("ddp", "fsdp")),
    "late_eager_gradient": (late_eager_gradient, ("ddp", "fsdp")),
    "inplace_init": (inplace_init, ("fsdp",)),
    "inplace_init_mixed_precision": (inplace_init_mixed_precision, ("fsdp",)),
    "inplace_init_tensor_parallel": (inplace_init_tensor_parallel, ("ddp", "fsdp")),
    "sequence_parallel": (sequence_parallel, ("ddp",)),
    "sequence_parallel_llama": (sequence_parallel_llama, ("ddp",)),
    "context_parallel": (context_parallel, ("ddp",)),
    "context_parallel_llama": (context_parallel_llama, ("ddp",)),
    "step_scalar_argument": (step_scalar_argument, ("ddp", "fsdp")),
    "step_adamw_alternate_freeze": (step_adamw_alternate_freeze, ("ddp", "fsdp")),
    "step_adamw_alternate_freeze_f32": (step_adamw_alternate_freeze_f32, ("ddp", "fsdp")),
    "step_accumulation_over_calls": (step_accumulation_over_calls, ("ddp", "fsdp", "zero2")),
    "step_optimizer_outside": (step_optimizer_outside, ("fsdp",)),
    "two_step_functions": (two_step_functions, ("fsdp", "zero1")),
}
CASES = [(name, s) for name, (_, strategies) in LOOPS.items() for s in strategies]


def _meta(rank, strategy):
    with torch.device("meta"):
        meta = Net()
    try:
        spmd.parallelize(meta, strategy="fsdp")
        return "accepted"
    except ValueError as e:
        return str(e)


EXTRA = {"checkpointed_plan": _checkpointed_plan, "meta": _meta}


def job(rank: int, cases: list[tuple[str, str]]) -> dict:
    torch.set_num_threads(1)
    # a hang would show as this timeout naming the rank, not as the test's (with room for
    # a peer still compiling on a loaded machine)
    dist.init_process_group("gloo", timeout=timedelta(seconds=90))
    try:
        return {(name, strategy): (LOOPS[name][0] if name in LOOPS else EXTRA[name])(
            rank, strategy) for name, strategy in cases}
    finally:
        dist.destroy_process_group()


# quiet seconds each case took on 2 ranks (2 cores), packed into jobs of tests.jobs.BUDGET
COST = {**{case: 0.5 for case in CASES}, ("meta", "fsdp"): 0.1,
        ("checkpointed_plan", "ddp"): 2.0, ("checkpointed_plan", "fsdp"): 2.0,
        ("sequence_parallel", "ddp"): 14.5, ("sequence_parallel_llama", "ddp"): 14.5,
        ("context_parallel", "ddp"): 13.0, ("context_parallel_llama", "ddp"): 13.0,
        ("activation_checkpointing_llama", "ddp"): 10.5,
        ("activation_checkpointing_llama", "fsdp"): 12.0,
        ("changing_batch_encoder", "ddp"): 7.0, ("changing_batch_encoder", "fsdp"): 10.5,
        ("activation_checkpointing", "ddp"): 3.7, ("activation_checkpointing", "fsdp"): 4.1,
        ("recompile_limit", "ddp"): 3.4, ("recompile_limit", "fsdp"): 3.1,
        ("changing_batch", "ddp"): 2.8, ("changing_batch", "fsdp"): 1.9,
        ("changing_batch", "zero2"): 1.6, ("step_accumulation_over_calls", "zero2"): 1.4,
        ("uneven_last_batch", "fsdp"): 1.3}
JOBS = Jobs(job, pack(selected(
    COST, lambda c: f"tests/cpu/test_training_loops.py::test_loop_equals_one_process[{c[0]}-{c[1]}]")),
    nprocs=WORLD)


def runs(case: tuple[str, str]) -> list:
    """Each rank's result of ``case``."""
    return JOBS.results(case)


@pytest.mark.parametrize("name,strategy", CASES, ids=[f"{n}-{s}" for n, s in CASES])
def test_loop_equals_one_process(name, strategy):
    expected, _ = LOOPS[name][0](None, strategy)
    exact = all(v.dtype == torch.float64 for v in expected.values())
    tol = 1e-12 if exact else 1e-5  # float32: the fused kernels round differently
    for rank, (got, _) in enumerate(runs((name, strategy))):
        for key, value in expected.items():
            assert torch.allclose(got[key], value, rtol=tol, atol=tol), (rank, key)


def test_sequence_parallel_loop_runs_planned_graphs():
    """The loop's fixed-shape steps ran compiled, planned graphs (not eagerly): the
    sequence shards' reduce-scatters and gathers are in its plans, and no gradient fell
    back. Its changing shapes make a dynamic graph, which tensor parallelism does not plan
    yet: the model runs eagerly from there (still equal to one process, above), and its
    state says why."""
    families = [(f, loop) for f, loop in (("transformer", "sequence_parallel"),
                                          ("llama", "sequence_parallel_llama"))
                if (loop, "ddp") in JOBS.cases]  # (llama's: in the long profile)
    assert families
    for family, loop in families:
        for _, planned in runs((loop, "ddp")):
            failed, fallbacks, kinds = planned[family]
            assert failed is None, (family, failed)
            assert fallbacks == [], (family, fallbacks)
            assert {("reduce_scatter", "tp"), ("all_gather", "tp")} <= set(kinds), family
            reason = planned[f"{family} after changing shapes"]
            assert reason is None or "could not be captured" in reason, (family, reason)


def test_context_parallel_loop_runs_ring_attention():
    """The loop's fixed-shape steps ran planned graphs with ring attention on "cp" and no
    gradient fell back (its changing shapes then ran eagerly, equal to one process)."""
    families = [(f, loop) for f, loop in (("transformer", "context_parallel"),
                                          ("llama", "context_parallel_llama"))
                if (loop, "ddp") in JOBS.cases]  # (llama's: in the long profile)
    assert families
    for family, loop in families:
        for _, planned in runs((loop, "ddp")):
            failed, fallbacks, kinds = planned[family]
            assert failed is None, (family, failed)
            assert fallbacks == [], (family, fallbacks)
            assert {("ring", "cp"), ("all_reduce", "cp")} <= set(kinds), family


def test_changing_batch_sizes_compile_few_graphs():
    """Sizes 12, 8, 4, ... per step: a static graph, then one for dynamic sizes (and one
    for the size-1 specialisation Dynamo makes), not one per size."""
    for strategy in ("ddp", "fsdp", "zero2"):
        for _, graphs in runs(("changing_batch", strategy)):
            assert 2 <= len(graphs) <= 3, graphs
            reasons = list(graphs.values())
            assert reasons[0].startswith("first call; data (6,8)")
            assert reasons[1].startswith("recompiled for new input sizes, dynamic"), reasons


def test_checkpointed_blocks_are_planned_not_left_to_the_safety_net():
    for strategy in ("ddp", "fsdp"):
        for fallbacks, failed, collectives in runs(("checkpointed_plan", strategy)):
            assert fallbacks == [] and failed is None and collectives > 0, strategy


def test_late_eager_gradient_is_averaged_and_listed():
    for _, fallbacks in runs(("late_eager_gradient", "ddp")):
        assert fallbacks == ["fc1.weight"]


def test_forward_past_the_recompile_limit_is_listed():
    for strategy in ("ddp", "fsdp"):
        for _, reasons in runs(("recompile_limit", strategy)):
            assert len(reasons) == 1 and "recompile limit" in reasons[0], reasons


def test_inplace_write_with_autograd_on_is_refused_by_name():
    for _, refused in runs(("inplace_init", "fsdp")):
        assert refused is not None and "fc1.bias" in refused and "no_grad" in refused


def test_fused_adamw_keeps_per_parameter_step_counts():
    for strategy in ("ddp", "fsdp"):
        for _, how in runs(("step_adamw_alternate_freeze_f32", strategy)):
            assert all(v.startswith("fused") for v in how.values()), how


def test_meta_model_is_refused_before_anything_is_sent():
    for refused in runs(("meta", "fsdp")):
        assert "'fc1.weight' is on the meta device" in refused
        assert "to_empty" in refused
