"""A DeepSeek-V3-shaped mixture of experts planned on a simulated cluster: the expert
all-to-alls priced per link, the predicted step and memory, dropless against capacity
factors. Nothing runs: the model is built on the meta device and planned by
``spmd.inspect`` on ``Mesh.simulated``.

    python benchmarks/moe_plan.py [--layers 5] [--dense 1] [--ep 64] [--nodes-of 8]
                                  [--seq 4096] [--factors none,1.25,1.0]
                                  [--headrooms inf,1.25]
                                  [--strategy zero1] [--gpu H100_SXM]

The model is transformers' ``DeepseekV3ForCausalLM`` at the published shape (DeepSeek-V3
technical report, arXiv 2412.19437, and its ``config.json``): width 7168, 128 heads of
multi-head latent attention (query rank 1536, key/value rank 512, 64 rotary and 128
other dimensions per head, values 128), 256 routed experts of width 2048 with 8 chosen
per token by the grouped, bias-corrected sigmoid router (8 groups, 4 kept), one shared
expert, dense layers of width 18432, vocabulary 129,280, bfloat16. The published run
trained on 2048 H800s with 16 pipeline stages and expert parallelism 64 over 8 nodes of
8; each stage holds about 4 of the 61 layers. ``--layers 5 --dense 1`` plans one stage's
share (one dense layer and 4 MoE layers, with the embedding and head) on ``--ep`` ranks
of ``--nodes-of`` per node, one sequence of ``--seq`` tokens per rank. The H800 is not
a preset: the H100 SXM's (``spmd.hardware``) stands in (the H800's NVLink is 400 GB/s
against 900; the network, 400 Gb/s per GPU, is the same).

For each capacity factor (``none``: dropless, the default: the rows bounded at twice
what even routing brings, the forward run again where a step overflows) and each other
dropless headroom (``spmd.ep.experts(headroom=)``; ``inf``: the rows padded to every
pair of every rank) the table gives the planning time, one
MoE layer's all-to-alls per step (the counts, then the rows out and back in forward and
again in backward, for even routing), split into what crosses nodes (on each GPU's
network path) and what stays in the node (NVLink, at the same time), the predicted step
with its exposed communication, MFU and the predicted peak memory per GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def config(layers: int, dense: int):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048, num_hidden_layers=layers, first_k_dense_replace=dense,
        num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256,
        n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
        norm_topk_prob=True, routed_scaling_factor=2.5, q_lora_rank=1536,
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        max_position_embeddings=4096, use_cache=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--dense", type=int, default=1, help="dense layers first")
    p.add_argument("--ep", type=int, default=64)
    p.add_argument("--nodes-of", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--factors", default="none,1.25,1.0")
    p.add_argument("--headrooms", default="inf,1.25", help="other dropless headrooms ('' "
                   "for none; inf: every pair of every rank)")
    p.add_argument("--strategy", default="zero1")
    p.add_argument("--gpu", default="H100_SXM")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    import torch
    from transformers import DeepseekV3ForCausalLM

    import spmd
    from spmd import hardware
    from spmd.ep import all_to_all_seconds
    from spmd.lowering.cost_model import along

    cluster = getattr(hardware, args.gpu)(nodes_of=args.nodes_of)
    mesh = spmd.Mesh.simulated((args.ep,), dim_names=("ep",), hardware=cluster)
    link = along(mesh, "ep", None)
    print(f"DeepSeek-V3 shape, {args.layers} layers ({args.dense} dense), {args.ep} expert "
          f"ranks on {cluster.name}, {args.strategy}, {args.seq} tokens per rank "
          f"({time.strftime('%Y-%m-%d')})")
    rows = []
    cases = [(None if t == "none" else float(t), None,
              "none (dropless, default headroom 2)" if t == "none" else t)
             for t in args.factors.split(",") if t]
    cases += [(None, float(t), "dropless, headroom inf (every pair)" if t == "inf"
               else f"dropless, headroom {t}") for t in args.headrooms.split(",") if t]
    for factor, headroom, text in cases:
        with torch.device("meta"):
            model = DeepseekV3ForCausalLM(config(args.layers, args.dense)).to(torch.bfloat16)
        ids = torch.zeros((1, args.seq), dtype=torch.int64, device="meta")
        start = time.perf_counter()
        plan = spmd.inspect(model, ids, mesh=mesh, strategy=args.strategy,
                            placements=spmd.ep.experts(capacity_factor=factor,
                                                       headroom=headroom))
        planned = time.perf_counter() - start
        priced = all_to_all_seconds(plan)
        layer = min(l for nodes in priced.values() for l, _ in nodes.values())
        one = sum(t for nodes in priced.values() for l, t in nodes.values() if l == layer)
        total = sum(t for nodes in priced.values() for _, t in nodes.values())
        # one row all-to-all of this layer, split by link as the cost model prices it
        scatter = next(n for g in plan.graphs.values() for n in g.graph.nodes
                       if n.name.startswith("ep_scatter"))
        val = scatter.args[0].meta["val"]
        nbytes = val.numel() * val.element_size()
        across, within = link.all_to_all_links(nbytes)
        timeline = plan.predicted_timeline()
        step = timeline.step_seconds
        from spmd.plan.roofline import step_flops

        flops = step_flops(plan.graphs, cluster.device)
        mfu = flops.model / (step * cluster.device.peak(flops.dtype))
        peak = plan.memory().peak
        rows.append((text, planned, nbytes, across, within, one, total, step,
                     timeline.exposed_seconds, mfu, peak,
                     peak <= cluster.device.memory_bytes))
    print("\n| capacity factor or headroom | plan s | rows out per all-to-all | across nodes ms | "
          "within node ms | one layer's all-to-alls ms | all layers' ms | predicted step ms "
          "| exposed ms | MFU | peak GiB | fits |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for (text, planned, nbytes, across, within, one, total, step, exposed, mfu, peak,
         fits) in rows:
        print(f"| {text} | {planned:.1f} | {nbytes / 2**20:,.0f} MiB | {across * 1e3:.2f} | "
              f"{within * 1e3:.2f} | {one * 1e3:.1f} | {total * 1e3:.1f} | {step * 1e3:.1f} "
              f"| {exposed * 1e3:.1f} | {mfu:.1%} | {peak / 2**30:.1f} | "
              f"{'yes' if fits else 'no'} |")


if __name__ == "__main__":
    main()
