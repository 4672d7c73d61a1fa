"""The equivalence model zoo: small transformers of every family the compiler must train
the same on N ranks as on one, each with its batches, its loss and its tensor-parallel
placements.

Every model is tiny (hidden 32, 2 layers, 4 query heads and 2 key-value heads where the
family has grouped-query attention, vocabulary 64, sequences of 8 tokens), in float64, and
built the same every call (its own seeded generator, like ``tests/models.py``), so every
rank and the single-process reference start equal without a broadcast. Dropout is 0, so
the math is deterministic. float64 also keeps AdamW honest on gradients that are zero in
exact arithmetic (a key projection's bias, which softmax ignores): their rounding noise
(~1e-17) stays far below AdamW's eps, where in float32 it would become whole steps.

Hugging Face models are built from configs here (nothing is downloaded) and wrapped in
:class:`Logits`, so every model maps token ids to logits; transformers is imported only
when such a model is built (about 3 s). Our own LLaMA-style models (``tests/llama.py``,
one per rotary and grouped-query form, the RMSNorm forms taking turns) join through
:func:`own_llama_entries`; :func:`all_entries` lists every model.

    from tests.zoo import ZOO, entry
    e = entry("llama")
    model = e.model()                       # seeded, float64
    x, y = e.make_batch(step=0, rows=4)     # token ids, next-token targets
    loss = e.loss_fn(model(x), y)
    spmd.inspect(model, x, mesh=..., placements=e.placements)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd

from .models import Transformer, _seeded

VOCAB = 64
HIDDEN = 32
LAYERS = 2
HEADS = 4
KV_HEADS = 2
SEQUENCE = 8


def make_batch(step: int = 0, rows: int = 4, *, vocab: int = VOCAB,
               length: int = SEQUENCE) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (rows, length) and their next-token targets, the same for a given step."""
    g = torch.Generator().manual_seed(1000 + step)
    seq = torch.randint(0, vocab, (rows, length + 1), generator=g)
    return seq[:, :-1], seq[:, 1:]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over every position."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@dataclass(frozen=True, kw_only=True, slots=True)
class Entry:
    """One model of the zoo.

    Attributes:
        name: its name in :data:`ZOO`.
        family: 'transformer', 'encoder', 'llama', 'gpt2', 'mistral', 'qwen2', 'glm' or
            'mixtral' (a mixture of experts).
        build: the model (float64, the same weights every call); :meth:`model` calls it.
        blocks: the module path of each transformer block, in order: what a structural
            test counts collectives per (a module path starting with one is in it).
        placements: tensor parallelism's placements for it (``spmd.tp.megatron()``).
        make_batch: ``(step, rows) -> (token ids, targets)``.
        loss_fn: ``(model output, targets) -> scalar loss``.
    """

    name: str
    family: str
    build: Callable[[], nn.Module]
    blocks: tuple[str, ...]
    placements: Any = field(default_factory=spmd.tp.megatron)
    make_batch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]] = make_batch
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lm_loss

    def model(self) -> nn.Module:
        return self.build()

    @property
    def block(self) -> str:
        """The first block's module path."""
        return self.blocks[0]


class Logits(nn.Module):
    """A Hugging Face causal LM as a module from token ids to logits (it returns a
    ``ModelOutput``, and would build a key-value cache)."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=input_ids, use_cache=False).logits


class Encoder(nn.Module):
    """torch's ``nn.TransformerEncoder`` (post-norm, batch first, no dropout) between a
    token embedding and a vocabulary head."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model=HIDDEN, nhead=HEADS,
                                           dim_feedforward=2 * HIDDEN, dropout=0.0,
                                           batch_first=True)
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.encoder = nn.TransformerEncoder(layer, num_layers=LAYERS,
                                             enable_nested_tensor=False)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.emb(tokens)))


def _double(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        return build().double()
    make.__name__ = build.__name__
    return _seeded(make)


def _transformer() -> nn.Module:
    return Transformer(layers=LAYERS, dim=HIDDEN, vocab=VOCAB)


# the config arguments the zoo's Hugging Face decoders (LLaMA, Mistral, Qwen2) share
DECODER = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
               num_hidden_layers=LAYERS, num_attention_heads=HEADS,
               num_key_value_heads=KV_HEADS, max_position_embeddings=4 * SEQUENCE,
               attention_dropout=0.0, use_cache=False, attn_implementation="sdpa",
               bos_token_id=0, eos_token_id=1)


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return Logits(LlamaForCausalLM(LlamaConfig(**DECODER)))


def _mistral() -> nn.Module:
    from transformers import MistralConfig, MistralForCausalLM

    # a window shorter than the sequence, so the sliding-window mask is not all-causal
    return Logits(MistralForCausalLM(MistralConfig(**DECODER, sliding_window=SEQUENCE // 2)))


def _qwen2() -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Logits(Qwen2ForCausalLM(Qwen2Config(**DECODER)))  # q, k, v with biases


def _glm() -> nn.Module:
    from transformers import GlmConfig, GlmForCausalLM

    # gate and up fused in one projection, its plan 'colwise_gather_output' (the chunk
    # after it splits the two), rotary on half of each head
    return Logits(GlmForCausalLM(GlmConfig(**DECODER, head_dim=HIDDEN // HEADS,
                                           pad_token_id=0)))


def _mixtral() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    # a mixture of experts: 4 experts, top-2, stacked weights run as batched_mm (static
    # shapes; torch._grouped_mm takes no float64); spmd.ep splits them by expert
    config = MixtralConfig(**DECODER, num_local_experts=4, num_experts_per_tok=2,
                           router_jitter_noise=0.0)
    config._experts_implementation = "batched_mm"
    return Logits(MixtralForCausalLM(config))


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=4 * SEQUENCE, n_embd=HIDDEN,
                        n_layer=LAYERS, n_head=HEADS, n_inner=2 * HIDDEN, attn_pdrop=0.0,
                        embd_pdrop=0.0, resid_pdrop=0.0, summary_first_dropout=0.0,
                        use_cache=False, attn_implementation="sdpa", bos_token_id=0,
                        eos_token_id=1, tie_word_embeddings=True)
    model = GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight
    return Logits(model)


def _blocks(prefix: str) -> tuple[str, ...]:
    return tuple(f"{prefix}.{i}" for i in range(LAYERS))


ZOO: dict[str, Entry] = {e.name: e for e in [
    Entry(name="transformer", family="transformer", build=_double(_transformer),
          blocks=_blocks("layers")),
    Entry(name="encoder", family="encoder", build=_double(Encoder),
          blocks=_blocks("encoder.layers")),
    Entry(name="llama", family="llama", build=_double(_llama),
          blocks=_blocks("hf.model.layers")),
    Entry(name="gpt2", family="gpt2", build=_double(_gpt2),
          blocks=_blocks("hf.transformer.h")),
    Entry(name="mistral", family="mistral", build=_double(_mistral),
          blocks=_blocks("hf.model.layers")),
    Entry(name="qwen2", family="qwen2", build=_double(_qwen2),
          blocks=_blocks("hf.model.layers")),
    Entry(name="glm", family="glm", build=_double(_glm),
          blocks=_blocks("hf.model.layers")),
    Entry(name="mixtral", family="mixtral", build=_double(_mixtral),
          blocks=_blocks("hf.model.layers")),
]}


def data_index(mesh: Any, strategy: Any) -> tuple[int, int]:
    """This rank's index among a planned strategy's data-parallel ranks, and their count:
    which rows of the global batch it trains on."""
    index, count = 0, 1
    for dim in strategy.data_dims:
        size = mesh.size(dim)
        index, count = index * size + mesh.get_group(dim).rank(), count * size
    return index, count


def own_llama_entries() -> list[Entry]:
    """Our own LLaMA-style models (``tests/llama.py``, family 'llama'), one per rotary form
    and grouped-query form, named ``llama_<rope>_<gqa>``; the RMSNorm forms (by hand,
    ``F.rms_norm``, ``nn.RMSNorm``) take turns across them, so each appears twice."""
    from . import llama

    def form(rope: str, gqa: str, norm: str) -> Callable[[], nn.Module]:
        def build() -> nn.Module:
            default = torch.get_default_dtype()
            torch.set_default_dtype(torch.float64)  # its rotary tables too (complex128)
            try:
                return llama.Llama(vocab=VOCAB, dim=HIDDEN, layers=LAYERS, heads=HEADS,
                                   kv_heads=KV_HEADS, hidden=2 * HIDDEN, length=SEQUENCE,
                                   norm=norm, rope=rope, gqa=gqa)
            finally:
                torch.set_default_dtype(default)
        build.__name__ = f"llama_{rope}_{gqa}"
        return _double(build)

    forms = [(rope, gqa) for rope in llama.ROPES for gqa in llama.GQAS]
    return [Entry(name=f"llama_{rope}_{gqa}", family="llama",
                  build=form(rope, gqa, llama.NORMS[k % len(llama.NORMS)]),
                  blocks=_blocks("layers"))
            for k, (rope, gqa) in enumerate(forms)]


def all_entries() -> list[Entry]:
    """Every model of the zoo: :data:`ZOO`'s, then our own LLaMA-style ones."""
    return [*ZOO.values(), *own_llama_entries()]


def entry(name: str) -> Entry:
    """The zoo entry called ``name``."""
    found = {e.name: e for e in all_entries()}
    if name not in found:
        raise KeyError(f"no zoo model {name!r}; the zoo has {', '.join(found)}")
    return found[name]
