"""The structural count of tensor-parallel collectives per transformer block, for every model
of the zoo, planned on a simulated tp=2 mesh (no processes): Megatron's block costs exactly
one all-reduce on "tp" in forward and one in backward for each split sub-layer, nothing
else on "tp" (no gather: every op has a rule that keeps pieces where they are).

Split sub-layers per family: attention and MLP for every family, ours and the LLaMA
family (HF LLaMA, Mistral, Qwen2: their ``base_model_tp_plan``) by name, GPT-2's and
torch's encoder's attention through their fused query-key-value projections split by
head groups (``StridedShard``). The backward's all-reduce is the norm's input gradient (RMSNorm written by
hand, ``F.rms_norm`` and ``nn.RMSNorm`` alike): reduced once where it forks, not three
times through the norm's backward.
"""

from __future__ import annotations

import pytest

import spmd

from ..zoo import all_entries

pytest.importorskip("transformers")

SPLIT = {"transformer": 2, "llama": 2, "mistral": 2, "qwen2": 2, "gpt2": 2, "encoder": 2}


def _block_of(params: tuple[str, ...], blocks: tuple[str, ...]) -> str | None:
    found = {b for b in blocks for p in params if p == b or p.startswith(b + ".")}
    assert len(found) <= 1, (params, found)
    return found.pop() if found else None


# (glm's own plan gathers its fused gate/up projection's output, 'colwise_gather_output',
# for the chunk after it: more than one all-reduce per sublayer, by the plan's choice)
@pytest.mark.parametrize("e", [e for e in all_entries() if e.family in SPLIT],
                         ids=lambda e: e.name)
def test_each_block_costs_one_all_reduce_per_split_sublayer_each_way(e):
    x, _ = e.make_batch(0, 2)
    plan = spmd.inspect(e.model(), x, mesh=spmd.Mesh.simulated((2,), ("tp",)),
                        placements=e.placements)
    assert [p.op for p in plan.placed if p.fallback] == []
    per_block: dict[tuple[str | None, str], int] = {}
    for c in plan.collectives:
        assert (c.kind, c.mesh_dim) == ("all_reduce", "tp"), c
        key = (_block_of(c.provenance.params, e.blocks), c.phase)
        per_block[key] = per_block.get(key, 0) + 1
    want = {(b, phase): SPLIT[e.family] for b in e.blocks for phase in ("forward", "backward")}
    assert per_block == want
