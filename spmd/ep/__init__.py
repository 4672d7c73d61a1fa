"""Expert parallelism: the experts of each mixture-of-experts layer split by expert index
over the ranks of a data dimension, tokens sent to them and back by all-to-all.

    mesh = spmd.Mesh((4,), dim_names=("ep",))
    model = spmd.parallelize(MoE(), mesh=mesh, placements=spmd.ep.experts())
    model = spmd.parallelize(MoE(), mesh=mesh, strategy="fsdp",
                             placements=spmd.ep.experts())

The expert-parallel dimension is a data dimension, as torchtitan borrows it from the data
ranks: every rank gets its own batch, and everything but the experts (attention, the
router, shared experts, norms) runs on it as the strategy says (``ddp``: replicated,
``fsdp``: sharded and gathered), its gradients averaged over the ranks. The experts'
weights are stored by expert index (rank ``r`` holds ``E / n`` of them, never gathered)
and each rank's routing is the model's own code (softmax or sigmoid scores, top-k,
normalised weights, DeepSeek's grouped and bias-corrected top-k): only the experts
module's forward is replaced. It sends each (token, choice) row to the rank holding its
expert (``spmd::ep_route``, ``spmd::ep_scatter``: the counts exchanged, then an
all-to-all with uneven splits), multiplies each expert's rows by its weights
(``spmd::grouped_mm``), applies the module's own gate and activation, and sends the rows
back (``spmd::ep_gather``), where the routing weights combine them as the model did.
Dropless: every token reaches its experts however uneven the routing (an expert with no
token, every token on one rank). See :mod:`spmd.lowering.experts` for the ops and
``docs/experts.md`` for the whole picture.

An experts module is what transformers' ``use_experts_implementation`` makes (Mixtral,
Qwen2/3-MoE, DeepSeek-V3, OLMoE, GPT-OSS, ...) or anything shaped like it: stacked
``gate_up_proj`` ``(E, 2I, H)`` (or ``up_proj`` without a gate) and ``down_proj``
``(E, H, I)``, optional ``*_bias`` ``(E, out)``, ``is_transposed`` for ``(E, in, out)``
weights, ``act_fn`` or ``_apply_gate``, and ``forward(hidden (T, H), top_k_index (T, k),
top_k_weights (T, k))``.
"""

from spmd.ep.placing import place_experts, place_for_pipeline
from spmd.ep.presets import (DEFAULT_HEADROOM, ExpertParallel, ExpertTensorParallel,
                             expert_parameters, experts, find_experts, split_experts,
                             unsupported)
from spmd.ep.pricing import all_to_all_seconds, plan_lines
from spmd.ep.stats import dropped_tokens, expert_load, load_balancing_loss

__all__ = ["experts", "ExpertParallel", "ExpertTensorParallel", "find_experts", "expert_load",
           "dropped_tokens", "split_experts", "load_balancing_loss", "all_to_all_seconds",
           "plan_lines", "place_experts", "place_for_pipeline", "expert_parameters",
           "unsupported", "DEFAULT_HEADROOM"]
