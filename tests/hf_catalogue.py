"""Every Hugging Face causal-LM family the installed ``transformers`` builds offline, each
from a tiny config of its own: the catalogue issue 43's sweep trains (``tests/hf_sweep.py``).

A family is a ``model_type`` of transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``. Its
config is the family's default, shrunk by :data:`TINY` (hidden 32, 2 layers, 4 heads,
vocabulary 64) in every sub-config (a multimodal model's vision tower too), with every
dropout and router jitter at 0 (the one process and the ranks must compute the same), the
experts as transformers' ``batched_mm`` (every token's experts' weights gathered and
multiplied at once: ``torch._grouped_mm`` takes no float64, and the ``eager`` loop over
the experts a rank's tokens reach runs a graph a data-dependent number of times, which
fsdp's per-run gathers cannot follow: its ranks stop, naming the collective where they
disagree), and then :data:`OWN`: what a
family needs beyond the generic sizes (a rotary dimension, a state-space head count, a
layer-type list). The model is built in float64 (its buffers too: the default dtype is
float64 while it is built) from a seeded generator, the same every call, and wrapped in
:class:`tests.zoo.Logits` (token ids to logits).

    from tests.hf_catalogue import families, build
    for family in families():
        model = build(family)               # Logits(<family>ForCausalLM), float64

Nothing is downloaded. A family that still does not build says why
(:func:`try_build`); ``python benchmarks/hf_families.py`` tabulates them.
"""

from __future__ import annotations

import signal
from typing import Any

import torch
import torch.nn as nn

VOCAB = 64

TINY: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
    n_embd=32, n_layer=2, n_head=4, n_positions=64, d_model=32, num_layers=2, num_heads=4,
    ffn_dim=64, d_ff=64, n_inner=64, moe_intermediate_size=32, num_experts=4,
    num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=0,
    kv_lora_rank=8, q_lora_rank=8, n_group=1, topk_group=1, n_groups=1, n_shared_experts=1,
    num_experts_per_token=2, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
    pad_token_id=0, bos_token_id=1, eos_token_id=2, rotary_dim=8, partial_rotary_factor=1.0,
    # sparse attention's indexer, linear attention, state-space layers (inner width 64)
    index_topk=4, index_head_dim=8, index_n_heads=2, linear_head_dim=8, linear_num_heads=4,
    mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=8,
    n_mamba_heads=4, mamba_headdim=16, chunk_size=8,
    # sub-configs of multimodal models (a vision tower at its default size takes minutes)
    patch_size=4, image_size=16, num_channels=3, depth=2, embed_dim=32, out_hidden_size=32,
    projection_dim=32, text_hidden_size=32, vision_hidden_size=32,
)

# what a family needs beyond TINY, set after it (in the top-level config)
OWN: dict[str, dict[str, Any]] = {
    "mamba2": dict(head_dim=16, state_size=8),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    "plbart": dict(encoder_attention_heads=4, decoder_attention_heads=4,
                   encoder_layers=2, decoder_layers=2, encoder_ffn_dim=64, decoder_ffn_dim=64),
    "whisper": dict(encoder_attention_heads=4, decoder_attention_heads=4,
                    encoder_layers=2, decoder_layers=2, encoder_ffn_dim=64,
                    decoder_ffn_dim=64),
    "reformer": dict(is_decoder=True, attention_head_size=8, axial_pos_shape=[4, 16],
                     axial_pos_embds_dim=[16, 16], feed_forward_size=64,
                     attn_layers=["local", "lsh"], local_attn_chunk_length=4,
                     lsh_attn_chunk_length=4, num_buckets=4),
}


_DROPOUT_WORDS = ("dropout", "pdrop", "drop_rate", "jitter")


def families() -> list[str]:
    """Every causal-LM ``model_type`` of the installed transformers, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _shrink(config: Any, seen: set[int]) -> None:
    """TINY and no dropout in ``config`` and every sub-config in it."""
    from transformers import PretrainedConfig

    if id(config) in seen:
        return
    seen.add(id(config))
    for key in list(vars(config)):
        value = getattr(config, key, None)
        if isinstance(value, PretrainedConfig):
            _shrink(value, seen)
        elif key in TINY and not isinstance(value, (list, dict)):
            _set(config, key, TINY[key])
        elif any(w in key for w in _DROPOUT_WORDS) and isinstance(value, float):
            _set(config, key, 0.0)
    if isinstance(getattr(config, "qk_rope_head_dim", None), int):
        # multi-head latent attention: the rotary part is the head dimension rotary reads,
        # and the query's head is both parts (derived once, at the config's creation)
        _set(config, "head_dim", config.qk_rope_head_dim)
        _set(config, "num_key_value_heads", config.num_attention_heads)  # keys per head
        if isinstance(getattr(config, "qk_nope_head_dim", None), int):
            _set(config, "qk_head_dim", config.qk_nope_head_dim + config.qk_rope_head_dim)
    types = getattr(config, "layer_types", None)
    layers = getattr(config, "num_hidden_layers", None)
    if isinstance(types, list) and isinstance(layers, int) and len(types) != layers:
        _set(config, "layer_types", (types * layers)[:layers])


def _set(config: Any, key: str, value: Any) -> None:
    try:
        setattr(config, key, value)
    except Exception:  # a derived property, or a validator that refuses it
        pass


def config(family: str) -> Any:
    """The family's tiny config (float64 experts as a loop, no dropout)."""
    from transformers import CONFIG_MAPPING

    cfg = CONFIG_MAPPING[family]()
    _shrink(cfg, set())
    for key, value in OWN.get(family, {}).items():
        setattr(cfg, key, value)
    _set(cfg, "is_decoder", True)  # an encoder family's causal LM attends causally
    for c in [cfg, *(getattr(cfg, k) for k in vars(cfg) if k.endswith("_config"))]:
        _set(c, "_experts_implementation", "batched_mm")
        _set(c, "use_cache", False)
    return cfg


class Logits(nn.Module):
    """A causal LM as a module from token ids to logits (no key-value cache)."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=input_ids, use_cache=False).logits


def build(family: str) -> nn.Module:
    """The family's causal LM from :func:`config`, float64, the same weights every call."""
    from transformers import AutoModelForCausalLM

    cfg = config(family)
    default = torch.get_default_dtype()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        torch.set_default_dtype(torch.float64)
        try:
            model = AutoModelForCausalLM.from_config(cfg)
        finally:
            torch.set_default_dtype(default)
    return Logits(model.double())


class _Late(Exception):
    pass


def _late(*_: object) -> None:
    raise _Late


def try_build(family: str, seconds: int = 20) -> tuple[nn.Module | None, str]:
    """(the model, '') where it builds and runs forward on 2 x 8 tokens within
    ``seconds``; (None, why) where it does not."""
    previous = signal.signal(signal.SIGALRM, _late)
    signal.alarm(seconds)
    try:
        model = build(family)
        model(torch.randint(3, VOCAB, (2, 8)))
        return model, ""
    except _Late:
        return None, f"over {seconds} s"
    except Exception as e:  # what stops a family is what this reports
        first = str(e).strip().splitlines()[0][:120] if str(e).strip() else ""
        return None, f"{type(e).__name__}: {first}"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def has_plan(model: nn.Module) -> bool:
    """Whether the family's config carries a ``base_model_tp_plan``."""
    return any(getattr(getattr(m, "config", None), "base_model_tp_plan", None)
               for m in model.modules())
