"""Megatron's preset on Hugging Face models (no processes): the model's own
``base_model_tp_plan`` where its config has one (LLaMA, Mistral, Qwen2), names and
``Conv1D`` layers where it has none (GPT-2), styles with no exact placement refused, and
each model planned on a simulated mesh."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import spmd
from spmd.lowering.placements import Shard, StridedShard

from ..zoo import DECODER, ZOO

transformers = pytest.importorskip("transformers")

# ops that have no sharding rule yet, and why they appear: replicated (correct, but each
# costs a gather) until lowering/rules grows one
MISSING_RULES = {
    # rotate_half's slices in apply_rotary_pos_emb, backward: slice_backward of the
    # query's and key's halves, which arrive split by heads (lowering/rules/views.py has
    # slice.Tensor but not its backward)
    "aten.slice_backward.default",
}

_COLUMN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
           "mlp.up_proj")
_ROW = ("self_attn.o_proj", "mlp.down_proj")


def _decoder_placements(prefix: str, biases: bool = False) -> dict[str, Shard]:
    expected = {}
    for i in range(2):
        for name in _COLUMN:
            expected[f"{prefix}layers.{i}.{name}.weight"] = Shard(0)
            if biases and name.startswith("self_attn"):
                expected[f"{prefix}layers.{i}.{name}.bias"] = Shard(0)
        for name in _ROW:
            expected[f"{prefix}layers.{i}.{name}.weight"] = Shard(1)
    return expected


@pytest.mark.parametrize("name,config", [("llama", "LlamaConfig"),
                                         ("mistral", "MistralConfig"),
                                         ("qwen2", "Qwen2Config")])
def test_a_models_own_plan_gives_its_placements(name, config):
    model = ZOO[name].model().hf  # LlamaForCausalLM: the plan is relative to model.model
    placed = spmd.tp.megatron(model)
    # Qwen2's q, k and v have biases: 'colwise' splits them with their weights; the row-
    # parallel o_proj and down_proj have none (a rowwise bias would stay replicated)
    assert placed == {"tp": _decoder_placements("model.", biases=name == "qwen2")}
    assert placed.source["model.layers.1.self_attn.o_proj.weight"] == (
        f"{config}.base_model_tp_plan['layers.*.self_attn.o_proj'] = 'rowwise'")
    assert placed.source["model.layers.0.mlp.gate_proj.weight"] == (
        f"{config}.base_model_tp_plan['layers.*.mlp.gate_proj'] = 'colwise'")


def test_a_wrapped_model_keeps_its_plan():
    placed = spmd.tp.megatron(ZOO["llama"].model(), dim="model")  # Logits(LlamaForCausalLM)
    assert placed == {"model": _decoder_placements("hf.model.")}


def test_gpt2_splits_its_conv1d_layers_and_its_fused_qkv_by_head_groups():
    """GPT-2's Conv1D stores (in, out): column-parallel c_fc is weight Shard(1), bias
    Shard(0); row-parallel c_proj weight Shard(0); the fused c_attn by head groups
    (weight StridedShard(1, 3), bias StridedShard(0, 3)), so the attention's c_proj is
    row-parallel too."""
    model = ZOO["gpt2"].model().hf
    placed = spmd.tp.megatron(model)
    expected = {}
    for i in range(2):
        expected[f"transformer.h.{i}.mlp.c_fc.weight"] = Shard(1)
        expected[f"transformer.h.{i}.mlp.c_fc.bias"] = Shard(0)
        expected[f"transformer.h.{i}.mlp.c_proj.weight"] = Shard(0)
        expected[f"transformer.h.{i}.attn.c_attn.weight"] = StridedShard(1, 3)
        expected[f"transformer.h.{i}.attn.c_attn.bias"] = StridedShard(0, 3)
        expected[f"transformer.h.{i}.attn.c_proj.weight"] = Shard(0)
    assert placed == {"tp": expected}
    assert placed.source["transformer.h.0.mlp.c_fc.weight"] == (
        "name: column-parallel Conv1D 'c_fc'")
    assert model.transformer.h[0].mlp.c_fc.weight.shape == (32, 64)  # (in, out)


def _llama(plan):
    config = transformers.LlamaConfig(**DECODER)
    config.base_model_tp_plan = plan
    return transformers.LlamaForCausalLM(config)


def test_the_plan_wins_over_names():
    """q_proj is a column-parallel name, but a plan that leaves the attention out is
    obeyed."""
    placed = spmd.tp.megatron(_llama({"layers.*.mlp.up_proj": "colwise",
                                      "layers.*.mlp.gate_proj": "colwise_rep",
                                      "layers.*.mlp.down_proj": "rowwise_split_input",
                                      "layers.*.self_attn.q_proj": "replicate"}))["tp"]
    assert placed == {f"model.layers.{i}.mlp.{n}.weight": Shard(d) for i in range(2)
                      for n, d in (("up_proj", 0), ("gate_proj", 0), ("down_proj", 1))}


@pytest.mark.parametrize("style", ["grouped_gemm", "ep_dispatch_experts",
                                   "a_style_of_the_future"])
def test_a_style_with_no_placement_is_refused(style):
    model = _llama({"layers.*.self_attn.q_proj": "colwise",
                    "layers.*.mlp.up_proj": style})
    with pytest.raises(ValueError, match=rf"\['layers.\*.mlp.up_proj'\] = '{style}'.*"
                                         rf"style '{style}' is .*by name"):
        spmd.tp.megatron(model)


# every style transformers' plans use (v5.25's ALL_PARALLEL_STYLES and v4.5x's), on a
# LLaMA's up_proj (nn.Linear, weight (out, in)): what it places there
_STYLE_PLACEMENTS = {
    "colwise": Shard(0), "colwise_rep": Shard(0), "colwise_gather_output": Shard(0),
    "local_colwise": Shard(0), "unit_colwise": Shard(0),
    "rowwise": Shard(1), "rowwise_rep": Shard(1), "rowwise_split_input": Shard(1),
    "local_rowwise": Shard(1), "unit_rowwise": Shard(1),
    "packed_colwise": StridedShard(0, 2), "packed_rowwise": StridedShard(1, 2),
    "local_packed_rowwise": StridedShard(1, 2),
    "replicate": None, "replicated_with_grad_allreduce": None, "mla_kv_a_proj": None,
    "all_reduce": None, "gather": None, "sequence_parallel": None, "local_params": None,
    "local": None, "isolated": None, "moe_tp_experts": None, "moe_identity_expert": None,
}


@pytest.mark.parametrize("style", sorted(_STYLE_PLACEMENTS))
def test_every_style_of_transformers_plans_is_read(style):
    placed = spmd.tp.megatron(_llama({"layers.*.self_attn.q_proj": "colwise",
                                      "layers.*.mlp.up_proj": style}))["tp"]
    assert placed.get("model.layers.0.mlp.up_proj.weight") == _STYLE_PLACEMENTS[style]


def test_every_style_transformers_registers_is_read_or_refused():
    registry = pytest.importorskip("transformers.distributed.parallel_utils")
    known = set(spmd.hf.STYLES) | set(spmd.hf._REFUSED)
    assert set(registry.ALL_PARALLEL_STYLES) <= known, set(registry.ALL_PARALLEL_STYLES) - known
    assert set(spmd.hf.STYLES) == set(_STYLE_PLACEMENTS) | {"embedding_rowwise",
                                                            "embedding_colwise"}


def test_a_parameters_own_key_splits_it_by_its_dimensions():
    """A key naming a module's own tensor (an MoE's experts (experts, out, in), attention
    sinks (heads,)) splits it as transformers does: output features the second to last
    dimension, input features the last, a packed weight by StridedShard."""
    model = _llama({"layers.*.self_attn.q_proj": "colwise"})
    for layer in model.model.layers:
        layer.mlp.experts = torch.nn.Module()
        layer.mlp.experts.gate_up = torch.nn.Parameter(torch.zeros(4, 16, 8))
        layer.mlp.experts.down = torch.nn.Parameter(torch.zeros(4, 8, 8))
        layer.self_attn.sinks = torch.nn.Parameter(torch.zeros(4))
    model.config.base_model_tp_plan.update({
        "layers.*.mlp.experts.gate_up": "packed_colwise",
        "layers.*.mlp.experts.down": "rowwise", "layers.*.self_attn.sinks": "colwise",
        "layers.*.mlp.experts": "moe_tp_experts", "layers.*.self_attn": "local_params"})
    placed = spmd.tp.megatron(model)["tp"]
    assert placed["model.layers.1.mlp.experts.gate_up"] == StridedShard(1, 2)
    assert placed["model.layers.1.mlp.experts.down"] == Shard(2)
    assert placed["model.layers.1.self_attn.sinks"] == Shard(0)


def test_a_style_for_the_wrong_layer_is_refused():
    model = _llama({"layers.*.input_layernorm": "colwise"})
    with pytest.raises(ValueError, match="LlamaRMSNorm; 'colwise' splits nn.Linear.*own key"):
        spmd.tp.megatron(model)


def test_the_models_own_tp_plan_must_agree_with_its_config():
    model = ZOO["llama"].model().hf
    model.model.tp_plan = {**model.model.tp_plan, "layers.*.mlp.up_proj": "rowwise"}
    with pytest.raises(ValueError, match=r"\['layers.\*.mlp.up_proj'\] = 'colwise' but the "
                                         r"model's tp_plan.*is 'rowwise'"):
        spmd.tp.megatron(model)


def test_the_preset_resolves_against_the_model_it_is_given():
    preset = spmd.tp.megatron()
    assert isinstance(preset, spmd.tp.Preset)
    model = ZOO["qwen2"].model()
    mesh = spmd.Mesh.simulated((2,), ("tp",))
    resolved = spmd.tp.resolve_placements(model, mesh, preset, "test")
    assert resolved["hf.model.layers.0.self_attn.k_proj.bias"] == {"tp": Shard(0)}
    assert resolved["hf.model.layers.1.mlp.down_proj.weight"] == {"tp": Shard(1)}
    assert "hf.model.embed_tokens.weight" not in resolved
    assert "hf.lm_head.weight" not in resolved


def test_name_matching_does_not_import_transformers():
    code = ("import sys, spmd, torch.nn as nn; "
            "spmd.tp.megatron(nn.ModuleDict({'q': nn.Linear(2, 2), 'o': nn.Linear(2, 2)})); "
            "print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=100)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("name,blocks_split", [("llama", 2), ("mistral", 2), ("qwen2", 2),
                                               ("gpt2", 2)])
def test_each_model_plans_on_a_simulated_mesh(name, blocks_split):
    """One all-reduce in forward per split part of each block (attention and MLP; GPT-2:
    its MLP), and no op replicated for want of a rule beyond the known ones."""
    entry = ZOO[name]
    inputs, _ = entry.make_batch(0, 2)
    torch.manual_seed(0)
    plan = spmd.inspect(entry.model(), inputs, mesh=spmd.Mesh.simulated((2,), ("tp",)),
                        placements=spmd.tp.megatron())
    missing = {p.op for p in plan.placed if p.fallback}
    assert missing <= MISSING_RULES, missing
    forward = [c for c in plan.collectives if c.mesh_dim == "tp" and c.phase == "forward"]
    assert [c.kind for c in forward] == ["all_reduce"] * (blocks_split * len(entry.blocks))
    modules = {p.module for p in plan.placed}
    assert any(m.startswith(entry.block + ".") for m in modules), sorted(modules)[:5]


def test_a_fused_gate_up_projection_gathered_for_its_chunk_plans():
    """GLM's plan: the fused gate/up projection 'colwise_gather_output' (its output
    gathered for the chunk that splits the two), the down projection
    'rowwise_split_input'. The weight's gradient comes out strided by the chunk
    (StridedShard) and is brought to the contiguous Shard(0) its piece is stored in
    through Replicate (it crashed: 'offers no decision reachable from inputs
    [StridedShard(0, split=2)]'). Its equality with one process: tests/cpu/test_zoo.py."""
    entry = ZOO["glm"]
    inputs, _ = entry.make_batch(0, 2)
    plan = spmd.inspect(entry.model(), inputs, mesh=spmd.Mesh.simulated((2,), ("tp",)),
                        placements=spmd.tp.megatron())
    assert plan.tp_placements["hf.model.layers.0.mlp.gate_up_proj.weight"] == {"tp": Shard(0)}
    assert plan.tp_placements["hf.model.layers.0.mlp.down_proj.weight"] == {"tp": Shard(1)}
    grads = [c for c in plan.collectives if c.phase == "backward" and "tp_grad" in
             c.provenance.reason and "gate_up_proj" in str(c.provenance.params)]
    assert [c.kind for c in grads] == ["all_gather"] * len(entry.blocks), \
        [(c.kind, c.provenance.reason) for c in grads]
    assert "StridedShard(0, split=2) -> Replicate()" in grads[0].provenance.reason


@pytest.mark.parametrize("family,column,row", [("ctrl", "Wq", "dense"),
                                               ("cpmant", "project_q", "attention_out")])
def test_a_family_without_a_plan_is_split_by_its_layer_names(family, column, row):
    """CTRL's and CPM-Ant's attention (no base_model_tp_plan): their query projections
    column-parallel, their output projections row-parallel (the sweep refused them
    before: no layer name it knew)."""
    from .. import hf_catalogue

    model = hf_catalogue.build(family)
    placed = spmd.tp.megatron(model)["tp"]
    columns = [n for n in placed if n.endswith(f".{column}.weight")]
    rows = [n for n in placed if n.endswith(f".{row}.weight")]
    assert len(columns) == 2 and all(placed[n] == Shard(0) for n in columns)
    assert len(rows) == 2 and all(placed[n] == Shard(1) for n in rows)


def test_a_wrapper_whose_prefix_names_no_attribute_keeps_its_plan():
    """Llama4ForCausalLM's base_model_prefix is 'language_model', but it holds its base
    model as .model: the plan is read on that child (the sweep refused llama4_text under
    tp: its plan matched nothing)."""
    from .. import hf_catalogue

    placed = spmd.tp.megatron(hf_catalogue.build("llama4_text"))["tp"]
    assert placed["hf.model.layers.0.self_attn.q_proj.weight"] == Shard(0)
    assert placed["hf.model.layers.1.self_attn.o_proj.weight"] == Shard(1)
    # the experts' own keys: gate_up 'packed_rowwise' (experts, hidden, 2 x inner), down
    # 'colwise' (experts, inner, hidden)
    assert placed["hf.model.layers.0.feed_forward.experts.gate_up_proj"] == StridedShard(2, 2)
    assert placed["hf.model.layers.0.feed_forward.experts.down_proj"] == Shard(1)


def test_spmd_ep_experts_reads_the_models_own_expert_parallel_plan():
    """transformers' ``config.base_model_ep_plan`` (``"layers.*.mlp.experts":
    "ep_dispatch_experts"``, its weights ``"grouped_gemm"``) names the modules
    ``spmd.ep.experts()`` splits by expert index; one naming a module that is no experts
    module is refused naming the plan's entry, before anything is placed; explicit
    ``modules=`` win over the plan."""
    from ..hf_catalogue import build

    model = build("mixtral")
    base = model.hf.model
    assert base.config.base_model_ep_plan["layers.*.mlp.experts"] == "ep_dispatch_experts"
    planned = spmd.hf.ep_plan_experts(model)
    assert sorted(planned) == [f"hf.model.layers.{i}.mlp.experts"
                               for i in range(len(base.layers))]
    assert "MixtralConfig.base_model_ep_plan['layers.*.mlp.experts'] = " \
           "'ep_dispatch_experts'" in planned["hf.model.layers.0.mlp.experts"]
    assert set(spmd.ep.find_experts(model)) == set(planned)
    # the plan, not the shapes: a plan that names the router is followed, and refused
    base.config.base_model_ep_plan = {"layers.*.mlp.gate": "ep_dispatch_experts"}
    with pytest.raises(ValueError, match=r"base_model_ep_plan\['layers.\*.mlp.gate'\] = "
                                         r"'ep_dispatch_experts' names hf.model.layers.0.mlp"
                                         r".gate \(MixtralTopKRouter\), which is not an "
                                         r"experts module"):
        spmd.parallelize(model, mesh=spmd.Mesh.simulated(2), placements=spmd.ep.experts())
    assert set(spmd.ep.find_experts(model, ("*.experts",))) == set(planned)
    # the plan's weights alone (no dispatch key) name their module
    base.config.base_model_ep_plan = {"layers.*.mlp.experts.gate_up_proj": "grouped_gemm"}
    assert set(spmd.hf.ep_plan_experts(model)) == set(planned)
