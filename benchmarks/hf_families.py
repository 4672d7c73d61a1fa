"""Which Hugging Face causal-LM families build offline from a tiny config (issue 43's first
column): every ``model_type`` of transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, its
default config shrunk by one generic set of sizes, built in float64 with the experts'
loop implementation (``torch._grouped_mm`` takes no float64) and run forward on 2 x 8
tokens, each within ``--seconds``. Nothing is downloaded.

    python benchmarks/hf_families.py [--seconds 20] [--only llama,glm]

Prints a row per family (built or why not, parameters, whether its config carries a
``base_model_tp_plan``) and the counts. The generic sizes do not fit every family (rotary
dimensions, per-layer attributes, multimodal towers built at their default size): a family
that fails here may build with sizes of its own, which the sweep's catalogue gives it.
"""

from __future__ import annotations

import signal
import time
import warnings

import torch

import harness

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            max_position_embeddings=64, n_embd=32, n_layer=2, n_head=4, n_positions=64,
            d_model=32, num_layers=2, num_heads=4, ffn_dim=64, d_ff=64, n_inner=64,
            moe_intermediate_size=32, num_experts=4, num_local_experts=4,
            n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=0,
            kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
            v_head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2, rotary_dim=8,
            partial_rotary_factor=1.0, tie_word_embeddings=False)


class _Late(Exception):
    pass


def _late(*_: object) -> None:
    raise _Late


def build(model_type: str) -> torch.nn.Module:
    """The family's causal LM from its default config shrunk by :data:`TINY`, float64."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    config = CONFIG_MAPPING[model_type]()
    try:
        config._experts_implementation = "eager"
    except Exception:  # (a config without experts)
        pass
    for key, value in TINY.items():
        if hasattr(config, key):
            try:
                setattr(config, key, value)
            except Exception:  # a derived property
                pass
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).double()


def try_family(model_type: str, seconds: int) -> tuple[bool, str, int, bool]:
    """(built and ran, why not, parameters, carries a tensor-parallel plan)."""
    signal.signal(signal.SIGALRM, _late)
    signal.alarm(seconds)
    try:
        model = build(model_type)
        model(input_ids=torch.randint(3, 64, (2, 8)), use_cache=False)
        plan = bool(getattr(model.config, "base_model_tp_plan", None))
        return True, "", sum(p.numel() for p in model.parameters()), plan
    except _Late:
        return False, f"over {seconds} s", 0, False
    except Exception as e:  # what stops a family is what this reports
        first = str(e).splitlines()[0][:100] if str(e) else ""
        return False, f"{type(e).__name__}: {first}", 0, False
    finally:
        signal.alarm(0)


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--seconds", type=int, default=20, help="per family")
    parser.add_argument("--only", default="", help="comma-separated model types")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    families = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    if args.only:
        families = [f for f in families if f in args.only.split(",")]
    harness.table(("family", "builds", "parameters", "tp plan", "why not", "seconds"),
                  "llrlll")
    built = planned = 0
    for family in families:
        start = time.perf_counter()
        ok, why, n, plan = try_family(family, args.seconds)
        built += ok
        planned += plan
        harness.row(family, "yes" if ok else "no", n if ok else "", "yes" if plan else "",
                    why, f"{time.perf_counter() - start:.1f}")
    print(f"\n{built} of {len(families)} families built and ran; {planned} carry a "
          f"base_model_tp_plan")


if __name__ == "__main__":
    main()
